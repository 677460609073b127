"""Kubernetes: an endpoint whose address is not an IP address or DNS name is
listed as invalid (the shared check in ``nadisc.Instance``)."""

from __future__ import annotations

from tests.providers.kubernetes.conftest import endpoint
from tests.providers.kubernetes.test_units import service, slice_, snapshot

HOSTILE = "<img src=x onerror=alert(5)>"


def test_a_hostile_endpoint_address_is_invalid_and_named() -> None:
    bad = endpoint(2)
    bad["addresses"] = [HOSTILE]
    snap = snapshot(
        service(), slice_("s1", [endpoint(1), bad], ports=[{"name": "http", "port": 8080}])
    )
    assert len(snap.instances) == 1 and snap.instances[0].host == "10.0.0.1"
    ((key, reason),) = snap.invalid.items()
    assert key.startswith("s1/") or "s1" in key
    assert "DNS name" in reason and "instance" in reason
