"""Sans-IO decoding of Nacos answers: shapes, eligibility, protect mark, bounds."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nadisc_nacos import _wire, decode_instance_list
from nadisc_nacos._wire import decode_beat, decode_envelope, decode_login, listing_digest

from nadisc import CapacityRejected, EvidenceKind, IncompleteSnapshot, Instance

# The documented v1 example answer (open-API docs, "query instance list"),
# one healthy host added.
DOC_EXAMPLE: dict[str, Any] = {
    "name": "DEFAULT_GROUP@@nacos.test.1",
    "groupName": "DEFAULT_GROUP",
    "clusters": "",
    "cacheMillis": 10000,
    "hosts": [
        {
            "instanceId": "10.10.10.10#8888#DEFAULT#DEFAULT_GROUP@@nacos.test.1",
            "ip": "10.10.10.10",
            "port": 8888,
            "weight": 1,
            "healthy": False,
            "enabled": True,
            "ephemeral": False,
            "clusterName": "DEFAULT",
            "serviceName": "DEFAULT_GROUP@@nacos.test.1",
            "metadata": {},
            "instanceHeartBeatInterval": 5000,
            "instanceIdGenerator": "simple",
            "instanceHeartBeatTimeOut": 15000,
            "ipDeleteTimeout": 30000,
        },
        {
            "instanceId": "b",
            "ip": "10.10.10.11",
            "port": 8888,
            "weight": 2.5,
            "healthy": True,
            "enabled": True,
            "metadata": {"zone": "a"},
        },
    ],
    "lastRefTime": 1528787794594,
    "checksum": "3bbcf6dd1175203a8afdade0e77a27cd1528787794594",
    "allIPs": False,
    "reachProtectionThreshold": False,
    "valid": True,
}


def decode(document: Any, *, api: str = "v1", **options: Any) -> Any:
    values: dict[str, Any] = {
        "api": api,
        "service": "nacos.test.1",
        "group": "DEFAULT_GROUP",
        "max_bytes": 1 << 20,
        "max_instances": 100,
    }
    values.update(options)
    return decode_instance_list(json.dumps(document).encode(), **values)


def test_documented_example_serves_only_healthy_enabled_hosts_with_weight() -> None:
    listing = decode(DOC_EXAMPLE)
    (only,) = listing.snapshot.instances
    assert (only.identity, only.host, only.port, only.weight) == ("b", "10.10.10.11", 8888, 2.5)
    assert dict(only.metadata) == {"zone": "a"}
    assert listing.snapshot.evidence is EvidenceKind.REGISTRY_HEALTH
    assert listing.cache_seconds == 10.0 and listing.checksum.startswith("3bbc")


def test_disabled_and_zero_weight_are_not_eligible() -> None:
    hosts = [
        {"ip": "10.0.0.1", "port": 1, "enabled": False},
        {"ip": "10.0.0.2", "port": 2, "weight": 0},
        {"ip": "10.0.0.3", "port": 3},
    ]
    listing = decode({"hosts": hosts})
    assert listing.snapshot.identities() == ("10.0.0.3#3#DEFAULT#DEFAULT_GROUP@@nacos.test.1",)
    assert not listing.snapshot.invalid


def test_protect_threshold_is_weaker_evidence() -> None:
    listing = decode({**DOC_EXAMPLE, "reachProtectionThreshold": True})
    assert listing.snapshot.evidence is EvidenceKind.WEAK_HEALTH
    v3 = decode(
        {
            "code": 0,
            "message": "success",
            "data": {"hosts": DOC_EXAMPLE["hosts"], "reachProtectionThreshold": True},
        },
        api="v3",
    )
    assert v3.snapshot.evidence is EvidenceKind.WEAK_HEALTH


def test_v3_envelope_with_the_bare_list() -> None:
    listing = decode({"code": 0, "message": "success", "data": DOC_EXAMPLE["hosts"]}, api="v3")
    assert listing.snapshot.identities() == ("b",)
    assert listing.cache_seconds == 0
    assert decode({"code": 0, "message": "success", "data": []}, api="v3").snapshot.instances == ()
    with pytest.raises(IncompleteSnapshot, match="code 30000"):
        decode({"code": 30000, "message": "server error", "data": None}, api="v3")


def test_malformed_hosts_are_counted_invalid_and_the_rest_stands() -> None:
    hosts = [
        {"ip": "10.0.0.1", "port": "eighty"},
        {"port": 80},
        {"ip": "10.0.0.3", "port": 70000, "instanceId": "far"},
        {"instanceId": "dup", "ip": "10.0.0.4", "port": 4},
        {"instanceId": "dup", "ip": "10.0.0.5", "port": 5},
        {"ip": "10.0.0.6", "port": 6, "metadata": {"k": 1}},
        {"ip": "10.0.0.7", "port": 7, "instanceId": "good"},
    ]
    snapshot = decode({"hosts": hosts}).snapshot
    assert snapshot.identities() == ("dup", "good")
    assert set(snapshot.invalid) == {"hosts[0]", "hosts[1]", "hosts[5]", "far", "dup"}


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"[]", b'{"hosts": 3}', b'"ok"', b'{"hosts": [], "cacheMillis": "x"}'],
)
def test_bad_shapes_are_incomplete(body: bytes) -> None:
    with pytest.raises(IncompleteSnapshot):
        decode_instance_list(
            body, api="v1", service="s", group="g", max_bytes=100, max_instances=10
        )


def test_byte_and_instance_bounds() -> None:
    body = json.dumps(DOC_EXAMPLE).encode()
    with pytest.raises(CapacityRejected, match="exceed the budget"):
        decode_instance_list(
            body, api="v1", service="s", group="g", max_bytes=len(body) - 1, max_instances=10
        )
    hosts = [{"ip": "10.0.0.1", "port": n} for n in range(1, 12)]
    with pytest.raises(CapacityRejected, match="max_instances_per_service"):
        decode({"hosts": hosts}, max_instances=10)


def test_unchanged_instances_are_reused() -> None:
    first = decode(DOC_EXAMPLE).snapshot
    again = decode(DOC_EXAMPLE, previous=first).snapshot
    assert again.instances[0] is first.instances[0]
    moved = json.loads(json.dumps(DOC_EXAMPLE))
    moved["hosts"][1]["weight"] = 3
    (changed,) = decode(moved, previous=first).snapshot.instances
    assert changed is not first.instances[0] and changed.weight == 3
    # Its metadata did not change: the previous view is kept.
    assert changed.metadata is first.instances[0].metadata
    moved["hosts"][1]["metadata"] = {"zone": "b"}
    (rezoned,) = decode(moved, previous=first).snapshot.instances
    assert dict(rezoned.metadata) == {"zone": "b"}


def test_login_beat_and_envelope_answers() -> None:
    # the documented login example
    login = decode_login(
        b'{"accessToken":"eyJhbGciOiJIUzI1NiJ9.x","tokenTtl":18000,"globalAdmin":true}',
        max_bytes=1000,
    )
    assert login.access_token.startswith("eyJ") and login.token_ttl == 18000
    with pytest.raises(IncompleteSnapshot) as refused:
        decode_login(b'{"accessToken":"","tokenTtl":18000}', max_bytes=1000)
    assert "eyJ" not in str(refused.value)
    beat = decode_beat(
        b'{"clientBeatInterval":5000,"code":10200,"lightBeatEnabled":true}', max_bytes=1000
    )
    assert (beat.code, beat.client_beat_interval, beat.light_beat_enabled) == (10200, 5000, True)
    assert decode_envelope(
        b'{"code":21003,"message":"instance not found","data":null}', max_bytes=1000, what="beat"
    ) == (21003, "instance not found", None)


def test_the_digest_ignores_only_the_server_clock() -> None:
    body = json.dumps(DOC_EXAMPLE).encode()
    later = json.dumps({**DOC_EXAMPLE, "lastRefTime": 1528787799999}).encode()
    assert listing_digest(body) == listing_digest(later)
    changed = json.loads(body)
    changed["hosts"][0]["healthy"] = True
    assert listing_digest(json.dumps(changed).encode()) != listing_digest(body)
    marked = json.dumps({**DOC_EXAMPLE, "reachProtectionThreshold": True}).encode()
    assert listing_digest(marked) != listing_digest(body)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                [b'"lastRefTime":', b'"lastRefTime"', b'"lastRefTime": -12', b"\\", b"1", b" "]
            ),
            st.binary(max_size=6),
        ),
        max_size=12,
    ).map(b"".join)
)
def test_the_digest_hashes_what_the_clock_pattern_leaves(body: bytes) -> None:
    """Found by ``bytes.find`` and hashed in place, it leaves out exactly
    what the pattern's substitution would."""
    stripped = _wire._REF_TIME.sub(b"", body)
    assert listing_digest(body) == hashlib.sha1(stripped, usedforsecurity=False).digest()


def test_built_instances_equal_constructed_ones() -> None:
    (built,) = decode(DOC_EXAMPLE).snapshot.instances
    assert built == Instance("b", "10.10.10.11", 8888, weight=2.5, metadata={"zone": "a"})
    assert hash(built) == hash(Instance("b", "10.10.10.11", 8888, weight=2.5))


def test_listings_with_ids_take_the_fast_path_and_hosts_without_one_the_careful_path() -> None:
    # The fast path unpacks each host's fields by position, in this order.
    assert _wire._FastHost.__struct_fields__ == _wire._FAST_FIELDS
    body = json.dumps(DOC_EXAMPLE).encode()
    fast = _wire._fast_list(body, "v1", "nacos.test.1", "DEFAULT_GROUP", 100, None, "what")
    assert fast is not None and fast.snapshot == decode(DOC_EXAMPLE).snapshot
    bare = json.loads(body)
    for host in bare["hosts"]:
        del host["instanceId"]
    encoded = json.dumps(bare).encode()
    assert _wire._fast_list(encoded, "v1", "nacos.test.1", "DEFAULT_GROUP", 100, None, "w") is None
    (served,) = decode(bare).snapshot.instances  # the default id, as Nacos builds it
    assert served.identity == "10.10.10.11#8888#DEFAULT#DEFAULT_GROUP@@nacos.test.1"


# -- the fast path and the careful path agree ---------------------------------------------


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 70000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=1),
)
_METADATA = st.one_of(
    st.sampled_from([{}, {"zone": "a"}, {"zone": "b", "v": "1"}]),
    st.dictionaries(st.sampled_from(["k", "zone"]), st.one_of(st.text(max_size=3), _VALUES)),
    _VALUES,
)


@st.composite
def _hosts(draw: st.DrawFn) -> dict[str, Any]:
    """A host that is mostly well-formed, with any field possibly hostile."""
    host: dict[str, Any] = {
        "ip": draw(st.sampled_from(["10.0.0.1", "10.0.0.2", "", "::1"])),
        "port": draw(st.sampled_from([1, 80, 65535, 0, 65536, -1])),
    }
    if draw(st.booleans()):
        host["instanceId"] = draw(st.sampled_from(["a", "b", "c", "", None]))
    for key, good in (
        ("weight", st.sampled_from([1, 0.5, 0, -1, 1e308])),
        ("healthy", st.booleans()),
        ("enabled", st.booleans()),
        ("clusterName", st.sampled_from(["DEFAULT", "c1"])),
    ):
        if draw(st.booleans()):
            host[key] = draw(good)
    if draw(st.booleans()):
        host["metadata"] = draw(_METADATA)
    if draw(st.integers(0, 9)) == 0:  # one field of any type at all
        host[draw(st.sampled_from(["ip", "port", "weight", "healthy", "metadata"]))] = draw(_VALUES)
    return host


def _careful(body: bytes, api: str, previous: Any = None) -> Any:
    return _wire._careful_list(body, api, "svc", "G", 1000, previous, "instance list of G@@svc")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_hosts(), max_size=8),
    st.sampled_from(["v1", "v3"]),
    st.booleans(),
    st.sampled_from([64, 1, 0]),
    st.sampled_from([8, 0]),
)
def test_the_fast_path_equals_the_careful_path(
    hosts: list[dict[str, Any]], api: str, reuse: bool, give_up_after: int, count_each: int
) -> None:
    """Also with metadata sharing given up beyond 0 or 1 distinct texts (the
    one view per host that per-host metadata takes), and with the shared
    texts' hosts counted by one pass of lookups instead of one count each."""
    saved = _wire._SHARED_UP_TO, _wire._COUNT_EACH_UP_TO
    _wire._SHARED_UP_TO, _wire._COUNT_EACH_UP_TO = give_up_after, count_each
    try:
        _fast_equals_careful(hosts, api, reuse)
    finally:
        _wire._SHARED_UP_TO, _wire._COUNT_EACH_UP_TO = saved


def _fast_equals_careful(hosts: list[dict[str, Any]], api: str, reuse: bool) -> None:
    document: dict[str, Any] = {"hosts": hosts, "cacheMillis": 3000, "checksum": "x"}
    if api == "v3":
        document = {"code": 0, "message": "success", "data": hosts}
    body = json.dumps(document).encode()
    expected = _careful(body, api)
    previous = expected.snapshot if reuse else None
    fast = _wire._fast_list(body, api, "svc", "G", 1000, previous, "what")
    decoded = decode_instance_list(
        body,
        api=api,
        service="svc",
        group="G",
        max_bytes=1 << 20,
        max_instances=1000,
        previous=previous,
    )
    for listing in (decoded, fast) if fast is not None else (decoded,):
        assert listing.snapshot == expected.snapshot
        assert dict(listing.snapshot.invalid) == dict(expected.snapshot.invalid)
        assert (listing.cache_seconds, listing.checksum) == (
            expected.cache_seconds,
            expected.checksum,
        )
        assert listing.snapshot.approximate_bytes() == 64 + sum(
            i.approximate_bytes() for i in listing.snapshot.instances
        )
        for instance in listing.snapshot.instances:
            assert type(instance) is Instance
            rebuilt = Instance(
                instance.identity,
                instance.host,
                instance.port,
                instance.weight,
                metadata=dict(instance.metadata),
            )  # the constructor's checks accept every value the fast path let through
            assert rebuilt == instance and hash(rebuilt) == hash(instance)
        if reuse:
            assert all(
                a is b
                for a, b in zip(
                    listing.snapshot.instances, expected.snapshot.instances, strict=True
                )
            )
    if expected.snapshot.invalid:
        assert fast is None  # anything to name goes the careful way


def test_shared_metadata_views_and_giving_up_on_distinct_metadata() -> None:
    same = [
        {"ip": f"10.0.0.{n}", "port": 80, "instanceId": f"i{n}", "metadata": {"zone": "a"}}
        for n in range(1, 100)
    ]
    snapshot = decode({"hosts": same}, max_instances=1000).snapshot
    assert len({id(i.metadata) for i in snapshot.instances}) == 1
    distinct = [dict(host, metadata={"ts": str(n)}) for n, host in enumerate(same)]
    snapshot = decode({"hosts": distinct}, max_instances=1000).snapshot
    assert [i.metadata["ts"] for i in snapshot.instances] == [str(n) for n in range(99)]
    with pytest.raises(TypeError):
        snapshot.instances[0].metadata["ts"] = "x"


def test_a_repeated_id_or_bad_metadata_late_in_a_large_list_is_named() -> None:
    hosts = [{"ip": "10.0.0.1", "port": n, "instanceId": f"i{n}"} for n in range(1, 300)]
    hosts.append({"ip": "10.0.0.2", "port": 9, "instanceId": "i9"})
    hosts.append({"ip": "10.0.0.2", "port": 7, "instanceId": "late", "metadata": {"k": 2}})
    snapshot = decode({"hosts": hosts}, max_instances=1000).snapshot
    assert len(snapshot.instances) == 299
    assert dict(snapshot.invalid).keys() == {"i9", "hosts[300]"}
    assert "repeated" in snapshot.invalid["i9"]
