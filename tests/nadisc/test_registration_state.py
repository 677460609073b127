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
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

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


#: Every combination of the provider capabilities next_action reads.
CAPABILITY_SETS = [
    {
        "idempotent_renewal": renewal,
        "idempotent_register": register,
        "deregister_without_handle": by_record,
    }
    for renewal, register, by_record in itertools.product((False, True), repeat=3)
]


def all_records() -> list[RegistrationRecords]:
    out = []
    flags = itertools.product((False, True), repeat=7)
    for (write, health, until, fresh), (
        eligible,
        residual,
        handle,
        quiescing,
        confirmed,
        acked_once,
        repeating,
    ) in itertools.product(
        itertools.product(
            WriteOutcome, HealthEvidence, (None, NOW - 1.0, NOW + 5.0), (-math.inf, NOW + 1.0)
        ),
        list(flags),
    ):
        if handle and not acked_once:
            continue  # a handle is only ever held after an acknowledgement
        if repeating and write is not WriteOutcome.PENDING:
            continue  # only a write in flight can be a repeat
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
                acked_once=acked_once,
                quiescing=quiescing,
                confirmed=confirmed,
                fresh_after=fresh,
                repeating=repeating,
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
        sm.RenewUnknown("RenewalOutcomeUnknown", creates=False),
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
    # quiescing or ineligible. The one unknown write that may be repeated is a
    # re-registration (after a lost lease: acknowledged once, no handle now);
    # whether it is repeated is the provider's (next_action, below).
    if new.write is WriteOutcome.PENDING and old.write is not WriteOutcome.PENDING:
        assert isinstance(event, sm.RegisterStarted)
        assert old.write in (WriteOutcome.NONE, WriteOutcome.LOST) or (
            old.write is WriteOutcome.UNKNOWN and not old.handle and old.acked_once
        )
        assert new.repeating is (old.write is WriteOutcome.UNKNOWN)
        assert not old.quiescing and old.eligible
    # Only a write that could create the record leaves a residual risk.
    if new.residual_risk and not old.residual_risk:
        assert isinstance(event, sm.RegisterUnknown) or (
            isinstance(event, sm.RenewUnknown) and event.creates
        )
    # A repeat that definitely did not apply leaves the earlier outcome unknown.
    if isinstance(event, sm.RegisterFailed) and old.repeating:
        assert new.write is WriteOutcome.UNKNOWN and new.residual_risk == old.residual_risk
    # A repeated registration acknowledged: Active only after a fresh check.
    if isinstance(event, sm.RegisterAcked) and old.repeating and not old.quiescing:
        assert sm.derive_state(new, NOW) is not RegistrationState.ACTIVE
        assert new.fresh_after == NOW and new.healthy_until is None
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
    # Only an acknowledged handle can be renewed; a removal needs one too,
    # except for a write whose outcome is unknown (removed by record, by the
    # providers that can: next_action, below).
    if isinstance(event, sm.RenewAcked | sm.RenewUnknown | sm.RenewLeaseLost):
        assert old.handle
    if isinstance(event, sm.DeregisterStarted):
        assert (
            old.handle
            or old.write is WriteOutcome.UNKNOWN
            or (old.write in (WriteOutcome.REJECTED, WriteOutcome.LOST) and old.residual_risk)
        )
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
        if records.write is WriteOutcome.UNKNOWN and not records.handle:
            assert action in (Action.BLOCKED, Action.DONE)
    if records.write is WriteOutcome.UNKNOWN and not records.quiescing:
        assert action_plain is Action.BLOCKED
    for caps in CAPABILITY_SETS:
        action = sm.next_action(records, **caps)
        if action in (Action.REGISTER, Action.RENEW, Action.RETRY_RENEW, Action.RETRY_REGISTER):
            # Every submission re-checks local eligibility; none while quiescing.
            assert records.eligible and not records.quiescing
        if action is Action.RETRY_RENEW:
            assert caps["idempotent_renewal"] and records.handle
        if action is Action.RETRY_REGISTER:
            # Only a lost re-registration, only for upsert providers: a first
            # registration whose outcome is unknown is never written again.
            assert caps["idempotent_register"]
            assert records.write is WriteOutcome.UNKNOWN and not records.handle
            assert records.acked_once
        lost_first_or_not_repeatable = not records.acked_once or not caps["idempotent_register"]
        unknown_write = records.write is WriteOutcome.UNKNOWN and not records.handle
        if unknown_write and lost_first_or_not_repeatable:
            assert action in (Action.BLOCKED, Action.DONE, Action.DEREGISTER)
        if action is Action.DEREGISTER:
            assert records.quiescing
            assert records.handle or (
                caps["deregister_without_handle"]
                and (
                    records.write is WriteOutcome.UNKNOWN
                    or (
                        records.write in (WriteOutcome.REJECTED, WriteOutcome.LOST)
                        and records.residual_risk
                    )
                )
            )


def test_exhaustive_records_by_events() -> None:
    accepted = refused = 0
    # check_state depends on the record alone: each distinct record is
    # checked once (about 45,000 of them; the 340,000 accepted steps reach
    # the same records again and again).
    checked: set[RegistrationRecords] = set()
    for old in RECORDS:
        check_state(old)
        checked.add(old)
        for event in EVENTS:
            new = check_step(old, event)
            if new is None:
                refused += 1
            else:
                accepted += 1
                if new not in checked:
                    checked.add(new)
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


def test_retry_delay_is_the_backoff_capped_only_by_a_lease() -> None:
    rng = random.Random(11)
    for attempt in range(1, 12):
        cap = min(30.0, 2.0 ** (attempt - 1))
        for _ in range(20):
            # No lease: the documented backoff, reaching max_backoff.
            delay = sm.retry_delay(attempt, 1.0, 30.0, None, rng)
            assert cap / 2 <= delay <= cap
            # A lease that needs a renewal within 3 s: never later than that.
            leased = sm.retry_delay(attempt, 1.0, 30.0, 3.0, rng)
            assert min(cap / 2, 3.0) <= leased <= min(cap, 3.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            sm.retry_delay(1, 1.0, 30.0, bad)


def lost_lease() -> RegistrationRecords:
    return sm.apply(acked(), sm.RenewLeaseLost(), 5)


def test_lost_reregistration_is_repeated_only_for_upsert_providers() -> None:
    r = sm.apply(lost_lease(), sm.RegisterStarted(), 6)
    r = sm.apply(r, sm.RegisterUnknown(), 7)
    assert sm.derive_state(r, 7) is RegistrationState.OUTCOME_UNKNOWN
    assert r.residual_risk and r.attempt == 1
    assert sm.next_action(r, idempotent_renewal=True) is Action.BLOCKED
    assert (
        sm.next_action(r, idempotent_renewal=True, idempotent_register=True)
        is Action.RETRY_REGISTER
    )
    off = sm.apply(r, sm.EligibilityObserved(False), 7)
    assert sm.next_action(off, idempotent_renewal=True, idempotent_register=True) is Action.WAIT
    with pytest.raises(LifecycleError):
        sm.apply(off, sm.RegisterStarted(), 8)  # every submission needs eligibility
    # A repeat that did not apply leaves the outcome unknown (not lost).
    again = sm.apply(r, sm.RegisterStarted(), 8)
    assert again.repeating and sm.derive_state(again, 8) is RegistrationState.REGISTERING
    failed = sm.apply(again, sm.RegisterFailed(), 8)
    assert failed.write is WriteOutcome.UNKNOWN and failed.attempt == 2
    # Acknowledged: Active only after a HEALTHY check started after the ack.
    r = sm.apply(sm.apply(failed, sm.RegisterStarted(), 9), sm.RegisterAcked(), 10)
    assert sm.derive_state(r, 10) is RegistrationState.DEGRADED
    assert r.fresh_after == 10 and r.attempt == 0 and r.last_error is None
    assert sm.apply(r, sm.CheckHealthy(epoch=0, started_at=9.5, grace=GRACE), 11) == r
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=10, grace=GRACE), 11)
    assert sm.derive_state(r, 11) is RegistrationState.ACTIVE and r.residual_risk


def test_a_first_write_with_unknown_outcome_is_blocked_whatever_the_provider() -> None:
    r = sm.apply(RegistrationRecords(eligible=True), sm.RegisterStarted(), 0)
    r = sm.apply(r, sm.RegisterUnknown(), 1)
    for caps in CAPABILITY_SETS:
        assert sm.next_action(r, **caps) is Action.BLOCKED
    with pytest.raises(LifecycleError):
        sm.apply(r, sm.RegisterStarted(), 2)


def test_an_unknown_write_is_removed_by_record_only_where_the_provider_can() -> None:
    r = sm.apply(RegistrationRecords(eligible=True), sm.RegisterStarted(), 0)
    r = sm.apply(sm.apply(r, sm.RegisterUnknown(), 1), sm.QuiesceBegan(), 2)
    assert sm.next_action(r, idempotent_renewal=True) is Action.DONE
    assert (
        sm.next_action(r, idempotent_renewal=True, deregister_without_handle=True)
        is Action.DEREGISTER
    )
    removing = sm.apply(r, sm.DeregisterStarted(), 2)
    removed = sm.apply(removing, sm.DeregisterAcked(), 3)
    assert sm.derive_state(removed, 3) is RegistrationState.RESIDUAL
    failed = sm.apply(removing, sm.DeregisterFailed(), 3)
    assert sm.derive_state(failed, 3) is RegistrationState.OUTCOME_UNKNOWN
    # A handle-less removal of anything else is refused.
    lost = replace(sm.apply(RegistrationRecords(), sm.QuiesceBegan(), 0), write=WriteOutcome.LOST)
    with pytest.raises(LifecycleError):
        sm.apply(lost, sm.DeregisterStarted(), 1)


def rejected_repeat() -> RegistrationRecords:
    """A lost lease, a re-registration whose answer was lost, and its repeat
    refused (HTTP 400): FAILED, with the lost write's residual risk."""
    r = lost_lease()
    for event in (sm.RegisterStarted(), sm.RegisterUnknown(), sm.RegisterStarted()):
        r = sm.apply(r, event, 1)
    assert r.repeating
    return sm.apply(r, sm.RegisterRejected(), 2)


UPSERT = {"idempotent_renewal": True, "idempotent_register": True}


def removed_by_record_at_close(r: RegistrationRecords, now: float) -> RegistrationRecords:
    """Close ``r`` (no handle, residual risk): a provider that removes by
    record sends the removal (acknowledged: RESIDUAL, failed: unknown); one
    that cannot is told DONE. Returns the quiescing records."""
    assert not r.handle and r.residual_risk
    closing = sm.apply(r, sm.QuiesceBegan(), now)
    assert sm.next_action(closing, **UPSERT, deregister_without_handle=True) is Action.DEREGISTER
    removing = sm.apply(closing, sm.DeregisterStarted(), now)
    acked_removal = sm.apply(removing, sm.DeregisterAcked(), now + 1)
    assert sm.derive_state(acked_removal, now + 1) is RegistrationState.RESIDUAL
    failed_removal = sm.apply(removing, sm.DeregisterFailed(), now + 1)
    assert sm.derive_state(failed_removal, now + 1) is RegistrationState.OUTCOME_UNKNOWN
    assert sm.next_action(closing, **UPSERT) is Action.DONE
    return closing


def test_a_rejected_repeat_is_removed_at_close_where_the_record_names_it() -> None:
    r = rejected_repeat()
    assert sm.derive_state(r, 2) is RegistrationState.FAILED
    closing = removed_by_record_at_close(r, 3)
    # Where nothing can address it, it is never reported as removed.
    retired = sm.apply(closing, sm.Retired(), 4)
    assert retired.write is WriteOutcome.REJECTED and retired.residual_risk
    assert sm.derive_state(retired, 4) is RegistrationState.FAILED


def lost_again_after_a_lost_write() -> RegistrationRecords:
    """A re-registration whose answer was lost, its repeat acknowledged, the
    lease lost again and the next re-registration definitely not applied
    (refused connection): LOST with no handle, and the residual risk."""
    r = lost_lease()
    for event in (sm.RegisterStarted(), sm.RegisterUnknown(), sm.RegisterStarted()):
        r = sm.apply(r, event, 6)
    r = sm.apply(r, sm.RegisterAcked(), 7)
    r = sm.apply(r, sm.RenewLeaseLost(), 8)
    r = sm.apply(r, sm.RegisterStarted(), 9)
    return sm.apply(r, sm.RegisterFailed("IncompleteSnapshot"), 9)


def test_a_lease_lost_after_a_lost_write_is_removed_at_close_where_the_record_names_it() -> None:
    r = lost_again_after_a_lost_write()
    assert r.write is WriteOutcome.LOST
    closing = removed_by_record_at_close(r, 10)
    # Without removal by record: the registry's "gone" is all there is, and
    # the lost write may still land after it.
    retired = sm.apply(closing, sm.Retired(), 11)
    assert sm.derive_state(retired, 11) is RegistrationState.RESIDUAL
    # With no lost write behind it, a lost lease needs no removal anywhere.
    plain = sm.apply(sm.apply(lost_lease(), sm.RegisterStarted(), 6), sm.RegisterFailed(), 6)
    plain = sm.apply(plain, sm.QuiesceBegan(), 7)
    assert sm.next_action(plain, **UPSERT, deregister_without_handle=True) is Action.DONE
    with pytest.raises(LifecycleError):
        sm.apply(plain, sm.DeregisterStarted(), 7)
    assert sm.derive_state(sm.apply(plain, sm.Retired(), 7), 7) is RegistrationState.DEREGISTERED


def test_a_lost_refresh_leaves_no_residual_risk() -> None:
    r = sm.apply(acked(), sm.RenewUnknown("RenewalOutcomeUnknown", creates=False), 5)
    assert sm.derive_state(r, 5) is RegistrationState.OUTCOME_UNKNOWN and not r.residual_risk
    assert sm.next_action(r, idempotent_renewal=True) is Action.RETRY_RENEW
    r = sm.apply(r, sm.RenewAcked(), 6)
    assert sm.derive_state(r, 6) is RegistrationState.DEGRADED  # a fresh check first
    r = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=6, grace=GRACE), 7)
    assert sm.derive_state(r, 7) is RegistrationState.ACTIVE
    r = sm.apply(sm.apply(r, sm.QuiesceBegan(), 8), sm.DeregisterStarted(), 8)
    assert sm.derive_state(sm.apply(r, sm.DeregisterAcked(), 9), 9) is (
        RegistrationState.DEREGISTERED
    )
    creating = sm.apply(acked(), sm.RenewUnknown(), 5)
    assert creating.residual_risk


@pytest.mark.parametrize("attempt", [0, 1])
@pytest.mark.parametrize("eligible", [True, False])
@pytest.mark.parametrize("write", [WriteOutcome.ACKED, WriteOutcome.UNKNOWN])
def test_last_error_clears_once_active_with_nothing_pending(
    attempt: int, eligible: bool, write: WriteOutcome
) -> None:
    r = replace(
        acked(eligible),
        write=write,
        attempt=attempt,
        last_error="IncompleteSnapshot",
        health=HealthEvidence.TRANSIENT_FAILURE,
    )
    after = sm.apply(r, sm.CheckHealthy(epoch=0, started_at=5, grace=GRACE), 5)
    active = sm.derive_state(after, 5) is RegistrationState.ACTIVE
    assert active is (eligible and write is WriteOutcome.ACKED)
    # Cleared exactly when Active with no failed attempt pending.
    assert (after.last_error is None) is (active and attempt == 0)


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
        self.caps: dict[str, bool] = CAPABILITY_SETS[1]  # idempotent renewal only
        #: A re-registration's answer was lost and the provider cannot repeat it.
        self.reregistration_blocked = False
        self.steps = 0

    @initialize(caps=st.sampled_from(CAPABILITY_SETS), eligible=st.booleans())
    def capabilities(self, caps: dict[str, bool], eligible: bool) -> None:
        self.caps = caps
        self.step(sm.EligibilityObserved(eligible))

    def action(self) -> Action:
        return sm.next_action(self.records, **self.caps)

    def step(self, event: sm.Event) -> bool:
        self.steps += 1
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
        # The shell writes only when next_action says so; the table refuses
        # every other registration write except the repeat of a lost
        # re-registration, which only the capability gates.
        action = self.action()
        before = self.records
        if action not in (Action.REGISTER, Action.RETRY_REGISTER):
            try:
                sm.apply(before, sm.RegisterStarted(), self.now)
            except LifecycleError:
                return
            assert before.write is WriteOutcome.UNKNOWN and before.acked_once
            assert not self.caps["idempotent_register"] or not before.eligible
            return
        assert self.step(sm.RegisterStarted())
        assert not self.first_write_unknown
        assert not self.reregistration_blocked
        if action is Action.RETRY_REGISTER:
            assert self.caps["idempotent_register"] and before.acked_once
        events: dict[str, sm.Event] = {
            "ack": sm.RegisterAcked(),
            "unknown": sm.RegisterUnknown(),
            "rejected": sm.RegisterRejected(),
            "failed": sm.RegisterFailed(),
        }
        event = events[outcome]
        assert self.step(event)
        if outcome == "unknown":
            if before.acked_once:
                self.reregistration_blocked = not self.caps["idempotent_register"]
            else:
                self.first_write_unknown = True
            self.ever_unknown = True
        if outcome == "ack":
            self.reregistration_blocked = False
            if action is Action.RETRY_REGISTER:
                # Acknowledged, but Active only after a HEALTHY check started later.
                assert sm.derive_state(self.records, self.now) is not RegistrationState.ACTIVE
        if outcome == "failed" and action is Action.RETRY_REGISTER:
            assert self.records.write is WriteOutcome.UNKNOWN

    @rule(outcome=st.sampled_from(["ack", "unknown", "refresh_unknown", "lost", "failed"]))
    def renew(self, outcome: str) -> None:
        renewals: dict[str, sm.Event] = {
            "ack": sm.RenewAcked(),
            "unknown": sm.RenewUnknown(),
            # A renewal that cannot create the record (a TTL pass, a light beat).
            "refresh_unknown": sm.RenewUnknown("RenewalOutcomeUnknown", creates=False),
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

    # Quiesce ends every write: let the sequence run a while first, so lost
    # leases, lost answers and their repeats are reached.
    @precondition(lambda self: self.steps >= 20)
    @rule()
    def quiesce(self) -> None:
        assert self.step(sm.QuiesceBegan())

    @precondition(lambda self: self.records.quiescing)
    @rule(ack=st.booleans())
    def deregister(self, ack: bool) -> None:
        action = self.action()
        if action is Action.DEREGISTER:
            if not self.records.handle:
                assert self.caps["deregister_without_handle"]
                assert self.records.write is WriteOutcome.UNKNOWN or (
                    self.records.write in (WriteOutcome.REJECTED, WriteOutcome.LOST)
                    and self.records.residual_risk
                )
            assert self.step(sm.DeregisterStarted())
            assert self.step(sm.DeregisterAcked() if ack else sm.DeregisterFailed())
        elif action is Action.DONE and self.step(sm.Retired()):
            pass

    @invariant()
    def rules_hold(self) -> None:
        r = self.records
        state = sm.derive_state(r, self.now)
        # Residual risk comes from, and only from, a lost answer of a write
        # that could create the record; once set it stays.
        assert r.residual_risk == self.ever_unknown
        if self.reregistration_blocked and not r.quiescing:
            assert self.action() is Action.BLOCKED
        if state is RegistrationState.ACTIVE:
            assert r.eligible and r.write is WriteOutcome.ACKED and sm.health_valid(r, self.now)
        if self.first_write_unknown:
            assert r.write in (
                WriteOutcome.UNKNOWN,
                WriteOutcome.DEREGISTERING,
                WriteOutcome.DEREGISTERED,
                WriteOutcome.DEREGISTER_UNKNOWN,
            )
            assert self.action() in (
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


# ------------------------------------------------- hypothesis: the shell's view


class ShellMachine(RuleBasedStateMachine):
    """Drives the records the way the runner does: each ``act`` performs what
    :func:`next_action` allows, under one of every capability set, with a
    drawn outcome; time, eligibility and checks move in between. Reaches the
    lease-loss / lost-answer / repeat cycles the event-level machine rarely
    does, and checks the rules the shell relies on."""

    def __init__(self) -> None:
        super().__init__()
        self.records = RegistrationRecords(eligible=True)
        self.now = 0.0
        self.caps: dict[str, bool] = CAPABILITY_SETS[0]
        #: A first registration's answer was lost.
        self.first_unknown = False
        #: Some write that could create the record lost its answer.
        self.creating_unknown = False
        #: Time of the last acknowledgement after a lost answer (None: none
        #: pending): Active needs a HEALTHY check started at or after it.
        self.recovered_at: float | None = None
        self.writes_after_first_unknown = 0
        self.acts = 0
        #: The close sent a removal.
        self.removal_sent = False

    @initialize(caps=st.sampled_from(CAPABILITY_SETS))
    def capabilities(self, caps: dict[str, bool]) -> None:
        self.caps = caps

    def action(self) -> Action:
        return sm.next_action(self.records, **self.caps)

    def apply(self, event: sm.Event) -> None:
        self.records = sm.apply(self.records, event, self.now)

    @rule(dt=st.floats(min_value=0, max_value=10))
    def tick(self, dt: float) -> None:
        self.now += dt

    # Mostly eligible, mostly acknowledged: the cycles of interest need a few
    # acknowledged writes in a row before something goes wrong.
    @rule(eligible=st.sampled_from([True, True, True, False]))
    def eligibility(self, eligible: bool) -> None:
        self.apply(sm.EligibilityObserved(eligible))

    @rule(lag=st.floats(min_value=0, max_value=3), healthy=st.booleans())
    def check(self, lag: float, healthy: bool) -> None:
        if not self.records.handle:
            return  # the runner checks only what it holds a handle for
        started = self.now - lag
        if healthy:
            self.apply(sm.CheckHealthy(epoch=self.records.epoch, started_at=started, grace=GRACE))
        else:
            self.apply(sm.CheckNegative(epoch=self.records.epoch, status=HealthStatus.UNHEALTHY))

    @rule()
    def lease_lost(self) -> None:
        if self.action() is Action.RENEW:
            self.apply(sm.RenewLeaseLost())

    @rule(
        outcome=st.sampled_from(
            ["ack", "ack", "ack", "ack", "unknown", "refresh_unknown", "failed", "rejected"]
        )
    )
    def act(self, outcome: str) -> None:
        self.acts += 1
        action = self.action()
        before = self.records
        if action in (Action.REGISTER, Action.RETRY_REGISTER):
            if self.first_unknown:
                self.writes_after_first_unknown += 1
            self.apply(sm.RegisterStarted())
            if outcome == "ack":
                self.apply(sm.RegisterAcked())
                if action is Action.RETRY_REGISTER:
                    self.recovered_at = self.now
            elif outcome in ("unknown", "refresh_unknown"):
                self.apply(sm.RegisterUnknown())
                self.creating_unknown = True
                if not before.acked_once:
                    self.first_unknown = True
            elif outcome == "failed":
                self.apply(sm.RegisterFailed())
                if action is Action.RETRY_REGISTER:
                    assert self.records.write is WriteOutcome.UNKNOWN
            else:
                self.apply(sm.RegisterRejected())
        elif action in (Action.RENEW, Action.RETRY_RENEW):
            if outcome == "ack":
                self.apply(sm.RenewAcked())
                if before.write is WriteOutcome.UNKNOWN or before.withheld:
                    self.recovered_at = self.now
            elif outcome == "unknown":
                self.apply(sm.RenewUnknown())
                self.creating_unknown = True
            elif outcome == "refresh_unknown":
                self.apply(sm.RenewUnknown("RenewalOutcomeUnknown", creates=False))
            else:
                self.apply(sm.RenewFailed())
        elif (
            action is Action.WAIT
            and before.handle
            and not before.eligible
            and before.write in (WriteOutcome.ACKED, WriteOutcome.UNKNOWN)
        ):
            self.apply(sm.RenewWithheld())

    # Closing ends the sequence's interesting part: let it run a while first.
    @precondition(lambda self: not self.records.quiescing and self.acts >= 12)
    @rule(ack=st.booleans())
    def close(self, ack: bool) -> None:
        self.apply(sm.QuiesceBegan())
        action = self.action()
        if action is Action.DEREGISTER:
            self.apply(sm.DeregisterStarted())
            self.removal_sent = True
            self.apply(sm.DeregisterAcked() if ack else sm.DeregisterFailed())
        elif action is Action.DONE:
            self.apply(sm.Retired())
        assert self.action() in (Action.DONE, Action.WAIT)

    @invariant()
    def rules_hold(self) -> None:
        r = self.records
        state = sm.derive_state(r, self.now)
        # The seed's rule: a first registration whose outcome is unknown is
        # never written again, whatever the provider declares.
        assert self.writes_after_first_unknown == 0
        assert r.residual_risk == self.creating_unknown
        if state is RegistrationState.ACTIVE:
            assert r.write is WriteOutcome.ACKED and r.eligible and sm.health_valid(r, self.now)
            if self.recovered_at is not None:
                assert r.fresh_after >= self.recovered_at
        action = self.action()
        if (
            r.write is WriteOutcome.UNKNOWN
            and not r.handle
            and r.acked_once
            and not r.quiescing
            and r.eligible
        ):
            # A lost re-registration is repeated exactly when the provider's
            # register is an upsert by identity.
            expected = Action.RETRY_REGISTER if self.caps["idempotent_register"] else Action.BLOCKED
            assert action is expected
        if r.quiescing and r.write is WriteOutcome.DEREGISTERED and r.residual_risk:
            assert state is RegistrationState.RESIDUAL
        if r.write is WriteOutcome.UNKNOWN and r.quiescing and not r.handle:
            # Left unknown at close: only when no removal could be addressed.
            assert not self.caps["deregister_without_handle"]
        if r.write is WriteOutcome.REJECTED and r.quiescing and r.residual_risk:
            # A rejected write after a lost one is removed where it can be.
            assert not self.caps["deregister_without_handle"]
        if r.write is WriteOutcome.DEREGISTERED and r.residual_risk and r.quiescing:
            # Retired as gone without a removal (a lost lease with no handle)
            # only where no removal could be addressed.
            assert self.removal_sent or not self.caps["deregister_without_handle"]


TestShellMachine = ShellMachine.TestCase
TestShellMachine.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HypothesisHealthCheck.too_slow],
)
