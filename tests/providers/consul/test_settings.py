"""Settings validation: frozen, strict, secrets hidden, Consul's own limits."""

from __future__ import annotations

from typing import Any

import certifi
import pytest
from nadisc_consul import ConsulProvider, ConsulSettings, ServiceBinding
from pydantic import ValidationError

import nadisc
from nadisc import ConfigError
from tests.providers.consul.conftest import context


def settings(**values: Any) -> ConsulSettings:
    return ConsulSettings.model_validate(values)


def test_defaults_follow_the_documented_options() -> None:
    value = settings()
    assert str(value.url) == "http://127.0.0.1:8500/"
    assert value.wait == 30.0 and value.catalog_wait == 300.0
    assert value.reregister_interval == 30.0
    assert value.health_check_interval == 10.0
    assert value.deregister_critical_service_after == 60.0
    assert value.consistency == "default" and value.enabled
    assert not value.allow_loopback


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"unknown": 1}, "unknown"),
        ({"deregister_critical_service_after": 30}, "deregister_critical_service_after"),
        ({"wait": 0}, "wait"),
        ({"wait": 601}, "wait"),
        ({"consistency": "eventual"}, "consistency"),
        ({"meta": {"nadisc.version": "1"}}, "meta"),
        ({"meta": {"consul-x": "1"}}, "meta"),
        ({"health_check_path": "health"}, "health_check_path"),
        ({"services": {"a": {"name": "x", "extra": 1}}}, "services"),
        ({"url": "ftp://consul"}, "url"),
    ],
)
def test_bad_values_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as error:
        settings(**values)
    assert field in str(error.value)


def test_frozen() -> None:
    value = settings()
    with pytest.raises(ValidationError):
        value.wait = 5.0


def test_token_is_secret() -> None:
    value = settings(token="abcd-1234-secret")
    assert "abcd-1234-secret" not in repr(value)
    assert "abcd-1234-secret" not in str(value.model_dump())
    assert value.token is not None and value.token.get_secret_value() == "abcd-1234-secret"


def test_bindings_resolve_alias_then_unique_remote_name() -> None:
    value = settings(services={"orders": {"name": "order-worker", "tag": "grpc"}})
    assert value.binding("orders") == ServiceBinding(name="order-worker", tag="grpc")
    assert value.binding("order-worker").tag == "grpc"
    assert value.binding("other") == ServiceBinding(name="other")


async def test_ca_file_is_used_for_https_and_bad_bundles_are_config_errors() -> None:
    with pytest.raises(ValidationError, match="https"):
        settings(url="http://consul:8500", ca_file=certifi.where())
    good = ConsulProvider(context(), settings(url="https://consul:8501", ca_file=certifi.where()))
    await good.aclose()
    with pytest.raises(ConfigError, match=r"consul\.ca_file"):
        ConsulProvider(context(), settings(url="https://consul:8501", ca_file="/nonexistent.pem"))


async def test_binding_name_defaults_to_the_alias_and_bindings_are_exposed() -> None:
    value = settings(services={"orders": {"tag": "grpc"}, "db": {"name": "postgres"}})
    assert value.binding("orders") == ServiceBinding(name="orders", tag="grpc")
    provider = ConsulProvider(context(), value)
    assert provider.bindings() == {"orders": "orders", "db": "postgres"}
    await provider.aclose()


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "::0", "[::0]", "[::]", "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0", "*"]
)
def test_an_unspecified_advertised_host_is_refused_always(host: str) -> None:
    for allow_loopback in (False, True):
        with pytest.raises(ValidationError, match="advertised_host must be a routable host"):
            settings(advertised_host=host, allow_loopback=allow_loopback)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"])
def test_a_loopback_advertised_host_needs_allow_loopback(host: str) -> None:
    with pytest.raises(ValidationError, match="allow_loopback"):
        settings(advertised_host=host)
    assert settings(advertised_host=host, allow_loopback=True).advertised_host == host


@pytest.mark.parametrize(
    "host",
    ["10.1.2.3", "2001:db8::5", "[2001:db8::5]", "app.internal", "consul-1", "host0x1", "a1.b2"],
)
def test_a_routable_advertised_host_is_accepted(host: str) -> None:
    assert settings(advertised_host=host).advertised_host == host


#: Spellings the C resolver (``inet_aton``) reads as another address, and
#: what it reads: ``getaddrinfo`` maps them there, other clients look the
#: text up as a name.
NUMERIC_SPELLINGS = [
    ("0", "0.0.0.0"),
    ("0x0", "0.0.0.0"),
    ("0.0", "0.0.0.0"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),
    ("0x7F000001", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("127.1.", "127.0.0.1"),
    ("10.1", "10.0.0.1"),
    ("167837953", "10.1.1.1"),
]


@pytest.mark.parametrize(("host", "reading"), NUMERIC_SPELLINGS)
def test_a_numeric_advertised_host_is_refused_always(host: str, reading: str) -> None:
    for allow_loopback in (False, True):
        with pytest.raises(ValidationError) as info:
            settings(advertised_host=host, allow_loopback=allow_loopback)
        (error,) = info.value.errors()
        assert error["loc"] == ("advertised_host",)
        assert f"advertised_host is a numeric host name (read as {reading})" in error["msg"]
        assert "dotted-quad" in error["msg"]


@pytest.mark.parametrize("host", ["app.123", "app.0x1f", "1.2.3.4.5", "999.1.1.1"])
def test_a_host_name_ending_in_a_number_is_refused(host: str) -> None:
    with pytest.raises(ValidationError, match="its last label is a number"):
        settings(advertised_host=host)


def consul_document(**block: str) -> str:
    fields = ", ".join(f"{key}: '{value}'" for key, value in block.items())
    return f"""
discovery:
  enabled: true
  connections:
    primary:
      provider: consul
      consul: {{{fields}, services: {{self: {{name: api}}}}}}
"""


@pytest.mark.parametrize(
    ("host", "reason"),
    [(host, f"read as {reading}") for host, reading in NUMERIC_SPELLINGS[:9]]
    + [("0.0.0.0", "not an unspecified (wildcard) address"), ("::", "(wildcard)")],
)
def test_a_refused_advertised_host_is_a_config_error_at_its_path(host: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        nadisc.load_config(consul_document(advertised_host=host), require_providers=True)
    assert info.value.path == "discovery.connections.primary.consul.advertised_host"
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:abc", "invalid port number"),
        ("http://127.0.0.1:99999", "invalid port number"),
        ("http://127.0.0.1:0", "port 0 cannot be connected to"),
        ("https://[::1]:0", "port 0 cannot be connected to"),
        ("http://127.0.0.1:", "':' after the host but no port"),
        ("http://[::1]:/", "':' after the host but no port"),
        ("http://:8500", "empty host"),
    ],
)
def test_a_url_with_a_bad_port_or_host_is_a_config_error_at_its_path(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        nadisc.load_config(consul_document(url=url), require_providers=True)
    assert info.value.path == "discovery.connections.primary.consul.url"
    assert reason in str(info.value)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:1", "http://consul:65535", "https://[::1]:8501/", "http://consul"]
)
def test_a_url_with_a_dialable_port_is_accepted(url: str) -> None:
    assert settings(url=url).url.port in (1, 65535, 8501, 80)


@pytest.mark.parametrize(
    "url",
    [
        "http://admin:hunter2@consul:8500",
        "https://:hunter2@consul:8501",
        "http://hunter2@consul:8500",
    ],
)
def test_credentials_in_the_url_are_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ValidationError) as info:
        settings(url=url)
    assert "credentials do not belong in url; use token" in str(info.value)
    assert "hunter2" not in str(info.value) and "hunter2" not in repr(info.value)


def test_rejected_input_is_never_echoed_and_the_token_never_shown() -> None:
    with pytest.raises(ValidationError) as info:
        settings(token="hunter2", wait="hunter2-not-a-number")
    assert "hunter2" not in str(info.value)
    good = settings(token="hunter2", url="https://consul.example:8501")
    assert "hunter2" not in repr(good) and "hunter2" not in str(good)
    assert "hunter2" not in repr(good.model_dump())


def test_connection_meta_under_a_secret_looking_key_is_refused_unless_listed() -> None:
    """The connection's meta goes out with every registration: a
    secret-looking key is refused at load as on a registration's own."""
    text = """
discovery:
  enabled: true
  connections:
    primary:
      provider: consul
      consul:
        meta: {db_password: pw-meta-2, region: eu}
        services: {self: {name: api}}
"""
    with pytest.raises(ConfigError) as info:
        nadisc.load_config(text, require_providers=True)
    assert info.value.path == "discovery.connections.primary.consul.meta"
    assert "db_password" in str(info.value) and "pw-meta-2" not in str(info.value)
    allowed = ConsulSettings.model_validate(
        {
            "meta": {"db_password": "pw-meta-2", "region": "eu"},
            "publish_secret_looking_metadata": ["db_password"],
        }
    )
    assert allowed.meta == {"db_password": "pw-meta-2", "region": "eu"}


@pytest.mark.parametrize("url", ["http://0:8500", "http://0.0.0.0:8500", "http://[::]:8500"])
def test_a_url_whose_host_is_the_unspecified_address_is_refused(url: str) -> None:
    with pytest.raises(ValidationError, match="unspecified"):
        ConsulSettings.model_validate({"url": url})


def test_an_empty_token_is_refused_not_sent() -> None:
    # An empty token would be sent as "Bearer " (the agent's anonymous
    # policy); no token is written by leaving the key out.
    with pytest.raises(ValidationError):
        ConsulSettings.model_validate({"token": ""})
    assert ConsulSettings.model_validate({}).token is None
