"""A range's answer read column-wise on the gRPC wire (``_range_response``).

The messages are built with the ``RangeResponse`` class of the provider's
own table (checked field by field against etcd's generated protos in
``test_grpc_wire.py``) and serialized as etcd would send them: proto3
leaves out a field holding zero or an empty value
(``api/mvccpb/kv.pb.go``, ``KeyValue.MarshalToSizedBuffer`` writes
``lease`` and ``value`` only when non-zero / non-empty).
"""

from __future__ import annotations

from typing import Any

import pytest
from nadisc_etcd import _grpc
from nadisc_etcd._grpc import _range_response
from nadisc_etcd._proto import MESSAGES

Row = tuple[bytes, int, int, int, bytes, int]


def _encoded(rows: list[Row], *, revision: int = 90, more: bool = False, count: int = 0) -> bytes:
    message = MESSAGES["RangeResponse"](more=more, count=count or len(rows))
    message.header.revision = revision
    message.header.cluster_id = 7
    for key, create, mod, version, value, lease in rows:
        message.kvs.add(
            key=key,
            create_revision=create,
            mod_revision=mod,
            version=version,
            value=value,
            lease=lease,
        )
    data: bytes = message.SerializeToString()
    return data


def _rows(
    count: int, *, value: bytes = b'{"Op":0,"Addr":"10.0.0.1:80"}', lease: int = 0
) -> list[Row]:
    return [
        (f"s/a/i{n:04d}".encode(), 3 + n, 40 + n, 1 + n % 3, value, lease) for n in range(count)
    ]


def _read(data: bytes) -> list[Row]:
    answer = _range_response(data)
    return [
        (kv.key, kv.create_revision, kv.mod_revision, kv.version, kv.raw, kv.lease)
        for kv in answer.kvs
    ]


CASES = {
    "values, no leases": _rows(50),
    "values, every key on a lease": _rows(50, lease=0x7F00),
    "keys only": _rows(20, value=b""),
    "some leases 0": [
        (key, c, m, v, value, 0 if n % 2 else 55)
        for n, (key, c, m, v, value, _) in enumerate(_rows(30))
    ],
    "some values empty": [
        (key, c, m, v, b"" if n % 3 == 0 else value, lease)
        for n, (key, c, m, v, value, lease) in enumerate(_rows(30, lease=9))
    ],
    "a key-value without a create revision": [
        (key, 0 if n == 4 else c, m, v, value, lease)
        for n, (key, c, m, v, value, lease) in enumerate(_rows(10))
    ],
    "empty": [],
}


@pytest.mark.parametrize("rows", list(CASES.values()), ids=list(CASES))
def test_every_key_value_is_read_in_place_whatever_fields_it_leaves_out(rows: list[Row]) -> None:
    data = _encoded(rows, revision=123, more=True, count=len(rows) + 5)
    assert _read(data) == rows
    answer = _range_response(data)
    assert (answer.header.revision, answer.header.cluster_id) == (123, 7)
    assert (answer.more, answer.count) == (True, len(rows) + 5)
    assert all(kv.value == "" for kv in answer.kvs)  # the value is in ``raw``


def test_a_full_answer_is_read_without_a_step_per_key_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every key-value carrying every field (the common range): read from
    # the columns, never one message object at a time.
    def per_key_value(kv: Any) -> Any:
        raise AssertionError("read one key-value at a time")

    monkeypatch.setattr(_grpc, "_kv", per_key_value)
    rows = _rows(1000, lease=3)
    assert _read(_encoded(rows)) == rows
    keys_only = _rows(1000, value=b"")
    assert _read(_encoded(keys_only)) == keys_only


def test_columns_out_of_step_are_read_one_key_value_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read: list[bytes] = []
    original = _grpc._kv

    def per_key_value(kv: Any) -> Any:
        read.append(kv.key)
        return original(kv)

    monkeypatch.setattr(_grpc, "_kv", per_key_value)
    rows = CASES["some leases 0"]
    assert _read(_encoded(rows)) == rows
    assert read == [row[0] for row in rows]
