"""The one shared address check: ``Instance`` refuses a host that is not an IP
address or DNS name (:class:`nadisc.InvalidInstanceAddress`, naming the
instance), and a listing assembled by the trusted builder (which skips the
constructor's checks) lists such an instance as invalid instead of serving it."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc import EvidenceKind, Instance, InvalidInstanceAddress, ProviderSnapshot
from nadisc._instance import _check_host, _trusted_instances, valid_host

HOSTILE = "<img src=x onerror=alert(5)>"
GOOD = ["10.0.0.1", "::1", "fe80::1%eth0", "orders.svc.cluster.local", "h1", "node_7", "a.example."]
BAD = [
    HOSTILE,
    "",
    "a b",
    "a..b",
    "-a.example",
    "a-.example",
    "999.1.1.1",
    "1.2.3",
    "[::1]",
    "x" * 64,
    ".".join(["a" * 60] * 5),
    "exämple.com",
    "a/b",
    "a:b",
    "10.0.0.1:80",
]


@pytest.mark.parametrize("host", GOOD)
def test_valid_hosts(host: str) -> None:
    assert valid_host(host)
    Instance("i1", host, 80)


@pytest.mark.parametrize("host", BAD)
def test_invalid_hosts_are_refused_with_a_typed_error_naming_the_instance(host: str) -> None:
    assert not valid_host(host)
    if not host:
        return  # the empty host has its own message
    with pytest.raises(InvalidInstanceAddress) as caught:
        Instance("orders-7", host, 80)
    assert caught.value.identity == "orders-7" and caught.value.host == host
    assert "instance 'orders-7'" in str(caught.value)
    assert isinstance(caught.value, ValueError)  # providers' invalid-record paths catch it


@given(st.text(max_size=30))
def test_the_cache_never_changes_the_answer(host: str) -> None:
    assert valid_host(host) == _check_host(host) == valid_host(host)


def test_a_trusted_listing_lists_a_bad_host_as_invalid() -> None:
    view: MappingProxyType[str, str] = MappingProxyType({})
    built = _trusted_instances(
        ("a", "b", "c"), ("10.0.0.1", HOSTILE, "ok.example"), (80, 81, 82), (1.0,) * 3, (view,) * 3
    )
    checked = ProviderSnapshot._checked(
        "orders", tuple(built), EvidenceKind.REGISTRY_HEALTH, {}, -1
    )
    plain = ProviderSnapshot("orders", tuple(built), EvidenceKind.REGISTRY_HEALTH)
    for snap in (checked, plain):
        assert snap.identities() == ("a", "c")
        assert set(snap.invalid) == {"b"}
        assert (
            "instance 'b'" in snap.invalid["b"]
            and "not an IP address or DNS name" in snap.invalid["b"]
        )
        assert snap.approximate_bytes() == 64 + sum(i.approximate_bytes() for i in snap.instances)


def test_a_static_instance_with_a_bad_host_is_a_config_error_naming_its_path() -> None:
    from pydantic import ValidationError

    from nadisc import DiscoveryConfig

    static = {"services": {"a": [{"id": "i1", "host": HOSTILE, "port": 80}]}}
    with pytest.raises(ValidationError, match=r"static\.services\.a\.0\.host"):
        DiscoveryConfig.model_validate(
            {"enabled": True, "connections": {"p": {"provider": "static", "static": static}}}
        )
