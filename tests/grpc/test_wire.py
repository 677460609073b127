"""The wire rules without I/O: grpc-timeout, the deframer's split and credit, metadata."""

from __future__ import annotations

import struct

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc.grpc import RpcError
from nadisc.grpc._wire import (
    Deframer,
    decode_grpc_message,
    decode_metadata,
    encode_message,
    encode_metadata,
    encode_timeout,
    gunzip_bounded,
    gzip_bytes,
)

_UNIT = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "S": 1.0, "M": 60.0, "H": 3600.0}


@given(st.floats(min_value=0, max_value=10**9, allow_nan=False))
def test_timeout_is_short_and_never_earlier(seconds: float) -> None:
    raw = encode_timeout(seconds).decode()
    digits, unit = raw[:-1], raw[-1]
    assert digits.isdigit() and 1 <= len(digits) <= 8 and unit in _UNIT
    said = int(digits) * _UNIT[unit]
    if seconds < 99999999 * 3600:
        # Rounded up: the server never sees a deadline before the caller's,
        # and at most one unit (of the finest unit that fits) later.
        assert said >= seconds * (1 - 1e-12)
        assert said - seconds <= _UNIT[unit] * (1 + 1e-9) + 1e-9


def test_timeout_examples() -> None:
    assert encode_timeout(0) == b"1n"
    assert encode_timeout(-3) == b"1n"
    assert encode_timeout(1.5) == b"1500000u"
    assert encode_timeout(30) == b"30000000u"
    assert encode_timeout(1000) == b"1000000m"


messages_st = st.lists(st.tuples(st.booleans(), st.binary(max_size=300)), max_size=12)


@settings(max_examples=60)
@given(messages_st, st.data())
def test_deframer_split_anywhere_same_messages_and_full_credit(
    messages: list[tuple[bool, bytes]], data: st.DataObject
) -> None:
    wire = b"".join(encode_message(payload, flag) for flag, payload in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    deframer = Deframer(limit=1000)
    credit = 0
    taken: list[tuple[bool, bytes]] = []
    start = 0
    for cut in [*cuts, len(wire)]:
        credit += deframer.feed(wire[start:cut])
        start = cut
        # Take some of what is queued, as a reader would.
        while deframer.messages:
            if not data.draw(st.booleans()):
                break
            flag, payload, owed = deframer.messages.popleft()
            credit += owed
            taken.append((flag, payload))
    while deframer.messages:
        flag, payload, owed = deframer.messages.popleft()
        credit += owed
        taken.append((flag, payload))
    assert taken == messages
    assert credit == len(wire)  # every byte credited back exactly once
    assert not deframer.partial


def test_deframer_refuses_at_the_prefix() -> None:
    deframer = Deframer(limit=10)
    with pytest.raises(RpcError) as caught:
        deframer.feed(struct.pack(">BI", 0, 11))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RpcError) as caught:
        Deframer(limit=10).feed(b"\x02\x00\x00\x00\x00")
    assert caught.value.code() == grpc.StatusCode.INTERNAL


@given(st.binary(max_size=5000), st.integers(0, 6000))
def test_gunzip_bounded(payload: bytes, limit: int) -> None:
    packed = gzip_bytes(payload)
    if len(payload) <= limit:
        assert gunzip_bounded(packed, limit) == payload
    else:
        with pytest.raises(RpcError) as caught:
            gunzip_bounded(packed, limit)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@given(st.binary(max_size=100))
def test_bin_metadata_round_trips(value: bytes) -> None:
    (pair,) = encode_metadata((("x-v-bin", value),))
    assert b"=" not in pair[1]
    assert decode_metadata([pair])["x-v-bin"] == value


@given(st.text(max_size=60))
def test_grpc_message_percent_decoding(text: str) -> None:
    from urllib.parse import quote

    assert decode_grpc_message(quote(text, safe=" ").encode()) == text


def test_metadata_errors_name_the_key_not_the_value() -> None:
    with pytest.raises(ValueError) as caught:
        encode_metadata((("x-token", "secret\n"),))
    assert "x-token" in str(caught.value) and "secret" not in str(caught.value)
