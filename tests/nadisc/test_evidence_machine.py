"""A hypothesis state machine over the evidence core.

Random complete listings (empty or not), failures of every kind, withheld
listings, refreshes, closes and time steps; after every step every rule is
checked against a plain model of "what the seed allows". Every event is also
checked against the generation rule: the generation moves only when what a
reader sees (normal or strict view) changes, and the state key that
``changed()`` waits on moves exactly then.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nadisc import EvidenceKind, Instance, ProviderSnapshot
from nadisc._evidence import Evidence, EvidencePolicy, FailureKind, Reason, Refusal, Usable

POOL = ("a", "b", "c", "d", "e")
MAX_AGE = 10.0

ids_strategy = st.frozensets(st.sampled_from(POOL), max_size=len(POOL))


def snap(ids: frozenset[str], static: bool) -> ProviderSnapshot:
    kind = EvidenceKind.STATIC_FACT if static else EvidenceKind.REGISTRY_HEALTH
    return ProviderSnapshot(
        "svc", tuple(Instance(i, "10.0.0.1", 80 + POOL.index(i)) for i in sorted(ids)), kind
    )


def seen(view: Usable | Refusal) -> object:
    """What a reader sees in a view (not its generation or confirmation time)."""
    if isinstance(view, Refusal):
        return view.reason
    return (view.evidence, view.instances, view.degraded)


class EvidenceMachine(RuleBasedStateMachine):
    @initialize(grace=st.sampled_from([0.0, 2.5, 4.0, MAX_AGE]), static=st.booleans())
    def setup(self, grace: float, static: bool) -> None:
        self.grace = grace
        self.static = static
        self.ev = Evidence(EvidencePolicy(max_age=MAX_AGE, stale_if_error=grace))
        self.now = 1000.0
        # the model
        self.success_at: float | None = None
        self.success_ids: frozenset[str] = frozenset()
        self.failed = False
        self.failure_kind: FailureKind | None = None
        self.no_grace: Reason | None = None  # revoked / invalid since last success
        self.closed = False
        self.removed: set[str] = set()  # removed by a withheld set since the last success
        self.any_outcome = False

    # ------------------------------------------------------------ steps

    def served(self) -> tuple[object, object]:
        return (seen(self.ev.view(self.now)), seen(self.ev.view(self.now, strict=True)))

    def event(self, apply: Callable[[], bool]) -> None:
        """Apply one event and check the generation rule around it."""
        generation, key, before = self.ev.generation, self.ev.state_key(self.now), self.served()
        reported = apply()
        moved = self.ev.generation != generation
        changed = self.served() != before
        assert moved == reported, (reported, moved)
        assert moved <= changed, ("the generation moved but nothing seen changed", before)
        assert (self.ev.state_key(self.now) != key) == changed, (before, self.served())
        assert not moved or self.ev.generation == generation + 1

    @rule(ids=ids_strategy)
    def success(self, ids: frozenset[str]) -> None:
        self.event(lambda: self.ev.on_success(snap(ids, self.static), self.now))
        self.any_outcome = True
        if self.closed:
            return
        self.success_at = self.now
        self.success_ids = ids
        self.failed = False
        self.failure_kind = None
        self.no_grace = None
        self.removed = set()

    @rule(kind=st.sampled_from(list(FailureKind)))
    def failure(self, kind: FailureKind) -> None:
        self.event(lambda: self.ev.on_failure(kind, self.now))
        self.any_outcome = True
        if self.closed:
            return
        if kind in (FailureKind.REVOKED, FailureKind.INVALID):
            self.no_grace = Reason.REVOKED if kind is FailureKind.REVOKED else Reason.INVALID
            self.success_at = None
            self.success_ids = frozenset()
            self.failed = False
            self.failure_kind = None
            self.removed = set()
        else:
            self.failed = True
            self.failure_kind = kind

    @rule(ids=ids_strategy)
    def withheld(self, ids: frozenset[str]) -> None:
        self.event(lambda: self.ev.on_withheld(ids, self.now))
        self.any_outcome = True
        if self.closed or self.no_grace is not None:
            return
        self.removed |= set(self.success_ids - ids)
        self.failed = True
        self.failure_kind = FailureKind.CAPACITY

    @rule()
    def refresh(self) -> None:
        self.event(lambda: self.ev.on_refresh(self.now))
        if (
            not self.closed
            and self.no_grace is None
            and self.success_at is not None
            and not self.failed
        ):
            self.success_at = self.now

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 7.0, 12.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(sometimes=st.integers(0, 9))
    def close(self, sometimes: int) -> None:
        if sometimes == 0:  # rare, so that runs go on after it mostly
            self.event(self.ev.close)
            self.closed = True

    # ------------------------------------------------------------ the rules

    def expected_ids(self) -> frozenset[str] | None:
        """What may be served non-strictly now (None: nothing)."""
        if self.closed or self.no_grace is not None or self.success_at is None:
            return None
        age = self.now - self.success_at
        if not self.static and age >= MAX_AGE:
            return None
        if self.failed:
            grace_end = self.success_at + min(self.grace, MAX_AGE)
            if not self.static:
                grace_end = min(grace_end, self.success_at + MAX_AGE)
            if self.now >= grace_end:
                return None
        ids = self.success_ids - self.removed
        return ids or None

    @invariant()
    def views_follow_the_rules(self) -> None:
        if not hasattr(self, "ev"):
            return
        view = self.ev.view(self.now)
        strict = self.ev.view(self.now, strict=True)
        expected = self.expected_ids()
        if expected is None:
            assert isinstance(view, Refusal), (view, self.__dict__)
        else:
            assert isinstance(view, Usable), (view, self.__dict__)
            served = frozenset(i.identity for i in view.instances)
            # complete, never truncated, never a removed candidate
            assert served == expected
            assert not (served & self.removed)
            assert view.degraded == self.failed
        # strict reads refuse after any failure
        if self.failed or expected is None:
            assert isinstance(strict, Refusal)
        else:
            assert isinstance(strict, Usable)

    @invariant()
    def refusal_reasons(self) -> None:
        if not hasattr(self, "ev"):
            return
        view = self.ev.view(self.now)
        if not isinstance(view, Refusal):
            return
        if self.closed:
            assert view.reason is Reason.CLOSED
        elif self.no_grace is not None:
            assert view.reason is self.no_grace
        elif self.success_at is None:
            assert view.reason in (Reason.PENDING, Reason.INCOMPLETE, Reason.CAPACITY)
            if not self.any_outcome:
                assert view.reason is Reason.PENDING
        elif not self.success_ids and self.expected_ids() is None:
            assert view.reason in (Reason.EMPTY, Reason.STALE, Reason.CAPACITY)

    @invariant()
    def the_state_key_and_the_time_limit_read_the_refusal_s_reason(self) -> None:
        if not hasattr(self, "ev"):
            return
        for strict in (False, True):
            refusal = self.ev.refusal(self.now, strict=strict)
            until = self.ev.usable_until(self.now, strict=strict)
            assert (refusal is None) == (until is not None)
            if refusal is not None:
                assert refusal.message
        refusal = self.ev.refusal(self.now)
        reason = None if refusal is None else refusal.reason
        assert self.ev.state_key(self.now) == (self.ev.generation, reason)
        assert self.ev.key_and_expiry(self.now) == (
            self.ev.state_key(self.now),
            self.ev.expiry(self.now),
        )

    @invariant()
    def expiry_is_consistent(self) -> None:
        if not hasattr(self, "ev"):
            return
        now = self.now
        expiry = self.ev.expiry(now)
        assert expiry > now
        key = self.ev.state_key(now)
        usable = isinstance(self.ev.view(now), Usable)
        probes = [now + 0.25, now + 3.0, now + 50.0]
        if math.isfinite(expiry):
            probes += [(now + expiry) / 2, expiry - 1e-6]
        for t in probes:
            if t < expiry:
                # nothing changes by time alone before the expiry
                assert self.ev.state_key(t) == key
                assert isinstance(self.ev.view(t), Usable) == usable
        if math.isfinite(expiry):
            assert self.ev.state_key(expiry) != key
            # at the expiry the view really changes: usable -> refused, or
            # (an explicit empty that aged out) empty -> stale
            after = self.ev.view(expiry)
            assert isinstance(after, Refusal)
            before = self.ev.view(now)
            assert isinstance(before, Usable) or before.reason != after.reason
        elif self.static and usable:
            assert isinstance(self.ev.view(now + 1e9), Usable)

    @invariant()
    def failures_never_extend_validity(self) -> None:
        if not hasattr(self, "ev") or not self.failed or self.success_at is None:
            return
        expiry = self.ev.expiry(self.now)
        bound = self.success_at + min(self.grace, MAX_AGE)
        assert expiry == math.inf or expiry <= bound


EvidenceMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestEvidenceMachine = EvidenceMachine.TestCase
