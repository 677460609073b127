"""Self-registration into Consul through the owner: publish, health, the
re-apply reconciler, eligibility, unknown outcomes, quiesce and the close report.

Under an owner, the registration lifecycle is the one writer: its renewals
call ``ConsulProvider.renew``, which re-applies the registration every
``reregister_interval`` (and at once after a check found it reaped).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import ConsulSettings, factory

from nadisc import (
    CloseOutcome,
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    EvidenceUnavailable,
    HealthEvidence,
    Provider,
    RegistrationError,
    RegistrationState,
    open_discovery,
    validate_provider_block,
)
from tests.fakes.consul import ConsulFake, Fault, open_consul_fake, run_consul_fake
from tests.nadisc.owner_support import all_tasks

pytestmark = pytest.mark.trio_only

NODE = "fake-node-1"
REGISTER = "/v1/agent/service/register"
WEB = ("10.0.0.5", 18080)
INSTANCE = "order-api-10.0.0.5-18080"


def config(
    url: str,
    *,
    registration: Mapping[str, Any] | None = None,
    connection: Mapping[str, Any] | None = None,
    **block: Any,
) -> DiscoveryConfig:
    consul: dict[str, Any] = {
        "url": url,
        "identity_scope": "service",  # see SERVICE_SCOPE in conftest.py
        "wait": 20,
        "health_check_path": "/health",
        "tags": ["edge"],
        "cluster_id": "cluster-1",
        "services": {"self": {"name": "order-api"}, "orders": {"name": "orders"}},
    }
    consul.update(block)
    primary: dict[str, Any] = {
        "provider": "consul",
        "request_timeout_ms": 2000,
        "poll_interval_ms": 5000,
        "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        "consul": consul,
    }
    primary.update(connection or {})
    web: dict[str, Any] = {
        "service_name": "self",
        "listener_ref": "web",
        "ip": WEB[0],
        "port": WEB[1],
        "tags": ["v2"],
        "metadata": {"zone": "a"},
    }
    web.update(registration or {})
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {"primary": primary},
            "registrations": {"web": web},
            "shutdown_timeout_ms": 5000,
        }
    )


def in_process(cfg: DiscoveryConfig, fake: ConsulFake) -> dict[str, Provider]:
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, ConsulSettings)
    context = ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
    return {"primary": factory.create_with(context, settings, transport=fake.transport())}


def listeners(address: tuple[str, int] = WEB) -> dict[str, tuple[str, int]]:
    return {"web": address}


def puts(fake: ConsulFake) -> int:
    return sum(1 for r in fake.requests if r.method == "PUT" and r.path == REGISTER)


def more_puts(fake: ConsulFake, seen: int) -> bool:
    return puts(fake) > seen


def state(owner: DiscoveryOwner) -> RegistrationState:
    return owner.registrations()["web"].state


async def agent_probes(fake: ConsulFake) -> None:
    """Stands in for the agent's HTTP probes (which need sockets): every
    HTTP check reports passing, as a healthy instance's endpoint would."""
    while True:
        for check in list(fake.checks.values()):
            if check.kind == "http" and check.status != "passing":
                fake.set_check(check.check_id, "passing", now=anyio.current_time())
        await fake.wait_for(
            lambda: any(c.kind == "http" and c.status != "passing" for c in fake.checks.values())
        )


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a condition that spans the owner and the fake (virtual time)."""
    with anyio.fail_after(300):
        while not predicate():  # noqa: ASYNC110 - no single event covers both sides
            await anyio.sleep(0.05)


# -- over loopback: the agent really probes the check ------------------------------------------


async def test_publish_becomes_active_after_the_agents_check_and_quiesce_deregisters() -> None:
    before = all_tasks()
    async with run_consul_fake() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        cfg = config(
            fake.url,
            registration={"ip": "127.0.0.1", "port": port},
            connection={"monitor_interval_ms": 200, "observation_grace_ms": 5000},
            allow_loopback=True,
            # The fake's own status endpoint stands in for the app's health endpoint.
            health_check_path="/v1/status/leader",
            health_check_interval=0.1,
        )
        instance = f"order-api-127.0.0.1-{port}"
        async with open_discovery(
            cfg,
            listeners=listeners(("127.0.0.1", port)),
            eligibility={"web": Eligibility.always()},
            allow_loopback=True,
            publish_deadline=anyio.current_time() + 10,
        ) as owner:
            # open_discovery returns once the startup-required registration is Active.
            assert state(owner) is RegistrationState.ACTIVE
            service = fake.services[(NODE, instance)]
            assert (service.name, service.address, service.port) == ("order-api", "127.0.0.1", port)
            assert service.tags == ["edge", "v2"]
            assert service.meta["nadisc-cluster"] == "cluster-1" and service.meta["zone"] == "a"
            check = fake.checks[(NODE, f"service:{instance}")]
            assert check.kind == "http" and check.status == "passing"
            assert check.target == f"http://127.0.0.1:{port}/v1/status/leader"
            assert check.deregister_after == 60.0
            # Discovery on the same connection sees the registration.
            observation = await owner.client().observe("self", anyio.current_time() + 5)
            assert observation.snapshot().identities() == (instance,)
        assert (NODE, instance) not in fake.services
        report = owner.close_report
        assert report is not None and report.tasks_left == 0
        (entry,) = report.registrations
        assert getattr(entry, "outcome", None) is CloseOutcome.DEREGISTERED
        assert getattr(entry, "possibly_remaining", None) is False
    assert all_tasks() == before


# -- in process, under MockClock --------------------------------------------------------------


async def test_renewals_reapply_at_the_reregister_interval_not_every_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    times: list[float] = []
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)

        async def record_puts() -> None:
            while True:
                seen = puts(fake)
                await fake.wait_for(partial(more_puts, fake, seen))
                times.append(anyio.current_time())

        nursery.start_soon(record_puts)
        cfg = config(fake.url, reregister_interval=30)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            assert state(owner) is RegistrationState.ACTIVE
            start = anyio.current_time()
            await anyio.sleep(100)
            assert state(owner) is RegistrationState.ACTIVE
            health_reads = [r for r in fake.requests if r.path.startswith("/v1/agent/health/")]
            assert len(health_reads) >= 19  # a check every monitor interval (5 s)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] <= start and 3 <= len(times) <= 5
    assert all(30 <= gap <= 35 + 0.01 for gap in gaps)
    assert all_tasks() == before


async def test_a_reaped_registration_is_reapplied_by_the_lifecycle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake(reap_interval=30.0) as fake:
        # No probes: the HTTP check stays critical, and the agent reaps the
        # service after DeregisterCriticalServiceAfter (60 s).
        cfg = config(fake.url, registration={"startup_required": False})
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            await until(lambda: (NODE, INSTANCE) in fake.services)
            await until(lambda: (NODE, INSTANCE) not in fake.services)
            reaped_at = anyio.current_time()
            assert reaped_at >= 60
            await until(lambda: (NODE, INSTANCE) in fake.services)
            # Seen missing by the next check, re-applied by the renewal after it.
            assert anyio.current_time() - reaped_at <= 2 * 5 + 0.1
            assert (NODE, f"service:{INSTANCE}") in fake.checks
            assert owner.registrations()["web"].write.value == "acked"
    assert all_tasks() == before


async def test_eligibility_is_checked_before_every_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    eligible = [True]
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)
        cfg = config(fake.url)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.from_check(lambda: eligible[0])},
        ) as owner:
            assert state(owner) is RegistrationState.ACTIVE
            eligible[0] = False
            writes = puts(fake)
            await anyio.sleep(70)  # twice the reregister interval
            assert puts(fake) == writes  # nothing written while ineligible
            assert state(owner) is RegistrationState.INELIGIBLE
            eligible[0] = True
            resumed = anyio.current_time()
            await until(lambda: puts(fake) > writes)
            assert anyio.current_time() - resumed <= 5.5
            await until(lambda: state(owner) is RegistrationState.ACTIVE)
        nursery.cancel_scope.cancel()
    assert all_tasks() == before


async def test_an_unknown_first_write_is_never_repeated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.inject(REGISTER, Fault("status", status=500, body=b"rpc error"))
        cfg = config(fake.url, registration={"startup_required": False})
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            await until(lambda: puts(fake) == 1)
            await anyio.sleep(120)
            assert puts(fake) == 1
            assert state(owner) is RegistrationState.OUTCOME_UNKNOWN
        report = owner.close_report
        assert report is not None
        (entry,) = report.registrations
        # Consul removes by service ID alone: the unknown write is removed at
        # close, and the acknowledged removal is RESIDUAL (the lost write may
        # still land), never DEREGISTERED.
        assert any(r.path.startswith("/v1/agent/service/deregister/") for r in fake.requests)
        assert getattr(entry, "outcome", None) is CloseOutcome.RESIDUAL
        assert getattr(entry, "possibly_remaining", None) is True
    assert all_tasks() == before


async def test_a_lost_reapply_answer_ends_residual_and_nothing_is_written_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)
        cfg = config(fake.url)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            writes = puts(fake)
            fake.inject(REGISTER, Fault("status", status=500, body=b"rpc error"))
            await until(lambda: puts(fake) == writes + 1)  # the next re-apply: answer lost
            await until(lambda: owner.registrations()["web"].residual_risk)
        after_close = puts(fake)
        assert (NODE, INSTANCE) not in fake.services
        report = owner.close_report
        assert report is not None
        (entry,) = report.registrations
        assert getattr(entry, "outcome", None) is CloseOutcome.RESIDUAL
        await anyio.sleep(120)
        assert puts(fake) == after_close and (NODE, INSTANCE) not in fake.services
        nursery.cancel_scope.cancel()
    assert all_tasks() == before


async def test_a_failed_deregistration_is_reported_and_never_re_applied(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)
        cfg = config(fake.url)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            fake.inject(
                "/v1/agent/service/deregister/", Fault("status", status=500, body=b"rpc error")
            )
            writes = puts(fake)
        report = owner.close_report
        assert report is not None
        (entry,) = report.registrations
        assert getattr(entry, "outcome", None) is CloseOutcome.UNREACHABLE
        assert getattr(entry, "possibly_remaining", None) is True
        await anyio.sleep(120)
        nursery.cancel_scope.cancel()
    assert puts(fake) == writes
    assert (NODE, INSTANCE) in fake.services  # honestly reported as possibly remaining
    assert all_tasks() == before


async def test_deregistering_a_service_the_agent_already_reaped_is_deregistered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # After DeregisterCriticalServiceAfter the agent no longer holds the ID and
    # answers the deregistration 404 "Unknown service ID": absent is the goal.
    before = all_tasks()
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)
        cfg = config(fake.url)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            assert fake.deregister(INSTANCE)  # reaped behind the owner's back
        report = owner.close_report
        assert report is not None
        (entry,) = report.registrations
        assert getattr(entry, "outcome", None) is CloseOutcome.DEREGISTERED
        assert getattr(entry, "possibly_remaining", None) is False
        answers = [r for r in fake.requests if r.path.startswith("/v1/agent/service/deregister/")]
        assert [r.outcome for r in answers] == ["answered"]  # once, answered 404, not retried
        nursery.cancel_scope.cancel()
    assert all_tasks() == before


async def test_advertised_host_is_used(autojump_clock: trio.testing.MockClock) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        cfg = config(
            fake.url,
            registration={"startup_required": False},
            advertised_host="orders.internal.example",
        )
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ):
            await until(lambda: (NODE, INSTANCE) in fake.services)
            service = fake.services[(NODE, INSTANCE)]
            assert service.address == "orders.internal.example"
            check = fake.checks[(NODE, f"service:{INSTANCE}")]
            assert check.target == "http://orders.internal.example:18080/health"
    assert all_tasks() == before


async def test_loopback_is_advertised_only_with_allow_loopback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        cfg = config(fake.url, registration={"ip": "127.0.0.1"})
        with (
            caplog.at_level(logging.WARNING, logger="nadisc_consul._provider"),
            pytest.raises(RegistrationError, match="RegistrationRejected"),
        ):
            async with open_discovery(
                cfg,
                providers=in_process(cfg, fake),
                listeners=listeners(("127.0.0.1", WEB[1])),
                eligibility={"web": Eligibility.always()},
                allow_loopback=True,  # the owner lets it through; the connection refuses
            ):
                pytest.fail("a loopback address must not be advertised")
        assert puts(fake) == 0  # refused before any write
        assert any("loopback host '127.0.0.1'" in r.getMessage() for r in caplog.records)
        allowed = config(
            fake.url,
            registration={"ip": "127.0.0.1", "startup_required": False},
            allow_loopback=True,
        )
        async with open_discovery(
            allowed,
            providers=in_process(allowed, fake),
            listeners=listeners(("127.0.0.1", WEB[1])),
            eligibility={"web": Eligibility.always()},
            allow_loopback=True,
        ):
            await until(lambda: puts(fake) == 1)
            (service,) = [s for s in fake.services.values() if s.name == "order-api"]
            assert service.address == "127.0.0.1"
    with pytest.raises(ValueError, match="reachable"):
        config("http://127.0.0.1:8500", registration={"ip": "0.0.0.0"})  # wildcard: never
    assert all_tasks() == before


async def test_a_revoked_token_seen_by_discovery_drops_the_registrations_health_evidence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(agent_probes, fake)
        fake.register(
            {
                "Name": "orders",
                "ID": "orders-1",
                "Address": "10.0.0.9",
                "Port": 80,
                "Check": {"CheckID": "o1", "TTL": "1h", "Status": "passing"},
            },
            now=0.0,
        )
        fake.enable_acl()
        fake.add_token("t0ken")
        cfg = config(fake.url, token="t0ken")
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert observation.snapshot().identities() == ("orders-1",)
            assert state(owner) is RegistrationState.ACTIVE
            await anyio.sleep(1)  # between two renewals: only the watch is talking
            writes = puts(fake)
            fake.revoke_token("t0ken")
            epoch = await owner.identity_revoked("primary", after_epoch=0)
            assert epoch == 1 and puts(fake) == writes  # the observation saw it first
            status = owner.registrations()["web"]
            assert status.health is HealthEvidence.REVOKED
            assert status.state is not RegistrationState.ACTIVE
            with pytest.raises(EvidenceUnavailable) as info:
                observation.snapshot()
            assert info.value.reason == "revoked"
        nursery.cancel_scope.cancel()
    assert all_tasks() == before
