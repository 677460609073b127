"""Sans-IO decoding of Nacos answers: shapes, eligibility, protect mark, bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from nadisc_nacos import decode_instance_list
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
    assert (
        decode({"code": 0, "message": "success", "data": None}, api="v3").snapshot.instances == ()
    )
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
    assert decode(moved, previous=first).snapshot.instances[0] is not first.instances[0]


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


def test_built_instances_equal_constructed_ones() -> None:
    (built,) = decode(DOC_EXAMPLE).snapshot.instances
    assert built == Instance("b", "10.10.10.11", 8888, weight=2.5, metadata={"zone": "a"})
    assert hash(built) == hash(Instance("b", "10.10.10.11", 8888, weight=2.5))
