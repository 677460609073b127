"""The depth guard for registry answers, and the redaction of quoted server text."""

from __future__ import annotations

import msgspec
import pytest

from nadisc import IncompleteSnapshot, redacted_excerpt
from nadisc._jsonguard import decode_guarded, depth_guard, loads_guarded

DEEP = b"[" * 200_000 + b"]" * 200_000


def test_a_too_deep_answer_is_incomplete_and_names_what() -> None:
    with pytest.raises(IncompleteSnapshot, match="watch event: the answer is nested too deeply"):
        decode_guarded(msgspec.json.Decoder(), DEEP, "watch event")
    with pytest.raises(IncompleteSnapshot, match="nested too deeply"):
        loads_guarded(b'{"a":' + DEEP + b"}", "detail")
    with pytest.raises(IncompleteSnapshot, match="list"), depth_guard("list"):
        msgspec.json.decode(DEEP)


def test_other_decode_errors_stay_the_callers() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_guarded(msgspec.json.Decoder(int), b'"x"', "n")
    with pytest.raises(IncompleteSnapshot, match="not valid JSON"):
        loads_guarded(b"{", "detail")
    assert loads_guarded(b'{"a":[1]}', "detail") == {"a": [1]}
    assert decode_guarded(msgspec.json.Decoder(list[int]), b"[1,2]", "n") == [1, 2]


@pytest.mark.parametrize(
    "verdict", ["token expired!", "authorization failed!", "token invalid!", "password required"]
)
def test_a_registrys_verdict_after_a_credential_word_stays(verdict: str) -> None:
    assert redacted_excerpt(f"403: {verdict}") == f"403: {verdict}"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("Authorization: Bearer eyJhbGc.x.y", "eyJhbGc"),
        ("token=abc123", "abc123"),
        ('"password": "hunter2"', "hunter2"),
        ("token expiredly-long-value", "expiredly"),
    ],
)
def test_values_after_a_credential_word_are_still_cut(text: str, secret: str) -> None:
    assert secret not in redacted_excerpt(text)
