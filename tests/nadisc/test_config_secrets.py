"""Secret masking by key name: every common spelling of a credential is masked."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, SecretStr

from nadisc import ConfigError, load_config
from nadisc._config import block_secrets, provider_block, validate_provider_block

from .config_support import installed

BASE = """
discovery:
  enabled: true
  connections:
    primary:
      provider: acme
      acme:
        server_addr: http://n:8848/nacos/
        username: USERSECRET1
        password: PWSECRET1
        services: {orders: {name: order-worker}}
"""

SECRET_KEYS = (
    "authorization",
    "Authorization",
    "bearer",
    "auth",
    "access_key_id",
    "accessKeyId",
    "aws_key_id",
    "api_key",
    "apiKey",
    "X-Api-Key",
    "apikey",
    "private_key",
    "client_secret",
    "clientSecret",
    "auth_token",
    "session-token",
    "passphrase",
    "cookie",
    "signature",
    "db_user",
)


class _Echo(BaseModel):
    """A provider settings model that keeps whatever it is given."""

    model_config = ConfigDict(extra="allow")

    server_addr: str
    username: SecretStr | None = None
    password: SecretStr | None = None
    services: dict[str, dict[str, str]] = {}
    endpoint: str | None = None
    keys: str | None = None
    key_prefix: str | None = None
    monkey: str | None = None
    path: str | None = None


@pytest.fixture(autouse=True)
def _acme_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, acme=_Echo)


def with_lines(*lines: str) -> str:
    extra = "".join(f"\n        {line}" for line in lines)
    return BASE.replace("password: PWSECRET1", "password: PWSECRET1" + extra)


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_a_secret_looking_key_is_masked(key: str) -> None:
    config = load_config(with_lines(f"{key}: LEAKED-{len(key)}"))
    connection = config.connections["primary"]
    for text in (repr(config), str(config), repr(connection), repr(provider_block(connection))):
        assert "LEAKED" not in text
        assert "PWSECRET1" not in text and "USERSECRET1" not in text
    assert "http://n:8848/nacos/" in repr(config)  # non-secret values stay visible


def test_secrets_nested_under_a_secret_key_or_in_headers_are_masked() -> None:
    config = load_config(
        with_lines("auth: {bearer: PWSECRET6}", "headers: {Authorization: PWSECRET7}")
    )
    text = repr(config)
    assert "PWSECRET6" not in text and "PWSECRET7" not in text
    # the provider's own model still gets the real values
    block = validate_provider_block("primary", config.connections["primary"], _Echo).model_dump()
    assert block["auth"] == {"bearer": "PWSECRET6"}
    assert block["headers"] == {"Authorization": "PWSECRET7"}


@pytest.mark.parametrize("key", ["endpoint", "keys", "key_prefix", "monkey", "path"])
def test_ordinary_keys_stay_visible(key: str) -> None:
    config = load_config(with_lines(f"{key}: VISIBLE-VALUE"))
    assert "VISIBLE-VALUE" in repr(config)


def test_keys_the_settings_model_does_not_know_are_masked() -> None:
    # a misspelt secret (passwrd) is not secret-looking; an extra="allow"
    # model accepts it, and it must not be shown either
    config = load_config(with_lines("passwrd: TYPO-SECRET", "nested: {inner: TYPO-2}"))
    connection = config.connections["primary"]
    texts = [repr(config), str(config), repr(provider_block(connection))]
    texts.append(str(connection.model_dump(mode="json")))
    for text in texts:
        assert "TYPO-SECRET" not in text and "TYPO-2" not in text
    block = validate_provider_block("primary", connection, _Echo).model_dump()
    assert block["passwrd"] == "TYPO-SECRET"


def test_every_value_of_an_uninstalled_provider_is_masked() -> None:
    config = load_config(BASE.replace("acme", "nobody-installed-this"))
    assert "http://n:8848/nacos/" not in repr(config)
    block = provider_block(config.connections["primary"]).thaw()  # type: ignore[attr-defined]
    assert block["server_addr"] == "http://n:8848/nacos/"


@pytest.mark.parametrize(
    "url", ["http://bob:hunter2@n:8848/nacos/", "https://bob@n:8848", "http://:hunter2@n"]
)
def test_url_user_info_is_masked_at_load(url: str) -> None:
    config = load_config(BASE.replace("http://n:8848/nacos/", url))
    connection = config.connections["primary"]
    texts = [repr(config), str(config), repr(provider_block(connection))]
    texts += [str(connection.model_dump()), str(connection.model_dump(mode="json"))]
    for text in texts:
        assert "hunter2" not in text and "bob" not in text, text
    assert "***@n" in repr(config)
    block = validate_provider_block("primary", connection, _Echo)
    assert block.server_addr == url  # the provider's model still sees it (and may refuse it)


def test_config_errors_carry_no_input_values() -> None:
    bad = BASE.replace("provider: acme", "provider: acme\n      request_timeout_ms: PWSECRET2")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.path == "discovery.connections.primary.request_timeout_ms"
    assert "PWSECRET2" not in str(info.value) + repr(info.value)


def test_static_instance_metadata_under_a_secret_looking_key_is_masked() -> None:
    """The static block is a provider block too: its instances' metadata under
    secret-looking keys shows masked, and the instance still gets the value."""
    config = load_config(
        """
discovery:
  enabled: true
  connections:
    primary:
      provider: static
      static:
        services:
          orders:
            - {host: 10.0.0.1, port: 8080, metadata: {db_password: HIDDEN1, zone: a}}
"""
    )
    for shown in (repr(config), str(config), config.model_dump_json()):
        assert "HIDDEN1" not in shown
        assert "zone" in shown and "**********" in shown
    static = config.connections["primary"].static
    assert static is not None
    [instance] = static.instances("orders")
    assert instance.metadata == {"db_password": "HIDDEN1", "zone": "a"}
    # The connection's provider block holds it as a secret (failure reasons mask it).
    assert "HIDDEN1" in block_secrets(provider_block(config.connections["primary"]))
