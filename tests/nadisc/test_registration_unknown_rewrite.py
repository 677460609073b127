"""Lost answers the runtime may repeat or remove, and the ones it must not.

RegistrationSet driven against MemoryRegistry on trio's MockClock, with a
provider that declares the registry's capabilities: ``idempotent_register``
(a register is an upsert by identity, as in Consul and Nacos),
``deregister_without_handle`` (a removal is addressed by the record alone)
and renewals that cannot create a record (a TTL pass, a light beat).

Timing: monitor 5 s, grace 15 s, request 3 s, deregister 3 s, backoff 1 s .. 8 s.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import trio
import trio.testing

from nadisc import (
    Capabilities,
    CloseOutcome,
    ConnectionPlan,
    Eligibility,
    EvidenceKind,
    IncompleteSnapshot,
    Registered,
    RegistrationError,
    RegistrationSet,
    RegistrationSpec,
    RegistrationState,
    RegistrationTiming,
    WriteOutcome,
)
from nadisc._memory_registry import Fault, MemoryRegistry
from tests.nadisc.test_registration_runtime import (
    IID,
    TIMING,
    RegistryProvider,
    assert_backoff_gaps,
)

# Tests taking ``autojump_clock`` run on trio only (tests/conftest.py marks
# them); the last one runs on both loops in real (short) time.


class UpsertProvider(RegistryProvider):
    """:class:`RegistryProvider` declaring all of the registry's capabilities."""

    def __init__(self, registry: MemoryRegistry, *, renew_within: float | None = None) -> None:
        super().__init__(registry)
        self.renew_within = renew_within
        #: Handles the removals were addressed with, in order.
        self.removed_with: list[str] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            evidence=EvidenceKind.REGISTRY_HEALTH,
            registration=True,
            idempotent_renewal=self.registry.idempotent_renewal,
            idempotent_register=self.registry.idempotent_register,
            deregister_without_handle=self.registry.deregister_without_handle,
            renew_within=self.renew_within,
        )

    async def deregister(self, registered: Registered, deadline: float) -> None:
        self.removed_with.append(registered.handle)
        await super().deregister(registered, deadline)


def spec(**changes: object) -> RegistrationSpec:
    values: dict[str, object] = {
        "name": "web",
        "service_name": "orders",
        "ip": "10.0.0.5",
        "port": 8080,
        "eligibility": Eligibility.always(),
    }
    values.update(changes)
    return RegistrationSpec(**values)  # type: ignore[arg-type]


class Harness:
    def __init__(
        self, registrations: RegistrationSet, nursery: trio.Nursery, provider: UpsertProvider
    ) -> None:
        self.set = registrations
        self.nursery = nursery
        self.provider = provider

    def state(self) -> RegistrationState:
        return self.set.registrations()["web"].state

    async def until(self, state: RegistrationState, limit: float = 120.0) -> float:
        """Wait until the registration is in ``state``; returns the time."""
        with trio.fail_after(limit):
            while self.state() is not state:
                await self.set.wait_changed()
        return trio.current_time()

    async def close(self, budget: float = 10.0) -> None:
        self.set.begin_quiesce(trio.current_time() + budget)
        await self.set.wait_drained()


@asynccontextmanager
async def running(
    registry: MemoryRegistry,
    registration: RegistrationSpec | None = None,
    *,
    publish: bool = True,
    timing: RegistrationTiming = TIMING,
    renew_within: float | None = None,
) -> AsyncIterator[Harness]:
    provider = UpsertProvider(registry, renew_within=renew_within)
    registrations = RegistrationSet(rng=random.Random(3))
    registrations.freeze(
        (registration or spec(),),
        {"primary": ConnectionPlan(provider.capabilities, {"orders": "orders-svc"}, timing)},
    )
    async with trio.open_nursery() as nursery:
        harness = Harness(registrations, nursery, provider)
        if publish:
            await registrations.publish(nursery, {"primary": provider}, trio.current_time() + 30)
        try:
            yield harness
        finally:
            if not registrations.quiescing:
                registrations.begin_quiesce(trio.current_time() + 10)
            await registrations.wait_drained()


def upsert_registry(**options: bool) -> MemoryRegistry:
    values = {"idempotent_register": True, "deregister_without_handle": True}
    values.update(options)
    return MemoryRegistry(**values)


# ------------------------------------------------- bug 1: re-registration after lease loss


@pytest.mark.parametrize("fault", [Fault.drop(), Fault.lose_ack(), Fault.slow(10.0)])
async def test_lost_reregistration_after_lease_loss_is_repeated(
    autojump_clock: trio.testing.MockClock, fault: Fault
) -> None:
    registry = upsert_registry()
    async with running(registry) as h:
        registry.expire(IID)  # a registry restart: the lease is gone
        registry.inject("register", fault)  # ... and the re-registration's answer is lost
        lost_at = await h.until(RegistrationState.OUTCOME_UNKNOWN)
        status = h.set.registrations()["web"]
        assert status.write is WriteOutcome.UNKNOWN and status.residual_risk
        back = await h.until(RegistrationState.ACTIVE)
        registers = [e for e in registry.log if e.operation == "register"]
        assert len(registers) == 3  # the first one, the lost one, its repeat
        assert registers[-1].outcome == "ok"
        # The repeat came after a bounded backoff (attempt 1: 0.5 .. 1 s),
        # with the same record: one instance, under its identity.
        assert 0.5 <= registers[-1].at - lost_at <= 1.0 + 1e-9
        assert registry.instance_ids() == (IID,)
        # Active only after a HEALTHY check started after that acknowledgement.
        checks = [e for e in registry.log if e.operation == "check" and e.at >= registers[-1].at]
        assert checks and checks[0].outcome == "healthy" and checks[0].at <= back
        status = h.set.registrations()["web"]
        assert status.residual_risk and status.last_error is None
        await h.close()
    (entry,) = h.set.report()
    # The lost write may still land: an acknowledged removal is Residual.
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


async def test_repeats_back_off_and_a_repeat_that_never_left_keeps_the_outcome_unknown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    async with running(registry) as h:
        registry.expire(IID)
        registry.inject(
            "register",
            Fault.drop(),
            Fault.fail(IncompleteSnapshot("connection refused")),  # never sent
            Fault.drop(),
        )
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        writes: list[WriteOutcome] = []
        with trio.fail_after(120):
            while h.state() is not RegistrationState.ACTIVE:
                await h.set.wait_changed()
                writes.append(h.set.registrations()["web"].write)
        # A repeat that did not apply does not make the earlier loss definite:
        # the write record never went back to "lost" (nor to re-registering
        # from there), only between unknown, pending and, at last, acked.
        assert WriteOutcome.LOST not in writes
        assert set(writes) <= {WriteOutcome.UNKNOWN, WriteOutcome.PENDING, WriteOutcome.ACKED}
        registers = [e for e in registry.log if e.operation == "register"][1:]
        assert [e.outcome for e in registers] == [
            "OutcomeUnknown(dropped)",
            "IncompleteSnapshot",
            "OutcomeUnknown(dropped)",
            "ok",
        ]
        assert_backoff_gaps(registers)


async def test_a_late_landing_of_the_lost_reregistration_changes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    async with running(registry) as h:
        registry.expire(IID)
        registry.inject("register", Fault.land_later(4.0))
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        await h.until(RegistrationState.ACTIVE)
        await trio.sleep(20)  # the lost write landed meanwhile: the same record
        assert registry.instance_ids() == (IID,)
        assert h.state() is RegistrationState.ACTIVE
        assert ("renew", "LeaseLost") not in registry.operations("renew")[1:]


async def test_repeats_recheck_eligibility(autojump_clock: trio.testing.MockClock) -> None:
    registry = upsert_registry()
    controller, eligibility = Eligibility.channel()
    controller.update(True, 30.0)
    async with running(registry, spec(eligibility=eligibility)) as h:
        registry.expire(IID)
        registry.inject("register", Fault.drop())
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        controller.update(False, 30.0)
        count = len(registry.operations("register"))
        await trio.sleep(30)  # ineligible: the repeat is not submitted
        assert len(registry.operations("register")) == count
        assert h.state() is RegistrationState.OUTCOME_UNKNOWN
        controller.update(True, 30.0)
        await h.until(RegistrationState.ACTIVE, limit=5)
        assert len(registry.operations("register")) == count + 1


async def test_lost_reregistration_without_the_capability_blocks_and_warns(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    registry = MemoryRegistry()  # a new lease per registration (etcd-like)
    with caplog.at_level(logging.WARNING, logger="nadisc._registration"):
        async with running(registry) as h:
            registry.expire(IID)
            registry.inject("register", Fault.drop())
            await h.until(RegistrationState.OUTCOME_UNKNOWN)
            await trio.sleep(120)
            assert len(registry.operations("register")) == 2
            assert h.state() is RegistrationState.OUTCOME_UNKNOWN
    blocked = [r for r in caplog.records if "blocked" in r.getMessage()]
    assert len(blocked) == 1
    assert blocked[0].levelno == logging.WARNING
    assert "'web'" in blocked[0].getMessage() and "'primary'" in blocked[0].getMessage()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN and entry.possibly_remaining


async def test_first_registration_with_unknown_outcome_is_never_repeated(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Even where a register is an upsert: the seed keeps first writes blocked.
    registry = upsert_registry(deregister_without_handle=False)
    registry.inject("register", Fault.drop())
    with caplog.at_level(logging.WARNING, logger="nadisc._registration"):
        async with running(registry, spec(startup_required=False)) as h:
            await h.until(RegistrationState.OUTCOME_UNKNOWN)
            await trio.sleep(120)
            assert len(registry.operations("register")) == 1
    assert any("'web'" in r.getMessage() and "blocked" in r.getMessage() for r in caplog.records)
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN


async def test_startup_fails_at_once_for_an_unknown_first_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    registry.inject("register", Fault.lose_ack())
    async with running(registry, publish=False) as h:
        with pytest.raises(RegistrationError, match="'web'"):
            await h.set.publish(h.nursery, {"primary": h.provider}, trio.current_time() + 30)
    # ... and the write that did land was removed at close (bug 2, below).
    assert registry.instance_ids() == ()


# ------------------------------------------------- bug 2: removing an unknown first write


async def test_unknown_first_write_is_removed_by_record_at_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    registry.inject("register", Fault.lose_ack())  # it landed, the answer was lost
    async with running(registry, spec(startup_required=False)) as h:
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        assert registry.instance_ids() == (IID,)
        await h.close()
    assert registry.instance_ids() == ()
    assert h.provider.removed_with == [""]  # no handle: addressed by the record
    (entry,) = h.set.report()
    # Removal acknowledged, but the lost write may still be on its way.
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining
    assert entry.state is RegistrationState.RESIDUAL


async def test_unknown_first_write_whose_removal_fails_stays_unknown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    registry.inject("register", Fault.lose_ack())
    registry.inject("deregister", Fault.fail(IncompleteSnapshot("connection refused")))
    async with running(registry, spec(startup_required=False)) as h:
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        await h.close()
    (entry,) = h.set.report()
    assert entry.state is RegistrationState.OUTCOME_UNKNOWN
    # A removal was addressed and failed: the table's "unreachable".
    assert entry.outcome is CloseOutcome.UNREACHABLE and entry.possibly_remaining
    assert entry.last_error == "IncompleteSnapshot"
    assert registry.instance_ids() == (IID,)


async def test_unknown_first_write_is_left_alone_without_the_capability(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry(deregister_without_handle=False)
    registry.inject("register", Fault.lose_ack())
    async with running(registry, spec(startup_required=False)) as h:
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        await h.close()
    assert registry.operations("deregister") == []
    (entry,) = h.set.report()
    # No removal could be addressed to it: the table's "outcome unknown".
    assert entry.outcome is CloseOutcome.OUTCOME_UNKNOWN and entry.possibly_remaining


async def test_lost_reregistration_still_unknown_at_close_is_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = upsert_registry()
    async with running(registry) as h:
        registry.expire(IID)
        registry.inject("register", Fault.lose_ack(), *[Fault.drop()] * 10)
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        assert registry.instance_ids() == (IID,)  # the lost write landed
        await h.close()
    assert registry.instance_ids() == ()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.RESIDUAL


# ------------------------------------------------- bug 3b: renewals that cannot create


async def test_lost_refresh_renewal_leaves_no_residual_risk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(renewal_creates=False)
    async with running(registry) as h:
        registry.inject("renew", Fault.drop(), Fault.land_later(30.0))
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        status = h.set.registrations()["web"]
        assert status.last_error == "RenewalOutcomeUnknown" and not status.residual_risk
        recovered = await h.until(RegistrationState.ACTIVE)
        renewals = [e for e in registry.log if e.operation == "renew"]
        checks = [e for e in registry.log if e.operation == "check" and e.at >= renewals[-1].at]
        assert checks and checks[0].at <= recovered
        assert not h.set.registrations()["web"].residual_risk
        await h.close()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED and not entry.possibly_remaining
    await trio.sleep(60)
    # The held renewal landed after the removal: it could not re-create it.
    assert registry.instance_ids() == ()


async def test_lost_creating_renewal_keeps_the_residual_risk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()  # renewals may create (the default)
    async with running(registry) as h:
        registry.inject("renew", Fault.drop())
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        assert h.set.registrations()["web"].residual_risk
        await h.until(RegistrationState.ACTIVE)
        await h.close()
    (entry,) = h.set.report()
    assert entry.outcome is CloseOutcome.RESIDUAL


# ------------------------------------------------- bug 4: the backoff of repeated renewals


async def test_lost_renewals_back_off_up_to_max_backoff_not_the_monitor_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = RegistrationTiming(
        monitor_interval=2.0,
        observation_grace=15.0,
        deregister_timeout=3.0,
        request_timeout=1.0,
        initial_backoff=1.0,
        max_backoff=8.0,
    )
    registry = MemoryRegistry(renewal_creates=False)
    async with running(registry, timing=timing) as h:
        registry.inject("renew", *[Fault.drop()] * 6)
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        await h.until(RegistrationState.ACTIVE)
        renewals = [e for e in registry.log if e.operation == "renew"]
        renewals = renewals[renewals.index(next(e for e in renewals if e.outcome != "ok")) :]
        gaps = assert_backoff_gaps(renewals)
        assert len(gaps) == 6
        # Past the monitor interval: the registry is left alone for longer.
        assert max(gaps) > timing.monitor_interval


async def test_lost_renewals_are_repeated_before_the_lease_would_lapse(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(renewal_creates=False)
    async with running(registry, renew_within=3.0) as h:
        registry.inject("renew", *[Fault.drop()] * 6)
        await h.until(RegistrationState.OUTCOME_UNKNOWN)
        await h.until(RegistrationState.ACTIVE)
        renewals = [e for e in registry.log if e.operation == "renew"]
        gaps = [b.at - a.at for a, b in itertools.pairwise(renewals)]
        assert max(gaps) <= 3.0 + 1e-9


async def test_renewals_that_did_not_apply_back_off_while_checks_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = RegistrationTiming(
        monitor_interval=2.0,
        observation_grace=15.0,
        deregister_timeout=3.0,
        request_timeout=1.0,
        initial_backoff=1.0,
        max_backoff=8.0,
    )
    registry = MemoryRegistry()
    async with running(registry, timing=timing) as h:
        refused = IncompleteSnapshot("rate limited (429): not applied")
        registry.inject("renew", *[Fault.fail(refused)] * 5)
        await trio.sleep(40)  # five refusals: at most 1 + 2 + 4 + 8 + 8 s of backoff
        assert registry.pending_faults("renew") == 0
        first = next(e for e in registry.log if e.operation == "renew" and e.outcome != "ok")
        renewals = [e for e in registry.log if e.operation == "renew" and e.at >= first.at]
        gaps = assert_backoff_gaps(renewals[:6])
        assert max(gaps) > timing.monitor_interval
        # Meanwhile the checks kept the monitor pace: the evidence never lapsed.
        checks = [e.at for e in registry.log if e.operation == "check" and e.at >= first.at]
        assert max(b - a for a, b in itertools.pairwise(checks)) <= timing.monitor_interval + 1e-9
        assert h.state() is RegistrationState.ACTIVE
        assert not h.set.registrations()["web"].residual_risk


# ------------------------------------------------- bug 5: last_error after recovery


async def test_last_error_is_cleared_once_active_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    async with running(registry) as h:
        registry.inject("check", Fault.fail(IncompleteSnapshot("agent restarting")))
        await trio.sleep(5.5)
        status = h.set.registrations()["web"]
        # Still Active on the grace of the last HEALTHY check; the error shows.
        assert status.state is RegistrationState.ACTIVE
        assert status.last_error == "IncompleteSnapshot"
        await trio.sleep(5)  # the next check is HEALTHY again
        status = h.set.registrations()["web"]
        assert status.state is RegistrationState.ACTIVE and status.last_error is None


# ------------------------------------------------- both loops, real time


async def test_lost_reregistration_is_repeated_on_either_loop() -> None:
    timing = RegistrationTiming(
        monitor_interval=0.2,
        observation_grace=2.0,
        deregister_timeout=0.5,
        request_timeout=0.5,
        initial_backoff=0.05,
        max_backoff=0.2,
    )
    registry = upsert_registry()
    provider = UpsertProvider(registry)
    registrations = RegistrationSet(rng=random.Random(5))
    registrations.freeze(
        (spec(),),
        {"primary": ConnectionPlan(provider.capabilities, {"orders": "orders-svc"}, timing)},
    )

    def state() -> RegistrationState:
        return registrations.registrations()["web"].state

    async def until(wanted: RegistrationState) -> None:
        with anyio.fail_after(10):
            while state() is not wanted:
                await registrations.wait_changed()

    async with anyio.create_task_group() as tg:
        await registrations.publish(tg, {"primary": provider}, anyio.current_time() + 5)
        registry.expire(IID)
        registry.inject("register", Fault.drop())
        await until(RegistrationState.OUTCOME_UNKNOWN)
        await until(RegistrationState.ACTIVE)
        assert len(registry.operations("register")) == 3
        registrations.begin_quiesce(anyio.current_time() + 2)
        await registrations.wait_drained()
    (entry,) = registrations.report()
    assert entry.outcome is CloseOutcome.RESIDUAL
