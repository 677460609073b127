"""Registration plans: specs, resolution from config, and whole-plan freezing."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from nadisc import (
    Capabilities,
    ConnectionPlan,
    DiscoveryConfig,
    Eligibility,
    EvidenceKind,
    RegistrationError,
    RegistrationSet,
    RegistrationSpec,
    RegistrationTiming,
    resolve_registrations,
)
from nadisc._registration import freeze_plan

CAN = Capabilities(evidence=EvidenceKind.REGISTRY_HEALTH, registration=True)
CANNOT = Capabilities(evidence=EvidenceKind.STATIC_FACT)
CONNECTIONS: dict[str, Any] = {
    "primary": (CAN, {"orders": "orders-svc", "pay": "payments"}),
    "dr": ConnectionPlan(CAN, {"orders": "orders-svc"}),
    "static": (CANNOT, {"orders": "orders"}),
}
ALWAYS = Eligibility.always()


def spec(name: str = "web", **changes: Any) -> RegistrationSpec:
    values: dict[str, object] = {
        "name": name,
        "service_name": "orders",
        "ip": "10.0.0.5",
        "port": 8080,
        "eligibility": ALWAYS,
    }
    values.update(changes)
    return RegistrationSpec(**values)  # type: ignore[arg-type]


def test_spec_defaults_and_derived_instance_id() -> None:
    s = RegistrationSpec(name="web", service_name="orders")
    assert s.qualifier == "primary"
    assert s.startup_required is True and s.readiness_critical is False
    assert s.weight == 1.0 and s.tags == () and dict(s.metadata) == {}
    (frozen,) = freeze_plan([spec()], CONNECTIONS)
    assert frozen.record.instance_id == "orders-svc-10.0.0.5-8080"
    assert frozen.record.service == "orders-svc"
    assert frozen.qualifier == "primary" and frozen.service_alias == "orders"
    assert frozen.timing == RegistrationTiming()
    # Deterministic: the same plan derives the same id.
    (again,) = freeze_plan([spec()], CONNECTIONS)
    assert again.record == frozen.record


def test_address_from_the_single_listener_and_eligibility_from_it() -> None:
    web = Eligibility.always()
    (frozen,) = freeze_plan(
        [RegistrationSpec(name="web", service_name="orders")],
        CONNECTIONS,
        listeners={"web": ("10.1.2.3", 9000)},
        eligibility={"web": web},
    )
    assert (frozen.record.host, frozen.record.port) == ("10.1.2.3", 9000)
    assert frozen.eligibility is web


def test_listener_required_when_several() -> None:
    with pytest.raises(RegistrationError) as info:
        freeze_plan(
            [RegistrationSpec(name="web", service_name="orders")],
            CONNECTIONS,
            listeners={"web": ("10.1.2.3", 9000), "grpc": ("10.1.2.3", 9001)},
            eligibility={"web": ALWAYS},
        )
    assert info.value.path == "discovery.registrations.web.listener_ref"
    assert info.value.registration == "web"


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"qualifier": "nope"}, "qualifier", "unknown connection"),
        ({"qualifier": "static"}, "qualifier", "cannot register"),
        ({"service_name": "ghost"}, "service_name", "not bound"),
        ({"listener_ref": "admin", "ip": None}, "listener_ref", "unknown listener"),
        (
            {"eligibility": None, "eligibility_ref": "saga"},
            "eligibility_ref",
            "unknown eligibility",
        ),
        ({"eligibility": None}, "eligibility_ref", "unknown eligibility 'web'"),
        ({"ip": "0.0.0.0"}, "ip", "advertised address"),
        ({"ip": "::"}, "ip", "advertised address"),
        ({"ip": "224.0.0.1"}, "ip", "multicast"),
        ({"ip": "ff02::1"}, "ip", "multicast"),
        ({"ip": "255.255.255.255"}, "ip", "broadcast"),
        ({"ip": "169.254.1.1"}, "ip", "link-local"),
        ({"ip": "fe80::1"}, "ip", "link-local"),
        ({"ip": "127.0.0.1"}, "ip", "loopback"),
        ({"ip": "::1"}, "ip", "loopback"),
        ({"ip": "::ffff:0.0.0.0"}, "ip", "unspecified"),
        ({"ip": "localhost"}, "ip", "loopback"),
        ({"ip": "bad host!"}, "ip", "neither"),
        # Numeric shorthands resolvers turn into addresses (0.0.0.0, loopback).
        ({"ip": "0"}, "ip", r"numeric host name \(read as 0\.0\.0\.0\)"),
        ({"ip": "0.0"}, "ip", r"read as 0\.0\.0\.0"),
        ({"ip": "127.1"}, "ip", r"read as 127\.0\.0\.1"),
        ({"ip": "2130706433"}, "ip", r"read as 127\.0\.0\.1"),
        ({"ip": "0x7f000001"}, "ip", r"read as 127\.0\.0\.1"),
        ({"ip": "10.1"}, "ip", "numeric host name"),
        ({"ip": "orders.123"}, "ip", "numeric host name"),
        ({"ip": "orders.0x1f"}, "ip", "numeric host name"),
        ({"ip": "0.1.2.3"}, "ip", "this network"),
        ({"ip": "fec0::1"}, "ip", "site-local"),
        ({"ip": "4000::1"}, "ip", "reserved"),
        ({"ip": "240.0.0.1"}, "ip", "reserved"),
        ({"ip": "app.localhost"}, "ip", "loopback name"),
        ({"ip": "APP.localhost."}, "ip", "loopback name"),
        ({"ip": "localhost.localdomain"}, "ip", "loopback name"),
        ({"port": 0}, "port", "1-65535"),
        ({"port": 70000}, "port", "1-65535"),
        ({"weight": 0.0}, "weight", "weight"),
        ({"weight": float("nan")}, "weight", "weight"),
        ({"metadata": {"k": 1}}, "metadata", "strings"),
        ({"tags": ("",)}, "tags", "tags"),
        ({"instance_id": ""}, "instance_id", "instance_id"),
    ],
)
def test_bad_specs_name_registration_and_path(
    changes: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(RegistrationError, match=words) as info:
        freeze_plan([spec(**changes)], CONNECTIONS, listeners={"web": ("10.0.0.9", 1)})
    assert info.value.registration == "web"
    assert info.value.path == f"discovery.registrations.web.{field}"
    assert "discovery.registrations.web" in str(info.value)


def test_loopback_with_explicit_opt_in() -> None:
    (frozen,) = freeze_plan([spec(ip="127.0.0.1", allow_loopback=True)], CONNECTIONS)
    assert frozen.record.host == "127.0.0.1"
    (named,) = freeze_plan([spec(ip="localhost", allow_loopback=True)], CONNECTIONS)
    assert named.record.host == "localhost"
    (sub,) = freeze_plan([spec(ip="app.localhost", allow_loopback=True)], CONNECTIONS)
    assert sub.record.host == "app.localhost"
    (six,) = freeze_plan([spec(ip="::1", allow_loopback=True)], CONNECTIONS)
    assert six.record.host == "::1"
    with pytest.raises(RegistrationError, match="numeric host name"):
        freeze_plan([spec(ip="127.1", allow_loopback=True)], CONNECTIONS)
    with pytest.raises(RegistrationError, match="advertised"):
        freeze_plan([spec(ip="0.0.0.0", allow_loopback=True)], CONNECTIONS)


def test_host_names_and_ipv6_are_fine() -> None:
    a, b = freeze_plan(
        [spec("a", ip="orders-1.internal.example"), spec("b", ip="2001:db8::5")], CONNECTIONS
    )
    assert a.record.host == "orders-1.internal.example"
    assert b.record.instance_id == "orders-svc-2001:db8::5-8080"
    # Names with digits or "0x" inside a label, and NAT64 addresses, stay fine.
    c, d, e = freeze_plan(
        [
            spec("c", ip="host-0x1.example"),
            spec("d", ip="node1.rack2.example"),
            spec("e", ip="64:ff9b::a00:5"),
        ],
        CONNECTIONS,
    )
    assert (c.record.host, d.record.host, e.record.host) == (
        "host-0x1.example",
        "node1.rack2.example",
        "64:ff9b::a00:5",
    )


def test_duplicate_backend_keys() -> None:
    with pytest.raises(RegistrationError, match="same backend key") as info:
        freeze_plan(
            [spec("a"), spec("b", port=8081, instance_id="orders-svc-10.0.0.5-8080")], CONNECTIONS
        )
    assert info.value.registration == "b"
    with pytest.raises(RegistrationError, match="same address"):
        freeze_plan([spec("a"), spec("b", instance_id="other")], CONNECTIONS)
    # The same address in another spelling is the same address.
    with pytest.raises(RegistrationError, match="same address"):
        freeze_plan(
            [spec("a", ip="fd00::5"), spec("b", ip="fd00:0:0:0:0:0:0:5", instance_id="other")],
            CONNECTIONS,
        )
    with pytest.raises(RegistrationError, match="twice"):
        freeze_plan([spec("a"), spec("a", port=9)], CONNECTIONS)
    # Same address on another connection, or for another service, is fine.
    plan = freeze_plan(
        [spec("a"), spec("b", qualifier="dr"), spec("c", service_name="pay")], CONNECTIONS
    )
    assert [p.name for p in plan] == ["a", "b", "c"]


def test_freeze_is_all_or_nothing_and_once() -> None:
    registrations = RegistrationSet()
    with pytest.raises(RegistrationError):
        registrations.freeze([spec("a"), spec("b", ip="0.0.0.0")], CONNECTIONS)
    assert not registrations.frozen
    assert registrations.registrations(now=0.0) == {}
    frozen = registrations.freeze([spec("a")], CONNECTIONS)
    assert [f.name for f in frozen] == ["a"]
    assert set(registrations.eligibilities()) == {"a"}
    from nadisc import LifecycleError

    with pytest.raises(LifecycleError):
        registrations.freeze([spec("a")], CONNECTIONS)


def test_timing_validation_and_config() -> None:
    with pytest.raises(ValueError):
        RegistrationTiming(monitor_interval=0)
    with pytest.raises(ValueError):
        RegistrationTiming(initial_backoff=40, max_backoff=30)
    from nadisc import ConnectionConfig

    timing = RegistrationTiming.from_config(
        ConnectionConfig.model_validate(
            {
                "provider": "memory",
                "monitor_interval_ms": 2000,
                "observation_grace_ms": 9000,
                "deregister_timeout_ms": 1500,
                "request_timeout_ms": 1000,
                "retry": {"initial_backoff_ms": 200, "max_backoff_ms": 4000},
            }
        )
    )
    assert timing == RegistrationTiming(2.0, 9.0, 1.5, 1.0, 0.2, 4.0)


def config(registrations: dict[str, object]) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "consul",
                    "consul": {"services": {"orders": {"name": "orders-svc"}}},
                }
            },
            "registrations": registrations,
        }
    )


def test_resolve_from_config() -> None:
    web = Eligibility.always()
    saga = Eligibility.always()
    cfg = config(
        {
            "web": {
                "service_name": "orders",
                "ip": "10.0.0.5",
                "port": 8080,
                "listener_ref": "web",
                "readiness_critical": True,
                "metadata": {"zone": "a"},
                "tags": ["v1"],
                "weight": 2.5,
            },
            "recovery": {
                "service_name": "orders",
                "ip": "10.0.0.5",
                "port": 8090,
                "listener_ref": "grpc",
                "eligibility_ref": "saga-recovery",
                "startup_required": False,
                "instance_id": "orders-recovery-1",
            },
        }
    )
    specs = resolve_registrations(
        cfg,
        {"web": ("10.0.0.5", 8080), "grpc": ("10.0.0.5", 8090)},
        {"web": web, "grpc": Eligibility.always(), "saga-recovery": saga},
    )
    by_name = {s.name: s for s in specs}
    assert by_name["web"].eligibility is web and by_name["web"].eligibility_ref == "web"
    assert by_name["web"].readiness_critical and by_name["web"].weight == 2.5
    assert dict(by_name["web"].metadata) == {"zone": "a"} and by_name["web"].tags == ("v1",)
    assert by_name["recovery"].eligibility is saga
    assert not by_name["recovery"].startup_required
    frozen = freeze_plan(specs, {"primary": (CAN, {"orders": "orders-svc"})})
    assert {f.record.instance_id for f in frozen} == {
        "orders-svc-10.0.0.5-8080",
        "orders-recovery-1",
    }


def test_resolve_reference_errors_carry_config_paths() -> None:
    cfg = config(
        {"web": {"service_name": "orders", "ip": "10.0.0.5", "port": 8080, "listener_ref": "web"}}
    )
    with pytest.raises(RegistrationError) as info:
        resolve_registrations(cfg, {"grpc": ("10.0.0.5", 1)}, {"grpc": ALWAYS})
    assert info.value.path == "discovery.registrations.web.listener_ref"
    with pytest.raises(RegistrationError) as info:
        resolve_registrations(cfg, {"web": ("10.0.0.5", 1)}, {})
    assert info.value.path == "discovery.registrations.web.eligibility_ref"
    bare = config({"web": {"service_name": "orders", "ip": "10.0.0.5", "port": 8080}})
    with pytest.raises(RegistrationError, match="no eligibility"):
        resolve_registrations(bare, {}, {})
    # One listener: listener_ref may be omitted, and its eligibility is used.
    (only,) = resolve_registrations(bare, {"web": ("10.0.0.5", 8080)}, {"web": ALWAYS})
    assert only.listener_ref == "web" and only.eligibility is ALWAYS
    # A mapping of RegistrationConfig works too (the legacy connection_ref included).
    legacy = config(
        {
            "web": {
                "service_name": "orders",
                "ip": "10.0.0.5",
                "port": 8080,
                "connection_ref": "primary",
            }
        }
    )
    (spec_,) = resolve_registrations(
        legacy.registrations, {"web": ("10.0.0.5", 8080)}, {"web": ALWAYS}
    )
    assert spec_.qualifier == "primary"


async def test_no_write_for_an_invalid_plan() -> None:

    from nadisc import LifecycleError
    from nadisc._memory_registry import MemoryRegistry

    from .test_registration_runtime import RegistryProvider

    registry = MemoryRegistry()
    registrations = RegistrationSet()
    with pytest.raises(RegistrationError):
        registrations.freeze([spec("a"), spec("b", ip="0.0.0.0")], CONNECTIONS)
    async with anyio.create_task_group() as nursery:
        with pytest.raises(LifecycleError, match="before freeze"):
            await registrations.publish(
                nursery, {"primary": RegistryProvider(registry)}, anyio.current_time() + 5
            )
    assert registry.log == []
    assert registry.instance_ids() == ()


def test_no_address_and_no_eligibility_without_listeners() -> None:
    with pytest.raises(RegistrationError, match="no address") as info:
        freeze_plan([RegistrationSpec(name="web", service_name="orders")], CONNECTIONS)
    assert info.value.path == "discovery.registrations.web.listener_ref"
    with pytest.raises(RegistrationError, match="no eligibility") as info:
        freeze_plan([spec(eligibility=None)], CONNECTIONS)
    assert info.value.path == "discovery.registrations.web.eligibility_ref"
