"""The flat load state of a balance always says what a plain model of PeakEwma says.

A state machine edits a power-of-two-choices balance of PeakEwma endpoints
(and some a pick cannot read flat: InFlight, slow start; and a tracker
shared by two endpoints) with every membership operation, drains, held
calls that complete, fail or are cancelled, dispatches that stay in flight
and then return, fail, are declined or are cancelled, and the passing of
time. Every PeakEwma tracker has a twin: a plain reference model of the
documented rules (one estimate, one list of the calls in flight), fed the
same calls at the same times. After every step each tracker reads exactly
what its model computes (stored estimate, last update, calls in flight,
observations and the cost with its age floor), the table is consistent,
and a pick, inline in ``Balance.dispatch`` or through the table, chooses
what the policy itself chooses through ``load()`` with the same generator
state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import (
    Balance,
    CallDeclined,
    ConcurrencyLimit,
    Endpoint,
    EndpointError,
    Held,
    InFlight,
    LoadTracker,
    PeakEwma,
    PowerOfTwoChoices,
    ReadinessState,
    SelectionError,
    service_fn,
)
from poise._flat import pick
from tests.poise._balance_support import assert_flat_mirrors

KEYS = [f"k{i}" for i in range(7)]
KINDS = ["ewma"] * 5 + ["no_age_floor", "limit", "limit", "inflight", "slow_start", "shared"]
_MIN = 1e-6


@dataclass
class Model:
    """PeakEwma's rules as its module docs state them, over plain fields."""

    default_rtt: float
    rate: float
    penalty: float
    age_floor: bool
    evidence: bool
    slow_start: float
    scale: float
    estimate: float = 0.0
    updated: float | None = None
    starts: list[float] = field(default_factory=list)
    observations: int = 0

    @classmethod
    def of(cls, tracker: PeakEwma) -> Model:
        return cls(
            default_rtt=tracker.default_rtt,
            rate=1.0 / tracker.decay,
            penalty=tracker.failure_penalty,
            age_floor=tracker.age_floor,
            evidence=tracker.cancel_evidence,
            slow_start=tracker.slow_start,
            scale=tracker.slow_start_scale,
            estimate=tracker.default_rtt,
        )

    def faded(self, now: float) -> float:
        assert self.updated is not None
        estimate = self.estimate
        gap = now - self.updated
        if gap > 0.0:
            estimate *= math.exp(-gap * self.rate)
            estimate = max(estimate, _MIN)
        return estimate

    def load(self, now: float, epoch: float) -> float:
        estimate = self.faded(now)
        if self.starts and self.age_floor and now - min(self.starts) > estimate:
            estimate = now - min(self.starts)
        cost = estimate * (len(self.starts) + 1)
        if self.slow_start > 0.0 and now - epoch < self.slow_start:
            remaining = 1.0 - max(now - epoch, 0.0) / self.slow_start
            cost *= 1.0 + (self.scale - 1.0) * remaining
        return cost

    def start(self, now: float) -> None:
        if self.updated is None:
            self.updated = now
        self.starts.append(now)

    def complete(self, started: float, now: float, failed: bool) -> None:
        assert self.updated is not None
        self.starts.remove(started)
        rtt = now - started
        elapsed = now - self.updated
        weight = math.exp(-elapsed * self.rate) if elapsed > 0.0 else 1.0
        estimate = self.estimate * weight
        if failed and self.penalty > 0.0:
            cap = max(rtt, 10.0 * self.penalty)
            rtt = max(rtt, self.penalty, min(2.0 * estimate, cap), estimate)
        if rtt > estimate:
            estimate = rtt
        else:
            estimate = max(estimate * weight + rtt * (1.0 - weight), _MIN)
        self.estimate = estimate
        self.updated = max(self.updated, now)
        self.observations += 1

    def cancel(self, started: float, now: float) -> None:
        assert self.updated is not None
        self.starts.remove(started)
        age = now - started
        if self.evidence and age > 0.0 and age > self.faded(now):
            self.estimate = age
            self.updated = max(self.updated, now)


class _Suspend:
    """An awaitable that yields once to whoever drives the coroutine by hand."""

    def __await__(self) -> Generator[str, None, None]:
        yield "suspended"


async def _no_checkpoint() -> None:
    """Dispatch's checkpoint, for a coroutine driven by hand (no event loop)."""


def _run(coroutine: Coroutine[Any, Any, Held[object]]) -> Held[object]:
    """Drive a call that never yields (its services do not) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        held: Held[object] = stop.value
        return held
    coroutine.close()
    raise AssertionError("the call yielded")


class _Cancelled(BaseException):
    """Stands for the event loop's cancellation."""


@dataclass
class Flying:
    """A dispatch suspended in its service."""

    coroutine: Coroutine[Any, Any, object]
    tracker: LoadTracker
    started: float


class FlatPickMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rng = random.Random(7)
        self.policy = PowerOfTwoChoices(self.rng)
        self.balance: Balance[object, object] = Balance(self.policy, clock=lambda: self.now)
        self.balance._checkpoint = _no_checkpoint
        self.shared = PeakEwma()
        self.held: list[tuple[Held[object], LoadTracker, float]] = []
        self.flying: list[Flying] = []
        self.made: list[Endpoint[object, object]] = []
        self.models: dict[int, Model] = {}
        self.epochs: dict[int, float] = {}
        # What a service call does: "" returns at once, "suspend" yields first.
        self.mode = ""
        self.served: list[int] = []

    def _serve(self, token: int) -> Callable[[object], Coroutine[Any, Any, object]]:
        async def serve(request: object) -> object:
            self.served.append(token)
            if self.mode == "suspend":
                await _Suspend()
            return request

        return serve

    def _new(self, key: str, kind: str) -> Endpoint[object, object]:
        token = len(self.made)
        tracker: LoadTracker
        service: object = service_fn(self._serve(token))
        if kind == "inflight":
            tracker = InFlight()
        elif kind == "slow_start":
            tracker = PeakEwma(slow_start=5.0)
        elif kind == "shared":
            tracker = self.shared
        elif kind == "no_age_floor":
            tracker = PeakEwma(age_floor=False, default_rtt=0.01, cancel_evidence=False)
        else:
            tracker = PeakEwma(default_rtt=0.02, decay=2.0, failure_penalty=0.5)
            if kind == "limit":
                service = ConcurrencyLimit(service_fn(self._serve(token)), 1)
        if isinstance(tracker, PeakEwma) and id(tracker) not in self.models:
            self.models[id(tracker)] = Model.of(tracker)
        ep: Endpoint[object, object] = Endpoint(key, service, tracker=tracker)  # type: ignore[arg-type]
        self.made.append(ep)
        return ep

    def _model(self, tracker: LoadTracker) -> Model | None:
        return self.models.get(id(tracker)) if isinstance(tracker, PeakEwma) else None

    def _keys(self) -> list[object]:
        return [ep.key for ep in self.balance.endpoints]

    # -- membership (the operations a reconcile commit uses) ------------------

    @rule(key=st.sampled_from(KEYS), kind=st.sampled_from(KINDS))
    def push(self, key: str, kind: str) -> None:
        if key not in self._keys():
            self.balance.push(self._new(key, kind))

    @precondition(lambda self: len(self.balance) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        self.balance.remove(data.draw(st.sampled_from(self._keys())))

    @rule(data=st.data())
    def splice(self, data: st.DataObject) -> None:
        keys = self._keys()
        removed = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
        rest = [key for key in keys if key not in removed]
        swapped = data.draw(st.lists(st.sampled_from(rest), unique=True)) if rest else []
        free = [key for key in KEYS if key not in keys]
        added = data.draw(st.lists(st.sampled_from(free), unique=True)) if free else []
        kinds = st.sampled_from(KINDS)
        self.balance.splice(
            removed=removed,
            replaced=[(key, self._new(str(key), data.draw(kinds))) for key in swapped],
            appended=[self._new(key, data.draw(kinds)) for key in added],
        )

    @rule(data=st.data())
    def replace_endpoints(self, data: st.DataObject) -> None:
        kept = data.draw(st.permutations(list(self.balance.endpoints)))
        kept = kept[: data.draw(st.integers(0, len(kept)))]
        taken = {ep.key for ep in kept}
        free = [key for key in KEYS if key not in taken]
        added = data.draw(st.lists(st.sampled_from(free), unique=True)) if free else []
        kinds = st.sampled_from(KINDS)
        self.balance.replace_endpoints(kept + [self._new(key, data.draw(kinds)) for key in added])

    @precondition(lambda self: len(self.balance) > 0)
    @rule(data=st.data(), eligible=st.booleans())
    def drain(self, data: st.DataObject, eligible: bool) -> None:
        self.balance.endpoint(data.draw(st.sampled_from(self._keys()))).eligible = eligible

    # -- loads ----------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.0, 0.001, 0.03, 0.5, 4.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    def _ready(self) -> bool:
        try:
            return self.balance.ready_nowait()
        except SelectionError:
            return False

    def _started(self, tracker: LoadTracker) -> None:
        model = self._model(tracker)
        if model is not None:
            model.start(self.now)

    @rule(request=st.integers())
    def call(self, request: int) -> None:
        if self._ready():
            self.mode = ""
            held = _run(self.balance.call_held(request))
            assert held.response == request
            tracker = self.made[self.served[-1]].tracker
            self._started(tracker)
            self.held.append((held, tracker, self.now))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), how=st.sampled_from(["ok", "failed", "cancel"]))
    def release(self, data: st.DataObject, how: str) -> None:
        held, tracker, started = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        model = self._model(tracker)
        if how == "cancel":
            held.cancel()
            if model is not None:
                model.cancel(started, self.now)
        else:
            held.complete(failed=how == "failed")
            if model is not None:
                model.complete(started, self.now, how == "failed")

    @rule(request=st.integers(), suspend=st.booleans())
    def dispatch(self, request: int, suspend: bool) -> None:
        """A dispatch picks what the policy picks; it returns at once or stays in flight."""
        b = self.balance
        if not self._ready():
            return
        state = self.rng.getstate()
        expected = b._ready[self.policy.pick(b._ready, None, self.now)]
        self.rng.setstate(state)
        self.mode = "suspend" if suspend else ""
        coroutine = b.dispatch(request)
        try:
            coroutine.send(None)
        except StopIteration as stop:
            assert stop.value == request
            assert not suspend
            flying = None
        else:
            assert suspend
            flying = coroutine
        picked = self.made[self.served[-1]]
        assert picked is expected
        tracker = picked.tracker
        self._started(tracker)
        if flying is None:
            model = self._model(tracker)
            if model is not None:
                model.complete(self.now, self.now, False)
        else:
            self.flying.append(Flying(flying, tracker, self.now))

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), how=st.sampled_from(["ok", "failed", "declined", "cancel"]))
    def land(self, data: st.DataObject, how: str) -> None:
        """A suspended dispatch returns, fails, is declined or is cancelled now."""
        flying = self.flying.pop(data.draw(st.integers(0, len(self.flying) - 1)))
        coroutine = flying.coroutine
        model = self._model(flying.tracker)
        if how == "ok":
            try:
                coroutine.send(None)
            except StopIteration:
                pass
            else:
                raise AssertionError("the dispatch yielded twice")
            if model is not None:
                model.complete(flying.started, self.now, False)
            return
        error: BaseException = {
            "failed": OSError("down"),
            "declined": CallDeclined("not sent"),
            "cancel": _Cancelled(),
        }[how]
        try:
            coroutine.throw(error)
        except EndpointError as exc:
            assert how == "failed" and exc.__cause__ is error
        except BaseException as exc:
            assert exc is error
        else:
            raise AssertionError("the dispatch swallowed the error")
        if model is not None:
            if how == "failed":
                model.complete(flying.started, self.now, True)
            elif how == "declined":
                model.cancel(flying.started, flying.started)
            else:
                model.cancel(flying.started, self.now)

    @rule(flat_first=st.booleans())
    def pick_agrees(self, flat_first: bool) -> None:
        b = self.balance
        if not self._ready() or b._unbound:
            return
        state = self.rng.getstate()
        runs: dict[str, int] = {}
        order = ["flat", "policy"] if flat_first else ["policy", "flat"]
        for which in order:
            self.rng.setstate(state)
            if which == "flat":
                runs[which] = pick(b._rrows, self.rng.random, self.now)  # type: ignore[arg-type]
            else:
                runs[which] = self.policy.pick(b._ready, None, self.now)
        assert runs["flat"] == runs["policy"]

    # -- invariants -------------------------------------------------------------

    @invariant()
    def trackers_say_what_their_models_say(self) -> None:
        trackers = {id(ep.tracker): ep.tracker for ep in self.made}
        for key, model in self.models.items():
            tracker = trackers[key]
            assert isinstance(tracker, PeakEwma)
            if model.updated is None and tracker.updated_at is not None:
                # First used by a pick that read it (and did not choose it):
                # a pick runs at the current time.
                assert tracker.updated_at == self.now and not model.starts
                model.updated = tracker.updated_at
            if model.updated is not None and key not in self.epochs:
                self.epochs[key] = model.updated
            assert tracker.updated_at == model.updated
            assert tracker.rtt_estimate == model.estimate
            assert tracker.in_flight == len(model.starts)
            assert tracker.observations == model.observations
            if model.updated is not None:
                # No side effect once used.
                assert tracker.load(self.now) == model.load(self.now, self.epochs[key])

    @invariant()
    def table_is_consistent(self) -> None:
        assert_flat_mirrors(self.balance)
        for ep in self.balance.endpoints:
            if ep.state is ReadinessState.READY:
                assert ep.eligible
        in_flight = len(self.held) + len(self.flying)
        assert self.balance.statistics().in_flight == in_flight

    def teardown(self) -> None:
        for held, _, _ in self.held:
            held.cancel()
        for flying in self.flying:
            flying.coroutine.close()
        assert self.balance.statistics().in_flight == 0
        for ep in self.made:
            tracker = ep.tracker
            assert not isinstance(tracker, PeakEwma | InFlight) or tracker.in_flight == 0


FlatPickMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_flat_pick_machine = FlatPickMachine.TestCase
