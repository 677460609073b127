"""etcd ``endpoints``: a port or host no client can dial is a config error at
``etcd.endpoints`` that names the endpoint by its position and says why,
never when the provider first opens a connection."""

from __future__ import annotations

import pydantic
import pytest
from nadisc_etcd import EtcdSettings

import nadisc


def settings_of(*endpoints: str) -> EtcdSettings:
    return EtcdSettings.model_validate({"endpoints": endpoints})


def document(endpoint: str) -> str:
    return f"""
discovery:
  enabled: true
  connections:
    primary:
      provider: etcd
      etcd:
        endpoints: ['http://10.0.0.10:2379', '{endpoint}']
        username: sekrit-user
        password: hunter2
        services: {{a: {{name: a}}}}
"""


BAD_PORTS = [
    ("http://127.0.0.1:abc", "the port is not a number"),
    ("http://127.0.0.1:+80", "the port is not a number"),
    ("http://127.0.0.1:-1", "the port is not a number"),
    ("http://127.0.0.1: 80", "the port is not a number"),
    ("http://127.0.0.1:1_0", "the port is not a number"),
    ("http://127.0.0.1:\u0663", "the port is not a number"),  # ARABIC-INDIC DIGIT THREE
    ("http://etcd:2379:80", "the port is not a number"),
    ("http://127.0.0.1:99999", "the port is outside 1-65535"),
    ("http://127.0.0.1:65536", "the port is outside 1-65535"),
    ("http://127.0.0.1:0", "the port is outside 1-65535"),
    ("https://[::1]:70000", "the port is outside 1-65535"),
    ("http://127.0.0.1:", "':' after the host but no port"),
    ("http://[::1]:", "':' after the host but no port"),
]

BAD_HOSTS = [
    ("http://:2379", "the host is empty"),
    ("http://[]:2379", "the host does not parse"),
    ("http://[zz]:2379", "the host does not parse"),
    ("http://[::1]x:2379", "text after the ']' of the IPv6 address"),
    ("http://etcd one:2379", "the host is not an IP address or a host name"),
    ("http://etcd%20one:2379", "the host is not an IP address or a host name"),
    # The checks every provider's server address gets (nadisc._config.undialable,
    # nadisc._instance.valid_host): no server at the unspecified address, and a
    # number in disguise is no host name.
    ("http://0.0.0.0:2379", "the host is the unspecified address"),
    ("http://[::]:2379", "the host is the unspecified address"),
    ("http://127.1:2379", "the host is not an IP address or a host name"),
]


@pytest.mark.parametrize(("endpoint", "reason"), BAD_PORTS + BAD_HOSTS)
def test_an_endpoint_with_a_bad_port_or_host_is_refused_by_position(
    endpoint: str, reason: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        settings_of("http://10.0.0.10:2379", endpoint)
    assert f"endpoints[1]: {reason}" in str(info.value)
    assert endpoint not in str(info.value)


@pytest.mark.parametrize(("endpoint", "reason"), BAD_PORTS + BAD_HOSTS)
def test_a_bad_endpoint_is_a_config_error_at_load(endpoint: str, reason: str) -> None:
    with pytest.raises(nadisc.ConfigError) as info:
        nadisc.load_config(document(endpoint), require_providers=True)
    assert info.value.path == "discovery.connections.primary.etcd.endpoints"
    assert f"endpoints[1]: {reason}" in str(info.value)
    for secret in ("hunter2", "sekrit-user"):
        assert secret not in str(info.value) and secret not in repr(info.value)


@pytest.mark.parametrize(
    ("endpoint", "kept"),
    [
        ("http://127.0.0.1:2379", "http://127.0.0.1:2379"),
        ("http://127.0.0.1:1", "http://127.0.0.1:1"),
        ("http://etcd-0.etcd.svc:65535", "http://etcd-0.etcd.svc:65535"),
        ("https://etcd.example/", "https://etcd.example"),
        ("http://[::1]:2379", "http://[::1]:2379"),
        ("http://[fe80::1%25eth0]:2379", "http://[fe80::1%25eth0]:2379"),
        ("http://[::1]", "http://[::1]"),
        ("http://etcd_a.:2379", "http://etcd_a.:2379"),
        ("http://etcd:02379", "http://etcd:2379"),  # the port as a plain number
    ],
)
def test_a_good_endpoint_is_kept(endpoint: str, kept: str) -> None:
    assert settings_of(endpoint).endpoints == (kept,)


def test_one_endpoint_spelled_with_a_padded_port_is_a_duplicate() -> None:
    with pytest.raises(pydantic.ValidationError, match="duplicate URL"):
        settings_of("http://etcd:2379", "http://etcd:02379")
