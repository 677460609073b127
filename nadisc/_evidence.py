"""The evidence rules of one observation: a synchronous, clock-injected core.

An :class:`Evidence` record answers one question — *may this listing be used
now, and if not, why?* — from plain data and the time passed in. It never
reads a clock, never waits and never starts anything; the async shell in
:mod:`nadisc._observation` feeds it outcomes and asks it for views.

Rules (seconds on the event-loop clock; ``grace = min(max_age, stale_if_error)``)::

    outcome                              effect on what may be served
    ───────────────────────────────────  ─────────────────────────────────────
    complete listing (non-empty)         replaces the set; confirmed_at = now
    complete empty listing               revokes every old candidate at once
    refresh (registry: nothing changed)  confirmed_at = now (only while healthy)
    incomplete / capacity rejection      grace: usable until confirmed_at + grace
                                         (never extended by later failures);
                                         strict reads refuse at once
    complete set withheld (local limit)  as capacity rejection, and candidates
                                         the new set removed are never served
    identity revoked / invalid snapshot  nothing served until a complete listing
    close                                nothing served, ever
    age >= max_age                       stale (static facts do not age)

State diagram (``barrier`` is the no-grace outcome currently in force)::

             success(non-empty)                failure(incomplete|capacity)
    PENDING ─────────────────► FRESH ────────────────────────► GRACE
       │                        ▲  │ success(empty)              │
       │ revoked|invalid        │  └──────────► EMPTY            │ time
       ▼                        │ success                        ▼
    BARRIER(revoked|invalid) ───┘                              STALE
    close from anywhere ─► CLOSED (final)

Generation: ``generation`` moves when, and only when, an event (an outcome
or close) changes what a reader sees *at the event's time*, in the normal or
the strict view. "What a reader sees" is the refusal reason, or the usable
listing (its instances and evidence kind) and its ``degraded`` flag. Not a
change: a re-confirmation of the same listing (only ``confirmed_at`` moves),
a repeated failure of the same kind, a failure behind a revocation, invalid
answer or close (both views stay refused for that reason), a failure after
the listing already went stale. Time alone never moves the generation; it
changes the view only at :meth:`Evidence.expiry`. :meth:`Evidence.state_key`
(generation, normal refusal reason) therefore changes exactly when the
served views change, by an event or by time, which is what
``Observation.changed()`` waits for.

Cost: every call is O(1) except a view after a withheld set, which filters
the listing once (O(n)), and a failure or withheld set, which compares what
is served before and after (O(n) at most, for the allowed subset).
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from ._instance import EvidenceKind, Instance, ProviderSnapshot

__all__ = ["Backoff", "Evidence", "EvidencePolicy", "FailureKind", "Reason", "Refusal", "Usable"]


class Reason(enum.StrEnum):
    """Why an observation refuses to serve (``EvidenceUnavailable.reason``)."""

    #: No outcome yet: the first query has not finished.
    PENDING = "pending"
    #: The last complete listing is older than ``max_age`` (or its grace ran out).
    STALE = "stale"
    #: The last refresh was incomplete and the read is strict (or nothing is known).
    INCOMPLETE = "incomplete"
    #: A capacity limit refused the listing.
    CAPACITY = "capacity"
    #: The connection's identity or permission was revoked.
    REVOKED = "revoked"
    #: The registry's answer was confirmed invalid.
    INVALID = "invalid"
    #: The registry confirmed there are no instances.
    EMPTY = "empty"
    #: The listing is weaker evidence (``EvidenceKind.weak``) and the read is strict.
    WEAK = "weak"
    #: The owner closed.
    CLOSED = "closed"


class FailureKind(enum.Enum):
    """The kinds of failed refresh the core distinguishes."""

    #: Transport, timeout, paging or decoding: grace may apply.
    INCOMPLETE = "incomplete"
    #: The response was over a byte/instance limit: grace may apply.
    CAPACITY = "capacity"
    #: Confirmed invalid candidates: no grace.
    INVALID = "invalid"
    #: Identity or permission revoked or trimmed: no grace.
    REVOKED = "revoked"


_GRACE_KINDS = frozenset({FailureKind.INCOMPLETE, FailureKind.CAPACITY})


#: The messages of the reasons that say all there is to say by themselves.
_FIXED_MESSAGES: dict[Reason, str] = {
    Reason.CLOSED: "the observation is closed",
    Reason.REVOKED: "the connection's identity or permission was revoked",
    Reason.INVALID: "the registry's answer was confirmed invalid",
}


@dataclass(frozen=True, slots=True)
class EvidencePolicy:
    """The age rules, in seconds."""

    max_age: float
    stale_if_error: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_age) and self.max_age > 0):
            raise ValueError("max_age must be a finite number > 0")
        if not (math.isfinite(self.stale_if_error) and self.stale_if_error >= 0):
            raise ValueError("stale_if_error must be a finite number >= 0")

    @property
    def grace(self) -> float:
        return min(self.max_age, self.stale_if_error)


@dataclass(frozen=True, slots=True)
class Usable:
    """A view that may be used now."""

    instances: tuple[Instance, ...]
    evidence: EvidenceKind
    #: The record's generation when this view was taken.
    generation: int
    #: Time of the last complete listing (or confirmation).
    confirmed_at: float
    #: True while serving inside the grace window after a failed refresh.
    degraded: bool
    #: The opaque token the shell attached to the listing (capacity accounting).
    hold: object


@dataclass(frozen=True, slots=True)
class Refusal:
    """A view that must not be used, and why."""

    reason: Reason
    message: str


class Evidence:
    """The evidence record of one (connection, service) observation."""

    __slots__ = (
        "_allowed",
        "_barrier",
        "_confirmed_at",
        "_failure",
        "_hold",
        "_outcomes",
        "_snapshot",
        "generation",
        "policy",
        "version",
    )

    def __init__(self, policy: EvidencePolicy) -> None:
        self.policy = policy
        #: Grows by one when an event changes what a reader sees at that
        #: moment (see "Generation" in the module docstring); never otherwise.
        self.generation = 0
        #: Grows by one with every event recorded (success, refresh, failure,
        #: withheld listing, close), whether or not the view changed: a reader
        #: that cached :meth:`usable_until` re-checks when it moved.
        self.version = 0
        self._snapshot: ProviderSnapshot | None = None
        self._hold: object = None
        self._confirmed_at = -math.inf
        self._failure: FailureKind | None = None
        self._barrier: Reason | None = None
        self._allowed: frozenset[str] | None = None
        self._outcomes = 0

    # ------------------------------------------------------------------ facts

    @property
    def has_outcome(self) -> bool:
        """True once any outcome (success or failure) was recorded."""
        return self._outcomes > 0

    @property
    def closed(self) -> bool:
        return self._barrier is Reason.CLOSED

    @property
    def confirmed_at(self) -> float | None:
        """Time of the last complete listing or confirmation (None: never)."""
        return None if self._snapshot is None else self._confirmed_at

    @property
    def hold(self) -> object:
        return self._hold

    @property
    def failure(self) -> FailureKind | None:
        return self._failure

    def matches(self, snapshot: ProviderSnapshot) -> bool:
        """True if ``snapshot`` lists exactly what the current listing lists.

        O(1) when the counts differ (a tuple's ``==`` compares item by item
        before it looks at the lengths); otherwise up to the first
        difference, an identity test per unchanged instance.
        """
        current = self._snapshot
        if current is None or current.evidence is not snapshot.evidence:
            return False
        listed, instances = current.instances, snapshot.instances
        return len(listed) == len(instances) and listed == instances

    # ------------------------------------------------------------------ outcomes

    def on_success(
        self,
        snapshot: ProviderSnapshot,
        now: float,
        hold: object = None,
        *,
        matched: bool | None = None,
    ) -> bool:
        """A complete listing was observed at ``now``. Returns True if the view changed.

        ``matched``: what :meth:`matches` said of ``snapshot`` just before,
        with nothing recorded since (so the listing is not compared twice).
        """
        if self.closed:
            return False
        self.version += 1
        self._outcomes += 1
        if matched is None:
            matched = self.matches(snapshot)
        # A matching listing implies the same barrier (EMPTY iff empty).
        changed = not (matched and self._failure is None and self._allowed is None)
        self._snapshot = snapshot
        self._hold = hold
        self._confirmed_at = now
        self._failure = None
        self._allowed = None
        self._barrier = Reason.EMPTY if not snapshot.instances else None
        if changed:
            self.generation += 1
        return changed

    def on_refresh(self, now: float) -> bool:
        """The registry confirmed at ``now`` that the listing did not change.

        Only a healthy record is confirmed: a refresh cannot heal a failure or
        lift a revocation (that needs a complete listing). Never a view change.
        """
        if self._snapshot is None or self._failure is not None:
            return False
        if self._barrier not in (None, Reason.EMPTY):
            return False
        self.version += 1
        self._confirmed_at = max(self._confirmed_at, now)
        return False

    def on_failure(self, kind: FailureKind, now: float) -> bool:
        """A refresh failed at ``now``. Returns True if the view changed.

        ``now`` never moves the validity window; it only tells whether the
        served views change (a failure behind a revocation, or after the
        listing already went stale, changes nothing a reader sees).
        """
        if self.closed:
            return False
        self.version += 1
        self._outcomes += 1
        if kind in _GRACE_KINDS:
            if self._failure is kind:
                return False
            # Only the kind (the reason shown) changes; the window stays
            # anchored at the last complete listing.
            before = self._served(now)
            self._failure = kind
            return self._bump_if_changed(before, now)
        reason = Reason.REVOKED if kind is FailureKind.REVOKED else Reason.INVALID
        if self._barrier is reason and self._snapshot is None:
            return False
        self._barrier = reason
        self._snapshot = None
        self._hold = None
        self._allowed = None
        self._failure = None
        self.generation += 1
        return True

    def on_withheld(self, identities: frozenset[str], now: float) -> bool:
        """A complete listing with ``identities`` arrived but a local capacity
        limit kept it from being published.

        Counts as a capacity failure (grace from the last complete listing),
        and every old candidate the new listing no longer contains is revoked
        for good: it is not served again before a published listing has it.
        """
        if self.closed:
            return False
        self.version += 1
        self._outcomes += 1
        if self._barrier in (Reason.REVOKED, Reason.INVALID):
            # Nothing is served anyway; keep the stronger reason.
            return False
        before = self._served(now)
        if self._snapshot is not None:
            current = (
                self._allowed
                if self._allowed is not None
                else frozenset(self._snapshot.identities())
            )
            self._allowed = current & identities
        self._failure = FailureKind.CAPACITY
        return self._bump_if_changed(before, now)

    def close(self) -> bool:
        """Nothing is served any more. Idempotent; returns True the first time."""
        if self.closed:
            return False
        self.version += 1
        self._barrier = Reason.CLOSED
        self._snapshot = None
        self._hold = None
        self._allowed = None
        self._failure = None
        self.generation += 1
        return True

    # ------------------------------------------------------------------ generation

    def _served(self, now: float) -> tuple[object, object]:
        """What a reader sees at ``now``, normal and strict: the refusal
        reason, or the served instances, their evidence kind and the degraded
        flag (not the confirmation time: a re-confirmation is no change)."""
        return (self._seen_as(now, strict=False), self._seen_as(now, strict=True))

    def _seen_as(self, now: float, *, strict: bool) -> object:
        view = self.view(now, strict=strict)
        if isinstance(view, Refusal):
            return view.reason
        return (view.evidence, view.instances, view.degraded)

    def _bump_if_changed(self, before: tuple[object, object], now: float) -> bool:
        if self._served(now) == before:
            return False
        self.generation += 1
        return True

    # ------------------------------------------------------------------ views

    def _thresholds(self) -> tuple[float, float]:
        """(end of max age, end of grace) for the current listing."""
        snapshot = self._snapshot
        assert snapshot is not None
        if snapshot.evidence is EvidenceKind.STATIC_FACT:
            age_end = math.inf
        else:
            age_end = self._confirmed_at + self.policy.max_age
        grace_end = math.inf
        if self._failure is not None:
            grace_end = min(age_end, self._confirmed_at + self.policy.grace)
        return age_end, grace_end

    def _reason(self, now: float, strict: bool) -> Reason | None:
        """Why nothing may be served at ``now``, or None if the listing may
        be (the decision alone: no message is built)."""
        barrier = self._barrier
        if barrier is Reason.CLOSED or barrier is Reason.REVOKED or barrier is Reason.INVALID:
            return barrier
        failure = self._failure
        snapshot = self._snapshot
        if snapshot is None:
            if failure is FailureKind.CAPACITY:
                return Reason.CAPACITY
            if failure is FailureKind.INCOMPLETE:
                return Reason.INCOMPLETE
            return Reason.PENDING
        if failure is not None:
            if now >= self._limit():
                return Reason.CAPACITY if failure is FailureKind.CAPACITY else Reason.STALE
            if strict:
                return Reason.CAPACITY if failure is FailureKind.CAPACITY else Reason.INCOMPLETE
        elif now >= self._limit():
            return Reason.STALE
        if barrier is Reason.EMPTY:
            return Reason.EMPTY
        if strict and snapshot.evidence.weak:
            return Reason.WEAK
        # ``allowed`` only ever narrows the listing's own identities, so an
        # empty set means nothing is left to serve.
        if self._allowed is not None and not self._allowed:
            return Reason.CAPACITY
        return None

    def _refusal(self, now: float, strict: bool) -> Refusal | None:
        """:meth:`_reason` with the message that explains it."""
        reason = self._reason(now, strict)
        if reason is None:
            return None
        return Refusal(reason, self._explain(reason, now, strict))

    def _explain(self, reason: Reason, now: float, strict: bool) -> str:
        """The message for ``reason``, which :meth:`_reason` gave at ``now``."""
        fixed = _FIXED_MESSAGES.get(reason)
        if fixed is not None:
            return fixed
        snapshot = self._snapshot
        if snapshot is None:
            if reason is Reason.CAPACITY:
                return "a capacity limit refused the first listing"
            if reason is Reason.INCOMPLETE:
                return "no complete listing has been obtained"
            return "no listing has been obtained yet"
        if self._failure is not None:
            if now >= self._limit():
                return (
                    f"the last refresh failed and the grace of {self.policy.grace}s "
                    f"after the last complete listing ran out "
                    f"({now - self._confirmed_at:.3f}s ago)"
                )
            if strict:
                return "the last refresh failed and the read is strict"
        if reason is Reason.STALE:
            return (
                f"the last complete listing is {now - self._confirmed_at:.3f}s old "
                f"(max_age {self.policy.max_age}s)"
            )
        if reason is Reason.WEAK:
            return (
                f"the listing is weaker evidence ({snapshot.evidence.value}) and the read is strict"
            )
        if reason is Reason.CAPACITY:
            return "a newer complete listing removed every candidate but exceeded capacity"
        return "the registry lists no instances"

    def refusal(self, now: float, *, strict: bool = False) -> Refusal | None:
        """Why nothing may be served at ``now``; None when :meth:`view` is usable.
        Cheaper than :meth:`view` (builds nothing on success)."""
        return self._refusal(now, strict)

    def usable_until(self, now: float, *, strict: bool = False) -> float | None:
        """None when nothing may be served at ``now``; otherwise the instant
        from which the listing is refused by time alone (``inf``: never).

        Until :attr:`version` moves, every ``now`` before that instant gets
        the same answer from :meth:`refusal` (None): time alone refuses a
        listing only once its max age or its grace after a failure ran out.
        """
        if self._reason(now, strict) is not None:
            return None
        return self._limit()

    def view(self, now: float, *, strict: bool = False) -> Usable | Refusal:
        """What may be served at ``now`` (strict: no grace after a failure)."""
        refusal = self._refusal(now, strict)
        if refusal is not None:
            return refusal
        snapshot = self._snapshot
        assert snapshot is not None
        instances = snapshot.instances
        if self._allowed is not None:
            allowed = self._allowed
            instances = tuple(i for i in instances if i.identity in allowed)
        return Usable(
            instances=instances,
            evidence=snapshot.evidence,
            generation=self.generation,
            confirmed_at=self._confirmed_at,
            degraded=self._failure is not None,
            hold=self._hold,
        )

    def _limit(self) -> float:
        """When the current listing stops being usable by time alone."""
        age_end, grace_end = self._thresholds()
        return grace_end if self._failure is not None else age_end

    def _timeless(self) -> bool:
        return self._snapshot is None or self._barrier in (
            Reason.CLOSED,
            Reason.REVOKED,
            Reason.INVALID,
        )

    def _signature(self, now: float) -> Reason | None:
        return self._reason(now, False)

    def expiry(self, now: float) -> float:
        """The next time after ``now`` at which the (non-strict) view changes
        by time alone; ``inf`` when only an event can change it."""
        return self._expiry(now, self._signature(now))

    def _expiry(self, now: float, signature: Reason | None) -> float:
        """:meth:`expiry`, given ``_signature(now)``."""
        if self._timeless():
            return math.inf
        limit = self._limit()
        if limit > now and self._signature(limit) != signature:
            return limit
        return math.inf

    def key_and_expiry(self, now: float) -> tuple[tuple[int, Reason | None], float]:
        """``(state_key(now), expiry(now))``, the reason at ``now`` decided once."""
        signature = self._signature(now)
        return (self.generation, signature), self._expiry(now, signature)

    def state_key(self, now: float) -> tuple[int, Reason | None]:
        """Changes exactly when an event changed the record or the listing
        expired by time: ``(generation, refusal reason or None)``."""
        return (self.generation, self._signature(now))

    def __repr__(self) -> str:
        size = -1 if self._snapshot is None else len(self._snapshot.instances)
        return (
            f"<Evidence generation={self.generation} instances={size} "
            f"failure={self._failure} barrier={self._barrier}>"
        )


class Backoff:
    """Exponential backoff with jitter between half the current cap and the cap.

    The cap starts at ``initial`` and doubles after every delay handed out, up
    to ``maximum``; :meth:`reset` after a success. ``rng`` is injectable for
    tests (anything with ``uniform(a, b)``).
    """

    __slots__ = ("_attempt", "_rng", "initial", "maximum")

    def __init__(self, initial: float, maximum: float, *, rng: random.Random | None = None) -> None:
        if not (math.isfinite(initial) and initial > 0):
            raise ValueError("initial backoff must be a finite number > 0")
        if not (math.isfinite(maximum) and maximum >= initial):
            raise ValueError("max backoff must be finite and >= initial backoff")
        self.initial = initial
        self.maximum = maximum
        self._attempt = 0
        self._rng = rng if rng is not None else random.Random()

    @property
    def attempt(self) -> int:
        return self._attempt

    def cap(self) -> float:
        """The current cap (before the next delay)."""
        if self._attempt >= 64:
            return self.maximum
        return min(self.maximum, self.initial * (2.0**self._attempt))

    def next_delay(self) -> float:
        """The next delay, in ``[cap / 2, cap]``; then the cap doubles."""
        cap = self.cap()
        self._attempt += 1
        return self._rng.uniform(cap / 2.0, cap)

    def reset(self) -> None:
        self._attempt = 0
