"""RegistrationSet driven against MemoryRegistry on trio's MockClock.

Timing used throughout: monitor 5 s, grace 15 s, request 3 s, deregister
3 s, backoff 1 s .. 8 s.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from nadisc import (
    Capabilities,
    CloseOutcome,
    ConnectionPlan,
    DeadlineExceeded,
    Eligibility,
    EvidenceKind,
    HealthEvidence,
    HealthStatus,
    IncompleteSnapshot,
    InvalidSnapshot,
    LeaseLost,
    LifecycleError,
    ObservationSink,
    ProviderSnapshot,
    QualifierError,
    Registered,
    RegistrationError,
    RegistrationRecord,
    RegistrationRejected,
    RegistrationSet,
    RegistrationSpec,
    RegistrationState,
    RegistrationTiming,
    WriteOutcome,
)
from nadisc._memory_registry import Fault, MemoryRegistry

pytestmark = pytest.mark.trio_only

TIMING = RegistrationTiming(
    monitor_interval=5.0,
    observation_grace=15.0,
    deregister_timeout=3.0,
    request_timeout=3.0,
    initial_backoff=1.0,
    max_backoff=8.0,
)
IID = "orders-svc-10.0.0.5-8080"


class RegistryProvider:
    """The smallest provider over a MemoryRegistry (registration half only)."""

    def __init__(self, registry: MemoryRegistry) -> None:
        self.registry = registry

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            evidence=EvidenceKind.REGISTRY_HEALTH,
            registration=True,
            idempotent_renewal=self.registry.idempotent_renewal,
        )

    async def prepare(self, deadline: float) -> None:
        return None

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        return ProviderSnapshot(service, (), EvidenceKind.REGISTRY_HEALTH)

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: trio.TaskStatus[None]
    ) -> None:
        raise NotImplementedError

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        return await self.registry.register(record, deadline)

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        return await self.registry.renew(registered, deadline)

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        return await self.registry.check(registered, deadline)

    async def deregister(self, registered: Registered, deadline: float) -> None:
        await self.registry.deregister(registered, deadline)

    async def aclose(self) -> None:
        return None


def spec(name: str = "web", **changes: object) -> RegistrationSpec:
    values: dict[str, object] = {
        "name": name,
        "service_name": "orders",
        "ip": "10.0.0.5",
        "port": 8080,
        "eligibility": Eligibility.always(),
    }
    values.update(changes)
    return RegistrationSpec(**values)  # type: ignore[arg-type]


def plan(registry: MemoryRegistry, timing: RegistrationTiming = TIMING) -> ConnectionPlan:
    return ConnectionPlan(
        RegistryProvider(registry).capabilities, {"orders": "orders-svc", "pay": "pay"}, timing
    )


class Harness:
    def __init__(self, registrations: RegistrationSet, nursery: trio.Nursery) -> None:
        self.set = registrations
        self.nursery = nursery

    def state(self, name: str = "web") -> RegistrationState:
        return self.set.registrations()[name].state

    async def close(self, budget: float = 10.0) -> None:
        self.set.begin_quiesce(trio.current_time() + budget)
        await self.set.wait_drained()


@asynccontextmanager
async def running(
    registry: MemoryRegistry,
    *specs: RegistrationSpec,
    publish: bool = True,
    others: dict[str, MemoryRegistry] | None = None,
) -> AsyncIterator[Harness]:
    registrations = RegistrationSet(rng=random.Random(3))
    connections = {"primary": plan(registry)}
    providers = {"primary": RegistryProvider(registry)}
    for qualifier, other in (others or {}).items():
        connections[qualifier] = plan(other)
        providers[qualifier] = RegistryProvider(other)
    registrations.freeze(specs or (spec(),), connections)
    async with trio.open_nursery() as nursery:
        harness = Harness(registrations, nursery)
        harness.providers = providers  # type: ignore[attr-defined]
        if publish:
            await registrations.publish(nursery, providers, trio.current_time() + 30)
        try:
            yield harness
        finally:
            if not registrations.quiescing:
                registrations.begin_quiesce(trio.current_time() + 10)
            await registrations.wait_drained()


def assert_backoff_gaps(events: Sequence[Any]) -> list[float]:
    """The gaps between consecutive ``events`` (registry log entries) follow
    the documented retry backoff: the k-th within [cap/2, cap] for a cap of
    2^(k-1) s, at most 8 s (``TIMING``'s max backoff), jitter included."""
    gaps = [b.at - a.at for a, b in itertools.pairwise(events)]
    for attempt, gap in enumerate(gaps, start=1):
        cap = min(8.0, 2.0 ** (attempt - 1))
        assert cap / 2 <= gap <= cap + 1e-9, (attempt, gap)
    return gaps


async def test_happy_path_register_renew_check_deregister(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        # The runner is a child of the nursery we handed over.
        assert len(h.nursery.child_tasks) == 1
        assert h.state() is RegistrationState.ACTIVE
        assert h.set.ready()
        stored = registry.get(IID)
        assert stored is not None and stored.record.service == "orders-svc"
        await trio.sleep(16)
        assert registry.get(IID).renewals == 3  # type: ignore[union-attr]
        assert h.state() is RegistrationState.ACTIVE
        status = h.set.registrations()["web"]
        assert status.write is WriteOutcome.ACKED and status.epoch == 0
        assert status.health is HealthEvidence.HEALTHY
        await h.close()
        assert len(h.nursery.child_tasks) == 0
    assert registry.get(IID) is None
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED
    assert entry.state is RegistrationState.DEREGISTERED
    assert not entry.possibly_remaining and not entry.permanent


async def test_first_write_with_lost_ack_is_never_rewritten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.lose_ack())
    async with running(registry, publish=False) as h:
        with pytest.raises(RegistrationError, match="'web'"):
            await h.set.publish(h.nursery, h.providers, trio.current_time() + 30)  # type: ignore[attr-defined]
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        await trio.sleep(60)
        assert registry.operations("register") == [("register", "OutcomeUnknown(applied)")]
        assert registry.operations("renew") == []
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        assert h.set.registrations()["web"].residual_risk
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN and entry.possibly_remaining
    # The record did land remotely: exactly why it is reported, not papered over.
    assert registry.get(IID) is not None


async def test_timed_out_write_lands_later(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.slow(10.0))  # longer than request_timeout
    spec_ = spec(startup_required=False)
    async with running(registry, spec_) as h:
        await trio.sleep(4)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        assert registry.get(IID) is None
        await trio.sleep(7)
        assert registry.get(IID) is not None  # it landed after all
        await trio.sleep(30)
        # The registry's own bound answered first (the lifecycle's scope is
        # the backstop): one write, its outcome unknown, never repeated.
        assert [o for _, o in registry.operations("register")] == ["OutcomeUnknown"]
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN


async def test_held_write_lands_on_trigger(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.land_later())
    async with running(registry, spec(startup_required=False)) as h:
        await trio.sleep(1)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        assert registry.held_writes() == 1
        assert registry.land_held() == 1
        assert registry.get(IID) is not None
        await trio.sleep(20)
        assert len(registry.operations("register")) == 1


async def test_lost_renewal_is_retried_with_backoff_for_idempotent_providers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(idempotent_renewal=True)
    async with running(registry) as h:
        registry.inject("renew", Fault.drop(), Fault.drop(), Fault.drop())
        t0 = trio.current_time()
        await trio.sleep(5.5)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        # Three lost answers, then success: retries spaced by the jittered caps.
        while h.state() is not RegistrationState.ACTIVE:
            await h.set.wait_changed()
        renewals = [e for e in registry.log if e.operation == "renew"]
        assert [e.outcome for e in renewals] == [
            "OutcomeUnknown(dropped)",
            "OutcomeUnknown(dropped)",
            "OutcomeUnknown(dropped)",
            "ok",
        ]
        assert_backoff_gaps(renewals)
        # Active again only after a check that started after the recovery.
        checks = [e for e in registry.log if e.operation == "check" and e.at >= renewals[-1].at]
        assert checks and checks[0].outcome == "healthy"
        assert trio.current_time() - t0 < 15
        status = h.set.registrations()["web"]
        assert status.residual_risk
        await h.close()
    (entry,) = h.set.report()
    # Deregistration was acknowledged, but a lost renewal may still land.
    assert entry.outcome is CloseOutcome.RESIDUAL
    assert entry.state is RegistrationState.RESIDUAL


async def test_renewal_retry_rechecks_eligibility(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry(idempotent_renewal=True)
    controller, eligibility = Eligibility.channel()
    controller.update(True, 30.0)
    async with running(registry, spec(eligibility=eligibility)) as h:
        registry.inject("renew", Fault.drop())
        controller.update(True, 5.5)
        await trio.sleep(5.2)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        count = len(registry.operations("renew"))
        await trio.sleep(20)  # eligibility lapsed: no retry is submitted
        assert len(registry.operations("renew")) == count
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        controller.update(True, 30.0)
        await trio.sleep(2)
        assert len(registry.operations("renew")) == count + 1
        assert h.state() is RegistrationState.ACTIVE


async def test_lost_renewal_without_idempotence_stays_blocked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(idempotent_renewal=False)
    async with running(registry) as h:
        registry.inject("renew", Fault.lose_ack())
        await trio.sleep(5.5)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        await trio.sleep(60)
        assert len(registry.operations("renew")) == 1
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        assert not h.set.ready(trio.current_time()) or not any(
            s.readiness_critical for s in h.set.registrations().values()
        )
        await h.close()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


async def test_late_write_after_deregistration_is_reported_residual(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(idempotent_renewal=False)
    async with running(registry) as h:
        registry.inject("renew", Fault.land_later(20.0))
        await trio.sleep(5.5)
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        await h.close()
        assert registry.get(IID) is None  # removed, acknowledged ...
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.RESIDUAL
    await trio.sleep(30)
    assert registry.get(IID) is not None  # ... and yet the late heartbeat re-created it


async def test_lease_lost_reregisters_under_a_new_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        old = registry.get(IID)
        assert old is not None
        registry.expire(IID)
        await trio.sleep(5.5)
        assert h.state() is RegistrationState.ACTIVE
        new = registry.get(IID)
        assert new is not None and new.handle != old.handle
        outcomes = registry.operations("renew")
        assert ("renew", "LeaseLost") in outcomes
        assert len(registry.operations("register")) == 2
        assert h.set.registrations()["web"].last_error is None


async def test_lease_ttl_lapses_when_ineligible(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry(lease_ttl=12.0)
    controller, eligibility = Eligibility.channel()
    controller.update(True, 30.0)
    async with running(registry, spec(eligibility=eligibility, readiness_critical=True)) as h:
        assert h.set.ready()
        renewals = len(registry.operations("renew"))
        controller.update(False, 1.0)
        assert h.state() is RegistrationState.INELIGIBLE  # at once
        assert not h.set.ready()
        await trio.sleep(20)
        # No renewal (health publication) was sent: the lease lapsed remotely.
        assert len(registry.operations("renew")) == renewals
        assert registry.get(IID) is None


async def test_transient_check_failures_keep_but_never_extend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        until = h.set.registrations()["web"].healthy_until
        assert until is not None
        t0 = trio.current_time()
        registry.inject("check", *(Fault.fail(IncompleteSnapshot("flaky")) for _ in range(5)))
        await trio.sleep(11)
        status = h.set.registrations()["web"]
        assert status.health is HealthEvidence.TRANSIENT_FAILURE
        assert status.healthy_until == until  # kept, not extended
        assert status.state is RegistrationState.ACTIVE
        await trio.sleep(until - trio.current_time())
        assert h.state() is RegistrationState.DEGRADED
        assert trio.current_time() - t0 < 16
        await trio.sleep(20)  # faults used up: healthy again
        assert h.state() is RegistrationState.ACTIVE


async def test_negative_health_removes_eligibility_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.script_health(
            IID, HealthStatus.UNHEALTHY, HealthStatus.HEALTHY, HealthStatus.DISABLED
        )
        await trio.sleep(5.1)
        assert h.state() is RegistrationState.DEGRADED
        assert h.set.registrations()["web"].health is HealthEvidence.UNHEALTHY
        await trio.sleep(5)
        assert h.state() is RegistrationState.ACTIVE
        await trio.sleep(5)
        assert h.set.registrations()["web"].health is HealthEvidence.DISABLED
        assert h.state() is RegistrationState.DEGRADED


async def test_revocation_is_per_connection_and_waitable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    other = MemoryRegistry()
    specs = (spec("web"), spec("pay", qualifier="secondary", service_name="pay"))
    async with running(registry, *specs, others={"secondary": other}) as h:
        epochs: list[int] = []

        async def host() -> None:
            epochs.append(await h.set.identity_revoked("primary"))

        h.nursery.start_soon(host)
        await trio.sleep(0.5)
        assert h.set.revoke_identity("primary") == 1
        # Synchronously: evidence cancelled on this connection only.
        statuses = h.set.registrations()
        assert statuses["web"].state is RegistrationState.DEGRADED
        assert statuses["web"].health is HealthEvidence.REVOKED
        assert statuses["web"].epoch == 1
        assert statuses["pay"].state is RegistrationState.ACTIVE  # untouched
        assert statuses["pay"].epoch == 0
        await trio.sleep(0.01)
        assert epochs == [1]
        # Recovery needs a new valid check under the new epoch (the runner is
        # woken at once).
        await trio.sleep(0.1)
        assert h.state("web") is RegistrationState.ACTIVE
        # A revocation that already happened is reported at once.
        assert await h.set.identity_revoked("primary", after_epoch=0) == 1


async def test_check_started_before_revocation_cannot_extend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.inject("check", Fault.slow(2.0))
        await trio.sleep(5.5)  # the slow check is in flight (started at ~5)
        h.set.revoke_identity("primary")
        await trio.sleep(1.0)  # it answers HEALTHY now, under the old epoch
        status = h.set.registrations()["web"]
        assert status.health is HealthEvidence.REVOKED
        assert status.state is RegistrationState.DEGRADED
        await trio.sleep(5)
        assert h.state() is RegistrationState.ACTIVE


async def test_registry_side_revocation_notifies_host(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.revoke_identity()
        epoch = await h.set.identity_revoked("primary")
        assert epoch >= 1
        assert h.state() is RegistrationState.DEGRADED
        registry.restore_identity()
        await trio.sleep(6)
        assert h.state() is RegistrationState.ACTIVE


async def test_publish_waits_for_eligibility(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    controller, eligibility = Eligibility.channel()
    async with running(registry, spec(eligibility=eligibility), publish=False) as h:

        async def grant() -> None:
            await trio.sleep(2)
            controller.update(True, 30.0)

        h.nursery.start_soon(grant)
        t0 = trio.current_time()
        await h.set.publish(h.nursery, h.providers, t0 + 10)  # type: ignore[attr-defined]
        assert 2 <= trio.current_time() - t0 < 3
        assert h.state() is RegistrationState.ACTIVE
        controller.close()
        assert h.state() is RegistrationState.INELIGIBLE


async def test_publish_deadline_names_pending_and_writes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    _controller, never = Eligibility.channel()
    specs = (spec("web", eligibility=never), spec("aux", port=8081, startup_required=False))
    async with running(registry, *specs, publish=False) as h:
        with pytest.raises(DeadlineExceeded, match="'web'"):
            await h.set.publish(h.nursery, h.providers, trio.current_time() + 5)  # type: ignore[attr-defined]
        assert h.state("web") is RegistrationState.PENDING
        assert registry.instance_ids() == ("orders-svc-10.0.0.5-8081",)
    report = {e.name: e for e in h.set.report()}
    assert report["web"].outcome is CloseOutcome.NOT_REGISTERED
    assert report["aux"].outcome is CloseOutcome.DEREGISTERED


async def test_rejection_fails_publish(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.fail(RegistrationRejected("bad name")))
    async with running(registry, publish=False) as h:
        with pytest.raises(RegistrationError, match="failed"):
            await h.set.publish(h.nursery, h.providers, trio.current_time() + 10)  # type: ignore[attr-defined]
        assert h.state() is RegistrationState.FAILED
        assert h.set.registrations()["web"].last_error == "RegistrationRejected"
    (entry,) = h.set.report()
    assert (
        entry.outcome is CloseOutcome.NOT_REGISTERED or entry.outcome is CloseOutcome.DEREGISTERED
    )


async def test_definite_register_failure_is_retried_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.fail(IncompleteSnapshot("connection refused")))
    async with running(registry) as h:
        assert h.state() is RegistrationState.ACTIVE
        assert [o for _, o in registry.operations("register")] == ["IncompleteSnapshot", "ok"]
        gap = registry.log[1].at - registry.log[0].at
        assert 0.5 <= gap <= 1.0


async def test_deregistration_timeout_is_unreachable_and_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry, spec(ephemeral=False)) as h:
        registry.inject("deregister", Fault.slow(60.0))
        t0 = trio.current_time()
        h.set.begin_quiesce(t0 + 30)
        await trio.sleep(1)
        assert h.state() is RegistrationState.DEREGISTERING
        await h.set.wait_drained()
        assert trio.current_time() - t0 <= TIMING.deregister_timeout + 1e-6
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.UNREACHABLE
    assert entry.state is RegistrationState.OUTCOME_UNKNOWN
    assert entry.possibly_remaining and entry.permanent


async def test_cleanup_survives_outer_cancellation(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registrations = RegistrationSet()
    registrations.freeze([spec()], {"primary": plan(registry)})
    providers = {"primary": RegistryProvider(registry)}
    async with trio.open_nursery() as nursery:
        await registrations.publish(nursery, providers, trio.current_time() + 10)
        registry.inject("deregister", Fault.slow(1.0))
        nursery.cancel_scope.cancel()  # no quiesce: the owner's group is torn down
    assert registry.get(IID) is None
    (entry,) = registrations.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED


async def test_write_in_flight_at_quiesce_finishes_and_is_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.slow(2.0))
    async with running(registry, spec(startup_required=False)) as h:
        await trio.sleep(1)
        assert h.state() is RegistrationState.REGISTERING
        await h.close()
        assert registry.operations("register") == [("register", "ok")]
    assert registry.get(IID) is None
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED


async def test_quiesce_deadline_shortens_a_write_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.slow(2.5))
    async with running(registry, spec(startup_required=False)) as h:
        await trio.sleep(1)
        t0 = trio.current_time()
        await h.close(budget=0.5)
        assert trio.current_time() - t0 <= 0.5 + 1e-6
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN


async def test_lifecycle_errors(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registrations = RegistrationSet()
    providers = {"primary": RegistryProvider(registry)}
    async with trio.open_nursery() as nursery:
        with pytest.raises(LifecycleError, match="before freeze"):
            await registrations.publish(nursery, providers, trio.current_time() + 5)
        registrations.freeze([spec()], {"primary": plan(registry)})
        with pytest.raises(LifecycleError, match="already frozen"):
            registrations.freeze([spec()], {"primary": plan(registry)})
        with pytest.raises(QualifierError):
            await registrations.publish(nursery, {}, trio.current_time() + 5)
        with pytest.raises(DeadlineExceeded):
            await registrations.publish(nursery, providers, trio.current_time() - 1)
        with pytest.raises(DeadlineExceeded):
            await registrations.publish(nursery, providers, float("nan"))
        assert registry.log == []  # nothing was written by any refused call
        await registrations.publish(nursery, providers, trio.current_time() + 5)
        with pytest.raises(LifecycleError, match="already published"):
            await registrations.publish(nursery, providers, trio.current_time() + 5)
        registrations.begin_quiesce(trio.current_time() + 5)
        registrations.begin_quiesce(trio.current_time() + 50)  # idempotent
        await registrations.wait_drained()
    assert registrations.report()[0].outcome is CloseOutcome.DEREGISTERED


async def test_quiesce_before_publish_retires_everything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registrations = RegistrationSet()
    registrations.freeze([spec()], {"primary": plan(registry)})
    registrations.begin_quiesce(trio.current_time() + 5)
    await registrations.wait_drained()
    (entry,) = registrations.report()
    assert entry.outcome is CloseOutcome.NOT_REGISTERED and not entry.possibly_remaining
    async with trio.open_nursery() as nursery:
        with pytest.raises(LifecycleError, match="quiescing"):
            await registrations.publish(
                nursery, {"primary": RegistryProvider(registry)}, trio.current_time() + 5
            )


async def test_views_are_immutable_and_secret_free(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    async with running(registry, spec(metadata={"token": "s3cret"})) as h:
        statuses = h.set.registrations()
        with pytest.raises(TypeError):
            statuses["x"] = statuses["web"]  # type: ignore[index]
        with pytest.raises(AttributeError):
            statuses["web"].state = RegistrationState.FAILED  # type: ignore[misc]
        assert "s3cret" not in repr(statuses) + repr(h.set) + repr(h.set.report())
        assert "active=1" in repr(h.set)


def test_runs_on_asyncio_too() -> None:
    import anyio

    async def main() -> tuple[RegistrationState, CloseOutcome]:
        registry = MemoryRegistry()
        timing = RegistrationTiming(
            monitor_interval=0.02,
            observation_grace=0.5,
            request_timeout=0.2,
            deregister_timeout=0.2,
        )
        registrations = RegistrationSet()
        registrations.freeze([spec()], {"primary": plan(registry, timing)})
        async with anyio.create_task_group() as tg:
            await registrations.publish(
                tg, {"primary": RegistryProvider(registry)}, anyio.current_time() + 5
            )
            await anyio.sleep(0.05)
            state = registrations.registrations()["web"].state
            registrations.begin_quiesce(anyio.current_time() + 2)
            await registrations.wait_drained()
        return state, registrations.report()[0].outcome

    state, outcome = anyio.run(main, backend="asyncio")
    assert state is RegistrationState.ACTIVE
    assert outcome is CloseOutcome.DEREGISTERED


async def test_lost_lease_not_yet_replaced_closes_clean(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.expire(IID)
        registry.inject("register", *(Fault.fail(IncompleteSnapshot("refused")) for _ in range(9)))
        await trio.sleep(6)
        status = h.set.registrations()["web"]
        assert status.state is RegistrationState.DEGRADED
        assert status.write is WriteOutcome.LOST
        await h.close()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED and not entry.possibly_remaining
    assert registry.get(IID) is None


async def test_quiesce_while_publishing_ends_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    _controller, never = Eligibility.channel()
    async with running(registry, spec(eligibility=never), publish=False) as h:

        async def shutdown() -> None:
            await trio.sleep(1)
            h.set.begin_quiesce(trio.current_time() + 5)

        h.nursery.start_soon(shutdown)
        t0 = trio.current_time()
        with pytest.raises(LifecycleError, match="quiesce"):
            await h.set.publish(h.nursery, h.providers, t0 + 60)  # type: ignore[attr-defined]
        assert trio.current_time() - t0 == pytest.approx(1.0)


async def test_lasting_registry_revocation_notifies_once_and_does_not_spin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.revoke_identity()
        await trio.sleep(30)
        assert h.set.epoch("primary") == 1  # one revocation, seen many times
        assert h.state() is RegistrationState.DEGRADED
        # One renewal and at most two checks per monitor interval.
        assert len(registry.operations()) <= 3 + 3 * (30 // 5 + 1)
        registry.restore_identity()
        await trio.sleep(5)
        assert h.state() is RegistrationState.ACTIVE
        assert h.set.epoch("primary") == 1
        registry.revoke_identity()  # a new revocation after recovery is a new epoch
        await trio.sleep(5)
        assert h.set.epoch("primary") == 2


async def test_regained_eligibility_is_not_active_before_renewals_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(lease_ttl=12.0)
    up = [True]
    async with running(registry, spec(eligibility=Eligibility.from_check(lambda: up[0]))) as h:
        await trio.sleep(0.1)
        up[0] = False
        await trio.sleep(11.7)
        renewals = len(registry.operations("renew")) + len(registry.operations("register"))
        up[0] = True
        assert h.state() is not RegistrationState.ACTIVE
        # Polled: a lapsed lease is a time-derived fact no event announces.
        while h.state() is not RegistrationState.ACTIVE:  # noqa: ASYNC110
            await trio.sleep(0.05)
        assert registry.get(IID) is not None  # Active only with a live record
        assert len(registry.operations("renew")) + len(registry.operations("register")) > renewals
        assert trio.current_time() < 11.8 + 1.0  # a check-based grant is polled, not 5 s later


async def test_invalid_evidence_removes_eligibility_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.inject("check", Fault.fail(InvalidSnapshot("garbled")))
        await trio.sleep(5.1)
        status = h.set.registrations()["web"]
        assert status.health is HealthEvidence.INVALID and status.healthy_until is None
        assert status.state is RegistrationState.DEGRADED


async def test_quiesce_deadline_bounds_a_slow_deregistration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.inject("deregister", Fault.slow(60.0))
        t0 = trio.current_time()
        h.set.begin_quiesce(t0 + 0.5)  # shorter than deregister_timeout (3 s)
        await h.set.wait_drained()
        assert trio.current_time() - t0 == pytest.approx(0.5)
        assert TIMING.deregister_timeout > 0.5
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.UNREACHABLE


class _AfterSend(RegistryProvider):
    """Sends each write to the registry, then raises DeadlineExceeded once per
    operation named in ``fail`` (the answer missed the caller's deadline)."""

    def __init__(self, registry: MemoryRegistry, *fail: str) -> None:
        super().__init__(registry)
        self.fail = set(fail)

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        result = await self.registry.register(record, deadline)
        if "register" in self.fail:
            self.fail.discard("register")
            raise DeadlineExceeded("register: the answer came too late")
        return result

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        result = await self.registry.renew(registered, deadline)
        if "renew" in self.fail:
            self.fail.discard("renew")
            raise DeadlineExceeded("renew: the answer came too late")
        return result


async def test_register_deadline_after_sending_is_outcome_unknown_and_never_rewritten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registrations = RegistrationSet(rng=random.Random(3))
    registrations.freeze([spec()], {"primary": plan(registry)})
    async with trio.open_nursery() as nursery:
        provider = _AfterSend(registry, "register")
        with pytest.raises(RegistrationError, match="outcome_unknown"):
            await registrations.publish(nursery, {"primary": provider}, trio.current_time() + 30)
        status = registrations.registrations()["web"]
        assert status.state is RegistrationState.OUTCOME_UNKNOWN
        assert status.residual_risk and status.last_error == "DeadlineExceeded"
        await trio.sleep(60)
        assert registry.operations("register") == [("register", "ok")]  # sent once
        assert registry.operations("renew") == []
        assert registry.get(IID) is not None  # it did land
        registrations.begin_quiesce(trio.current_time() + 5)
    (entry,) = registrations.report()
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN and entry.possibly_remaining


async def test_renew_deadline_after_sending_is_outcome_unknown_without_a_second_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(idempotent_renewal=False)
    registrations = RegistrationSet(rng=random.Random(3))
    registrations.freeze([spec()], {"primary": plan(registry)})
    async with trio.open_nursery() as nursery:
        provider = _AfterSend(registry, "renew")
        await registrations.publish(nursery, {"primary": provider}, trio.current_time() + 30)
        await trio.sleep(5.5)
        status = registrations.registrations()["web"]
        assert status.state is RegistrationState.OUTCOME_UNKNOWN
        assert status.residual_risk and status.last_error == "DeadlineExceeded"
        await trio.sleep(60)
        # No repeat (not idempotent) and no re-registration.
        assert len(registry.operations("renew")) == 1
        assert len(registry.operations("register")) == 1
        registrations.begin_quiesce(trio.current_time() + 5)
    (entry,) = registrations.report()
    assert entry.outcome is CloseOutcome.RESIDUAL


class _OddCheck(RegistryProvider):
    """Answers health checks with ``answer`` (a value or an exception)."""

    def __init__(self, registry: MemoryRegistry) -> None:
        super().__init__(registry)
        self.answer: object = None

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        if self.answer is None:
            return await self.registry.check(registered, deadline)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("answer", "health"),
    [
        ("healthy", HealthEvidence.INVALID),  # not a HealthStatus: invalid evidence
        (LeaseLost("gone"), HealthEvidence.MISSING),
    ],
)
async def test_odd_check_answers_remove_evidence_at_once(
    autojump_clock: trio.testing.MockClock, answer: object, health: HealthEvidence
) -> None:
    registry = MemoryRegistry()
    registrations = RegistrationSet(rng=random.Random(3))
    registrations.freeze([spec()], {"primary": plan(registry)})
    async with trio.open_nursery() as nursery:
        provider = _OddCheck(registry)
        await registrations.publish(nursery, {"primary": provider}, trio.current_time() + 30)
        provider.answer = answer
        await trio.sleep(5.1)
        status = registrations.registrations()["web"]
        assert status.health is health and status.healthy_until is None
        assert status.state is RegistrationState.DEGRADED
        registrations.begin_quiesce(trio.current_time() + 5)


async def test_checks_continue_while_ineligible(autojump_clock: trio.testing.MockClock) -> None:
    controller, eligibility = Eligibility.channel()
    controller.update(True, 30.0)
    registry = MemoryRegistry()
    async with running(registry, spec(eligibility=eligibility)) as h:
        controller.update(False, 1.0)
        checks = len(registry.operations("check"))
        registry.set_health(IID, HealthStatus.UNHEALTHY)
        await trio.sleep(12)
        # The renewal is withheld but the evidence keeps being read.
        assert len(registry.operations("check")) > checks
        status = h.set.registrations()["web"]
        assert status.health is HealthEvidence.UNHEALTHY
        assert status.state is RegistrationState.INELIGIBLE
        controller.close()
