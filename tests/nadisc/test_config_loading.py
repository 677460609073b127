"""Loading documents: YAML/TOML/JSON, duplicate keys, paths, secrets, schema."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

from nadisc import (
    ConfigError,
    ConfigWarning,
    DiscoveryConfig,
    binding_names,
    config_json_schema,
    default_qualifier,
    load_config,
    load_config_file,
    load_document,
    parse_config,
    provider_block,
)

from ..seed_yaml import SEED_EXAMPLE
from .config_support import UNINSTALLED


def test_the_contract_example_loads() -> None:
    with pytest.warns(ConfigWarning, match="literal"):
        config = load_config(SEED_EXAMPLE)
    assert config.enabled and config.eligibility_probe
    assert set(config.connections) == {"primary", "infrastructure"}
    primary = config.connections["primary"]
    assert primary.provider == "nacos"
    assert primary.rest.lb_strategy == "weighted"
    assert primary.rest.request_timeout_ms == 5000
    assert binding_names(primary) == {"self": "order-api", "orders": "order-worker"}
    assert binding_names(config.connections["infrastructure"]) == {"coordinator": "saga-server"}
    registration = config.registrations["business-http"]
    assert registration.qualifier == "primary"
    assert registration.readiness_critical is True
    assert default_qualifier(config) == "primary"


def test_placeholders_stay_literal_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUSINESS_REGISTER_IP", "10.9.9.9")
    monkeypatch.setenv("BUSINESS_NACOS_PASSWORD", "from-the-environment")
    with pytest.warns(ConfigWarning) as caught:
        config = load_config(SEED_EXAMPLE)
    # each secret field holding a literal placeholder is named, none of the others
    paths = sorted(str(w.message).split(":")[0] for w in caught)
    assert paths == [
        "discovery.connections.infrastructure.nacos.password",
        "discovery.connections.infrastructure.nacos.username",
        "discovery.connections.primary.nacos.password",
        "discovery.connections.primary.nacos.username",
    ]
    assert config.registrations["business-http"].ip == "${BUSINESS_REGISTER_IP}"
    block = provider_block(config.connections["primary"])
    assert block["password"].get_secret_value() == "${BUSINESS_NACOS_PASSWORD}"
    assert "from-the-environment" not in repr(config)


# ----------------------------------------------------------------- three formats, one result

YAML_DOC = """\
discovery:
  enabled: true
  connections:
    primary:
      provider: static
      poll_interval_ms: 4000
      static:
        services:
          orders:
            - {host: 10.0.0.1, port: 8080}
            - {host: 10.0.0.2, port: 8080, weight: 2}
"""

TOML_DOC = """\
[discovery]
enabled = true

[discovery.connections.primary]
provider = "static"
poll_interval_ms = 4000

[[discovery.connections.primary.static.services.orders]]
host = "10.0.0.1"
port = 8080

[[discovery.connections.primary.static.services.orders]]
host = "10.0.0.2"
port = 8080
weight = 2
"""

JSON_DOC = json.dumps(
    {
        "discovery": {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "static",
                    "poll_interval_ms": 4000,
                    "static": {
                        "services": {
                            "orders": [
                                {"host": "10.0.0.1", "port": 8080},
                                {"host": "10.0.0.2", "port": 8080, "weight": 2},
                            ]
                        }
                    },
                }
            },
        }
    }
)


def test_formats_agree() -> None:
    from_yaml = load_config(YAML_DOC)
    assert load_config(TOML_DOC, "toml") == from_yaml
    assert load_config(JSON_DOC, "json") == from_yaml
    assert load_config(YAML_DOC.encode(), "yaml") == from_yaml
    instances = from_yaml.connections["primary"].static
    assert instances is not None
    assert [i.identity for i in instances.instances("orders")] == [
        "10.0.0.1:8080",
        "10.0.0.2:8080",
    ]


@pytest.mark.parametrize(
    ("suffix", "text"),
    [(".yaml", YAML_DOC), (".yml", YAML_DOC), (".toml", TOML_DOC), (".json", JSON_DOC)],
)
def test_load_file_by_suffix(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"app{suffix}"
    path.write_text(text)
    assert load_config_file(path).connections["primary"].poll_interval_ms == 4000


def test_load_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot tell the format"):
        load_config_file(tmp_path / "app.ini")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(tmp_path / "missing.yaml")
    explicit = tmp_path / "app.conf"
    explicit.write_text(JSON_DOC)
    assert load_config_file(explicit, "json").enabled


def test_empty_documents_are_disabled() -> None:
    assert load_config("") == DiscoveryConfig()
    assert load_config("application: {name: x}\n") == DiscoveryConfig()
    assert load_config("{}", "json") == DiscoveryConfig()
    assert load_config("", "toml") == DiscoveryConfig()


# ----------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("discovery:\n  enabled: true\n  enabled: false\n", "discovery.enabled"),
        (
            "discovery:\n  enabled: true\n  connections:\n    a:\n      provider: static\n"
            "      provider: dns\n",
            "discovery.connections.a.provider",
        ),
        (
            "discovery:\n  enabled: true\n  connections:\n    a: {provider: x, x: {}}\n"
            "    a: {provider: y, y: {}}\n",
            "discovery.connections.a",
        ),
        (
            "discovery:\n  connections:\n    a:\n      static:\n        services:\n"
            "          o:\n            - {host: a, port: 1, port: 2}\n",
            "discovery.connections.a.static.services.o[0].port",
        ),
        ("discovery: {}\ndiscovery: {}\n", "discovery"),
    ],
)
def test_yaml_duplicate_keys_at_any_depth(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == path
    assert "duplicate key" in info.value.detail


def test_yaml_merge_keys_are_not_duplicates() -> None:
    text = (
        "defaults: &defaults {provider: static, poll_interval_ms: 4000}\n"
        "discovery:\n  enabled: true\n  connections:\n"
        "    primary:\n      <<: *defaults\n      poll_interval_ms: 3000\n"
        "      static: {services: {}}\n"
    )
    config = load_config(text)
    assert config.connections["primary"].poll_interval_ms == 3000


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('{"discovery": {"enabled": true, "enabled": false}}', "discovery.enabled"),
        (
            '{"discovery": {"connections": {"a": {"static": {"services": {"o": '
            '[{"host": "a", "host": "b"}]}}}}}}',
            "discovery.connections.a.static.services.o[0].host",
        ),
    ],
)
def test_json_duplicate_keys_at_any_depth(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text, "json")
    assert info.value.path == path
    assert "duplicate key" in info.value.detail


@pytest.mark.parametrize(
    "text",
    [
        "[discovery]\nenabled = true\nenabled = false\n",
        "[discovery]\nenabled = true\n[discovery]\neligibility_probe = false\n",
        "[discovery.connections.a]\nprovider = 'x'\n[discovery.connections.a]\nprovider = 'y'\n",
    ],
)
def test_toml_duplicates_are_translated(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text, "toml")
    assert info.value.path == "<document>"
    assert "line" in info.value.detail


# ----------------------------------------------------------------- syntax and roots


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ("discovery: [unclosed\n", "yaml"),
        ("discovery:\n  password: hunter2\n bad-indent: 1\n", "yaml"),
        ('{"discovery": ', "json"),
        ('{"discovery": {"x": NaN}}', "json"),
        ("[discovery\n", "toml"),
        ("a: 1\n---\nb: 2\n", "yaml"),
        ("- 1\n- 2\n", "yaml"),
        ('"discovery"', "json"),
    ],
)
def test_syntax_errors_are_config_errors(text: str, fmt: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text, fmt)  # type: ignore[arg-type]
    assert info.value.path in {"<document>", "discovery"}
    assert "hunter2" not in str(info.value)


def test_unknown_format() -> None:
    with pytest.raises(ConfigError, match="unknown format"):
        load_config("{}", "ini")  # type: ignore[arg-type]


def test_discovery_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("discovery: [1, 2]\n")
    assert info.value.path == "discovery"
    with pytest.raises(ConfigError) as info:
        load_config("discovery: null\n")
    assert info.value.path == "discovery"


@pytest.mark.parametrize("legacy", ["rest_discovery", "nacos_discovery", "nacos-discovery"])
def test_new_and_legacy_roots_together_are_refused(legacy: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(f"discovery: {{enabled: false}}\n{legacy}: {{enabled: false}}\n")
    assert info.value.path == legacy
    # the legacy root alone belongs to the legacy entry points
    assert load_config(f"{legacy}: {{enabled: true}}\n") == DiscoveryConfig()


def test_error_paths_from_documents() -> None:
    text = "discovery:\n  enabled: true\n  connections:\n    business: {provider: 5}\n"
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == "discovery.connections.business.provider"
    assert str(info.value).startswith("discovery.connections.business.provider: ")
    text = (
        "discovery:\n  enabled: true\n  connections:\n    primary: {provider: static, "
        "static: {services: {}}}\n  registrations:\n"
        "    web: {qualifier: business, service_name: self, ip: 10.0.0.1, port: 80}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == "discovery.registrations.web.qualifier"


def test_yaml_numbers_are_not_strings() -> None:
    text = (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: static\n"
        "      static: {services: {o: [{host: 1234, port: 80}]}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == "discovery.connections.primary.static.services.o[0].host"


# ----------------------------------------------------------------- secrets

SECRET_DOC = """\
discovery:
  enabled: true
  connections:
    primary:
      provider: PROVIDER
      PROVIDER:
        address: http://127.0.0.1:8500
        token: s3cr3t-token
        username: alice-user
        password: pa55word
        tls: {client_key: k3y-material, ca_file: /etc/ca.pem}
        credentials: {user: nested-us3r, secret_list: [l1st-item]}
        services:
          self: {name: order-api}
""".replace("PROVIDER", UNINSTALLED)

SECRETS = ("s3cr3t-token", "alice-user", "pa55word", "k3y-material", "nested-us3r", "l1st-item")


def test_secrets_never_show_in_repr_or_str() -> None:
    config = load_config(SECRET_DOC)
    connection = config.connections["primary"]
    texts = [
        repr(config),
        str(config),
        repr(connection),
        str(connection),
        repr(provider_block(connection)),
        str(provider_block(connection)),
        json.dumps(connection.model_dump(mode="json")),
        repr(connection.model_extra),
        repr(copy.deepcopy(config)),
        repr(pickle.loads(pickle.dumps(config))),
    ]
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, text
    # a provider that is not installed has no model saying what is safe to show
    assert "/etc/ca.pem" not in repr(connection)
    block = provider_block(connection).thaw()  # type: ignore[attr-defined]
    assert block["token"] == "s3cr3t-token"
    assert block["tls"]["client_key"] == "k3y-material"
    assert block["credentials"] == {"user": "nested-us3r", "secret_list": ["l1st-item"]}
    assert copy.deepcopy(config) == config


def test_secrets_never_show_in_errors() -> None:
    header = f"      {UNINSTALLED}:\n"
    bad = SECRET_DOC.replace(header, header + "        colour: 1\n")
    bad = bad.replace(
        f"provider: {UNINSTALLED}", f"provider: {UNINSTALLED}\n      poll_interval_ms: pa55word"
    )
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "poll_interval_ms" in message
    for secret in SECRETS:
        assert secret not in message
    # the pydantic error is not chained for display, and holds no input values either
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__
    for secret in SECRETS:
        assert secret not in str(info.value.__context__)


def test_json_schema() -> None:
    schema = config_json_schema()
    assert schema["title"] == "discovery"
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["properties"]["shutdown_timeout_ms"]["default"] == 10_000
    defs = schema["$defs"]
    assert defs["LimitsConfig"]["properties"]["max_connections"]["maximum"] == 256
    assert defs["RestConfig"]["properties"]["max_attempts"]["maximum"] == 16
    assert defs["ConnectionConfig"]["additionalProperties"]["type"] == "object"
    # installed providers' blocks are part of it, from their own settings models
    connection = defs["ConnectionConfig"]["properties"]
    assert connection["etcd"]["$ref"] == "#/$defs/etcd.EtcdSettings"
    etcd = defs["etcd.EtcdSettings"]["properties"]
    assert etcd["ttl_seconds"]["default"] == 15 and "ttl_secs" not in etcd
    assert defs["consul.ConsulSettings"]["properties"]["wait"]["maximum"] == 600
    # secret fields never carry a default
    assert "default" not in etcd["password"] or etcd["password"]["default"] is None
    # every property of every model says what it is
    # (the nadisc models and the etcd/consul blocks; other providers describe
    # their fields with Field(description=...) or #: comments the same way)
    undescribed = [
        f"{name}.{prop}"
        for name, model in [("discovery", schema), *defs.items()]
        if "." not in name or name.startswith(("etcd.", "consul."))
        for prop, body in model.get("properties", {}).items()
        if not body.get("description")
    ]
    assert undescribed == []
    assert len([1 for m in defs.values() for _ in m.get("properties", {})]) > 90
    assert parse_config({"discovery": {"enabled": False}}) == DiscoveryConfig()


# ----------------------------------------------------------------- hostile documents


def test_yaml_alias_bomb_is_refused_without_expanding() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    lines.append("discovery: {enabled: false}")
    with pytest.raises(ConfigError, match="aliases expand"):
        load_config("\n".join(lines) + "\n")


def test_yaml_recursive_alias_is_refused() -> None:
    with pytest.raises(ConfigError, match="refers to itself"):
        load_config("loop: &loop [*loop]\ndiscovery: {enabled: false}\n")


def test_shared_yaml_nodes_are_fine() -> None:
    text = (
        "x-rest: &rest {request_timeout_ms: 4000, connect_timeout_ms: 500}\n"
        "discovery:\n  enabled: true\n  connections:\n"
        "    a: {provider: static, static: {services: {}}, rest: *rest}\n"
        "    b: {provider: static, static: {services: {}}, rest: *rest}\n"
    )
    config = load_config(text)
    assert config.connections["a"].rest == config.connections["b"].rest
    assert config.connections["b"].rest.request_timeout_ms == 4000


@pytest.mark.parametrize(
    ("text", "fmt"),
    [("[" * 100_000, "json"), ("x: " + "[" * 50_000, "yaml")],
)
def test_deep_nesting_is_a_config_error(text: str, fmt: str) -> None:
    with pytest.raises(ConfigError):
        load_config(text, fmt)  # type: ignore[arg-type]


def test_a_host_can_resolve_placeholders_between_parsing_and_validation() -> None:
    document = load_document(SEED_EXAMPLE)
    registration = document["discovery"]["registrations"]["business-http"]
    assert registration["ip"] == "${BUSINESS_REGISTER_IP}"
    registration["ip"] = "10.20.0.7"
    with pytest.warns(ConfigWarning):  # the passwords are still literal placeholders
        assert parse_config(document).registrations["business-http"].ip == "10.20.0.7"
    with pytest.raises(ConfigError, match="duplicate key"):
        load_document("a: 1\na: 2\n")
