"""The registration state machine: three records, one table, one pure view.

A registration is described by three separate records that are never
folded into one another, plus a few flags:

* **write** — what we know about the registry write
  (:class:`WriteOutcome`): nothing sent, a write in flight, acknowledged,
  outcome unknown, lease lost, rejected, deregistering, deregistered, or a
  deregistration whose outcome is unknown;
* **health** — the registry's confirmation (:class:`HealthEvidence`), with
  the deadline ``healthy_until`` a HEALTHY check granted and the identity
  epoch under which it was obtained;
* **eligible** — local eligibility (the host's own view);
* **withheld** — a renewal (the health publication) fell due while the
  registration was ineligible and was not sent. Until a renewal is
  acknowledged again, and a HEALTHY check started after it, the
  registration is not ``ACTIVE`` even once eligible: the registry may have
  stopped advertising it (a TTL or lease may even have run out);
* **residual_risk** — a write whose answer was lost may still land *and
  create the record* (a registration, a re-applied registration, a full
  heartbeat; not a renewal that only refreshes an existing record, such as
  a TTL pass or a light beat). Once set it is never cleared: an
  acknowledged deregistration then reports ``RESIDUAL`` and nothing is
  re-created on the strength of that ack.

:func:`apply` is the transition table (records x event -> records); it is
synchronous and takes the time as an argument. :func:`derive_state` maps the
records to the public :class:`RegistrationState`; :func:`next_action` tells
the async shell what it may do next, given the provider's capabilities. No
I/O happens here.

::

              RegisterStarted            RegisterAcked     Healthy check
    PENDING ─────────────────► REGISTERING ────────► (acked) ──────────► ACTIVE
       │                          │  │ Rejected                 ▲   │ lapse, unhealthy,
       │                          │  └─────────► FAILED         │   │ revoked, lease lost
       │                          │ Unknown                     │   ▼
       │                          └───────► OUTCOME_UNKNOWN     DEGRADED ◄─┐
       │                            (first write: blocked for ever)   │    │
       │                                                              │ LeaseLost, no
       │           RenewUnknown (idempotent renewal only)             │ unknown write:
       │   ACTIVE ──────────────► OUTCOME_UNKNOWN ── RenewAcked ──────┘ re-register
       │                                            + fresh check ──► ACTIVE
       │   DEGRADED (lost) ── re-registration, answer lost ──► OUTCOME_UNKNOWN
       │       idempotent register: repeated with the same record ── RegisterAcked
       │       + HEALTHY check started after it ──► ACTIVE (otherwise: blocked)
       │   ACTIVE/DEGRADED ── locally ineligible ──► INELIGIBLE (no renewals sent)
       │   INELIGIBLE ── eligible again, no renewal fell due meanwhile ──► ACTIVE
       │   INELIGIBLE ── a renewal fell due: RenewWithheld (withheld) ──┐
       │                                                               ▼
       │   eligible again ──► DEGRADED ── RenewAcked + HEALTHY check ──► ACTIVE
       │                      (withheld)   started after that renewal
       │
       └─ Quiesce ─► DEREGISTERING ── ack ──► DEREGISTERED   (RESIDUAL if
          (a handle, or an     └─ timeout/failure ──► OUTCOME_UNKNOWN    residual_risk)
          unknown write and a provider that removes by record)

Rules the table enforces (and the exhaustive tests check):

* a first registration whose outcome is unknown is never written again;
* after a lost answer, only a renewal (we hold an acknowledged handle) or a
  re-registration after a lost lease (acknowledged once, no handle now) may
  be repeated, with the same record; :func:`next_action` allows the first
  only for providers with ``idempotent_renewal`` and the second only for
  providers with ``idempotent_register`` (a register that is an upsert by
  identity); a repeat that definitely did not apply leaves the outcome
  unknown;
* after a lost renewal or re-registration answer, or after renewals were
  withheld while ineligible, ``ACTIVE`` needs both a new acknowledgement
  and a HEALTHY check started after it;
* a HEALTHY check grants evidence for ``grace`` seconds from the moment it
  *started* (a slow answer buys no extra time);
* a transient check failure keeps, and never extends, the last HEALTHY
  deadline; UNHEALTHY / MISSING / DISABLED / invalid evidence / revocation
  drop it at once;
* a check started under an older identity epoch changes nothing;
* re-registration after ``LeaseLost`` starts only from ``LOST``, which is
  reached by a definitive answer (or repeats a lost re-registration, above);
  a registration blocked in an unknown first write never gets there;
* a removal needs a handle, except for a write whose outcome is unknown
  (or a rejected write after one: the repeat of a lost re-registration
  refused with HTTP 400 says nothing about the lost write, which may have
  stored the record; or a lease lost after one, whose re-registration has
  no handle: the lost write may land after the registry said the record
  was gone), which :func:`next_action` removes only for providers with
  ``deregister_without_handle`` (the record alone names it);
* ``last_error`` names the last failure not yet recovered from: it is
  cleared by an acknowledged (re-)registration, a recovering renewal, or a
  HEALTHY check that makes the registration Active with no failed attempt
  pending;
* after quiesce nothing is registered, renewed, or confirmed again (the
  outcome of a write already in flight is still recorded, so a write that
  landed during shutdown is removed and one that was lost is reported).
"""

from __future__ import annotations

import enum
import math
import random as _random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeAlias

from ._errors import LifecycleError
from ._provider import HealthStatus

__all__ = [
    "Action",
    "CheckHealthy",
    "CheckInvalid",
    "CheckNegative",
    "CheckTransient",
    "DeregisterAcked",
    "DeregisterFailed",
    "DeregisterStarted",
    "EligibilityObserved",
    "Event",
    "HealthEvidence",
    "IdentityRevokedEvent",
    "QuiesceBegan",
    "RegisterAcked",
    "RegisterFailed",
    "RegisterRejected",
    "RegisterStarted",
    "RegisterUnknown",
    "RegistrationRecords",
    "RegistrationState",
    "RenewAcked",
    "RenewFailed",
    "RenewLeaseLost",
    "RenewUnknown",
    "RenewWithheld",
    "Retired",
    "WriteOutcome",
    "apply",
    "backoff_delay",
    "derive_state",
    "health_valid",
    "next_action",
    "retry_delay",
]


class WriteOutcome(enum.Enum):
    """What we know about the registry write."""

    NONE = "none"
    PENDING = "pending"
    ACKED = "acked"
    UNKNOWN = "unknown"
    LOST = "lost"
    REJECTED = "rejected"
    DEREGISTERING = "deregistering"
    DEREGISTERED = "deregistered"
    DEREGISTER_UNKNOWN = "deregister_unknown"


class HealthEvidence(enum.Enum):
    """The registry's confirmation of the registration's health."""

    NONE = "none"
    HEALTHY = "healthy"
    TRANSIENT_FAILURE = "transient_failure"
    UNHEALTHY = "unhealthy"
    MISSING = "missing"
    DISABLED = "disabled"
    INVALID = "invalid"
    REVOKED = "revoked"


class RegistrationState(enum.Enum):
    """The public state of one registration, derived from its records."""

    PENDING = "pending"
    REGISTERING = "registering"
    ACTIVE = "active"
    DEGRADED = "degraded"
    INELIGIBLE = "ineligible"
    OUTCOME_UNKNOWN = "outcome_unknown"
    DEREGISTERING = "deregistering"
    DEREGISTERED = "deregistered"
    RESIDUAL = "residual"
    FAILED = "failed"


class Action(enum.Enum):
    """What the async shell may do next (see :func:`next_action`)."""

    #: Send the first registration (or re-register after a lost lease).
    REGISTER = "register"
    #: Renew / re-apply the acknowledged record, then check health.
    RENEW = "renew"
    #: Repeat a renewal whose answer was lost (idempotent providers only).
    RETRY_RENEW = "retry_renew"
    #: Repeat, with the same record, a re-registration whose answer was lost
    #: (providers whose register is an upsert by identity only).
    RETRY_REGISTER = "retry_register"
    #: Nothing may be sent now (ineligible, or a write is in flight); check only.
    WAIT = "wait"
    #: Blocked: an unknown outcome (or a rejection) forbids any write.
    BLOCKED = "blocked"
    #: Quiescing: remove the registration (a handle is held, or the provider
    #: can address the removal with the record alone).
    DEREGISTER = "deregister"
    #: Nothing (more) to send; while quiescing the shell applies ``Retired``
    #: unless the write is already final.
    DONE = "done"


_NEG_INF = -math.inf


@dataclass(frozen=True, slots=True)
class RegistrationRecords:
    """The three records and their flags. Immutable; :func:`apply` makes new ones."""

    write: WriteOutcome = WriteOutcome.NONE
    health: HealthEvidence = HealthEvidence.NONE
    #: Deadline granted by the last HEALTHY check (kept, never extended, by
    #: transient failures); ``None`` when there is no usable evidence.
    healthy_until: float | None = None
    #: Identity epoch the health evidence was obtained under.
    health_epoch: int = 0
    eligible: bool = False
    #: Current identity epoch of the registration's connection.
    epoch: int = 0
    #: A write whose answer was lost may still take effect. Never cleared.
    residual_risk: bool = False
    #: We hold an acknowledged handle (``Registered``) for the record.
    handle: bool = False
    #: A write was sent at least once (something may exist remotely).
    written: bool = False
    #: The registry acknowledged a registration write at least once.
    acked_once: bool = False
    #: The registration has been Active at least once.
    confirmed: bool = False
    #: HEALTHY checks started before this time do not count (set when a
    #: renewal recovers from a lost answer).
    fresh_after: float = _NEG_INF
    quiescing: bool = False
    #: Renewals (the health publication) were withheld while ineligible:
    #: ``ACTIVE`` needs an acknowledged renewal and a HEALTHY check started
    #: after it first.
    withheld: bool = False
    #: Consecutive attempts in the current backoff sequence.
    attempt: int = 0
    #: The registration write in flight repeats one whose answer was lost:
    #: if it definitely does not apply, the earlier outcome is still unknown.
    repeating: bool = False
    #: Kind (class name) of the last failure not yet recovered from, for
    #: diagnostics; never a message. Cleared when the registration is
    #: acknowledged again, or confirmed Active with no failed attempt pending.
    last_error: str | None = None


# --- events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterStarted:
    """A registration write is about to be sent."""


@dataclass(frozen=True, slots=True)
class RegisterAcked:
    """The registry acknowledged the registration write."""


@dataclass(frozen=True, slots=True)
class RegisterUnknown:
    """The registration write's answer was lost (timeout, cancellation)."""

    error: str = "OutcomeUnknown"


@dataclass(frozen=True, slots=True)
class RegisterRejected:
    """The registry definitively refused the write."""

    error: str = "RegistrationRejected"


@dataclass(frozen=True, slots=True)
class RegisterFailed:
    """The write definitely did not apply (it never reached the registry)."""

    error: str = "ProviderFailure"


@dataclass(frozen=True, slots=True)
class RenewAcked:
    """A renewal was acknowledged."""


@dataclass(frozen=True, slots=True)
class RenewUnknown:
    """A renewal's answer was lost. ``creates``: the renewal could create the
    record if the registry no longer held it (a re-applied registration, a
    full heartbeat), so it may still land as a new record: residual risk.
    False for a renewal the registry refuses on a missing record (a TTL
    pass, a light beat): it may land, but cannot leave a record behind."""

    error: str = "OutcomeUnknown"
    creates: bool = True


@dataclass(frozen=True, slots=True)
class RenewLeaseLost:
    """The registry no longer holds the registration."""

    error: str = "LeaseLost"


@dataclass(frozen=True, slots=True)
class RenewFailed:
    """A renewal definitely did not apply (not sent); retried later."""

    error: str = "ProviderFailure"


@dataclass(frozen=True, slots=True)
class CheckHealthy:
    """A HEALTHY check result; it started at ``started_at`` under ``epoch``."""

    epoch: int
    started_at: float
    grace: float


@dataclass(frozen=True, slots=True)
class CheckTransient:
    """A check could not complete (incomplete, unknown, timeout)."""

    epoch: int
    error: str = "IncompleteSnapshot"


@dataclass(frozen=True, slots=True)
class CheckNegative:
    """The registry reports the registration UNHEALTHY, MISSING or DISABLED."""

    epoch: int
    status: HealthStatus


@dataclass(frozen=True, slots=True)
class CheckInvalid:
    """The registry's evidence about the registration is invalid."""

    epoch: int
    error: str = "InvalidSnapshot"


@dataclass(frozen=True, slots=True)
class IdentityRevokedEvent:
    """The connection's identity was revoked: a new epoch begins."""

    new_epoch: int


@dataclass(frozen=True, slots=True)
class EligibilityObserved:
    """Local eligibility as read now."""

    eligible: bool


@dataclass(frozen=True, slots=True)
class RenewWithheld:
    """A renewal fell due while locally ineligible and was not sent."""


@dataclass(frozen=True, slots=True)
class QuiesceBegan:
    """No more registrations, renewals or confirmations."""


@dataclass(frozen=True, slots=True)
class DeregisterStarted:
    """A deregistration is about to be sent (requires a held handle)."""


@dataclass(frozen=True, slots=True)
class DeregisterAcked:
    """The registry acknowledged the removal."""


@dataclass(frozen=True, slots=True)
class DeregisterFailed:
    """The removal failed or timed out: the record may remain."""

    error: str = "OutcomeUnknown"


@dataclass(frozen=True, slots=True)
class Retired:
    """Quiesce finished for a registration that needs no removal call."""


Event: TypeAlias = (
    RegisterStarted
    | RegisterAcked
    | RegisterUnknown
    | RegisterRejected
    | RegisterFailed
    | RenewAcked
    | RenewUnknown
    | RenewLeaseLost
    | RenewFailed
    | CheckHealthy
    | CheckTransient
    | CheckNegative
    | CheckInvalid
    | IdentityRevokedEvent
    | EligibilityObserved
    | RenewWithheld
    | QuiesceBegan
    | DeregisterStarted
    | DeregisterAcked
    | DeregisterFailed
    | Retired
)

_W = WriteOutcome
_H = HealthEvidence
_FINAL_WRITES = frozenset({_W.DEREGISTERED, _W.DEREGISTER_UNKNOWN})
_CLOSING_WRITES = frozenset({_W.DEREGISTERING}) | _FINAL_WRITES
_NEGATIVE = {
    HealthStatus.UNHEALTHY: _H.UNHEALTHY,
    HealthStatus.MISSING: _H.MISSING,
    HealthStatus.DISABLED: _H.DISABLED,
}


def _refuse(records: RegistrationRecords, event: Event) -> LifecycleError:
    return LifecycleError(
        f"registration event {type(event).__name__} is not allowed with write "
        f"{records.write.value}{' while quiescing' if records.quiescing else ''}"
    )


def _require(records: RegistrationRecords, event: Event, *writes: WriteOutcome) -> None:
    if records.write not in writes:
        raise _refuse(records, event)


def _require_active(records: RegistrationRecords, event: Event, *writes: WriteOutcome) -> None:
    if records.quiescing:
        raise _refuse(records, event)
    _require(records, event, *writes)


def _drop_health(records: RegistrationRecords, health: HealthEvidence) -> RegistrationRecords:
    return replace(records, health=health, healthy_until=None)


# Each handler: (records, event, now) -> records. Write events check their
# source outcome and raise LifecycleError when the shell asks for something
# the rules forbid; evidence and eligibility events are always accepted.


def _repeatable(r: RegistrationRecords) -> bool:
    """An unknown *re*-registration (after a lease was lost): the only unknown
    write without a handle that may be repeated, and only by providers whose
    register is an upsert by identity (the shell asks :func:`next_action`).
    A first registration whose outcome is unknown never is."""
    return r.write is _W.UNKNOWN and not r.handle and r.acked_once


def _on_register_started(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    # NONE: first write. LOST: re-registration under a new lease, allowed only
    # from a definitive loss. UNKNOWN: the repeat, with the same record, of a
    # re-registration whose answer was lost (never of a first write).
    # All require local eligibility: every submission re-checks it first.
    if not _repeatable(r):
        _require(r, e, _W.NONE, _W.LOST)
    if r.quiescing:
        raise _refuse(r, e)
    if not r.eligible:
        raise LifecycleError("a registration write requires local eligibility")
    return replace(r, write=_W.PENDING, handle=False, written=True, repeating=r.write is _W.UNKNOWN)


def _on_register_acked(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    _require(r, e, _W.PENDING)
    acked = replace(
        r, write=_W.ACKED, handle=True, acked_once=True, attempt=0, withheld=False, repeating=False
    )
    if r.quiescing:
        # The write raced with quiesce; it landed and must be removed.
        return acked
    if r.repeating:
        # Recovery from a lost answer: evidence gathered before this
        # acknowledgement proves nothing about it, so a HEALTHY check started
        # from now on is needed to become Active again.
        acked = replace(acked, health=_H.NONE, healthy_until=None, fresh_after=now)
    return replace(acked, last_error=None)


def _on_register_unknown(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RegisterUnknown)
    _require(r, e, _W.PENDING)
    return replace(
        r,
        write=_W.UNKNOWN,
        residual_risk=True,
        attempt=r.attempt + 1,
        repeating=False,
        last_error=e.error,
    )


def _on_register_rejected(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RegisterRejected)
    _require(r, e, _W.PENDING)
    return replace(r, write=_W.REJECTED, repeating=False, last_error=e.error)


def _on_register_failed(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RegisterFailed)
    _require(r, e, _W.PENDING)
    # The write never applied: back to where it came from (a re-registration
    # after a lost lease returns to LOST and keeps its old handle unusable; a
    # repeat of a lost answer returns to UNKNOWN: the earlier write's outcome
    # is still not known).
    if r.repeating:
        back = _W.UNKNOWN
    elif r.acked_once:
        back = _W.LOST
    else:
        back = _W.NONE
    return replace(r, write=back, attempt=r.attempt + 1, repeating=False, last_error=e.error)


def _on_renew_acked(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    _require(r, e, _W.ACKED, _W.UNKNOWN)
    if not r.handle:
        raise LifecycleError("a renewal needs an acknowledged registration handle")
    if r.write is _W.UNKNOWN or r.withheld:
        # Recovery from a lost answer (or from withheld renewals): the old
        # evidence may predate it, so a HEALTHY check started from now on is
        # needed to become Active again.
        return replace(
            r,
            write=_W.ACKED,
            attempt=0,
            health=_H.NONE,
            healthy_until=None,
            fresh_after=now,
            last_error=None,
            withheld=False,
        )
    return _settle_error(replace(r, attempt=0), now)


def _on_renew_unknown(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RenewUnknown)
    _require(r, e, _W.ACKED, _W.UNKNOWN)
    if not r.handle:
        raise LifecycleError("a renewal needs an acknowledged registration handle")
    # Only a renewal that could create the record leaves a residual risk: one
    # the registry refuses on a missing record cannot re-create it later.
    return replace(
        r,
        write=_W.UNKNOWN,
        residual_risk=r.residual_risk or e.creates,
        attempt=r.attempt + 1,
        last_error=e.error,
    )


def _on_renew_lease_lost(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RenewLeaseLost)
    _require(r, e, _W.ACKED, _W.UNKNOWN)
    if not r.handle:
        raise LifecycleError("a renewal needs an acknowledged registration handle")
    return replace(
        r, write=_W.LOST, health=_H.MISSING, healthy_until=None, attempt=0, last_error=e.error
    )


def _on_renew_failed(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, RenewFailed)
    _require(r, e, _W.ACKED, _W.UNKNOWN)
    return replace(r, attempt=r.attempt + 1, last_error=e.error)


def _evidence_ignored(r: RegistrationRecords, epoch: int) -> bool:
    # After quiesce nothing is confirmed any more; a check started under an
    # older identity cannot change today's evidence.
    return r.quiescing or r.write in _CLOSING_WRITES or epoch != r.epoch


def _on_check_healthy(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, CheckHealthy)
    if _evidence_ignored(r, e.epoch) or e.started_at < r.fresh_after:
        return r
    if not (math.isfinite(e.grace) and e.grace > 0):
        raise LifecycleError("observation grace must be finite and > 0")
    # The answer may describe the registry as of any moment after the check
    # started, so the grace counts from the start: a slow answer never buys
    # extra time.
    until = e.started_at + e.grace
    confirmed = r.confirmed or (r.write is _W.ACKED and r.eligible and now < until)
    healthy = replace(
        r,
        health=_H.HEALTHY,
        healthy_until=until,
        health_epoch=r.epoch,
        confirmed=confirmed,
    )
    return _settle_error(healthy, now)


def _settle_error(r: RegistrationRecords, now: float) -> RegistrationRecords:
    """Clear ``last_error`` once the registration is Active again with no
    failed attempt pending: the error is recovered from (every provider's
    recovery path ends here, whether or not it re-registered)."""
    if r.last_error is None or r.attempt > 0:
        return r
    if derive_state(r, now) is not RegistrationState.ACTIVE:
        return r
    return replace(r, last_error=None)


def _on_check_transient(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, CheckTransient)
    if _evidence_ignored(r, e.epoch):
        return r
    if r.health in (_H.HEALTHY, _H.TRANSIENT_FAILURE):
        # Keep, never extend, the deadline the last HEALTHY check granted.
        return replace(r, health=_H.TRANSIENT_FAILURE, last_error=e.error)
    return replace(r, last_error=e.error)


def _on_check_negative(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, CheckNegative)
    if _evidence_ignored(r, e.epoch):
        return r
    if e.status is HealthStatus.HEALTHY:
        raise LifecycleError("CheckNegative cannot carry HEALTHY")
    return _drop_health(r, _NEGATIVE[e.status])


def _on_check_invalid(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, CheckInvalid)
    if _evidence_ignored(r, e.epoch):
        return r
    return replace(_drop_health(r, _H.INVALID), last_error=e.error)


def _on_identity_revoked(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, IdentityRevokedEvent)
    if e.new_epoch <= r.epoch:
        raise LifecycleError("a revocation must start a newer identity epoch")
    revoked = _drop_health(r, _H.REVOKED)
    return replace(revoked, epoch=e.new_epoch, last_error="IdentityRevoked")


def _on_eligibility(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, EligibilityObserved)
    if r.eligible is e.eligible:
        return r
    return replace(r, eligible=e.eligible)


def _on_renew_withheld(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    _require_active(r, e, _W.ACKED, _W.UNKNOWN)
    if r.eligible or not r.handle:
        raise LifecycleError("a renewal is withheld only while ineligible, with a handle")
    return r if r.withheld else replace(r, withheld=True)


def _on_quiesce(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    if r.quiescing:
        return r
    return replace(r, quiescing=True)


def _on_deregister_started(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    if not r.quiescing:
        raise _refuse(r, e)
    _require(r, e, _W.ACKED, _W.UNKNOWN, _W.LOST, _W.REJECTED)
    # Without a handle only a write whose outcome is unknown is removed (or a
    # rejected write or a lost lease after one, with its residual risk), and
    # only by a provider that addresses removals by the record alone (the
    # shell asks next_action): the unknown write may have landed.
    unknown_earlier = r.write is _W.UNKNOWN or (
        r.write in (_W.REJECTED, _W.LOST) and r.residual_risk
    )
    if not r.handle and not unknown_earlier:
        raise LifecycleError("deregistration needs an acknowledged registration handle")
    return replace(r, write=_W.DEREGISTERING, healthy_until=None, health=_H.NONE)


def _on_deregister_acked(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    _require(r, e, _W.DEREGISTERING)
    return replace(r, write=_W.DEREGISTERED)


def _on_deregister_failed(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    assert isinstance(e, DeregisterFailed)
    _require(r, e, _W.DEREGISTERING)
    return replace(r, write=_W.DEREGISTER_UNKNOWN, last_error=e.error)


def _on_retired(r: RegistrationRecords, e: Event, now: float) -> RegistrationRecords:
    # Quiesce with nothing to remove: never written, rejected, lost with no
    # handle to address, or written with an unknown outcome and no handle
    # (the latter keeps UNKNOWN: something may exist that we cannot name).
    if not r.quiescing:
        raise _refuse(r, e)
    if r.write is _W.REJECTED and r.residual_risk:
        # Refused, but an earlier write whose answer was lost may have stored
        # the record and nothing could remove it: it stays FAILED, with its
        # residual risk (the close report says its outcome is unknown).
        return replace(r, healthy_until=None, health=_H.NONE)
    if r.write in (_W.NONE, _W.REJECTED) or (r.write is _W.LOST and not r.handle):
        # LOST: the registry itself said it no longer holds the record. With
        # residual risk (only where no removal could be addressed) the close
        # reports RESIDUAL: gone when it answered, but a lost write may land.
        return replace(r, write=_W.DEREGISTERED, healthy_until=None, health=_H.NONE)
    if r.write is _W.UNKNOWN and not r.handle:
        return replace(r, healthy_until=None, health=_H.NONE)
    raise _refuse(r, e)


Handler = Callable[[RegistrationRecords, Event, float], RegistrationRecords]

#: The transition table: event type -> handler.
TRANSITIONS: dict[type[Event], Handler] = {
    RegisterStarted: _on_register_started,
    RegisterAcked: _on_register_acked,
    RegisterUnknown: _on_register_unknown,
    RegisterRejected: _on_register_rejected,
    RegisterFailed: _on_register_failed,
    RenewAcked: _on_renew_acked,
    RenewUnknown: _on_renew_unknown,
    RenewLeaseLost: _on_renew_lease_lost,
    RenewFailed: _on_renew_failed,
    CheckHealthy: _on_check_healthy,
    CheckTransient: _on_check_transient,
    CheckNegative: _on_check_negative,
    CheckInvalid: _on_check_invalid,
    IdentityRevokedEvent: _on_identity_revoked,
    EligibilityObserved: _on_eligibility,
    RenewWithheld: _on_renew_withheld,
    QuiesceBegan: _on_quiesce,
    DeregisterStarted: _on_deregister_started,
    DeregisterAcked: _on_deregister_acked,
    DeregisterFailed: _on_deregister_failed,
    Retired: _on_retired,
}


def apply(records: RegistrationRecords, event: Event, now: float) -> RegistrationRecords:
    """Apply one event at time ``now``. Raises :class:`~nadisc.LifecycleError`
    when the rules forbid the event in this situation (records unchanged)."""
    return TRANSITIONS[type(event)](records, event, now)


def health_valid(records: RegistrationRecords, now: float) -> bool:
    """True when the health evidence confirms the registration at ``now``
    under the current identity epoch."""
    return (
        records.health in (_H.HEALTHY, _H.TRANSIENT_FAILURE)
        and records.healthy_until is not None
        and now < records.healthy_until
        and records.health_epoch == records.epoch
    )


def derive_state(records: RegistrationRecords, now: float) -> RegistrationState:
    """The public state at ``now``. Pure and total."""
    write = records.write
    if write is _W.DEREGISTERED:
        if records.residual_risk:
            return RegistrationState.RESIDUAL
        return RegistrationState.DEREGISTERED
    if write is _W.DEREGISTER_UNKNOWN:
        return RegistrationState.OUTCOME_UNKNOWN
    if write is _W.DEREGISTERING:
        return RegistrationState.DEREGISTERING
    if write is _W.REJECTED:
        return RegistrationState.FAILED
    if write is _W.UNKNOWN:
        return RegistrationState.OUTCOME_UNKNOWN
    if write is _W.NONE:
        return RegistrationState.PENDING
    if write is _W.PENDING:
        return RegistrationState.REGISTERING
    # ACKED or LOST: something was registered.
    if not records.eligible:
        return RegistrationState.INELIGIBLE
    if write is _W.LOST:
        return RegistrationState.DEGRADED
    if records.withheld:
        return RegistrationState.DEGRADED
    if health_valid(records, now):
        return RegistrationState.ACTIVE
    return RegistrationState.DEGRADED if records.confirmed else RegistrationState.REGISTERING


def next_action(
    records: RegistrationRecords,
    *,
    idempotent_renewal: bool,
    idempotent_register: bool = False,
    deregister_without_handle: bool = False,
) -> Action:
    """What the shell may do next, given the provider's capabilities
    (:class:`~nadisc.Capabilities` fields of the same names). Local
    eligibility is re-checked here for every submission: an ineligible
    registration sends nothing."""
    write = records.write
    if records.quiescing:
        if write in (_W.ACKED, _W.UNKNOWN, _W.LOST) and records.handle:
            return Action.DEREGISTER
        if write is _W.UNKNOWN and deregister_without_handle:
            # The unknown write may have landed; the record alone names it.
            return Action.DEREGISTER
        if write is _W.REJECTED and records.residual_risk and deregister_without_handle:
            # A refused write (the repeat of a lost re-registration, say)
            # proves nothing about the earlier write whose answer was lost:
            # it may have stored the record, which the record alone names.
            return Action.DEREGISTER
        if write is _W.LOST and records.residual_risk and deregister_without_handle:
            # The registry said the record was gone, but a write whose answer
            # was lost may land after that answer (requests on different
            # connections are not ordered): remove it by record, in case.
            return Action.DEREGISTER
        if write in (_W.PENDING, _W.DEREGISTERING):
            return Action.WAIT
        # Nothing to remove (or nothing we can name): the shell applies Retired.
        return Action.DONE
    if write is _W.REJECTED:
        return Action.BLOCKED
    if write is _W.UNKNOWN:
        if records.handle and idempotent_renewal:
            return Action.RETRY_RENEW if records.eligible else Action.WAIT
        if _repeatable(records) and idempotent_register:
            return Action.RETRY_REGISTER if records.eligible else Action.WAIT
        return Action.BLOCKED
    if write is _W.PENDING:
        return Action.WAIT
    if not records.eligible:
        return Action.WAIT
    if write in (_W.NONE, _W.LOST):
        return Action.REGISTER
    return Action.RENEW


def backoff_delay(
    attempt: int, initial: float, maximum: float, rng: _random.Random | None = None
) -> float:
    """Delay before retry number ``attempt`` (1-based): the cap doubles from
    ``initial`` up to ``maximum``, and the delay is drawn between half the
    cap and the cap (jitter keeps retries of many processes apart)."""
    if attempt < 1:
        raise ValueError("attempt counts from 1")
    if not (0 < initial <= maximum) or not math.isfinite(maximum):
        raise ValueError("backoff needs 0 < initial <= maximum, finite")
    cap = min(maximum, initial * 2.0 ** min(attempt - 1, 64))
    draw = (rng or _random).random()
    return cap / 2 + draw * (cap / 2)


def retry_delay(
    attempt: int,
    initial: float,
    maximum: float,
    renew_within: float | None = None,
    rng: _random.Random | None = None,
) -> float:
    """Delay before repeating a write whose answer was lost: the
    :func:`backoff_delay` of ``attempt`` (up to ``maximum``), but never later
    than ``renew_within`` when the registration's lease needs a renewal that
    soon (an etcd lease, a Nacos beat): waiting longer would let the record
    lapse. The connection's monitor interval does not shorten it."""
    delay = backoff_delay(attempt, initial, maximum, rng)
    if renew_within is None:
        return delay
    if not (math.isfinite(renew_within) and renew_within > 0):
        raise ValueError("renew_within must be finite and > 0")
    return min(delay, renew_within)
