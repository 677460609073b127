"""One typing rule for every settings model: the core config and each provider's block.

A config mistake is a typed error at its path, never a silent coercion:

* a number written as a string (``wait: '30'``) is refused for a number;
* a float is refused for an integer (``ttl_seconds: 15.5``, and ``15.0`` too);
* a boolean is refused for a number, and a number or a word (``yes``,
  ``'true'``, ``1``) for a boolean;
* bytes (YAML ``!!binary``) are refused for text, a string for a list.

What stays accepted: an integer for a seconds value (``wait: 30``), a YAML
list for every list setting, and each documented spelling (Nacos's
comma-separated ``server_addr``, a Kubernetes port given as a name or a
number). A whole ``${VAR}`` placeholder expanded by nadisc takes the type
its value reads as, so ``wait: ${CONSUL_WAIT}`` still works.
"""

from __future__ import annotations

from typing import Any

import pytest
from nadisc_consul import ConsulSettings
from nadisc_etcd import EtcdSettings
from nadisc_kubernetes import KubernetesSettings
from nadisc_nacos import NacosSettings
from pydantic import BaseModel, ValidationError

from nadisc import ConfigError, load_config, validate_provider_block

ETCD_BASE: dict[str, Any] = {"endpoints": ["http://127.0.0.1:2379"]}

#: What each refused value is expected to be instead (pydantic's error type).
NUMBER, INTEGER, BOOLEAN, TEXT, LIST = (
    "float_type",
    "int_type",
    "bool_type",
    "string_type",
    "tuple_type",
)

MODELS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "consul": (ConsulSettings, {}),
    "nacos": (NacosSettings, {}),
    "etcd": (EtcdSettings, ETCD_BASE),
    "kubernetes": (KubernetesSettings, {}),
}

#: (provider, location, value, expected error type). ``location`` is a dotted
#: path below the block; the value is set there.
REFUSED: list[tuple[str, str, Any, str]] = [
    # consul: seconds (floats), counts (ints), switches, text, lists
    ("consul", "wait", "30", NUMBER),
    ("consul", "wait", "30s", NUMBER),
    ("consul", "wait", True, NUMBER),
    ("consul", "catalog_wait", "300", NUMBER),
    ("consul", "reregister_interval", "30", NUMBER),
    ("consul", "health_check_interval", False, NUMBER),
    ("consul", "initial_backoff", "1", NUMBER),
    ("consul", "watch_rate", "2", NUMBER),
    ("consul", "watch_burst", "5", INTEGER),
    ("consul", "watch_burst", 5.5, INTEGER),
    ("consul", "watch_burst", 5.0, INTEGER),
    ("consul", "watch_burst", True, INTEGER),
    ("consul", "health_check_failures_before_critical", "3", INTEGER),
    ("consul", "catalog_parallelism", 8.0, INTEGER),
    ("consul", "enabled", "yes", BOOLEAN),
    ("consul", "enabled", "true", BOOLEAN),
    ("consul", "enabled", 0, BOOLEAN),
    ("consul", "allow_loopback", 1, BOOLEAN),
    ("consul", "allow_loopback", 1.0, BOOLEAN),
    ("consul", "datacenter", b"dc1", TEXT),
    ("consul", "cluster_id", b"c1", TEXT),
    ("consul", "tags", "grpc", LIST),
    ("consul", "tags.1", b"raw", TEXT),
    ("consul", "services.orders.tag", b"grpc", TEXT),
    # nacos
    ("nacos", "beat_interval", "5", NUMBER),
    ("nacos", "beat_interval", True, NUMBER),
    ("nacos", "token_refresh_margin", "60", NUMBER),
    ("nacos", "cluster_filter", "yes", BOOLEAN),
    ("nacos", "cluster_filter", 1, BOOLEAN),
    ("nacos", "ephemeral", "false", BOOLEAN),
    ("nacos", "ephemeral", 0.0, BOOLEAN),
    ("nacos", "namespace", b"public", TEXT),
    ("nacos", "services.orders.name", b"orders", TEXT),
    # etcd
    ("etcd", "ttl_seconds", "15", INTEGER),
    ("etcd", "ttl_seconds", 15.5, INTEGER),
    ("etcd", "ttl_seconds", 15.0, INTEGER),
    ("etcd", "ttl_seconds", True, INTEGER),
    ("etcd", "connect_timeout_ms", "1000", INTEGER),
    ("etcd", "probe_interval_ms", 5000.0, INTEGER),
    ("etcd", "retry_initial_backoff_ms", "1000", INTEGER),
    ("etcd", "max_record_bytes", "65536", INTEGER),
    ("etcd", "max_request_connections", False, INTEGER),
    ("etcd", "prefix", b"services", TEXT),
    ("etcd", "endpoints", "http://127.0.0.1:2379", LIST),
    ("etcd", "services.orders.name", b"orders", TEXT),
    # kubernetes (strict before this rule was shared: the reference)
    ("kubernetes", "watch_timeout", "290", NUMBER),
    ("kubernetes", "watch_grace", True, NUMBER),
    ("kubernetes", "page_size", 500.0, INTEGER),
    ("kubernetes", "page_size", "500", INTEGER),
    ("kubernetes", "trust_unowned_slices", "yes", BOOLEAN),
    ("kubernetes", "namespace", b"shop", TEXT),
]


def _put(block: dict[str, Any], location: str, value: Any) -> dict[str, Any]:
    """``block`` with ``value`` at the dotted ``location`` (a number is a list index)."""
    out = dict(block)
    head, _, rest = location.partition(".")
    if not rest:
        out[head] = value
    elif rest.isdigit():
        items = ["ok"] * (int(rest) + 1)
        items[int(rest)] = value
        out[head] = items
    else:
        out[head] = _put(dict(out.get(head) or {}), rest, value)
    return out


def _loc(location: str) -> tuple[str | int, ...]:
    return tuple(int(p) if p.isdigit() else p for p in location.split("."))


@pytest.mark.parametrize(("provider", "location", "value", "expected"), REFUSED)
def test_a_value_of_the_wrong_type_is_refused_at_its_field(
    provider: str, location: str, value: Any, expected: str
) -> None:
    model, base = MODELS[provider]
    with pytest.raises(ValidationError) as info:
        model.model_validate(_put(base, location, value))
    errors = info.value.errors()
    assert [(e["loc"], e["type"]) for e in errors] == [(_loc(location), expected)]


#: Values each model keeps, as written in a config document.
ACCEPTED: list[tuple[str, dict[str, Any], str, Any]] = [
    ("consul", {"wait": 30}, "wait", 30.0),
    ("consul", {"wait": 2.5}, "wait", 2.5),
    (
        "consul",
        {"deregister_critical_service_after": 90},
        "deregister_critical_service_after",
        90.0,
    ),
    ("consul", {"watch_burst": 7}, "watch_burst", 7),
    ("consul", {"enabled": False}, "enabled", False),
    ("consul", {"tags": ["grpc", "v2"]}, "tags", ("grpc", "v2")),
    ("consul", {"tags": ("grpc",)}, "tags", ("grpc",)),
    (
        "consul",
        {"publish_secret_looking_metadata": ["api_key"]},
        "publish_secret_looking_metadata",
        ("api_key",),
    ),
    ("consul", {"token": "abcd"}, "token", "abcd"),
    ("nacos", {"beat_interval": 5}, "beat_interval", 5.0),
    (
        "nacos",
        {"server_addr": "a:8848, b:8848"},
        "base_urls",
        ("http://a:8848/nacos", "http://b:8848/nacos"),
    ),
    ("nacos", {"server_addr": ["http://a:8848/nacos"]}, "base_urls", ("http://a:8848/nacos",)),
    ("nacos", {"server_addr": "http://a:8848/nacos"}, "base_urls", ("http://a:8848/nacos",)),
    (
        "nacos",
        {"publish_secret_looking_metadata": ["api_key"]},
        "publish_secret_looking_metadata",
        ["api_key"],
    ),
    (
        "etcd",
        {"endpoints": ["http://a:2379", "http://b:2379"]},
        "endpoints",
        ("http://a:2379", "http://b:2379"),
    ),
    ("etcd", {"endpoints": ("http://a:2379",)}, "endpoints", ("http://a:2379",)),
    ("etcd", {**ETCD_BASE, "ttl_seconds": 20}, "ttl_seconds", 20),
    ("kubernetes", {"watch_timeout": 60}, "watch_timeout", 60.0),
    ("kubernetes", {"services": {"a": {"port": "http"}}}, "services", None),
    ("kubernetes", {"services": {"a": {"port": 8080}}}, "services", None),
]


@pytest.mark.parametrize(("provider", "values", "attribute", "expected"), ACCEPTED)
def test_documented_spellings_are_kept(
    provider: str, values: dict[str, Any], attribute: str, expected: Any
) -> None:
    model, _ = MODELS[provider]
    settings = model.model_validate(values)
    value = getattr(settings, attribute)
    if attribute == "token":
        value = value.get_secret_value()
    if expected is not None:
        assert value == expected
        assert type(value) is type(expected)


@pytest.mark.parametrize("provider", sorted(MODELS))
def test_a_validated_model_validates_again_from_its_dump(provider: str) -> None:
    """A factory given another model re-validates its ``model_dump()``: URLs,
    secrets, tuples and nested bindings come back as objects, not text."""
    model, base = MODELS[provider]
    values = {
        "consul": {
            "token": "t-1",
            "tags": ["a"],
            "services": {"orders": {"tag": "grpc"}},
            "meta": {"zone": "a"},
        },
        "nacos": {
            "server_addr": "a:8848,b:8848",
            "username": "u",
            "password": "p",
            "services": {"orders": {}},
        },
        "etcd": {**base, "username": "u", "password": "p", "services": {"orders": {}}},
        "kubernetes": {"services": {"orders": {"name": "order-api", "port": 80}}},
    }[provider]
    first = model.model_validate(values)
    assert model.model_validate(first.model_dump()) == first


# ----------------------------------------------------------------- at load, with paths


def _document(provider: str, block: str) -> str:
    return (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n"
        f"      provider: {provider}\n      {provider}:\n{block}"
    )


@pytest.mark.parametrize(
    ("provider", "block", "field", "words"),
    [
        ("consul", "        wait: '30'\n", "wait", "valid number"),
        ("consul", "        enabled: 'yes'\n", "enabled", "valid boolean"),
        ("consul", "        watch_burst: 5.5\n", "watch_burst", "valid integer"),
        ("consul", "        tags: grpc\n", "tags", "valid tuple"),
        ("nacos", "        beat_interval: '5'\n", "beat_interval", "valid number"),
        ("nacos", "        ephemeral: 1\n", "ephemeral", "valid boolean"),
        (
            "etcd",
            "        endpoints: [http://127.0.0.1:2379]\n        ttl_seconds: '15'\n",
            "ttl_seconds",
            "valid integer",
        ),
        (
            "etcd",
            "        endpoints: [http://127.0.0.1:2379]\n        ttl_seconds: true\n",
            "ttl_seconds",
            "valid integer",
        ),
        ("kubernetes", "        page_size: '500'\n", "page_size", "valid integer"),
        ("consul", "        datacenter: !!binary ZGMx\n", "datacenter", "valid string"),
        ("etcd", "        endpoints: http://127.0.0.1:2379\n", "endpoints", "valid tuple"),
    ],
)
def test_a_wrong_type_in_a_document_names_its_path_and_the_expected_type(
    provider: str, block: str, field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_document(provider, block))
    assert info.value.path == f"discovery.connections.primary.{provider}.{field}"
    assert words in info.value.detail
    assert len(info.value.problems) == 1


def test_the_core_config_follows_the_same_rule() -> None:
    """The connection's own settings were already strict: the providers now match."""
    cases = [
        ("request_timeout_ms: '3000'", "request_timeout_ms", "valid integer"),
        ("request_timeout_ms: 3000.0", "request_timeout_ms", "valid integer"),
        ("request_timeout_ms: true", "request_timeout_ms", "valid integer"),
        ("startup_required: 'yes'", "startup_required", "valid boolean"),
        ("startup_required: 1", "startup_required", "valid boolean"),
    ]
    for line, field, words in cases:
        with pytest.raises(ConfigError) as info:
            load_config(
                _document("etcd", "        endpoints: [http://127.0.0.1:2379]\n").replace(
                    "      provider: etcd\n", f"      provider: etcd\n      {line}\n"
                )
            )
        assert info.value.path == f"discovery.connections.primary.{field}"
        assert words in info.value.detail


def test_a_secret_of_the_wrong_type_is_not_echoed() -> None:
    doc = _document(
        "nacos", "        username: app\n        password: 918273645\n        beat_interval: '7'\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    paths = {path for path, _ in info.value.problems}
    assert paths == {
        "discovery.connections.primary.nacos.password",
        "discovery.connections.primary.nacos.beat_interval",
    }
    assert "918273645" not in str(info.value) and "'7'" not in str(info.value)
    with pytest.raises(ValidationError) as raw:
        NacosSettings.model_validate({"username": "app", "password": 918273645})
    assert "918273645" not in str(raw.value)


# ----------------------------------------------------------------- ${VAR} placeholders


@pytest.mark.parametrize(
    ("provider", "block", "environ", "field", "expected"),
    [
        ("consul", "        wait: ${CONSUL_WAIT}\n", {"CONSUL_WAIT": "30"}, "wait", 30.0),
        ("consul", "        wait: ${CONSUL_WAIT}\n", {"CONSUL_WAIT": "2.5"}, "wait", 2.5),
        ("consul", "        wait: ${CONSUL_WAIT:-45}\n", {}, "wait", 45.0),
        (
            "consul",
            "        enabled: ${CONSUL_REGISTER}\n",
            {"CONSUL_REGISTER": "false"},
            "enabled",
            False,
        ),
        ("consul", "        watch_burst: ${BURST}\n", {"BURST": "9"}, "watch_burst", 9),
        ("nacos", "        beat_interval: ${BEAT}\n", {"BEAT": "3"}, "beat_interval", 3.0),
        ("nacos", "        ephemeral: ${EPHEMERAL}\n", {"EPHEMERAL": "true"}, "ephemeral", True),
        (
            "etcd",
            "        endpoints: ['${ETCD}']\n        ttl_seconds: ${TTL}\n",
            {"ETCD": "http://e:2379", "TTL": "20"},
            "ttl_seconds",
            20,
        ),
        ("kubernetes", "        page_size: ${PAGE}\n", {"PAGE": "100"}, "page_size", 100),
    ],
)
def test_a_whole_placeholder_takes_the_type_of_its_value(
    provider: str, block: str, environ: dict[str, str], field: str, expected: Any
) -> None:
    config = load_config(_document(provider, block), environ=environ)
    model, _ = MODELS[provider]
    settings = validate_provider_block("primary", config.connections["primary"], model)
    value = getattr(settings, field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("provider", "block", "environ", "field", "words"),
    [
        # not a number once expanded: stays text, refused for a number
        (
            "consul",
            "        wait: ${CONSUL_WAIT}\n",
            {"CONSUL_WAIT": "30s"},
            "wait",
            "valid number",
        ),
        # a placeholder inside other text is text
        ("consul", "        wait: ${CONSUL_WAIT}0\n", {"CONSUL_WAIT": "3"}, "wait", "valid number"),
        (
            "etcd",
            "        endpoints: [http://e:2379]\n        ttl_seconds: ${TTL}\n",
            {"TTL": "15.5"},
            "ttl_seconds",
            "valid integer",
        ),
        (
            "nacos",
            "        ephemeral: ${EPHEMERAL}\n",
            {"EPHEMERAL": "yes"},
            "ephemeral",
            "valid boolean",
        ),
        # not expanded (no environ given): literal text, refused for a number
        ("consul", "        wait: ${CONSUL_WAIT}\n", None, "wait", "valid number"),
    ],
)
def test_a_placeholder_that_does_not_read_as_the_type_is_refused(
    provider: str, block: str, environ: dict[str, str] | None, field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_document(provider, block), environ=environ)
    assert info.value.path == f"discovery.connections.primary.{provider}.{field}"
    assert words in info.value.detail
