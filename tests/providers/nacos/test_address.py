"""Nacos: a host whose ``ip`` is not an IP address or DNS name is listed as
invalid on the fast path and on the careful path (the shared screen of
listings built by ``nadisc``'s trusted builder)."""

from __future__ import annotations

from typing import Any

from tests.providers.nacos.test_wire import decode

HOSTILE = "<img src=x onerror=alert(5)>"


def host(instance_id: str, ip: str, **extra: Any) -> dict[str, Any]:
    return {
        "instanceId": instance_id,
        "ip": ip,
        "port": 8080,
        "weight": 1.0,
        "healthy": True,
        "enabled": True,
        "metadata": {},
        **extra,
    }


def test_fast_path_lists_a_hostile_ip_as_invalid() -> None:
    listing = decode({"hosts": [host("a", "10.0.0.1"), host("b", HOSTILE)]})
    snap = listing.snapshot
    assert snap.identities() == ("a",)
    assert "instance 'b'" in snap.invalid["b"] and "DNS name" in snap.invalid["b"]


def test_careful_path_lists_a_hostile_ip_as_invalid() -> None:
    # A malformed neighbour (port out of range) sends the answer down the careful path.
    bad_port = host("c", "10.0.0.3", port=0)
    listing = decode({"hosts": [host("a", "10.0.0.1"), host("b", HOSTILE), bad_port]})
    snap = listing.snapshot
    assert snap.identities() == ("a",)
    assert "instance 'b'" in snap.invalid["b"]
