"""The one shared address check: ``Instance`` refuses a host that is not an IP
address or DNS name (:class:`nadisc.InvalidInstanceAddress`, naming the
instance), and a listing assembled by the trusted builder (which skips the
constructor's checks) lists such an instance as invalid instead of serving it."""

from __future__ import annotations

import ipaddress
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc import EvidenceKind, Instance, InvalidInstanceAddress, ProviderSnapshot, _instance
from nadisc._instance import _IPV4, _check_host, _trusted_instances, valid_host, valid_hosts

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
    "010.0.0.1",
    "1.2.3.4.",
    "1.2.3.256",
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


def _accepted_by_ipaddress(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


#: Text shaped like dotted quads: octets of 0-999 with or without leading
#: zeros, three to five of them, now and then a stray character.
_QUADISH = st.builds(
    lambda octets, zeros, joint, tail: (
        joint.join("0" * pad + str(octet) for octet, pad in zip(octets, zeros, strict=False)) + tail
    ),
    st.lists(st.integers(0, 999), min_size=3, max_size=5),
    st.lists(st.integers(0, 2), min_size=5, max_size=5),
    st.sampled_from([".", ".", ".", ":", ". "]),
    st.sampled_from(["", "", "", ".", "\n", " ", "a", "\u0661"]),
)


@given(st.one_of(_QUADISH, st.text(alphabet="0123456789.\n ", max_size=20), st.text(max_size=20)))
def test_the_dotted_quad_pattern_accepts_exactly_what_ipaddress_does(text: str) -> None:
    # _check_host relies on it instead of ipaddress.IPv4Address.
    assert (_IPV4.fullmatch(text) is not None) == _accepted_by_ipaddress(text)


_HOSTS = st.one_of(
    st.sampled_from(GOOD + BAD),
    st.builds("{}.{}.{}.{}".format, *[st.integers(0, 300)] * 4),
    st.text(max_size=12),
)


@given(st.lists(_HOSTS, max_size=12), st.booleans())
def test_hosts_checked_together_get_the_answer_each_would(hosts: list[str], warm: bool) -> None:
    _instance._VALID_HOSTS.clear()
    if warm:
        for host in hosts[::2]:
            valid_host(host)
    expected = all(_check_host(host) for host in hosts)
    assert valid_hosts(hosts) == expected
    assert valid_hosts(hosts) == expected  # and again, from what it cached
    assert {host for host in hosts if _check_host(host)} >= _instance._VALID_HOSTS


def test_a_full_cache_starts_over_rather_than_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_instance, "_CACHE_LIMIT", 8)
    _instance._VALID_HOSTS.clear()
    first = [f"10.0.0.{n}" for n in range(6)]
    second = [f"10.0.1.{n}" for n in range(6)]
    assert valid_hosts(first) and set(first) == _instance._VALID_HOSTS
    assert valid_hosts(second) and set(second) == _instance._VALID_HOSTS
    assert valid_hosts([f"10.0.2.{n}" for n in range(9)])  # more than the cache holds
    assert len(_instance._VALID_HOSTS) <= 8


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
