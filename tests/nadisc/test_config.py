"""The ``discovery`` config models: defaults, limits, cross-field rules, references."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr

from nadisc import (
    ConfigError,
    ConnectionConfig,
    DiscoveryConfig,
    DnsConfig,
    LimitsConfig,
    ProviderBlock,
    RegistrationConfig,
    RestConfig,
    RetryConfig,
    SnapshotConfig,
    StaticConfig,
    binding_names,
    default_qualifier,
    parse_config,
    provider_block,
    restart_required,
    validate_provider_block,
)
from nadisc._config import MAX_DURATION_MS, parse_nameserver

from .config_support import UNINSTALLED


def static(services: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "provider": "static",
        "static": {"services": services or {"orders": [{"host": "10.0.0.1", "port": 8080}]}},
        **extra,
    }


def etcd(services: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    block = {"endpoints": ["http://127.0.0.1:2379"], "services": services or {}}
    return {"provider": "etcd", "etcd": block, **extra}


def doc(**discovery: Any) -> dict[str, Any]:
    return {"discovery": {"enabled": True, **discovery}}


def error_of(document: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    return info.value


# ----------------------------------------------------------------- defaults


def test_defaults_match_the_contract_table() -> None:
    config = parse_config(doc(connections={"primary": static()}))
    connection = config.connections["primary"]
    assert (config.enabled, config.eligibility_probe, config.default_connection) == (
        True,
        False,
        None,
    )
    assert config.shutdown_timeout_ms == 10_000
    assert connection.startup_required is True
    assert (
        connection.request_timeout_ms,
        connection.poll_interval_ms,
        connection.idle_timeout_ms,
    ) == (3000, 5000, 30_000)
    assert connection.snapshot == SnapshotConfig(max_age_ms=15_000, stale_if_error_ms=0)
    assert connection.retry == RetryConfig(initial_backoff_ms=1000, max_backoff_ms=30_000)
    assert (
        connection.monitor_interval_ms,
        connection.observation_grace_ms,
        connection.deregister_timeout_ms,
    ) == (5000, 15_000, 3000)
    rest = connection.rest
    assert (rest.request_timeout_ms, rest.connect_timeout_ms) == (10_000, 2000)
    assert (rest.lb_strategy, rest.instance_scheme, rest.max_attempts) == (
        "round_robin",
        "http",
        1,
    )
    assert not rest.retry_get_head_on_transport_error
    assert not rest.retry_get_head_on_retryable_status
    limits = config.limits
    assert limits.model_dump() == {
        "max_connections": 16,
        "max_registrations": 64,
        "max_service_watches_per_connection": 1024,
        "max_parallel_operations": 4,
        "max_watch_streams": 64,
        "max_instances_per_service": 4096,
        "max_total_instances": 65_536,
        "max_snapshot_bytes": 67_108_864,
        "max_transport_tasks": 4096,
    }


def test_missing_discovery_node_is_disabled() -> None:
    assert parse_config({"application": {"name": "x"}}) == DiscoveryConfig()
    assert parse_config(None).enabled is False


def test_registration_defaults() -> None:
    registration = RegistrationConfig(service_name="self", ip="10.0.0.5", port=18080)
    assert registration.qualifier == "primary"
    assert registration.startup_required is True
    assert registration.readiness_critical is False
    assert registration.weight == 1.0
    assert registration.effective_eligibility_ref is None
    with_listener = registration.model_copy(update={"listener_ref": "web"})
    assert with_listener.effective_eligibility_ref == "web"


# ----------------------------------------------------------------- durations and budgets


@pytest.mark.parametrize(
    ("connection", "path"),
    [
        ({"request_timeout_ms": 0}, "discovery.connections.c.request_timeout_ms"),
        ({"poll_interval_ms": -5}, "discovery.connections.c.poll_interval_ms"),
        ({"idle_timeout_ms": MAX_DURATION_MS + 1}, "discovery.connections.c.idle_timeout_ms"),
        ({"request_timeout_ms": 1.5}, "discovery.connections.c.request_timeout_ms"),
        ({"request_timeout_ms": "3000"}, "discovery.connections.c.request_timeout_ms"),
        ({"startup_required": "yes"}, "discovery.connections.c.startup_required"),
        (
            {"snapshot": {"max_age_ms": 20_000, "stale_if_error_ms": 20_001}},
            "discovery.connections.c.snapshot.stale_if_error_ms",
        ),
        (
            {"snapshot": {"stale_if_error_ms": -1}},
            "discovery.connections.c.snapshot.stale_if_error_ms",
        ),
        (
            {"poll_interval_ms": 12_000},  # 12000 + 3000 is not < 15000
            "discovery.connections.c.snapshot.max_age_ms",
        ),
        (
            {"monitor_interval_ms": 12_001},
            "discovery.connections.c.observation_grace_ms",
        ),
        (
            {"retry": {"initial_backoff_ms": 5000, "max_backoff_ms": 4000}},
            "discovery.connections.c.retry.initial_backoff_ms",
        ),
        (
            {"rest": {"request_timeout_ms": 1000, "connect_timeout_ms": 1000}},
            "discovery.connections.c.rest.connect_timeout_ms",
        ),
        ({"rest": {"max_attempts": 17}}, "discovery.connections.c.rest.max_attempts"),
        ({"rest": {"max_attempts": 0}}, "discovery.connections.c.rest.max_attempts"),
        ({"rest": {"lb_strategy": "random"}}, "discovery.connections.c.rest.lb_strategy"),
        ({"rest": {"instance_scheme": "ftp"}}, "discovery.connections.c.rest.instance_scheme"),
    ],
)
def test_bad_budgets_name_their_path(connection: dict[str, Any], path: str) -> None:
    error = error_of(doc(connections={"c": static(**connection)}))
    assert error.path == path, str(error)


def test_budget_messages_explain() -> None:
    error = error_of(doc(connections={"c": static(poll_interval_ms=12_000)}))
    assert "poll_interval_ms + request_timeout_ms" in error.detail
    error = error_of(
        doc(connections={"c": static(rest={"request_timeout_ms": 500, "connect_timeout_ms": 900})})
    )
    assert "cannot fit a connect timeout" in error.detail


def test_edges_that_fit_are_accepted() -> None:
    connection = ConnectionConfig.model_validate(
        static(
            poll_interval_ms=11_999,
            request_timeout_ms=3000,
            monitor_interval_ms=11_999,
            snapshot={"max_age_ms": 15_000, "stale_if_error_ms": 15_000},
            retry={"initial_backoff_ms": 30_000, "max_backoff_ms": 30_000},
            rest={"max_attempts": 16, "lb_strategy": "p2c_peak_ewma", "instance_scheme": "https"},
            idle_timeout_ms=MAX_DURATION_MS,
        )
    )
    assert connection.snapshot.stale_if_error_ms == 15_000
    assert connection.rest.max_attempts == 16


# ----------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"max_connections": 257}, "max_connections"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_registrations": 65_537}, "max_registrations"),
        ({"max_watch_streams": 4097}, "max_watch_streams"),
        ({"max_parallel_operations": 0}, "max_parallel_operations"),
        ({"max_transport_tasks": 0}, "max_transport_tasks"),
        ({"max_snapshot_bytes": 0}, "max_snapshot_bytes"),
        (
            {"max_connections": 128, "max_service_watches_per_connection": 1024},
            "max_service_watches_per_connection",
        ),
        (
            {"max_instances_per_service": 70_000, "max_total_instances": 65_536},
            "max_instances_per_service",
        ),
    ],
)
def test_limits(limits: dict[str, int], field: str) -> None:
    error = error_of(doc(limits=limits))
    assert error.path == f"discovery.limits.{field}", str(error)


def test_watch_product_at_the_edge_is_fine() -> None:
    limits = LimitsConfig(max_connections=64, max_service_watches_per_connection=1024)
    assert limits.max_connections * limits.max_service_watches_per_connection == 65_536


def test_connection_and_registration_counts_are_limited() -> None:
    connections = {f"c{i}": static() for i in range(3)}
    error = error_of(doc(connections=connections, limits={"max_connections": 2}))
    assert error.path == "discovery.connections"
    registrations = {
        f"r{i}": {"service_name": "self", "ip": "10.0.0.1", "port": 1000 + i} for i in range(3)
    }
    error = error_of(
        doc(
            connections={"primary": etcd({"self": {"name": "me"}})},
            registrations=registrations,
            limits={"max_registrations": 2},
        )
    )
    assert error.path == "discovery.registrations"


# ----------------------------------------------------------------- provider blocks


def test_unknown_field_is_refused_everywhere() -> None:
    assert error_of(doc(colour="red")).path == "discovery.colour"
    error = error_of(doc(connections={"c": static(colour=1)}))
    assert error.path == "discovery.connections.c.colour"
    error = error_of(doc(connections={"c": static(snapshot={"max_age": 1})}))
    assert error.path == "discovery.connections.c.snapshot.max_age"
    assert error.detail.startswith("unknown field")
    error = error_of(doc(connections={"c": static({"o": [{"host": "h", "port": 1, "zone": "a"}]})}))
    assert error.path == "discovery.connections.c.static.services.o[0].zone"


def test_wrong_provider_block_is_refused() -> None:
    error = error_of(doc(connections={"business": {"provider": "etcd", "consul": {}}}))
    assert error.path == "discovery.connections.business.consul"
    assert "wrong provider block" in error.detail
    error = error_of(doc(connections={"business": {**static(), "provider": "dns"}}))
    assert error.path == "discovery.connections.business.static"
    error = error_of(doc(connections={"business": {"provider": "etcd", "dns": {"services": {}}}}))
    assert error.path == "discovery.connections.business.dns"


def test_builtin_provider_needs_its_block() -> None:
    error = error_of(doc(connections={"business": {"provider": "static"}}))
    assert error.path == "discovery.connections.business.static"
    error = error_of(doc(connections={"business": {"provider": "dns"}}))
    assert error.path == "discovery.connections.business.dns"


@pytest.mark.parametrize("provider", ["", "Nacos", "rest", "snapshot", 7])
def test_bad_provider_names(provider: object) -> None:
    error = error_of(doc(connections={"business": {"provider": provider}}))
    assert error.path == "discovery.connections.business.provider", str(error)


def test_other_provider_block_is_kept_raw_and_read_only() -> None:
    # an uninstalled provider: its block is kept raw (and masked), the owner
    # reports the missing provider when it opens
    raw = etcd({"orders": {"name": "order-worker", "zone": "a"}})
    raw = {"provider": UNINSTALLED, UNINSTALLED: raw["etcd"]}
    config = parse_config(doc(connections={"primary": raw}))
    connection = config.connections["primary"]
    block = provider_block(connection)
    assert isinstance(block, ProviderBlock)
    assert block.thaw()["endpoints"] == ["http://127.0.0.1:2379"]
    assert block.thaw()["services"]["orders"]["zone"] == "a"
    with pytest.raises(TypeError):
        block["endpoints"] = ()
    assert binding_names(connection) == {"orders": "order-worker"}
    # a provider whose block is absent still gets a (empty) mapping
    bare = ConnectionConfig.model_validate({"provider": "consul"})
    assert dict(provider_block(bare)) == {}
    assert binding_names(bare) == {}


def test_malformed_bindings_of_other_providers() -> None:
    error = error_of(doc(connections={"p": etcd({"orders": "order-worker"})}))
    assert error.path == "discovery.connections.p.etcd.services.orders"
    error = error_of(doc(connections={"p": etcd({"orders": {"name": 5}})}))
    assert error.path == "discovery.connections.p.etcd.services.orders.name"
    raw = {"provider": UNINSTALLED, UNINSTALLED: {"services": {"orders": {"name": 5}}}}
    error = error_of(doc(connections={"p": raw}))
    assert error.path == f"discovery.connections.p.{UNINSTALLED}.services.orders.name"


class EtcdSettings(BaseModel):
    model_config = {"extra": "forbid"}

    endpoints: list[str]
    username: SecretStr | None = None
    password: SecretStr | None = None
    services: dict[str, dict[str, str]] = {}
    dial_timeout_ms: int = 1000


def test_validate_provider_block_with_the_provider_model() -> None:
    connection = ConnectionConfig.model_validate(
        {
            "provider": "etcd",
            "etcd": {
                "endpoints": ["http://a:2379"],
                "username": "svc",
                "password": "hunter2",
                "services": {"orders": {"name": "o"}},
            },
        }
    )
    settings = validate_provider_block("business", connection, EtcdSettings)
    assert settings.endpoints == ["http://a:2379"]
    assert settings.password is not None and settings.password.get_secret_value() == "hunter2"
    assert settings.username is not None and settings.username.get_secret_value() == "svc"

    bad = ConnectionConfig.model_validate(
        {"provider": "etcd", "etcd": {"endpoints": "x", "password": "hunter2", "dial": 1}}
    )
    with pytest.raises(ConfigError) as info:
        validate_provider_block("business", bad, EtcdSettings)
    assert info.value.path == "discovery.connections.business.etcd.endpoints"
    assert "discovery.connections.business.etcd.dial" in str(info.value)
    assert "hunter2" not in str(info.value)
    assert info.value.__cause__ is None


def test_validate_provider_block_for_builtins_returns_the_validated_block() -> None:
    connection = ConnectionConfig.model_validate(static())
    assert validate_provider_block("c", connection, StaticConfig) is connection.static
    dns = ConnectionConfig.model_validate(
        {"provider": "dns", "dns": {"services": {"web": {"host": "web.test", "port": 80}}}}
    )
    assert validate_provider_block("c", dns, DnsConfig) is dns.dns
    assert provider_block(dns)["services"]["web"]["port"] == 80


# ----------------------------------------------------------------- static and dns blocks


def test_static_block() -> None:
    block = StaticConfig.model_validate(
        {
            "services": {
                "orders": [
                    {"host": "10.0.0.1", "port": 8080},
                    {"host": "::1", "port": 8081, "weight": 3, "tags": ["canary"]},
                    {
                        "host": "10.0.0.2",
                        "port": 8080,
                        "id": "orders-2",
                        "metadata": {"zone": "b"},
                    },
                ],
                "empty": [],
            }
        }
    )
    instances = block.instances("orders")
    assert [i.identity for i in instances] == ["10.0.0.1:8080", "[::1]:8081", "orders-2"]
    assert instances[1].weight == 3.0 and instances[1].tags == ("canary",)
    assert instances[2].metadata == {"zone": "b"}
    assert block.instances("empty") == ()


@pytest.mark.parametrize(
    ("instances", "suffix"),
    [
        ([{"host": "a", "port": 1}, {"host": "a", "port": 1}], "static.services.o[1]"),
        (
            [{"host": "a", "port": 1, "id": "x"}, {"host": "b", "port": 2, "id": "x"}],
            "static.services.o[1]",
        ),
        ([{"host": "", "port": 1}], "static.services.o[0].host"),
        ([{"host": "a", "port": 65536}], "static.services.o[0].port"),
        ([{"host": "a", "port": 1, "weight": 0}], "static.services.o[0].weight"),
        ([{"host": "a", "port": 1, "weight": float("nan")}], "static.services.o[0].weight"),
        ([{"host": "a", "port": 1, "weight": "2"}], "static.services.o[0].weight"),
        ([{"host": "a", "port": 1, "metadata": {"k": 1}}], "static.services.o[0].metadata.k"),
    ],
)
def test_static_block_errors(instances: list[dict[str, Any]], suffix: str) -> None:
    error = error_of(doc(connections={"c": static({"o": instances})}))
    assert error.path == f"discovery.connections.c.{suffix}", str(error)


def test_dns_block() -> None:
    block = DnsConfig.model_validate(
        {
            "services": {
                "web": {"host": "web.example.test", "port": 443},
                "api": {"host": "_http._tcp.example.test", "srv": True},
                "v6": {"host": "v6.example.test", "port": 80, "address_types": ["AAAA"]},
            },
            "nameservers": ["127.0.0.1:5353", "::1", "[::1]:5300", "10.0.0.1"],
            "min_refresh_ms": 500,
        }
    )
    assert block.nameserver_addresses() == (
        ("127.0.0.1", 5353),
        ("::1", 53),
        ("::1", 5300),
        ("10.0.0.1", 53),
    )
    assert block.services["web"].address_types == ("A", "AAAA")
    assert block.services["api"].port is None
    assert DnsConfig().nameservers is None
    assert parse_nameserver("[fe80::1]") == ("fe80::1", 53)
    # str.isdigit() accepts a superscript two, which int() refuses.
    with pytest.raises(ValueError, match="nameserver port must be 1-65535"):
        parse_nameserver("10.0.0.1:\u00b2")


@pytest.mark.parametrize(
    ("block", "suffix"),
    [
        ({"services": {"w": {"host": "w.test"}}}, "dns.services.w.port"),
        (
            {"services": {"w": {"host": "_a._tcp.w.test", "srv": True, "port": 1}}},
            "dns.services.w.port",
        ),
        ({"services": {"w": {"host": "w.test", "srv": True}}}, "dns.services.w.host"),
        ({"services": {"w": {"host": "bad name", "port": 1}}}, "dns.services.w.host"),
        ({"services": {"w": {"host": "10.0.0.1", "port": 1}}}, "dns.services.w.host"),
        ({"services": {"w": {"host": "a..b", "port": 1}}}, "dns.services.w.host"),
        (
            {"services": {"w": {"host": "w.test", "port": 1, "address_types": []}}},
            "dns.services.w.address_types",
        ),
        (
            {"services": {"w": {"host": "w.test", "port": 1, "address_types": ["A", "A"]}}},
            "dns.services.w.address_types",
        ),
        (
            {"services": {"w": {"host": "w.test", "port": 1, "address_types": ["MX"]}}},
            "dns.services.w.address_types[0]",
        ),
        ({"nameservers": []}, "dns.nameservers"),
        ({"nameservers": ["dns.google"]}, "dns.nameservers"),
        ({"nameservers": ["127.0.0.1:0"]}, "dns.nameservers"),
        ({"nameservers": ["[::1]x"]}, "dns.nameservers"),
        ({"min_refresh_ms": 0}, "dns.min_refresh_ms"),
    ],
)
def test_dns_block_errors(block: dict[str, Any], suffix: str) -> None:
    error = error_of(doc(connections={"c": {"provider": "dns", "dns": block}}))
    assert error.path == f"discovery.connections.c.{suffix}", str(error)


# ----------------------------------------------------------------- names and qualifiers


def test_connection_names_are_case_sensitive_and_non_empty() -> None:
    config = parse_config(doc(connections={"Primary": static()}))
    assert default_qualifier(config) is None
    assert error_of(doc(connections={"": static()})).path == "discovery.connections"
    assert error_of(doc(connections={" a": static()})).path == "discovery.connections"
    assert error_of(doc(connections={"a.b": static()})).path == "discovery.connections"


def test_default_qualifier_is_the_fixed_name_primary() -> None:
    one = parse_config(doc(connections={"business": static()}))
    assert default_qualifier(one) is None  # never inferred from count
    many = parse_config(doc(connections={"a": static(), "primary": static(), "z": static()}))
    assert default_qualifier(many) == "primary"
    legacy = parse_config(
        doc(connections={"primary": static(), "infra": static()}, default_connection="infra")
    )
    assert default_qualifier(legacy) == "infra"
    assert default_qualifier(DiscoveryConfig()) is None
    assert default_qualifier(parse_config(doc())) is None  # zero connections: external only


def test_default_connection_must_exist() -> None:
    error = error_of(doc(connections={"primary": static()}, default_connection="nope"))
    assert error.path == "discovery.default_connection"


@pytest.mark.parametrize(
    "extra",
    [
        {"connections": {"primary": static()}},
        {"registrations": {"r": {"service_name": "s", "ip": "10.0.0.1", "port": 1}}},
        {"default_connection": "primary"},
        {"eligibility_probe": True},
    ],
)
def test_disabled_root_carries_nothing(extra: dict[str, Any]) -> None:
    error = error_of({"discovery": {"enabled": False, **extra}})
    assert error.path == f"discovery.{next(iter(extra))}"
    assert "disabled" in error.detail


# ----------------------------------------------------------------- registrations


def business(**registrations: dict[str, Any]) -> dict[str, Any]:
    return doc(
        connections={
            "primary": etcd({"self": {"name": "order-api"}}),
            "infrastructure": etcd({"coordinator": {"name": "saga"}}),
            "files": static(),
        },
        registrations=registrations,
    )


def reg(**fields: Any) -> dict[str, Any]:
    return {"service_name": "self", "ip": "10.0.0.5", "port": 18080, **fields}


def test_registration_targets() -> None:
    config = parse_config(
        business(
            http=reg(listener_ref="web", readiness_critical=True, metadata={"v": "1"}),
            infra=reg(qualifier="infrastructure", service_name="coordinator"),
            legacy=reg(connection_ref="infrastructure", service_name="coordinator", port=9),
        )
    )
    assert config.registrations["http"].qualifier == "primary"
    assert config.registrations["infra"].qualifier == "infrastructure"
    assert config.registrations["legacy"].qualifier == "infrastructure"
    assert config.registrations["http"].effective_eligibility_ref == "web"


@pytest.mark.parametrize(
    ("registration", "suffix"),
    [
        (reg(qualifier="nope"), "qualifier"),
        (reg(qualifier="Primary"), "qualifier"),
        (reg(connection_ref="nope"), "connection_ref"),
        (reg(qualifier="primary", connection_ref="primary"), "connection_ref"),
        (reg(service_name="orders"), "service_name"),
        (reg(service_name="coordinator"), "service_name"),  # bound on another connection
        (reg(qualifier="files", service_name="orders"), "qualifier"),  # static cannot register
        (reg(ip="0.0.0.0"), "ip"),
        (reg(ip="::"), "ip"),
        (reg(ip=""), "ip"),
        # Every spelling of the unspecified address, and what is not an address.
        *[
            (reg(ip=ip), "ip")
            for ip in (
                "0:0:0:0:0:0:0:0",
                "[::]",
                "::ffff:0.0.0.0",
                "0",
                "0.0.0.0.",
                "0x0",
                "127.1",
                "2130706433",
                "10.0.0.1:8080",
                "http://10.0.0.1",
                "user:pw-in-ip@10.0.0.1",
            )
        ],
        (reg(port=0), "port"),
        (reg(port=70_000), "port"),
        (reg(port="${PORT}"), "port"),
        (reg(weight=0), "weight"),
        (reg(weight=float("inf")), "weight"),
        (reg(tags="a"), "tags"),
    ],
)
def test_registration_errors(registration: dict[str, Any], suffix: str) -> None:
    error = error_of(business(r=registration))
    assert error.path == f"discovery.registrations.r.{suffix}", str(error)


@pytest.mark.parametrize("ip", ["10.0.0.7", "fd00::7", "api.internal", "api-1.example.com."])
def test_registration_ip_takes_addresses_and_host_names(ip: str) -> None:
    config = parse_config(business(r=reg(ip=ip)))
    assert config.registrations["r"].ip == ip


def test_registration_ip_errors_do_not_echo_the_value() -> None:
    error = error_of(business(r=reg(ip="user:pw-in-ip@10.0.0.1")))
    assert "pw-in-ip" not in str(error)


def test_unknown_qualifier_message() -> None:
    error = error_of(business(r=reg(qualifier="nope-secret-ref")))
    assert error.path == "discovery.registrations.r.qualifier"
    assert "names no configured connection" in str(error)
    assert "nope-secret-ref" not in str(error)  # reference values are not echoed


def test_duplicate_backend_key_is_refused() -> None:
    error = error_of(business(a=reg(), b=reg()))
    assert error.path == "discovery.registrations.b"
    assert "'a'" in error.detail


def test_the_same_instance_id_twice_is_refused() -> None:
    error = error_of(
        business(
            a=reg(ip="10.0.0.1", port=8080, instance_id="node-1"),
            b=reg(ip="10.0.0.2", port=9090, instance_id="node-1"),
        )
    )
    assert error.path == "discovery.registrations.b.instance_id"
    assert "'a'" in error.detail


def test_the_same_address_in_another_spelling_is_refused() -> None:
    error = error_of(
        business(a=reg(ip="fd00::1", port=7070), b=reg(ip="fd00:0:0:0:0:0:0:1", port=7070))
    )
    assert error.path == "discovery.registrations.b"
    error = error_of(
        business(a=reg(ip="api.example", port=7070), b=reg(ip="API.example.", port=7070))
    )
    assert error.path == "discovery.registrations.b"


def test_placeholders_are_not_expanded() -> None:
    config = parse_config(business(r=reg(ip="${BUSINESS_REGISTER_IP}")))
    assert config.registrations["r"].ip == "${BUSINESS_REGISTER_IP}"


# ----------------------------------------------------------------- frozen, comparing


def test_models_are_frozen() -> None:
    config = parse_config(doc(connections={"primary": static()}))
    with pytest.raises(Exception, match="frozen"):
        config.enabled = False
    with pytest.raises(Exception, match="frozen"):
        config.connections["primary"].rest.max_attempts = 3


def test_any_change_requires_a_restart() -> None:
    base = doc(connections={"primary": etcd({"self": {"name": "a"}})})
    old = parse_config(base)
    assert not restart_required(old, parse_config(base))
    changed = doc(connections={"primary": etcd({"self": {"name": "b"}})})
    assert restart_required(old, parse_config(changed))
    timing = doc(connections={"primary": etcd({"self": {"name": "a"}}, poll_interval_ms=4000)})
    assert restart_required(old, parse_config(timing))
    assert restart_required(old, DiscoveryConfig())

    def with_password(value: str) -> dict[str, Any]:
        block = {"endpoints": ["http://a:2379"], "username": "u", "password": value}
        return doc(connections={"primary": {"provider": "etcd", "etcd": block}})

    password, other_password = with_password("x"), with_password("y")
    assert restart_required(parse_config(password), parse_config(other_password))
    assert not restart_required(parse_config(password), parse_config(password))


def test_several_problems_are_reported_together() -> None:
    error = error_of(doc(connections={"c": static(request_timeout_ms=0, poll_interval_ms=0)}))
    assert error.path == "discovery.connections.c.request_timeout_ms"
    assert "discovery.connections.c.poll_interval_ms" in str(error)
    assert [p for p, _ in error.problems] == [
        "discovery.connections.c.request_timeout_ms",
        "discovery.connections.c.poll_interval_ms",
    ]


def test_direct_construction_matches_loading() -> None:
    direct = DiscoveryConfig(
        enabled=True,
        connections={"primary": ConnectionConfig.model_validate(static())},
    )
    assert direct == parse_config(doc(connections={"primary": static()}))
    assert RestConfig().max_attempts == 1


# ----------------------------------------------------------------- the budget rules as a property

durations = st.integers(min_value=-1, max_value=MAX_DURATION_MS + 1)


@settings(max_examples=150, deadline=None)
@given(
    request=durations,
    poll=durations,
    max_age=durations,
    stale=durations,
    monitor=durations,
    grace=durations,
)
def test_connection_accepted_exactly_when_the_rules_hold(
    request: int, poll: int, max_age: int, stale: int, monitor: int, grace: int
) -> None:
    def ok(value: int, minimum: int = 1) -> bool:
        return minimum <= value <= MAX_DURATION_MS

    expected = (
        all(ok(v) for v in (request, poll, max_age, monitor, grace))
        and ok(stale, 0)
        and stale <= max_age
        and poll + request < max_age
        and monitor + request < grace
    )
    document = doc(
        connections={
            "c": static(
                request_timeout_ms=request,
                poll_interval_ms=poll,
                monitor_interval_ms=monitor,
                observation_grace_ms=grace,
                snapshot={"max_age_ms": max_age, "stale_if_error_ms": stale},
            )
        }
    )
    try:
        parse_config(document)
    except ConfigError as error:
        assert not expected, str(error)
        assert error.path.startswith("discovery.connections.c.")
    else:
        assert expected


@pytest.mark.parametrize(
    ("discovery", "path", "hint"),
    [
        ({"enabeld": True}, "discovery.enabeld", "enabled"),
        ({"limits": {"max_conections": 3}}, "discovery.limits.max_conections", "max_connections"),
        (
            {"connections": {"a": static(request_timout_ms=5)}},
            "discovery.connections.a.request_timout_ms",
            "request_timeout_ms",
        ),
        (
            {"connections": {"a": static(rest={"lb_stratgy": "weighted"})}},
            "discovery.connections.a.rest.lb_stratgy",
            "lb_strategy",
        ),
        (
            {"connections": {"a": static({"o": [{"host": "h", "port": 1, "wieght": 2}]})}},
            "discovery.connections.a.static.services.o[0].wieght",
            "weight",
        ),
    ],
)
def test_unknown_fields_get_a_spelling_hint(
    discovery: dict[str, Any], path: str, hint: str
) -> None:
    error = error_of(doc(**discovery))
    assert error.path == path
    assert error.detail == f"unknown field (did you mean {hint!r}?)"


def test_provider_model_errors_get_hints_too() -> None:
    connection = ConnectionConfig.model_validate(
        {"provider": "etcd", "etcd": {"endpoints": ["x"], "dial_timeout": 5}}
    )
    with pytest.raises(ConfigError) as info:
        validate_provider_block("b", connection, EtcdSettings)
    assert info.value.path == "discovery.connections.b.etcd.dial_timeout"
    assert "did you mean 'dial_timeout_ms'" in info.value.detail


# ----------------------------------------------------------------- error paths


def test_a_union_fields_error_names_the_field_and_the_specific_problem() -> None:
    """pydantic puts a member tag after a union-typed field (``port.str``,
    ``port.constrained-int``) and one error per member: the path is the
    config key, and the out-of-range problem wins over "not a string"."""

    def kubernetes(port: object) -> dict[str, Any]:
        return {"provider": "kubernetes", "kubernetes": {"services": {"a": {"port": port}}}}

    error = error_of(doc(connections={"primary": kubernetes(0)}))
    assert error.problems == (
        (
            "discovery.connections.primary.kubernetes.services.a.port",
            "Input should be greater than or equal to 1",
        ),
    )
    # A value that is no member's type keeps each member's message, at the key.
    error = error_of(doc(connections={"primary": kubernetes([80])}))
    assert {path for path, _ in error.problems} == {
        "discovery.connections.primary.kubernetes.services.a.port"
    }
    assert len(error.problems) == 2


def test_a_mapping_key_of_the_wrong_type_is_named_as_written() -> None:
    error = error_of(doc(connections={1: static()}))
    assert error.path == "discovery.connections.1"
    assert error.detail.startswith("the key: ")


def test_a_static_listing_over_the_instance_limit_is_refused_at_load() -> None:
    instances = [{"host": f"10.0.0.{n}", "port": 80} for n in range(1, 4)]
    limits = {"max_instances_per_service": 2}
    error = error_of(doc(limits=limits, connections={"primary": static({"a": instances})}))
    assert error.path == "discovery.connections.primary.static.services.a"
    assert "max_instances_per_service" in error.detail
    config = parse_config(
        doc(
            limits={"max_instances_per_service": 3},
            connections={"primary": static({"a": instances})},
        )
    )
    assert len(config.connections["primary"].static.instances("a")) == 3  # type: ignore[union-attr]
