"""Secret masking by key name: every common spelling of a credential is masked."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from nadisc import ConfigError, load_config
from nadisc._config import provider_block, validate_provider_block

BASE = """
discovery:
  enabled: true
  connections:
    primary:
      provider: nacos
      nacos:
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


def test_config_errors_carry_no_input_values() -> None:
    bad = BASE.replace("provider: nacos", "provider: nacos\n      request_timeout_ms: PWSECRET2")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.path == "discovery.connections.primary.request_timeout_ms"
    assert "PWSECRET2" not in str(info.value) + repr(info.value)
