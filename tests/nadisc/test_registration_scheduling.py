"""Registration writes under the owner's ``max_parallel_operations`` bound.

The provider here models a saturated registry: every call takes
``base x calls in flight`` seconds, and a call whose answer would come after
its deadline loses the answer (``OutcomeUnknown``), as a real server under
load does. Everything runs on trio's MockClock.
"""

from __future__ import annotations

import math

import anyio
import anyio.abc
import pytest
import trio
import trio.testing

from nadisc import (
    Capabilities,
    CloseOutcome,
    ConnectionConfig,
    ConnectionSpec,
    DeadlineExceeded,
    Eligibility,
    EvidenceKind,
    HealthStatus,
    LimitsConfig,
    ObservationSink,
    OutcomeUnknown,
    OwnerBuilder,
    OwnerRegistrations,
    ProviderSnapshot,
    Registered,
    RegistrationRecord,
    RegistrationSpec,
    RegistrationState,
)

pytestmark = pytest.mark.trio_only

POLICY = ConnectionConfig.model_validate(
    {
        "provider": "memory",
        "monitor_interval_ms": 5000,
        "observation_grace_ms": 15000,
        "request_timeout_ms": 500,
        "deregister_timeout_ms": 500,
    }
)


class CongestedRegistry:
    """A registry whose answers slow down with the number of calls in flight."""

    def __init__(self, base: float, *, congestion: bool = True) -> None:
        self.base = base
        self.congestion = congestion
        self.in_flight = 0
        self.max_in_flight = 0
        self.keys: dict[str, str] = {}
        #: (operation, started, deadline) of every call.
        self.calls: list[tuple[str, float, float]] = []
        self._handles = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            evidence=EvidenceKind.REGISTRY_HEALTH, registration=True, idempotent_renewal=True
        )

    async def _serve(self, operation: str, deadline: float) -> None:
        now = anyio.current_time()
        self.calls.append((operation, now, deadline))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            took = self.base * (self.in_flight if self.congestion else 1)
            if now + took > deadline:
                # The server applies the write, but the answer comes too late.
                await anyio.sleep_until(deadline)
                raise OutcomeUnknown(f"{operation}: no answer before the deadline")
            await anyio.sleep(took)
        finally:
            self.in_flight -= 1

    async def prepare(self, deadline: float) -> None:
        return None

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        return ProviderSnapshot(service, (), EvidenceKind.REGISTRY_HEALTH)

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        raise NotImplementedError

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        self._handles += 1
        handle = str(self._handles)
        self.keys[record.instance_id] = handle  # applied before the answer
        await self._serve("register", deadline)
        return Registered(record=record, handle=handle)

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        await self._serve("renew", deadline)
        return registered

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        await self._serve("check", deadline)
        if self.keys.get(registered.record.instance_id) == registered.handle:
            return HealthStatus.HEALTHY
        return HealthStatus.MISSING

    async def deregister(self, registered: Registered, deadline: float) -> None:
        self.keys.pop(registered.record.instance_id, None)
        await self._serve("deregister", deadline)

    async def aclose(self) -> None:
        return None


def specs(count: int) -> list[RegistrationSpec]:
    return [
        RegistrationSpec(
            name=f"r{i:04d}",
            service_name="orders",
            ip="10.0.0.5",
            port=1000 + i,
            instance_id=f"i{i:04d}",
            eligibility=Eligibility.always(),
        )
        for i in range(count)
    ]


def builder(registry: CongestedRegistry, parallel: int) -> OwnerBuilder:
    limits = LimitsConfig(max_parallel_operations=parallel, max_registrations=1000)
    return (
        OwnerBuilder(limits=limits, shutdown_timeout=60)
        .connection(ConnectionSpec("primary", registry, POLICY, services={"orders": "orders"}))
        .registrations(OwnerRegistrations())
    )


async def test_many_registrations_on_a_saturated_registry_all_become_active(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 200 first writes at once would each take 200 x 10 ms = 2 s, four times
    # the 500 ms request timeout: every answer would be lost and every
    # registration blocked in OUTCOME_UNKNOWN. Four at a time they take 40 ms.
    registry = CongestedRegistry(0.010)
    async with builder(registry, 4).open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations(specs(200))
        started = trio.current_time()
        await owner.publish(trio.current_time() + 15)
        took = trio.current_time() - started
        states = {s.state for s in owner.registrations().values()}
        assert states == {RegistrationState.ACTIVE}
        assert len(registry.keys) == 200
        # 400 calls (a write and a check each), 4 at a time, 40 ms each.
        assert took <= math.ceil(400 / 4) * 0.040 + 0.5
    assert registry.max_in_flight <= 4
    # Every deadline counts from when the call started, not from when it queued.
    assert {round(deadline - start, 6) for _, start, deadline in registry.calls} == {0.5}
    report = owner.close_report
    assert report is not None
    outcomes = {entry.outcome for entry in report.registrations}  # type: ignore[attr-defined]
    assert outcomes == {CloseOutcome.DEREGISTERED}
    assert registry.keys == {}
    # Deregistrations went through the same bound.
    assert sum(1 for op, _, _ in registry.calls if op == "deregister") == 200


async def test_renewals_and_checks_share_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = CongestedRegistry(0.010)
    async with builder(registry, 3).open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations(specs(60))
        await owner.publish(trio.current_time() + 15)
        await trio.sleep(12)  # two renewal rounds
        assert {s.state for s in owner.registrations().values()} == {RegistrationState.ACTIVE}
    renewals = [c for c in registry.calls if c[0] == "renew"]
    assert len(renewals) >= 60
    assert registry.max_in_flight <= 3


async def test_a_startup_set_that_cannot_fit_says_how_many_were_confirmed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One at a time, 100 ms per call, a write and a check each: 20 fit in 4 s.
    registry = CongestedRegistry(0.100, congestion=False)
    with pytest.raises(DeadlineExceeded) as caught:
        async with builder(registry, 1).open() as owner:
            await owner.prepare(trio.current_time() + 5)
            owner.freeze_registrations(specs(100))
            await owner.publish(trio.current_time() + 4)
    message = str(caught.value)
    assert "of 100 startup-required registrations confirmed by the deadline" in message
    confirmed = int(message.split("publish: ")[1].split(" of 100")[0])
    assert 15 <= confirmed <= 20
    assert "waiting for their first write under max_parallel_operations=1" in message
    assert "and " in message and "more" in message  # the list is capped
    # Nothing written is left behind, and none was sent blind after the deadline.
    assert registry.keys == {}
    assert registry.max_in_flight == 1


@pytest.mark.parametrize("turns", range(1, 9))
async def test_quiesce_landing_on_a_turn_handover_sends_nothing_more(
    autojump_clock: trio.testing.MockClock, turns: int
) -> None:
    # The publish deadline falls exactly when a turn is handed over (every
    # 200 ms: a 100 ms write plus a 100 ms check), so quiesce may find the
    # next runner granted its turn but not yet running. It must give the
    # turn back unused: no write after quiesce, no refused state event.
    registry = CongestedRegistry(0.100, congestion=False)
    with pytest.raises(DeadlineExceeded):
        async with builder(registry, 1).open() as owner:
            await owner.prepare(trio.current_time() + 5)
            owner.freeze_registrations(specs(20))
            await owner.publish(trio.current_time() + 0.2 * turns)
    report = owner.close_report
    assert report is not None
    outcomes = [getattr(e, "outcome", None) for e in report.registrations]
    sent = {op for op, *_ in registry.calls}
    assert sent <= {"register", "check", "deregister"}
    registers = sum(1 for op, *_ in registry.calls if op == "register")
    assert outcomes.count(CloseOutcome.DEREGISTERED) == registers
    assert outcomes.count(CloseOutcome.NOT_REGISTERED) == 20 - registers
    assert registry.keys == {}


async def test_waiting_for_a_startup_set_costs_per_change_not_per_registration(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every write, ack and check of 300 registrations wakes publish; judging
    # all 300 each time would be ~300 x 900 state derivations.
    import nadisc._registration_state as sm

    judged = 0
    derive = sm.derive_state

    def counting(records: sm.RegistrationRecords, now: float) -> RegistrationState:
        nonlocal judged
        judged += 1
        return derive(records, now)

    registry = CongestedRegistry(0.010, congestion=False)
    async with builder(registry, 4).open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations(specs(300))
        monkeypatch.setattr(sm, "derive_state", counting)
        await owner.publish(trio.current_time() + 30)
        monkeypatch.setattr(sm, "derive_state", derive)
        assert {s.state for s in owner.registrations().values()} == {RegistrationState.ACTIVE}
    assert judged < 10 * 300, judged
