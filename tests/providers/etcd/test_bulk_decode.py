"""The column-wise decoding of a range's records against the per-record codec.

No server. A range's records are decoded in bulk (``decode_records``) and
record by record only when a chunk holds a record the bulk path does not
take; whatever the mix, the listing and every invalid record's reason must
be exactly what decoding each record by itself gives, on both wires (raw
bytes from gRPC, base64 text from the JSON gateway).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable
from functools import partial
from types import FrameType, MappingProxyType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nadisc_etcd import RecordError, _layout, decode_record_bytes
from nadisc_etcd._layout import (
    Layout,
    _split_addr,
    _split_addrs,
    decode_records,
    decode_records_b64,
    instance_id_after,
    instance_ids_after,
)
from nadisc_etcd._state import ServiceState, _Entry
from nadisc_etcd._wire import KeyValue

from nadisc import Instance

HEAD = b"p/orders/"
LIMIT = 256


def doc(**fields: object) -> bytes:
    return json.dumps(fields).encode()


#: Record values: the shapes the bulk path takes, and every way a record is
#: invalid or takes the per-record path (a bare Metadata, odd spacing,
#: repeated members, numbers where an integer belongs).
VALUES: list[bytes] = [
    doc(Op=0, Addr="10.0.0.1:80"),
    doc(Addr="10.0.0.2:8080"),
    doc(Op=0, Addr="[fe80::1]:443"),
    doc(Op=0, Addr="[::1]:1"),
    doc(Op=0, Addr="svc.example.com:65535"),
    doc(Op=0, Addr="h_1:080"),
    doc(Op=0, Addr="10.0.0.3:80", Metadata=None),
    doc(Op=0, Addr="10.0.0.4:80", Metadata={}),
    doc(Op=0, Addr="10.0.0.5:80", Metadata={"weight": 2.5}),
    doc(Op=0, Addr="10.0.0.6:80", Metadata={"weight": "3", "tags": ["a", "b"], "zone": "z1"}),
    doc(Op=0, Addr="10.0.0.7:80", Metadata={"n": 3, "o": {"b": 1, "a": [1, None]}, "t": True}),
    doc(Op=0, Addr="10.0.0.8:80", Metadata={"tags": []}),
    doc(Op=0, Addr="10.0.0.9:80", Metadata="bare"),
    doc(Op=0, Addr="10.0.0.10:80", Metadata=[1, 2]),
    doc(Op=0, Addr="10.0.0.11:80", Metadata=7),
    b'  {"Addr": "10.0.0.12:80"}  ',
    b'{"Addr":"10.0.0.13:80","Addr":"10.0.0.14:81"}',
    b'{"Op":1,"Op":0,"Addr":"10.0.0.15:80"}',
    b'{"Op":0,"Op":1,"Addr":"10.0.0.16:80"}',
    b'{"Op":-0,"Addr":"10.0.0.17:80"}',
    b'{"Op":0.0,"Addr":"10.0.0.18:80"}',
    b'{"Op":false,"Addr":"10.0.0.19:80"}',
    b'{"Op":null,"Addr":"10.0.0.20:80"}',
    doc(Op=1, Addr="10.0.0.21:80"),
    doc(Op=0),
    doc(Addr=""),
    doc(Addr=5),
    doc(Addr="host"),
    doc(Addr=":80"),
    doc(Addr="host:"),
    doc(Addr="host:0"),
    doc(Addr="host:99999"),
    doc(Addr="host:123456"),
    doc(Addr="host:\u00b2"),
    doc(Addr="host:\u0661"),
    doc(Addr="[]:80"),
    doc(Addr="::1:80"),
    doc(Addr="[::1:80"),
    doc(Addr="a[b:80"),
    doc(Addr="bad host:80"),
    doc(Addr="-bad:80"),
    doc(Addr="1.2.3.999:80"),
    doc(Addr="h:1", Metadata={"weight": 0}),
    doc(Addr="h:1", Metadata={"weight": True}),
    doc(Addr="h:1", Metadata={"weight": "NaN"}),
    doc(Addr="h:1", Metadata={"weight": "x"}),
    doc(Addr="h:1", Metadata={"tags": "x"}),
    doc(Addr="h:1", Metadata={"tags": [1]}),
    doc(Addr="h:1", Metadata={"x": "y" * 300}),
    b"",
    b"{nope",
    b"[1, 2]",
    b"null",
    b"\xff\xfe",
    b'{"Addr": "h:1", "Metadata": {"x": NaN}}',
    b'{"Addr": "h:1"} {"Addr": "h:2"}',
    b'{"Addr": "h:1"},{"Addr": "h:2"}',
    b'{"Addr": "h:1"}\n{"Addr": "h:2"}',
    b'{"Addr": "h\\n1:80"}',
]
#: What follows the head: instance ids, and keys that name no instance.
TAILS: list[bytes] = [b"i-1", b"i-2", b"z", b"\xc3\xa9t\xc3\xa9", b"a/b", b"", b"\xff", b"x\ny"]


def reference(state: ServiceState, kvs: list[KeyValue]) -> dict[bytes, _Entry]:
    """Each record decoded by itself (the per-record path)."""
    return {kv.key: state._decode(kv) for kv in kvs}


class SmallSteps(ServiceState):
    #: Small chunks, so a few records span several bulk decodes.
    RESET_STEP = 4


def state() -> ServiceState:
    return SmallSteps("orders", Layout("p"), max_record_bytes=LIMIT, max_instances=1000)


def kvs_of(pairs: list[tuple[bytes, bytes]], wire: str, first: int = 10) -> list[KeyValue]:
    out = []
    for n, (key, raw) in enumerate(pairs):
        if wire == "grpc":
            out.append(KeyValue(key=key, mod_revision=first + n, raw=raw))
        else:
            text = base64.b64encode(raw).decode()
            out.append(KeyValue(key=key, mod_revision=first + n, value=text))
    return out


def check_reset(kvs: list[KeyValue], reuse: ServiceState | None = None) -> ServiceState:
    fresh = state()
    fresh.reset(kvs, 99, reuse=reuse)
    expected = reference(state(), kvs)
    assert fresh._entries == expected
    listed = [entry.instance for entry in expected.values() if entry.instance is not None]
    snapshot = fresh.snapshot()
    assert list(snapshot.instances) == listed
    assert all(type(i.metadata) is MappingProxyType for i in snapshot.instances)
    bad = {
        key.decode("utf-8", "replace"): entry.problem
        for key, entry in sorted(expected.items())
        if entry.instance is None
    }
    assert dict(snapshot.invalid) == bad
    return fresh


@pytest.mark.parametrize("wire", ["json", "grpc"])
@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.tuples(st.sampled_from(TAILS), st.sampled_from(VALUES)), max_size=40))
def test_a_range_decodes_as_each_record_by_itself(
    wire: str, items: list[tuple[bytes, bytes]]
) -> None:
    # Unique keys in range order; the head itself names no instance.
    pairs = {
        HEAD + tail + b"%04d" % n if tail else HEAD: raw for n, (tail, raw) in enumerate(items)
    }
    check_reset(kvs_of(sorted(pairs.items()), wire))


@pytest.mark.parametrize("wire", ["json", "grpc"])
def test_one_bad_record_among_good_ones_is_reported_and_the_rest_stand(wire: str) -> None:
    good = [(HEAD + b"i%03d" % n, doc(Op=0, Addr=f"10.0.{n}.1:80")) for n in range(30)]
    one_by_one: list[bytes] = []

    class Counting(SmallSteps):
        def _decode(self, kv: KeyValue) -> Any:
            one_by_one.append(kv.key)
            return super()._decode(kv)

    for bad in (b"{nope", doc(Op=1, Addr="10.9.9.9:80"), doc(Addr="bad host:80"), b""):
        pairs = list(good)
        pairs[13] = (pairs[13][0], bad)
        kvs = kvs_of(pairs, wire)
        check_reset(kvs)
        fresh = Counting("orders", Layout("p"), max_record_bytes=LIMIT, max_instances=1000)
        one_by_one.clear()
        fresh.reset(kvs, 99)
        assert len(fresh.snapshot().instances) == 29
        assert list(fresh.snapshot().invalid) == ["p/orders/i013"]
        # Only the chunk holding the bad record was decoded record by record.
        assert one_by_one == [key for key, _ in pairs[12:16]]


@pytest.mark.parametrize("wire", ["json", "grpc"])
def test_records_a_live_state_decoded_are_reused_around_new_and_bad_ones(wire: str) -> None:
    pairs = [(HEAD + b"i%03d" % n, doc(Op=0, Addr=f"10.0.{n}.1:80")) for n in range(20)]
    live = check_reset(kvs_of(pairs, wire))
    # Some records unchanged (same mod_revision), some rewritten, one bad.
    changed = list(pairs)
    changed[5] = (changed[5][0], doc(Op=0, Addr="10.1.1.1:81"))
    changed[9] = (changed[9][0], b"[1]")
    kvs = kvs_of(changed, wire)
    kvs[5] = msgspec.structs.replace(kvs[5], mod_revision=500)
    kvs[9] = msgspec.structs.replace(kvs[9], mod_revision=501)
    fresh = check_reset(kvs, reuse=live)
    assert fresh._entries[kvs[0].key] is live._entries[kvs[0].key]
    assert fresh._entries[kvs[5].key].instance.port == 81  # type: ignore[union-attr]
    assert "object" in (fresh._entries[kvs[9].key].problem or "")


def each_decoded(identities: list[str], raws: list[bytes]) -> list[Instance | None]:
    """Each record decoded by itself: its instance, or None when invalid."""
    decoded: list[Instance | None] = []
    for identity, raw in zip(identities, raws, strict=True):
        try:
            decoded.append(decode_record_bytes(identity, raw, max_record_bytes=LIMIT))
        except RecordError:
            decoded.append(None)
    return decoded


@given(items=st.lists(st.sampled_from(VALUES), max_size=12))
def test_decode_records_is_each_record_or_none(items: list[bytes]) -> None:
    identities = [f"i{n}" for n in range(len(items))]
    expected = each_decoded(identities, items)
    bulk = decode_records(identities, items, max_record_bytes=LIMIT)
    texts = [base64.b64encode(raw).decode() for raw in items]
    assert decode_records_b64(identities, texts, max_record_bytes=LIMIT) == bulk
    if bulk is None:
        # Refused in bulk: a record is invalid, or of a shape left to the
        # per-record path (which then decodes it, valid or not).
        return
    assert bulk == expected


def test_decode_records_takes_the_common_shapes() -> None:
    items = [
        doc(Op=0, Addr="10.0.0.1:80"),
        doc(Addr="[fe80::1]:443", Metadata={"weight": "2", "tags": ["a"], "k": 1}),
        doc(Addr="svc.example.com:8080", Metadata={}),
    ]
    bulk = decode_records(["a", "b", "c"], items, max_record_bytes=LIMIT)
    assert bulk is not None
    assert [(i.host, i.port, i.weight, i.tags, dict(i.metadata)) for i in bulk] == [
        ("10.0.0.1", 80, 1.0, (), {}),
        ("fe80::1", 443, 2.0, ("a",), {"k": "1"}),
        ("svc.example.com", 8080, 1.0, (), {}),
    ]
    assert decode_records([], [], max_record_bytes=LIMIT) == []
    assert decode_records([""], [items[0]], max_record_bytes=LIMIT) is None


@given(tails=st.lists(st.sampled_from([*TAILS, b"p/orders", b"p/orderz/x", b"\n"]), max_size=8))
def test_instance_ids_are_each_key_s_or_none(tails: list[bytes]) -> None:
    keys = [tail if tail.startswith(b"p/order") else HEAD + tail for tail in tails]
    one_by_one = [instance_id_after(HEAD, key) for key in keys]
    together = instance_ids_after(HEAD, keys)
    if together is not None:
        assert together == one_by_one
    else:
        assert None in one_by_one or any(b"\n" in key for key in keys)
    if all(b"\n" not in key for key in keys) and None not in one_by_one:
        assert together == one_by_one


#: Addresses of every shape: plain ``host:port``, bracketed IPv6, no port,
#: two colons, a newline inside, ports out of range or not ASCII digits.
ADDRESSES = st.one_of(
    st.sampled_from(
        [
            "10.0.0.1:80",
            "svc.example.com:8080",
            "h_1:080",
            "h:00080",
            "h:65535",
            "h:65536",
            "h:0",
            "h:00000",
            "[fe80::1]:443",
            "[example.com]:80",
            "a[b:80",
            "::1:80",
            "h:1\nh:2",
            "h\n:1",
            ":80",
            "host:",
            "host",
        ]
    ),
    st.text(alphabet="0123456789ab.-_:[]\n \u00b2\u0661", max_size=12),
)


def split_one_by_one(addr: str) -> tuple[str, int] | None:
    try:
        return _split_addr(addr)
    except RecordError:
        return None


def plain(addr: str) -> bool:
    """Of the shape the joined pass takes: one colon, no newline, no
    leading bracket, a port of 1-5 ASCII digits in 1-65535."""
    host, _, port = addr.partition(":")
    return (
        addr.count(":") == 1
        and "\n" not in addr
        and bool(host)
        and not host.startswith("[")
        and 0 < len(port) <= 5
        and all(c in "0123456789" for c in port)
        and 0 < int(port) < 65536
    )


@settings(max_examples=500, deadline=None)
@given(addrs=st.lists(ADDRESSES, min_size=1, max_size=10))
def test_addresses_split_together_as_each_by_itself(addrs: list[str]) -> None:
    one_by_one = [split_one_by_one(addr) for addr in addrs]
    together = _split_addrs(addrs)
    if all(map(plain, addrs)):
        # The joined pass takes every plain list, whatever its hosts.
        assert together is not None
    if together is None:
        return
    assert None not in one_by_one
    assert together == ([p[0] for p in one_by_one if p], [p[1] for p in one_by_one if p])
    assert all(type(port) is int for port in together[1])


@settings(max_examples=300, deadline=None)
@given(addrs=st.lists(ADDRESSES, min_size=1, max_size=10))
def test_records_of_any_address_decode_in_bulk_as_each_by_itself(addrs: list[str]) -> None:
    """What ``decode_records`` makes of records with these addresses is
    each record decoded by itself, and equal to the validating
    constructor's instance."""
    identities = [f"i{n}" for n in range(len(addrs))]
    raws = [doc(Op=0, Addr=addr) for addr in addrs]
    expected = each_decoded(identities, raws)
    bulk = decode_records(identities, raws, max_record_bytes=LIMIT)
    if None not in expected:
        assert bulk == expected
        for instance, identity, addr in zip(bulk, identities, addrs, strict=True):
            host, port = _split_addr(addr)
            assert instance == Instance(identity, host, port)
    else:
        assert bulk is None


def count_lines(run: Callable[[], object], filename: str) -> int:
    """Python lines run in ``filename`` while ``run`` runs."""
    lines = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == filename else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(before)
    return lines


def test_a_chunk_of_plain_records_takes_no_python_step_per_address() -> None:
    """Plain records (``host:port``, no Metadata) of any count are decoded
    in a fixed number of Python lines: the addresses are checked and split
    as one text, not one at a time."""

    def records(count: int) -> tuple[list[str], list[bytes]]:
        addrs = [f"10.{n // 250}.{n % 250}.1:{8000 + n % 7}" for n in range(count)]
        addrs[1] = "svc-1.example.com:080"
        return [f"i{n}" for n in range(count)], [doc(Op=0, Addr=addr) for addr in addrs]

    lines: dict[int, int] = {}
    for count in (10, 1000):
        identities, raws = records(count)
        decoded = decode_records(identities, raws, max_record_bytes=LIMIT)
        assert (
            decoded is not None
            and decoded[1].port == 80
            and decoded[-1].port == 8000 + (count - 1) % 7
        )
        lines[count] = count_lines(
            partial(decode_records, identities, raws, max_record_bytes=LIMIT), _layout.__file__
        )
    assert lines[1000] == lines[10]
