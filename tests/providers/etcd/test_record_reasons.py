"""The reason an invalid etcd record is refused says what the record holds.

A reason is shown to operators (``ProviderSnapshot.invalid``, the
observer's invalid records), so it must tell apart what merely prints
alike: bytes that are not UTF-8 from UTF-8 text that is not JSON, the
string ``"0"`` from the integer ``0``, ``true`` from ``1``. And it must not
quote the value: a record may carry secrets in its metadata, so a reason
shows a field's JSON type and at most 40 characters of a scalar, never an
object's or a list's contents, and never the text around a JSON error
(only where it is).
"""

from __future__ import annotations

import json

import pytest
from nadisc_etcd import RecordError, decode_record_bytes
from nadisc_etcd._layout import decode_records


def reason_for(raw: bytes) -> str:
    with pytest.raises(RecordError) as refused:
        decode_record_bytes("id", raw, max_record_bytes=4096)
    return str(refused.value)


def record(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # UTF-8 text that is not JSON is not "not UTF-8".
        (b"{broken", "value is not valid JSON (malformed at byte 1)"),
        (b'{"Addr": "h:1"', "value is not valid JSON (it ends early)"),
        (b'{"Addr": "h:1"} x', "value is not valid JSON (malformed at byte 17)"),
        (
            b'{"Addr": "h:1", "Metadata": {"x": NaN}}',
            "value is not valid JSON (malformed at byte 34)",
        ),
        (
            b'{"Addr": "h:1", "Metadata": {"x": 1e400}}',
            "value is not valid JSON (a number is out of range)",
        ),
        # Bytes that are not UTF-8, wherever they are.
        (b"\xff\xfe\x00", "value is not UTF-8 (invalid byte at offset 0)"),
        (
            b'{"Addr": "h:1", "Metadata": {"k": "\xc3("}}',
            "value is not UTF-8 (invalid byte at offset 35)",
        ),
    ],
)
def test_not_utf8_and_not_json_are_told_apart(raw: bytes, expected: str) -> None:
    assert reason_for(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (record(Op="0", Addr="h:1"), 'Op must be the integer 0 (Add), got the string "0"'),
        (record(Op=0.0, Addr="h:1"), "Op must be the integer 0 (Add), got the number 0.0"),
        (record(Op=False, Addr="h:1"), "Op must be the integer 0 (Add), got the boolean false"),
        (record(Op=None, Addr="h:1"), "Op must be the integer 0 (Add), got null"),
        (record(Op=1, Addr="h:1"), "Op must be the integer 0 (Add), got the integer 1"),
        (record(Op=[0], Addr="h:1"), "Op must be the integer 0 (Add), got a list"),
        (record(Op={"v": 0}, Addr="h:1"), "Op must be the integer 0 (Add), got an object"),
        (record(Op=0), "Addr is missing"),
        (record(Addr=""), "Addr is empty"),
        (record(Addr=8080), "Addr must be a string, got the integer 8080"),
        (record(Addr=None), "Addr must be a string, got null"),
        (record(Addr=["h:1"]), "Addr must be a string, got a list"),
    ],
)
def test_op_and_addr_reasons_show_the_json_type(raw: bytes, expected: str) -> None:
    assert reason_for(raw) == expected


NUMBER = "Metadata.weight must be a number or its decimal text, got "
POSITIVE = "Metadata.weight must be finite and > 0, got "
TAGS = "Metadata.tags must be a list of strings, got "


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"weight": True}, NUMBER + "the boolean true"),
        ({"weight": "heavy"}, NUMBER + 'the string "heavy"'),
        ({"weight": None}, NUMBER + "null"),
        ({"weight": {"v": 2}}, NUMBER + "an object"),
        ({"weight": 0}, POSITIVE + "the integer 0"),
        ({"weight": "0"}, POSITIVE + 'the string "0"'),
        ({"weight": -1.5}, POSITIVE + "the number -1.5"),
        ({"weight": "NaN"}, POSITIVE + 'the string "NaN"'),
        # An integer beyond the float range is refused, not an OverflowError.
        ({"weight": 10**400}, POSITIVE + f"the integer 1{'0' * 39}..."),
        ({"tags": "a,b"}, TAGS + 'the string "a,b"'),
        ({"tags": ["a", 1]}, TAGS + "a list holding the integer 1"),
        ({"tags": ["a", None]}, TAGS + "a list holding null"),
    ],
)
def test_metadata_reasons_show_the_json_type(metadata: dict[str, object], expected: str) -> None:
    assert reason_for(record(Addr="h:1", Metadata=metadata)) == expected


def test_a_huge_integer_weight_is_refused_in_bulk_too() -> None:
    raws = [record(Addr="h:1"), record(Addr="h:2", Metadata={"weight": 10**400})]
    assert decode_records(["a", "b"], raws, max_record_bytes=4096) is None


@pytest.mark.parametrize(
    "raw",
    [
        # Around a JSON error, at the start, in the middle, at the end.
        b'{"Addr": "h:1", "Metadata": {"password": "hunter2-secret"}, oops}',
        b'hunter2-secret {"Addr": "h:1"}',
        b'{"Addr": "h:1", "Metadata": {"password": "hunter2-secret"',
        b'{"Addr": "h:1", "Metadata": {"password": "hunter2-secret\xff"}}',
        # Inside a field of the wrong type.
        record(Op={"password": "hunter2-secret"}, Addr="h:1"),
        record(Op=["hunter2-secret"], Addr="h:1"),
        record(Addr={"password": "hunter2-secret"}),
        record(Addr="h:1", Metadata={"weight": {"password": "hunter2-secret"}}),
        record(Addr="h:1", Metadata={"tags": [{"password": "hunter2-secret"}]}),
        record(Addr="h:1", Metadata={"tags": {"password": "hunter2-secret"}}),
    ],
)
def test_a_reason_never_quotes_the_value(raw: bytes) -> None:
    assert "hunter2" not in reason_for(raw)


def test_a_long_scalar_is_cut_to_40_characters() -> None:
    text = "x" * 39 + "SECRET-TAIL"
    reason = reason_for(record(Op=text, Addr="h:1"))
    assert reason == f'Op must be the integer 0 (Add), got the string "{"x" * 39}S..."'
    assert "TAIL" not in reason
    number = reason_for(record(Op=10**60, Addr="h:1"))
    assert number == f"Op must be the integer 0 (Add), got the integer {'1' + '0' * 39}..."
