"""The registration state machine: exhaustive table checks and a hypothesis machine."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck as HypothesisHealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nadisc import HealthStatus, LifecycleError
from nadisc import _registration_state as sm
from nadisc._registration_state import (
    Action,
    HealthEvidence,
    RegistrationRecords,
    RegistrationState,
    WriteOutcome,
)

GRACE = 15.0
NOW = 100.0

# ---------------------------------------------------------------- enumeration


def all_records() -> list[RegistrationRecords]:
    out = []
    for (
        write,
        health,
        until,
        eligible,
        residual,
        handle,
        quiescing,
        confirmed,
        fresh,
    ) in itertools.product(
        WriteOutcome,
        HealthEvidence,
        (None, NOW - 1.0, NOW + 5.0),
        (False, True),
        (False, True),
        (False, True),
        (False, True),
        (False, True),
        (-math.inf, NOW + 1.0),
    ):
        out.append(
            RegistrationRecords(
                write=write,
                health=health,
                healthy_until=until,
                health_epoch=1,
                epoch=1,
                eligible=eligible,
                residual_risk=residual,
                handle=handle,
                written=write is not WriteOutcome.NONE,
                acked_once=handle,
                quiescing=quiescing,
                confirmed=confirmed,
                fresh_after=fresh,
            )
        )
    return out


def all_events() -> list[sm.Event]:
    return [
        sm.RegisterStarted(),
        sm.RegisterAcked(),
        sm.RegisterUnknown(),
        sm.RegisterRejected(),
        sm.RegisterFailed(),
        sm.RenewAcked(),
        sm.RenewUnknown(),
        sm.RenewLeaseLost(),
        sm.RenewFailed(),
        sm.CheckHealthy(epoch=1, started_at=NOW, grace=GRACE),
        sm.CheckHealthy(epoch=0, started_at=NOW, grace=GRACE),  # stale epoch
        sm.CheckTransient(epoch=1),
        sm.CheckTransient(epoch=0),
        *(
            sm.CheckNegative(epoch=1, status=s)
            for s in HealthStatus
            if s is not HealthStatus.HEALTHY
        ),
        sm.CheckNegative(epoch=0, status=HealthStatus.UNHEALTHY),
        sm.CheckInvalid(epoch=1),
        sm.IdentityRevokedEvent(new_epoch=2),
        sm.EligibilityObserved(True),
        sm.EligibilityObserved(False),
        sm.RenewWithheld(),
        sm.QuiesceBegan(),
        sm.DeregisterStarted(),
        sm.DeregisterAcked(),
        sm.DeregisterFailed(),
        sm.Retired(),
    ]


RECORDS = all_records()
EVENTS = all_events()
EVIDENCE_EVENTS = (sm.CheckHealthy, sm.CheckTransient, sm.CheckNegative, sm.CheckInvalid)


def test_every_event_type_has_a_table_entry() -> None:
    assert {type(e) for e in EVENTS} == set(sm.TRANSITIONS)


def check_step(old: RegistrationRecords, event: sm.Event) -> RegistrationRecords | None:
    try:
        new = sm.apply(old, event, NOW)
    except LifecycleError:
        return None
    # Monotonic facts.
    assert old.residual_risk <= new.residual_risk, "residual risk was cleared"
    assert new.epoch >= old.epoch
    assert old.quiescing <= new.quiescing, "quiesce was undone"
    assert old.written <= new.written
    # Never re-create after an unknown first write, never write while
    # quiescing or ineligible.
    if new.write is WriteOutcome.PENDING and old.write is not WriteOutcome.PENDING:
        assert isinstance(event, sm.RegisterStarted)
        assert old.write in (WriteOutcome.NONE, WriteOutcome.LOST)
        assert not old.quiescing and old.eligible
    # Transient failures keep and never extend the deadline.
    if isinstance(event, sm.CheckTransient):
        assert new.healthy_until == old.healthy_until
    # Evidence: a stale epoch, quiescing or a closing write changes nothing.
    if isinstance(event, EVIDENCE_EVENTS) and (
        event.epoch != old.epoch
        or old.quiescing
        or old.write
        in (WriteOutcome.DEREGISTERING, WriteOutcome.DEREGISTERED, WriteOutcome.DEREGISTER_UNKNOWN)
    ):
        assert new == old
    if isinstance(event, sm.CheckHealthy) and event.started_at < old.fresh_after:
        assert new == old
    if isinstance(event, sm.CheckNegative | sm.CheckInvalid | sm.IdentityRevokedEvent) and (
        new != old
    ):
        assert new.healthy_until is None
        assert sm.derive_state(new, NOW) is not RegistrationState.ACTIVE
    if isinstance(event, sm.IdentityRevokedEvent):
        assert new.health is HealthEvidence.REVOKED and new.epoch == event.new_epoch
    # Recovery from a lost renewal answer needs a fresh check.
    if isinstance(event, sm.RenewAcked) and old.write is WriteOutcome.UNKNOWN:
        assert sm.derive_state(new, NOW) is not RegistrationState.ACTIVE
        assert new.fresh_after == NOW
    # Only an acknowledged handle can be renewed or removed.
    if isinstance(
        event, sm.RenewAcked | sm.RenewUnknown | sm.RenewLeaseLost | sm.DeregisterStarted
    ):
        assert old.handle
    if isinstance(event, sm.DeregisterStarted):
        assert old.quiescing
    # A removal acknowledged after a possibly-landing write is Residual.
    if new.write is WriteOutcome.DEREGISTERED and new.residual_risk:
        assert sm.derive_state(new, NOW) is RegistrationState.RESIDUAL
    return new


def check_state(records: RegistrationRecords) -> None:
    for now in (NOW - 10, NOW, NOW + 10):
        state = sm.derive_state(records, now)
        assert isinstance(state, RegistrationState)
        if state is RegistrationState.ACTIVE:
            assert records.write is WriteOutcome.ACKED
            assert records.eligible and not records.withheld
            assert sm.health_valid(records, now)
            assert records.health_epoch == records.epoch
        if records.write is WriteOutcome.UNKNOWN:
            assert state is RegistrationState.OUTCOME_UNKNOWN
    action_plain = sm.next_action(records, idempotent_renewal=False)
    action_idem = sm.next_action(records, idempotent_renewal=True)
    for action in (action_plain, action_idem):
        if action in (Action.REGISTER, Action.RENEW, Action.RETRY_RENEW):
            # Every submission re-checks local eligibility; none while quiescing.
            assert records.eligible and not records.quiescing
        if records.write is WriteOutcome.UNKNOWN and not records.handle:
            assert action in (Action.BLOCKED, Action.DONE)
    if records.write is WriteOutcome.UNKNOWN and not records.quiescing:
        assert action_plain is Action.BLOCKED


def test_exhaustive_records_by_events() -> None:
    accepted = refused = 0
    for old in RECORDS:
        check_state(old)
        for event in EVENTS:
            new = check_step(old, event)
            if new is None:
                refused += 1
            else:
                accepted += 1
                check_state(new)
    # Both kinds occur: the table is neither all-accepting nor all-refusing.
    assert accepted > 0 and refused > 0


def test_unknown_first_write_is_never_rewritten() -> None:
    r = RegistrationRecords(eligible=True)
    r = sm.apply(r, sm.RegisterStarted(), 0)
    r = sm.apply(r, sm.RegisterUnknown(), 1)
    assert sm.derive_state(r, 1) is RegistrationState.OUTCOME_UNKNOWN
    assert sm.next_action(r, idempotent_renewal=True) is Action.BLOCKED
    with pytest.raises(LifecycleError):
        sm.apply(r, sm.RegisterStarted(), 2)
    # Even a healthy-looking check does not make it Active.
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=2, grace=GRACE), 2)
    assert sm.derive_state(r, 3) is RegistrationState.OUTCOME_UNKNOWN


def acked(eligible: bool = True) -> RegistrationRecords:
    r = RegistrationRecords(eligible=True)
    r = sm.apply(r, sm.RegisterStarted(), 0)
    r = sm.apply(r, sm.RegisterAcked(), 0)
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=0, grace=GRACE), 0)
    return sm.apply(r, sm.EligibilityObserved(eligible), 0)


def test_renewal_retry_only_for_idempotent_providers_then_fresh_check() -> None:
    r = sm.apply(acked(), sm.RenewUnknown(), 5)
    assert sm.derive_state(r, 5) is RegistrationState.OUTCOME_UNKNOWN
    assert sm.next_action(r, idempotent_renewal=False) is Action.BLOCKED
    assert sm.next_action(r, idempotent_renewal=True) is Action.RETRY_RENEW
    # Ineligible: the retry is withheld.
    off = sm.apply(r, sm.EligibilityObserved(False), 5)
    assert sm.next_action(off, idempotent_renewal=True) is Action.WAIT
    r = sm.apply(r, sm.RenewAcked(), 7)
    assert sm.derive_state(r, 7) is RegistrationState.DEGRADED
    # A check started before the recovery does not count.
    stale = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=6, grace=GRACE), 8)
    assert stale == r
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=7, grace=GRACE), 8)
    assert sm.derive_state(r, 8) is RegistrationState.ACTIVE
    assert r.residual_risk
    # The earlier request may still land: an acknowledged removal is Residual.
    r = sm.apply(r, sm.QuiesceBegan(), 9)
    r = sm.apply(r, sm.DeregisterStarted(), 9)
    r = sm.apply(r, sm.DeregisterAcked(), 9)
    assert sm.derive_state(r, 9) is RegistrationState.RESIDUAL
    assert sm.next_action(r, idempotent_renewal=True) is Action.DONE


def test_lease_lost_reregisters_only_from_a_definitive_loss() -> None:
    r = sm.apply(acked(), sm.RenewLeaseLost(), 5)
    assert sm.derive_state(r, 5) is RegistrationState.DEGRADED
    assert r.write is WriteOutcome.LOST
    assert sm.next_action(r, idempotent_renewal=False) is Action.REGISTER
    r2 = sm.apply(r, sm.RegisterStarted(), 6)
    failed = sm.apply(r2, sm.RegisterFailed(), 6)
    assert failed.write is WriteOutcome.LOST  # back to re-registering, not to NONE
    # While a renewal answer is unknown there is no re-registration.
    unknown = sm.apply(acked(), sm.RenewUnknown(), 5)
    with pytest.raises(LifecycleError):
        sm.apply(unknown, sm.RegisterStarted(), 6)


def test_transient_keeps_and_never_extends_the_deadline() -> None:
    r = acked()
    assert r.healthy_until == GRACE
    r = sm.apply(r, sm.CheckTransient(epoch=0), 10)
    assert r.healthy_until == GRACE and r.health is HealthEvidence.TRANSIENT_FAILURE
    assert sm.derive_state(r, 14.9) is RegistrationState.ACTIVE
    assert sm.derive_state(r, 15.0) is RegistrationState.DEGRADED
    r = sm.apply(r, sm.CheckTransient(epoch=0), 20)
    assert r.healthy_until == GRACE


@pytest.mark.parametrize(
    "status", [HealthStatus.UNHEALTHY, HealthStatus.MISSING, HealthStatus.DISABLED]
)
def test_negative_evidence_removes_eligibility_at_once(status: HealthStatus) -> None:
    r = sm.apply(acked(), sm.CheckNegative(epoch=0, status=status), 1)
    assert r.healthy_until is None
    assert sm.derive_state(r, 1) is RegistrationState.DEGRADED


def test_revocation_epochs() -> None:
    r = sm.apply(acked(), sm.IdentityRevokedEvent(new_epoch=1), 1)
    assert sm.derive_state(r, 1) is RegistrationState.DEGRADED
    # A check started before the revocation (epoch 0) cannot extend anything.
    assert sm.apply(r, sm.CheckHealthy(epoch=0, started_at=0.5, grace=GRACE), 2) == r
    r = sm.apply(r, sm.CheckHealthy(epoch=1, started_at=2, grace=GRACE), 2)
    assert sm.derive_state(r, 2) is RegistrationState.ACTIVE
    with pytest.raises(LifecycleError):
        sm.apply(r, sm.IdentityRevokedEvent(new_epoch=1), 3)


def test_ineligible_registered_instance() -> None:
    r = acked(eligible=False)
    assert sm.derive_state(r, 1) is RegistrationState.INELIGIBLE
    assert sm.next_action(r, idempotent_renewal=True) is Action.WAIT


def test_quiesce_paths() -> None:
    fresh = sm.apply(RegistrationRecords(), sm.QuiesceBegan(), 0)
    assert sm.next_action(fresh, idempotent_renewal=True) is Action.DONE
    retired = sm.apply(fresh, sm.Retired(), 0)
    assert sm.derive_state(retired, 0) is RegistrationState.DEREGISTERED
    r = sm.apply(acked(), sm.QuiesceBegan(), 1)
    assert sm.next_action(r, idempotent_renewal=False) is Action.DEREGISTER
    with pytest.raises(LifecycleError):
        sm.apply(r, sm.RegisterStarted(), 1)
    r = sm.apply(r, sm.DeregisterStarted(), 1)
    assert sm.derive_state(r, 1) is RegistrationState.DEREGISTERING
    clean = sm.apply(r, sm.DeregisterAcked(), 2)
    assert sm.derive_state(clean, 2) is RegistrationState.DEREGISTERED
    lost = sm.apply(r, sm.DeregisterFailed(), 2)
    assert sm.derive_state(lost, 2) is RegistrationState.OUTCOME_UNKNOWN
    # A registration write racing with quiesce is still recorded.
    racing = sm.apply(RegistrationRecords(eligible=True), sm.RegisterStarted(), 0)
    racing = sm.apply(racing, sm.QuiesceBegan(), 0)
    racing = sm.apply(racing, sm.RegisterAcked(), 1)
    assert sm.next_action(racing, idempotent_renewal=False) is Action.DEREGISTER


def test_rejection_fails() -> None:
    r = sm.apply(RegistrationRecords(eligible=True), sm.RegisterStarted(), 0)
    r = sm.apply(r, sm.RegisterRejected(), 0)
    assert sm.derive_state(r, 0) is RegistrationState.FAILED
    assert sm.next_action(r, idempotent_renewal=True) is Action.BLOCKED


# --------------------------------------------------------------------- backoff


def test_backoff_doubles_caps_and_jitters_between_half_and_cap() -> None:
    rng = random.Random(7)
    for attempt in range(1, 12):
        cap = min(30.0, 1.0 * 2 ** (attempt - 1))
        for _ in range(50):
            delay = sm.backoff_delay(attempt, 1.0, 30.0, rng)
            assert cap / 2 <= delay <= cap

    class Fixed(random.Random):
        def __init__(self, value: float) -> None:
            super().__init__()
            self.value = value

        def random(self) -> float:
            return self.value

    assert sm.backoff_delay(3, 1.0, 30.0, Fixed(0.0)) == 2.0
    assert sm.backoff_delay(3, 1.0, 30.0, Fixed(1.0)) == 4.0
    assert sm.backoff_delay(100, 1.0, 30.0, Fixed(1.0)) == 30.0
    with pytest.raises(ValueError):
        sm.backoff_delay(0, 1.0, 30.0)
    with pytest.raises(ValueError):
        sm.backoff_delay(1, 5.0, 1.0)


# ------------------------------------------------------------------ hypothesis


class RegistrationMachine(RuleBasedStateMachine):
    """Random event sequences with time moving forward; checks the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.records = RegistrationRecords()
        self.now = 0.0
        self.first_write_unknown = False
        self.ever_unknown = False
        self.deadline_before: float | None = None

    def step(self, event: sm.Event) -> bool:
        before = self.records
        try:
            self.records = sm.apply(before, event, self.now)
        except LifecycleError:
            assert self.records == before
            return False
        return True

    @rule(dt=st.floats(min_value=0, max_value=20))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(eligible=st.booleans())
    def eligibility(self, eligible: bool) -> None:
        self.step(sm.EligibilityObserved(eligible))

    @rule(outcome=st.sampled_from(["ack", "unknown", "rejected", "failed"]))
    def register(self, outcome: str) -> None:
        action = sm.next_action(self.records, idempotent_renewal=True)
        if not self.step(sm.RegisterStarted()):
            assert action is not Action.REGISTER
            return
        assert action is Action.REGISTER
        assert not self.first_write_unknown
        events: dict[str, sm.Event] = {
            "ack": sm.RegisterAcked(),
            "unknown": sm.RegisterUnknown(),
            "rejected": sm.RegisterRejected(),
            "failed": sm.RegisterFailed(),
        }
        event = events[outcome]
        assert self.step(event)
        if outcome == "unknown":
            self.first_write_unknown = True
            self.ever_unknown = True

    @rule(outcome=st.sampled_from(["ack", "unknown", "lost", "failed"]))
    def renew(self, outcome: str) -> None:
        renewals: dict[str, sm.Event] = {
            "ack": sm.RenewAcked(),
            "unknown": sm.RenewUnknown(),
            "lost": sm.RenewLeaseLost(),
            "failed": sm.RenewFailed(),
        }
        event = renewals[outcome]
        was_unknown = self.records.write is WriteOutcome.UNKNOWN
        if self.step(event):
            if outcome == "unknown":
                self.ever_unknown = True
            if outcome == "ack" and was_unknown:
                assert sm.derive_state(self.records, self.now) is not RegistrationState.ACTIVE

    @rule(
        status=st.sampled_from(list(HealthStatus)),
        stale=st.booleans(),
        transient=st.booleans(),
        lag=st.floats(min_value=0, max_value=5),
    )
    def check(self, status: HealthStatus, stale: bool, transient: bool, lag: float) -> None:
        before = self.records
        epoch = before.epoch - 1 if stale else before.epoch
        event: sm.Event
        if transient:
            event = sm.CheckTransient(epoch=epoch)
        elif status is HealthStatus.HEALTHY:
            event = sm.CheckHealthy(epoch=epoch, started_at=self.now - lag, grace=GRACE)
        else:
            event = sm.CheckNegative(epoch=epoch, status=status)
        assert self.step(event)
        if stale:
            assert self.records == before
        if transient or stale:
            assert self.records.healthy_until == before.healthy_until

    @rule()
    def revoke(self) -> None:
        assert self.step(sm.IdentityRevokedEvent(self.records.epoch + 1))
        assert sm.derive_state(self.records, self.now) is not RegistrationState.ACTIVE

    @rule()
    def quiesce(self) -> None:
        assert self.step(sm.QuiesceBegan())

    @precondition(lambda self: self.records.quiescing)
    @rule(ack=st.booleans())
    def deregister(self, ack: bool) -> None:
        action = sm.next_action(self.records, idempotent_renewal=True)
        if action is Action.DEREGISTER:
            assert self.step(sm.DeregisterStarted())
            assert self.step(sm.DeregisterAcked() if ack else sm.DeregisterFailed())
        elif action is Action.DONE and self.step(sm.Retired()):
            pass

    @invariant()
    def rules_hold(self) -> None:
        r = self.records
        state = sm.derive_state(r, self.now)
        if self.ever_unknown:
            assert r.residual_risk
        if state is RegistrationState.ACTIVE:
            assert r.eligible and r.write is WriteOutcome.ACKED and sm.health_valid(r, self.now)
        if self.first_write_unknown:
            assert r.write in (
                WriteOutcome.UNKNOWN,
                WriteOutcome.DEREGISTERING,
                WriteOutcome.DEREGISTERED,
                WriteOutcome.DEREGISTER_UNKNOWN,
            )
            assert sm.next_action(r, idempotent_renewal=True) in (
                Action.BLOCKED,
                Action.DONE,
                Action.DEREGISTER,
                Action.WAIT,
            )
        if r.write is WriteOutcome.DEREGISTERED and r.residual_risk:
            assert state is RegistrationState.RESIDUAL
        if r.healthy_until is not None:
            assert r.health in (HealthEvidence.HEALTHY, HealthEvidence.TRANSIENT_FAILURE)


TestRegistrationMachine = RegistrationMachine.TestCase
TestRegistrationMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HypothesisHealthCheck.too_slow],
)


def test_records_are_immutable() -> None:
    r = RegistrationRecords()
    with pytest.raises(AttributeError):
        r.write = WriteOutcome.ACKED  # type: ignore[misc]
    assert replace(r, eligible=True) != r


def test_regained_eligibility_needs_a_renewal_then_a_fresh_check() -> None:
    r = sm.RegistrationRecords(eligible=True)
    r = sm.apply(r, sm.RegisterStarted(), 0)
    r = sm.apply(r, sm.RegisterAcked(), 0)
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=0, grace=15), 0)
    assert sm.derive_state(r, 1) is RegistrationState.ACTIVE
    r = sm.apply(r, sm.EligibilityObserved(False), 1)
    assert sm.apply(sm.apply(r, sm.EligibilityObserved(True), 1), sm.RenewAcked(), 1) is not None
    # A lapse seen between two renewals withholds nothing: Active at once again.
    assert sm.derive_state(sm.apply(r, sm.EligibilityObserved(True), 1), 1) is (
        RegistrationState.ACTIVE
    )
    r = sm.apply(r, sm.RenewWithheld(), 1)  # a renewal fell due and was not sent
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=5, grace=15), 5)  # while withheld
    r = sm.apply(r, sm.EligibilityObserved(True), 6)
    assert sm.derive_state(r, 6) is not RegistrationState.ACTIVE  # nothing published yet
    assert sm.next_action(r, idempotent_renewal=False) is sm.Action.RENEW
    r = sm.apply(r, sm.RenewAcked(), 7)
    assert sm.derive_state(r, 7) is not RegistrationState.ACTIVE
    assert sm.apply(r, sm.CheckHealthy(epoch=0, started_at=6.5, grace=15), 8) == r
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=7, grace=15), 8)
    assert sm.derive_state(r, 8) is RegistrationState.ACTIVE


def test_healthy_grace_counts_from_the_start_of_the_check() -> None:
    r = sm.apply(
        sm.apply(RegistrationRecords(eligible=True), sm.RegisterStarted(), 0), sm.RegisterAcked(), 0
    )
    # The check started at 10 and answered at 12: the evidence is credited
    # from 10 (it may describe the registry as of then), never from 12.
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=10, grace=GRACE), 12)
    assert r.healthy_until == 10 + GRACE
    assert sm.derive_state(r, 10 + GRACE - 0.01) is RegistrationState.ACTIVE
    assert sm.derive_state(r, 10 + GRACE) is RegistrationState.DEGRADED


def test_health_valid_requires_the_current_identity_epoch() -> None:
    fresh = RegistrationRecords(
        write=WriteOutcome.ACKED,
        health=HealthEvidence.HEALTHY,
        healthy_until=NOW + GRACE,
        eligible=True,
        handle=True,
        confirmed=True,
    )
    assert sm.health_valid(fresh, NOW)
    assert sm.derive_state(fresh, NOW) is RegistrationState.ACTIVE
    # The same deadline obtained under an older identity proves nothing now.
    stale = replace(fresh, epoch=1)
    assert not sm.health_valid(stale, NOW)
    assert sm.derive_state(stale, NOW) is RegistrationState.DEGRADED
    assert not sm.health_valid(
        replace(fresh, health=HealthEvidence.TRANSIENT_FAILURE, epoch=2), NOW
    )
