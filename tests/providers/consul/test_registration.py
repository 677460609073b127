"""Self-registration: payload rules (sans-IO), agent writes, and the re-apply loop."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import (
    ConsulSettings,
    Contribution,
    HealthEndpoint,
    ReregistrationState,
    build_registration,
    merge_contributions,
    run_reregistration,
)

from nadisc import (
    HealthCheck,
    HealthStatus,
    IdentityRevoked,
    LeaseLost,
    OutcomeUnknown,
    Registered,
    RegistrationError,
    RegistrationRecord,
    RegistrationRejected,
)
from tests.fakes.consul import ConsulFake, Fault, open_consul_fake, run_consul_fake
from tests.providers.consul.conftest import in_process, over_loopback

NODE = "fake-node-1"


def record(**overrides: Any) -> RegistrationRecord:
    values: dict[str, Any] = {
        "registration": "web",
        "service": "orders",
        "instance_id": "orders-1",
        "host": "10.1.2.3",
        "port": 8080,
    }
    values.update(overrides)
    return RegistrationRecord(**values)


def settings(**values: Any) -> ConsulSettings:
    return ConsulSettings.model_validate(values)


class Mesh:
    def contribute(self) -> Contribution:
        return Contribution(("nadisc-mesh", "grpc"), {"nadisc-cluster": "from-mesh", "m": "1"})


# -- payload (sans-IO) -------------------------------------------------------------------


def test_payload_carries_identity_address_tags_meta_and_weights() -> None:
    payload, check_id, kind = build_registration(
        record(tags=("grpc",), metadata={"region": "eu-west"}, weight=3.0),
        settings(cluster_id="cluster-1", tags=["edge"], meta={"team": "core"}),
        version="1.2.3",
    )
    assert (check_id, kind) == (None, None)
    assert payload == {
        "ID": "orders-1",
        "Name": "orders",
        "Tags": ["edge", "grpc"],
        "Address": "10.1.2.3",
        "Port": 8080,
        "Meta": {
            "nadisc-version": "1.2.3",
            "nadisc-cluster": "cluster-1",
            "team": "core",
            "region": "eu-west",
        },
        "Weights": {"Passing": 3, "Warning": 1},
    }


def test_merge_precedence_is_automatic_then_contributors_then_user() -> None:
    tags, meta = merge_contributions(
        (("auto",), {"k": "auto", "a": "1"}),
        [Contribution(("c", "auto"), {"k": "contrib", "c": "1"}), Contribution(("c", "d"), {})],
        (("u", "c"), {"k": "user"}),
    )
    assert tags == ("auto", "c", "d", "u")
    assert meta == {"k": "user", "a": "1", "c": "1"}


def test_contributors_and_user_override_in_order() -> None:
    payload, _, _ = build_registration(
        record(),
        settings(cluster_id="cluster-1", meta={"m": "user"}),
        contributions=[Mesh().contribute()],
    )
    assert payload["Tags"] == ["nadisc-mesh", "grpc"]
    assert payload["Meta"] == {"nadisc-version": "0", "nadisc-cluster": "from-mesh", "m": "user"}


def test_check_precedence_record_then_settings_then_host_then_none() -> None:
    host = HealthEndpoint("/host-health")
    ttl = HealthCheck(kind="ttl", ttl=15.0)
    explicit, check_id, kind = build_registration(
        record(check=ttl), settings(health_check_path="/from-settings"), host_endpoint=host
    )
    assert (check_id, kind) == ("service:orders-1", "ttl")
    assert explicit["Check"] == {
        "CheckID": "service:orders-1",
        "Name": "orders health",
        "TTL": "15s",
        "DeregisterCriticalServiceAfter": "60s",
    }
    from_settings, _, kind = build_registration(
        record(),
        settings(
            health_check_path="/ready",
            health_check_interval=5,
            deregister_critical_service_after=90,
        ),
        host_endpoint=host,
    )
    assert kind == "http"
    assert from_settings["Check"] == {
        "CheckID": "service:orders-1",
        "Name": "orders health",
        "HTTP": "http://10.1.2.3:8080/ready",
        "Interval": "5s",
        "Timeout": "5s",
        "FailuresBeforeCritical": 3,
        "DeregisterCriticalServiceAfter": "90s",
    }
    from_host, _, _ = build_registration(
        record(), settings(), host_endpoint=HealthEndpoint("/hz", "https")
    )
    assert from_host["Check"]["HTTP"] == "https://10.1.2.3:8080/hz"  # type: ignore[index]
    none, check_id, _ = build_registration(record(), settings())
    assert "Check" not in none and check_id is None


def test_tcp_checks_and_ipv6_addresses() -> None:
    payload, _, kind = build_registration(
        record(host="2001:db8::7", check=HealthCheck(kind="tcp", interval=2.0)), settings()
    )
    assert kind == "tcp"
    assert payload["Address"] == "2001:db8::7"
    assert payload["Check"]["TCP"] == "[2001:db8::7]:8080"  # type: ignore[index]
    assert payload["Check"]["FailuresBeforeCritical"] == 3  # type: ignore[index]
    ttl, _, _ = build_registration(record(check=HealthCheck(kind="ttl", ttl=5.0)), settings())
    assert "FailuresBeforeCritical" not in ttl["Check"]  # type: ignore[operator]
    strict, _, _ = build_registration(
        record(check=HealthCheck(kind="tcp", interval=2.0)),
        settings(health_check_failures_before_critical=1),
    )
    assert strict["Check"]["FailuresBeforeCritical"] == 1  # type: ignore[index]


UNSPECIFIED = [
    "0.0.0.0",
    "::",
    "[::]",
    "::0",
    "[::0]",
    "0:0:0:0:0:0:0:0",
    "0000::",
    "::ffff:0.0.0.0",
    " 0.0.0.0 ",
    "*",
    "",
]
LOOPBACK = ["127.0.0.1", "127.1.2.3", "[::1]", "::1", "0:0:0:0:0:0:0:1", "localhost", "LOCALHOST"]


@pytest.mark.parametrize("host", UNSPECIFIED + LOOPBACK)
def test_wildcard_and_loopback_are_never_advertised_by_default(host: str) -> None:
    with pytest.raises(RegistrationError, match="advertised_host"):
        build_registration(record(host=host), settings())


@pytest.mark.parametrize("host", UNSPECIFIED)
def test_every_spelling_of_a_wildcard_bind_is_rewritten_only_with_allow_loopback(
    host: str,
) -> None:
    payload, _, _ = build_registration(record(host=host), settings(allow_loopback=True))
    assert payload["Address"] == "localhost"


@pytest.mark.parametrize(
    ("host", "kind"),
    [
        ("0", "wildcard"),
        ("0x0", "wildcard"),
        ("0.0", "wildcard"),
        ("127.1", "loopback"),
        ("2130706433", "loopback"),
        ("0x7f.1", "loopback"),
        ("0177.0.0.1", "loopback"),
    ],
)
def test_numeric_spellings_of_wildcard_and_loopback_count_as_what_they_read(
    host: str, kind: str
) -> None:
    with pytest.raises(RegistrationError, match=f"refusing to advertise the {kind}"):
        build_registration(record(host=host), settings())
    local, _, _ = build_registration(record(host=host), settings(allow_loopback=True))
    assert local["Address"] == ("localhost" if kind == "wildcard" else host)


@pytest.mark.parametrize("host", ["10.0.0.1", "2001:db8::1", "[2001:db8::1]", "app.internal"])
def test_routable_hosts_are_advertised_as_given(host: str) -> None:
    payload, _, _ = build_registration(record(host=host), settings())
    assert payload["Address"] == host.strip("[]")


def test_advertised_host_overrides_and_allow_loopback_keeps_the_local_rewrite() -> None:
    payload, _, _ = build_registration(
        record(host="0.0.0.0"), settings(advertised_host="app.internal")
    )
    assert payload["Address"] == "app.internal"
    local = settings(allow_loopback=True)
    assert build_registration(record(host="0.0.0.0"), local)[0]["Address"] == "localhost"
    assert build_registration(record(host="[::]"), local)[0]["Address"] == "localhost"
    assert build_registration(record(host="127.0.0.1"), local)[0]["Address"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"metadata": {"bad.key": "x"}}, "bad.key"),
        ({"metadata": {"consul-x": "x"}}, "consul-x"),
        ({"weight": 0.5}, "weight"),
        ({"check": HealthCheck(kind="http", path="/h", deregister_after=10)}, "minimum"),
        ({"check": HealthCheck(kind="grpc")}, "grpc"),
        ({"check": HealthCheck(kind="http", path="nope")}, "must start with"),
    ],
)
def test_bad_plans_are_refused_before_any_write(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RegistrationError, match=message):
        build_registration(record(**overrides), settings())


# -- against the fake agent --------------------------------------------------------------


async def test_register_writes_the_payload_and_passes_the_ttl_check() -> None:
    fake = ConsulFake()
    provider = in_process(fake, cluster_id="cluster-1")
    provider.add_contributor(Mesh())
    registered = await provider.register(
        record(check=HealthCheck(kind="ttl", ttl=30.0)), anyio.current_time() + 5
    )
    assert registered.handle == "ttl:service:orders-1"
    service = fake.services[(NODE, "orders-1")]
    assert (service.address, service.port) == ("10.1.2.3", 8080)
    assert service.tags == ["nadisc-mesh", "grpc"]
    assert service.meta["nadisc-cluster"] == "from-mesh"
    assert fake.checks[(NODE, "service:orders-1")].status == "passing"
    snapshot = await provider.query("orders", anyio.current_time() + 5)
    assert snapshot.identities() == ("orders-1",)
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.HEALTHY
    await provider.aclose()


async def test_renew_is_an_idempotent_upsert_that_heals_a_lost_registration() -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(record(), anyio.current_time() + 5)
    before = fake.index
    again = await provider.renew(registered, anyio.current_time() + 5)
    assert again == registered and fake.index == before  # nothing changed remotely
    fake.deregister("orders-1")  # the agent dropped it (reaped, agent restart)
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.MISSING
    await provider.renew(registered, anyio.current_time() + 5)
    assert (NODE, "orders-1") in fake.services
    await provider.aclose()


async def test_check_maps_agent_health_to_status() -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(
        record(check=HealthCheck(kind="ttl", ttl=30.0)), anyio.current_time() + 5
    )
    fake.set_check("service:orders-1", "warning")
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.UNHEALTHY
    fake.set_check("service:orders-1", "critical")
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.UNHEALTHY
    await provider.deregister(registered, anyio.current_time() + 5)
    await provider.deregister(registered, anyio.current_time() + 5)  # absent: no-op
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.MISSING
    await provider.aclose()


async def test_ttl_pass_on_a_missing_check_is_lease_lost() -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(
        record(check=HealthCheck(kind="ttl", ttl=30.0)), anyio.current_time() + 5
    )
    fake.inject("/v1/agent/check/pass/", Fault("status", status=404, body=b"Unknown check ID"))
    with pytest.raises(LeaseLost):
        await provider.renew(registered, anyio.current_time() + 5)
    await provider.aclose()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (500, b'CheckID "service:web-1" does not have associated TTL', LeaseLost),
        (500, b'Unknown check ID "service:web-1". Ensure that the check ID is passed', LeaseLost),
        (404, b"anything", LeaseLost),
        # Server trouble that merely mentions a TTL is not a lost check.
        (500, b"rpc error: timed out updating TTL: leadership lost", OutcomeUnknown),
        (500, b"No cluster leader", OutcomeUnknown),
    ],
)
async def test_only_consuls_missing_check_answers_are_lease_lost(
    status: int, body: bytes, expected: type[Exception]
) -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(
        record(check=HealthCheck(kind="ttl", ttl=30.0)), anyio.current_time() + 5
    )
    fake.inject("/v1/agent/check/pass/", Fault("status", status=status, body=body))
    with pytest.raises(expected):
        await provider.renew(registered, anyio.current_time() + 5)
    await provider.aclose()


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault("status", status=403, body=b"Permission denied"), IdentityRevoked),
        (Fault("status", status=400, body=b"Invalid Service Meta"), RegistrationRejected),
        (Fault("status", status=500, body=b"rpc error"), OutcomeUnknown),
    ],
)
async def test_write_failures_are_typed(fault: Fault, expected: type[Exception]) -> None:
    fake = ConsulFake()
    fake.inject("/v1/agent/service/register", fault)
    provider = in_process(fake)
    with pytest.raises(expected):
        await provider.register(record(), anyio.current_time() + 5)
    await provider.aclose()


async def test_acl_denied_registration_is_identity_revoked() -> None:
    fake = ConsulFake()
    fake.enable_acl()
    fake.add_token("reader", read=("",), write=())
    provider = in_process(fake, token="reader")
    with pytest.raises(IdentityRevoked, match="Permission denied"):
        await provider.register(record(), anyio.current_time() + 5)
    await provider.aclose()


async def test_lost_answers_over_loopback_are_outcome_unknown() -> None:
    async with run_consul_fake() as fake:
        provider = over_loopback(fake)
        fake.inject("/v1/agent/service/register", Fault("drop"))
        with pytest.raises(OutcomeUnknown, match="may or may not"):
            await provider.register(record(), anyio.current_time() + 5)
        await provider.aclose()


async def test_http_check_is_performed_by_the_agent_end_to_end() -> None:
    async with run_consul_fake() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        provider = over_loopback(
            fake,
            allow_loopback=True,
            health_check_path="/v1/status/leader",
            health_check_interval=0.1,
        )
        registered = await provider.register(
            record(host="127.0.0.1", port=port), anyio.current_time() + 5
        )
        check = fake.checks[(NODE, "service:orders-1")]
        assert check.kind == "http" and check.deregister_after == 60.0
        with anyio.fail_after(5):
            await fake.wait_for(lambda: check.status == "passing")
        assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.HEALTHY
        snapshot = await provider.query("orders", anyio.current_time() + 5)
        assert snapshot.identities() == ("orders-1",)
        await provider.deregister(registered, anyio.current_time() + 5)
        await provider.aclose()


# -- the re-apply loop -------------------------------------------------------------------


async def test_reregistration_brings_back_a_reaped_service(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_consul_fake(reap_interval=30.0) as fake:
        # No probes run in-process: the HTTP check stays critical and the
        # reaper removes the service after DeregisterCriticalServiceAfter.
        provider = in_process(fake, health_check_path="/health")
        registered = await provider.register(record(), anyio.current_time() + 5)
        state = ReregistrationState()
        seen: list[bool] = []
        async with anyio.create_task_group() as nursery:
            await nursery.start(
                lambda task_status: run_reregistration(
                    provider, registered, 30.0, lambda: True, state=state, task_status=task_status
                )
            )
            for _ in range(40):
                await anyio.sleep(5)
                seen.append((NODE, "orders-1") in fake.services)
            nursery.cancel_scope.cancel()
        await provider.aclose()
    assert False in seen  # it was reaped...
    assert seen[-1] or seen[-2] or seen[-3]  # ...and re-registered within an interval
    first_gap = seen.index(False)
    assert True in seen[first_gap:]
    assert state.writes >= 6 and state.failures == 0


async def test_reregistration_skips_when_ineligible_and_stops_when_halted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(record(), anyio.current_time() + 5)
    eligible = [False]
    state = ReregistrationState()
    writes_at_halt = -1
    async with anyio.create_task_group() as nursery:
        nursery.start_soon(
            lambda: run_reregistration(provider, registered, 10.0, lambda: eligible[0], state=state)
        )
        await anyio.sleep(25)
        assert state.writes == 0 and state.skipped_ineligible == 2
        eligible[0] = True
        await anyio.sleep(10)
        assert state.writes == 1
        state.halt("deregistration outcome unknown")
        writes_at_halt = state.writes
        await anyio.sleep(30)  # the loop returns by itself: the nursery can close
    assert state.writes == writes_at_halt and state.halted
    await provider.aclose()


async def test_reregistration_records_failures_and_keeps_going(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = Registered(record(), "none:")
    fake.inject("/v1/agent/service/register", Fault("status", status=500, body=b"boom"), times=2)
    state = ReregistrationState()
    async with anyio.create_task_group() as nursery:
        nursery.start_soon(
            lambda: run_reregistration(provider, registered, 5.0, lambda: True, state=state)
        )
        await anyio.sleep(16)
        nursery.cancel_scope.cancel()
    await provider.aclose()
    assert state.failures == 2 and state.writes == 1
    assert state.last_error is not None and "boom" in state.last_error
    assert (NODE, "orders-1") in fake.services


async def test_reregistration_refuses_a_bad_interval() -> None:
    provider = in_process(ConsulFake())
    with pytest.raises(ValueError):
        await run_reregistration(provider, Registered(record(), "none:"), 0.0, lambda: True)
    await provider.aclose()


async def test_maintenance_mode_reads_as_disabled() -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    registered = await provider.register(record(), anyio.current_time() + 5)
    fake.set_maintenance("orders-1", True, "deploy")
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.DISABLED
    fake.set_maintenance("orders-1", False)
    assert await provider.check(registered, anyio.current_time() + 5) is HealthStatus.HEALTHY
    await provider.aclose()
