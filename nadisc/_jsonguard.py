"""A JSON answer nested deeper than the decoder's stack is a typed failure.

Contract: every provider decodes registry answers with msgspec or ``json``;
both give up on a document nested a few thousand levels deep by raising
:class:`RecursionError`, which is no :class:`~nadisc.ProviderFailure` and
would escape a query, a login or a watch task untyped. These helpers turn
it (and only it) into :class:`~nadisc.IncompleteSnapshot` naming what was
being decoded; other decode errors stay the caller's to word::

    decode_guarded(decoder, body, "instance list of web")   # typed value
    with depth_guard("watch event"): decoder.decode(line)    # same, inline
    loads_guarded(body, "detail of 'web'")                   # untyped, any JSON error typed

Cost: none on the good path (one ``try``); the failure itself is bounded by
the decoder's own depth limit (msgspec stops at about 1,000 levels), so a
200,000-level body costs one partial scan.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import msgspec

from ._errors import IncompleteSnapshot

__all__ = ["decode_guarded", "depth_guard", "loads_guarded", "nested_too_deeply"]

T = TypeVar("T")

_untyped: msgspec.json.Decoder[Any] = msgspec.json.Decoder()


def nested_too_deeply(what: str) -> IncompleteSnapshot:
    """The failure for an answer nested deeper than the decoder allows."""
    return IncompleteSnapshot(f"{what}: the answer is nested too deeply to decode")


@contextmanager
def depth_guard(what: str) -> Iterator[None]:
    """Turns a ``RecursionError`` raised inside into ``IncompleteSnapshot``."""
    try:
        yield
    except RecursionError:
        raise nested_too_deeply(what) from None


def decode_guarded(decoder: msgspec.json.Decoder[T], body: bytes, what: str) -> T:
    """``decoder.decode(body)``, with too-deep nesting a typed failure (msgspec's
    own ``DecodeError``/``ValidationError`` pass through for the caller)."""
    try:
        return decoder.decode(body)
    except RecursionError:
        raise nested_too_deeply(what) from None


def loads_guarded(body: bytes, what: str) -> Any:
    """Any JSON document, untyped; not JSON or too deep is ``IncompleteSnapshot``
    (the message names ``what`` and never quotes the body)."""
    try:
        return _untyped.decode(body)
    except RecursionError:
        raise nested_too_deeply(what) from None
    except msgspec.DecodeError:
        raise IncompleteSnapshot(f"{what}: the answer is not valid JSON") from None
