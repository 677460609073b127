"""Deterministic subsetting: each client of a large fleet talks to a few backends.

With 300 clients and 1,000 backends, every client connecting to every
backend opens 300,000 connections. A subset of ``size`` backends per client
cuts that to ``300 x size``; the subsets must cover the backends evenly
(connection counts and load) and move little when membership changes.

The rule (an integer form of Finagle's deterministic aperture)::

    order   the backends by a stable hash of their key (ties: by the key),
            so a backend that joins lands at an arbitrary place, not at the end
    start   client i of N starts at rank floor(i x M / N)   (M backends)
    subset  the ranks start, start+1, ..., start+size-1 (mod M)

Starts are spread evenly over the ranks, so any run of ``size`` consecutive
ranks holds either ``floor`` or ``ceil`` of ``N x size / M`` starts: every
backend is in within one of the mean number of subsets, and when
``N x size / M`` is an integer, in exactly that many (each client spreading
its requests evenly over its subset then gives every backend the same
expected load). A backend that leaves or joins shifts the ranks after it by
one and the starts by a fraction of a rank, so each client's window moves
by at most about one backend (Finagle's aperture moves the same way; the
SRE book's shuffled rounds reshuffle whole rounds instead; see
``benchmarks/balancing_beyond.py`` for the three side by side).

The client identity is its index in ``0..N-1`` and the fleet size ``N``
(e.g. a StatefulSet ordinal and the replica count). Pure: no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import TypeVar

from ._errors import InvalidInput

__all__ = ["ring_order", "subset"]

K = TypeVar("K", bound=Hashable)


def _stable_hash(key: object) -> bytes:
    return hashlib.blake2b(str(key).encode("utf-8", "surrogatepass"), digest_size=8).digest()


def ring_order(keys: Sequence[K]) -> list[K]:
    """``keys`` in ring order: by a stable hash of ``str(key)``, ties by ``str(key)``."""
    return sorted(keys, key=lambda k: (_stable_hash(k), str(k)))


def _int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInput(f"subset: {name} must be an integer >= {low}, got {value!r}")
    return value


def subset(keys: Sequence[K], client_index: int, client_count: int, size: int) -> list[K]:
    """The backends (in ring order) that client ``client_index`` of ``client_count`` uses.

    All of ``keys`` when ``size >= len(keys)``. Raises
    :class:`~poise.InvalidInput` on an index outside ``0..client_count-1``,
    a size below 1, or duplicate keys.
    """
    count = _int("client_count", client_count, 1)
    index = _int("client_index", client_index, 0)
    if index >= count:
        raise InvalidInput(
            f"subset: client_index {index} is outside 0..{count - 1} (client_count {count})"
        )
    width = _int("size", size, 1)
    ordered = ring_order(keys)
    members = len(ordered)
    if len(set(ordered)) != members:
        raise InvalidInput("subset: the backend keys are not unique")
    if width >= members:
        return ordered
    start = index * members // count
    return [ordered[(start + offset) % members] for offset in range(width)]
