"""The nacos settings model: strict, secret-safe, and what users get at load."""

from __future__ import annotations

from typing import Any

import pytest
from nadisc_nacos import NacosSettings, factory
from pydantic import ValidationError

from nadisc import ConfigError, DiscoveryConfig, validate_provider_block


def test_defaults_and_address_forms() -> None:
    s = NacosSettings()
    assert s.base_urls == ("http://127.0.0.1:8848/nacos",)
    assert (s.namespace, s.group, s.cluster, s.api) == (
        "public",
        "DEFAULT_GROUP",
        "DEFAULT",
        "auto",
    )
    seed = NacosSettings(server_addr="http://nacos-business:8848/nacos/")  # type: ignore[arg-type]
    assert seed.base_urls == ("http://nacos-business:8848/nacos",)
    several = NacosSettings.model_validate({"server_addr": "10.0.0.1:8848, 10.0.0.2:8848"})
    assert several.base_urls == ("http://10.0.0.1:8848/nacos", "http://10.0.0.2:8848/nacos")
    listed = NacosSettings.model_validate(
        {"server_addr": ["https://a:8443/custom", "b:8848"], "ca_file": "/tmp/ca.pem"}
    )
    assert listed.base_urls == ("https://a:8443/custom", "http://b:8848/nacos")


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"server_addr": "http://nacos:s3cr3t@host:8848/nacos"}, "credentials do not belong"),
        ({"username": "u"}, "username and password go together"),
        ({"password": "s3cr3t"}, "username and password go together"),
        ({"api": "v2"}, "api"),
        ({"unknown": 1}, "unknown"),
        ({"group": "A@@B"}, "group"),
        ({"services": {"a": {"name": "x@@y"}}}, "services"),
        ({"services": {"a": {"name": "b"}, "b": {"name": "c"}}}, "alias 'b'"),
        ({"ca_file": "/tmp/ca.pem"}, "https"),
        ({"beat_interval": 0}, "beat_interval"),
    ],
)
def test_bad_blocks_are_refused_without_echoing_secrets(
    block: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        NacosSettings.model_validate(block)
    text = str(refused.value)
    assert fragment in text
    assert "s3cr3t" not in text


def test_password_is_secret() -> None:
    s = NacosSettings.model_validate({"username": "nacos", "password": "s3cr3t"})
    assert "s3cr3t" not in repr(s) and "s3cr3t" not in str(s.model_dump())
    assert s.password is not None and s.password.get_secret_value() == "s3cr3t"


def test_factory_model_validates_the_connection_block_with_its_path() -> None:
    assert factory.name == "nacos" and factory.settings_model is NacosSettings
    cfg = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "nacos",
                    "nacos": {
                        "server_addr": "http://n:8848/nacos",
                        "username": "u",
                        "password": "p4ss",
                        "services": {"orders": {"name": "ow"}},
                    },
                }
            },
        }
    )
    settings = validate_provider_block("primary", cfg.connections["primary"], NacosSettings)
    assert settings.remote_name("orders") == "ow" and settings.remote_name("ow") == "ow"
    bad = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "nacos", "nacos": {"api": "v9"}}}}
    )
    with pytest.raises(ConfigError) as refused:
        validate_provider_block("primary", bad.connections["primary"], NacosSettings)
    assert refused.value.path.startswith("discovery.connections.primary.nacos.api")


def test_json_schema_is_strict_and_marks_the_password() -> None:
    schema = NacosSettings.model_json_schema()
    assert schema["additionalProperties"] is False
    password = schema["properties"]["password"]["anyOf"][0]
    assert password == {"format": "password", "type": "string", "writeOnly": True}
    assert schema["properties"]["api"]["enum"] == ["auto", "v1", "v3"]


def test_connection_metadata_under_a_secret_looking_key_is_refused_unless_listed() -> None:
    """The connection's metadata goes out with every registration: a
    secret-looking key is refused at load as on a registration's own."""
    block = {"metadata": {"db_password": "pw-meta-1", "zone": "a"}}
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"p": {"provider": "nacos", "nacos": block}}}
    )
    with pytest.raises(ConfigError) as info:
        validate_provider_block("p", config.connections["p"], NacosSettings)
    assert info.value.path == "discovery.connections.p.nacos.metadata"
    assert "db_password" in str(info.value) and "pw-meta-1" not in str(info.value)
    allowed = NacosSettings.model_validate(
        {**block, "publish_secret_looking_metadata": ["db_password"]}
    )
    assert allowed.metadata == {"db_password": "pw-meta-1", "zone": "a"}


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("http://127.0.0.1:0/nacos", "port 0"),
        ("127.0.0.1:0", "port 0"),
        ("127.0.0.1:", "no port"),
        ("0:8848", "unspecified"),
        ("http://[::]:8848", "unspecified"),
    ],
)
def test_a_server_addr_that_names_no_server_is_refused(address: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        NacosSettings.model_validate({"server_addr": address})


def test_a_dialable_server_addr_is_kept() -> None:
    settings = NacosSettings.model_validate({"server_addr": "[::1]:8848, nacos-1:8848"})
    assert settings.base_urls == ("http://[::1]:8848/nacos", "http://nacos-1:8848/nacos")
