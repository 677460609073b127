"""One owner, the whole registration lifecycle, end to end on trio's MockClock.

publish -> Active; local eligibility lapses -> Ineligible (no renewals);
eligible again -> Degraded until a renewal is acknowledged and a later
check passes, then Active; a renewal answer is lost (idempotent provider) ->
OutcomeUnknown, the same record is renewed again, Active only after a fresh
health check; leaving the block deregisters: one registration ends
Deregistered, the one with the lost answer Residual; the close report says
so and no task is left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from nadisc import (
    CloseOutcome,
    DiscoveryOwner,
    Eligibility,
    IncompleteSnapshot,
    RegistrationCloseEntry,
    RegistrationState,
    open_discovery,
)
from nadisc.testing import Fault, MemoryProvider, MemoryRegistry

from .owner_support import all_tasks, inst
from .test_lifecycle_config import connection, discovery, registration

pytestmark = pytest.mark.trio_only

WEB = ("10.0.0.5", 18080)
ADMIN = ("10.0.1.5", 19090)
BUSINESS_ID = "order-api-10.0.0.5-18080"
INFRA_ID = "order-api-10.0.1.5-19090"

Transitions = list[tuple[float, str, RegistrationState]]


@asynccontextmanager
async def recording(owner: DiscoveryOwner) -> AsyncIterator[Transitions]:
    """Sample every registration's state every 50 ms; keep the transitions."""
    seen: Transitions = []
    last: dict[str, RegistrationState] = {}

    async def sample() -> None:
        while True:
            now = trio.current_time()
            for name, status in owner.registrations().items():
                if last.get(name) is not status.state:
                    last[name] = status.state
                    seen.append((now, name, status.state))
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        yield seen
        nursery.cancel_scope.cancel()


def states_of(seen: Transitions, name: str) -> list[RegistrationState]:
    return [state for _, n, state in seen if n == name]


async def until(predicate: Callable[[], bool]) -> float:
    """Wait (at most 30 s) until ``predicate()`` holds; return the time.

    Polled: some states follow from the time alone (a lapsed grant, an
    expired confirmation), which no event announces."""
    with trio.fail_after(30):
        while not predicate():  # noqa: ASYNC110 - time-derived states have no event
            await trio.sleep(0.05)
    return trio.current_time()


def pair() -> tuple[MemoryProvider, MemoryRegistry]:
    registry = MemoryRegistry(idempotent_renewal=True)
    provider = MemoryProvider(registry=registry)
    provider.set("order-worker", [inst("w1")])
    return provider, registry


def entries(owner: DiscoveryOwner) -> dict[str, RegistrationCloseEntry]:
    report = owner.close_report
    assert report is not None
    out: dict[str, RegistrationCloseEntry] = {}
    for entry in report.registrations:
        assert isinstance(entry, RegistrationCloseEntry)
        out[entry.name] = entry
    return out


async def test_the_whole_lifecycle(autojump_clock: trio.testing.MockClock) -> None:
    business, business_registry = pair()
    infra, infra_registry = pair()
    cfg = discovery(
        {"primary": connection(), "infra": connection()},
        {
            "business-http": registration(readiness_critical=True),
            "infra-http": registration(
                qualifier="infra", listener_ref="admin", ip=ADMIN[0], port=ADMIN[1]
            ),
        },
    )
    controller, web = Eligibility.channel()
    controller.update(True, 30.0)
    before = all_tasks()
    async with open_discovery(
        cfg,
        providers={"primary": business, "infra": infra},
        listeners={"web": WEB, "admin": ADMIN},
        eligibility={"web": web, "admin": Eligibility.always()},
    ) as owner:
        # 1. publish -> Active, before the block runs.
        statuses = owner.registrations()
        assert statuses["business-http"].state is RegistrationState.ACTIVE
        assert statuses["infra-http"].state is RegistrationState.ACTIVE
        assert business_registry.instance_ids() == (BUSINESS_ID,)
        assert infra_registry.instance_ids() == (INFRA_ID,)

        async with recording(owner) as seen:
            # 2. The host stops confirming eligibility: the grant lapses.
            controller.update(True, 2.0)
            lapsed = await until(
                lambda: owner.registrations()["business-http"].state is RegistrationState.INELIGIBLE
            )
            renewals = len(business_registry.operations("renew"))
            await trio.sleep(6)
            assert owner.registrations()["business-http"].state is RegistrationState.INELIGIBLE
            assert len(business_registry.operations("renew")) == renewals  # nothing sent
            assert not owner.observer().snapshot().registration("business-http").eligible
            # The other connection's registration keeps renewing.
            assert any(e.operation == "renew" and e.at > lapsed for e in infra_registry.log)

            # 3. Eligible again: renewed, confirmed, Active — in that order.
            # Renewals were withheld meanwhile, so regaining eligibility
            # alone (nothing sent yet) is not Active.
            controller.update(True, 30.0)
            regained = trio.current_time()
            assert owner.registrations()["business-http"].state is RegistrationState.DEGRADED
            active_again = await until(
                lambda: owner.registrations()["business-http"].state is RegistrationState.ACTIVE
            )
            # Renewals (the health publication) resumed first, then a HEALTHY
            # check that started after that renewal.
            first_renew = min(
                e.at for e in business_registry.log if e.operation == "renew" and e.at >= regained
            )
            confirming = [
                e
                for e in business_registry.log
                if e.operation == "check" and first_renew <= e.at <= active_again
            ]
            assert confirming and confirming[0].outcome == "healthy"
            assert len(business_registry.operations("renew")) > renewals

            # 4. A renewal's answer is lost (applied remotely, answer gone).
            infra_registry.inject("renew", Fault.lose_ack())
            await until(lambda: infra_registry.pending_faults("renew") == 0)
            await until(
                lambda: (
                    owner.registrations()["infra-http"].state is RegistrationState.OUTCOME_UNKNOWN
                )
            )
            assert owner.registrations()["infra-http"].residual_risk
            recovered = await until(
                lambda: owner.registrations()["infra-http"].state is RegistrationState.ACTIVE
            )
            await trio.sleep(0.2)

        # The transitions, in order (the Degraded stretch between regained
        # eligibility and the confirming check may fall between two samples).
        business_states = states_of(seen, "business-http")
        assert business_states in (
            [RegistrationState.ACTIVE, RegistrationState.INELIGIBLE, RegistrationState.ACTIVE],
            [
                RegistrationState.ACTIVE,
                RegistrationState.INELIGIBLE,
                RegistrationState.DEGRADED,
                RegistrationState.ACTIVE,
            ],
        )
        # No sample saw it Active between regaining eligibility and the
        # first renewal after the lapse.
        assert not any(
            regained <= at < first_renew
            for at, name, state in seen
            if name == "business-http" and state is RegistrationState.ACTIVE
        )
        assert states_of(seen, "infra-http") == [
            RegistrationState.ACTIVE,
            RegistrationState.OUTCOME_UNKNOWN,
            RegistrationState.ACTIVE,
        ]
        # The lost renewal was repeated with the same record (same instance,
        # one stored record, renewed in place) after a bounded backoff ...
        (lost,) = [e for e in infra_registry.log if e.outcome == "OutcomeUnknown(applied)"]
        after_loss = infra_registry.log[infra_registry.log.index(lost) :]
        renews = [e for e in after_loss if e.operation == "renew"]
        assert renews[0].outcome == "OutcomeUnknown(applied)"
        assert renews[1].outcome == "ok"
        assert {e.instance_id for e in renews} == {INFRA_ID}
        assert 0.1 <= renews[1].at - renews[0].at <= 0.2  # initial_backoff 200 ms
        assert infra_registry.instance_ids() == (INFRA_ID,)
        # ... and Active came only after a HEALTHY check started after it.
        checks = [e for e in after_loss if e.operation == "check" and e.at >= renews[1].at]
        assert checks and checks[0].outcome == "healthy"
        assert checks[0].at <= recovered
        assert not any(
            at < checks[0].at and at > renews[0].at
            for at, name, state in seen
            if name == "infra-http" and state is RegistrationState.ACTIVE
        )

    # 5. Leaving the block: quiesce deregistered both, the report is honest.
    assert business_registry.instance_ids() == () and infra_registry.instance_ids() == ()
    report = owner.close_report
    assert report is not None
    assert not report.deadline_elapsed and report.tasks_left == 0
    assert report.provider_errors == ()
    final = entries(owner)
    assert final["business-http"].outcome is CloseOutcome.DEREGISTERED
    assert final["business-http"].state is RegistrationState.DEREGISTERED
    assert not final["business-http"].possibly_remaining
    # The lost answer may still land somewhere: acknowledged removal is not proof.
    assert final["infra-http"].outcome is CloseOutcome.RESIDUAL
    assert final["infra-http"].state is RegistrationState.RESIDUAL
    assert final["infra-http"].possibly_remaining
    assert owner.registrations()["infra-http"].state is RegistrationState.RESIDUAL
    assert [name for name, _ in business_registry.operations()][-1] == "deregister"
    assert all_tasks() == before


async def test_unreachable_and_unknown_outcomes_reach_the_close_report(
    autojump_clock: trio.testing.MockClock,
) -> None:
    business, business_registry = pair()
    infra, infra_registry = pair()
    cfg = discovery(
        {"primary": connection(), "infra": connection()},
        {
            "business-http": registration(),
            # Not startup-required: its unknown first write does not fail the entry.
            "infra-http": registration(
                qualifier="infra",
                listener_ref="admin",
                ip=ADMIN[0],
                port=ADMIN[1],
                startup_required=False,
            ),
        },
    )
    infra_registry.inject("register", Fault.drop())
    business_registry.inject("deregister", Fault.fail(IncompleteSnapshot("connection reset")))
    always = Eligibility.always()
    before = all_tasks()
    async with open_discovery(
        cfg,
        providers={"primary": business, "infra": infra},
        listeners={"web": WEB, "admin": ADMIN},
        eligibility={"web": always, "admin": always},
    ) as owner:
        await trio.sleep(2)
        assert owner.registrations()["infra-http"].state is RegistrationState.OUTCOME_UNKNOWN
        # Never written again after the unknown first write.
        assert len(infra_registry.operations("register")) == 1
    final = entries(owner)
    assert final["business-http"].outcome is CloseOutcome.UNREACHABLE
    assert final["business-http"].last_error == "IncompleteSnapshot"
    assert final["infra-http"].outcome is CloseOutcome.OUTCOME_UNKNOWN
    assert all(entry.possibly_remaining for entry in final.values())
    # The record the failed deregistration could not remove is still there.
    assert business_registry.instance_ids() == (BUSINESS_ID,)
    assert all_tasks() == before


async def test_a_slow_deregistration_is_cut_at_deregister_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    business, business_registry = pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    business_registry.inject("deregister", Fault.slow(60.0))
    before = all_tasks()
    async with open_discovery(
        cfg,
        providers={"primary": business},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        left_at = trio.current_time()
    # deregister_timeout_ms is 700: the close did not wait for the 60 s answer.
    assert trio.current_time() - left_at == pytest.approx(0.7)
    final = entries(owner)
    assert final["business-http"].outcome is CloseOutcome.UNREACHABLE
    assert final["business-http"].possibly_remaining
    assert [e.outcome for e in business_registry.log if e.operation == "deregister"] == [
        "cancelled"
    ]
    assert all_tasks() == before
