"""Consul: a health entry whose address is not an IP address or DNS name is
listed as invalid, not served (the shared check in ``nadisc.Instance``)."""

from __future__ import annotations

from tests.providers.consul.test_wire import decode, entry

HOSTILE = "<img src=x onerror=alert(5)>"


def test_a_hostile_service_address_is_invalid_and_named() -> None:
    snap = decode([entry("web-1"), entry("web-2", address=HOSTILE)])
    assert snap.identities() == ("web-1",)
    ((key, reason),) = snap.invalid.items()
    assert "web-2" in key and "instance 'web-2'" in reason and "DNS name" in reason


def test_a_hostile_node_address_behind_an_empty_service_address_is_invalid() -> None:
    snap = decode([entry("web-1"), entry("web-2", address="", node="n2", node_address=HOSTILE)])
    assert snap.identities() == ("web-1",)
    assert any("instance 'web-2'" in reason for reason in snap.invalid.values())
