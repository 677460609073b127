"""The flat pick data of a balance always says what its endpoints and trackers say.

A state machine edits a power-of-two-choices balance of PeakEwma endpoints
(and some that cannot be mirrored: InFlight, slow start, a tracker shared by
two endpoints) with every membership operation, drains, held calls that
complete, fail or are cancelled, and the passing of time. After every step
the pick table mirrors the trackers exactly, and a pick from the flat lists
chooses what the policy itself chooses with the same generator state.
"""

from __future__ import annotations

import random
from collections.abc import Coroutine
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import (
    Balance,
    ConcurrencyLimit,
    Endpoint,
    Held,
    InFlight,
    LoadTracker,
    PeakEwma,
    PowerOfTwoChoices,
    ReadinessState,
    SelectionError,
    service_fn,
)
from tests.poise._balance_support import assert_flat_mirrors

KEYS = [f"k{i}" for i in range(7)]
KINDS = ["ewma", "ewma", "ewma", "no_age_floor", "limit", "inflight", "slow_start", "shared"]


async def _echo(request: object) -> object:
    return request


def _run(coroutine: Coroutine[Any, Any, Held[object]]) -> Held[object]:
    """Drive a call that never yields (its services do not) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        held: Held[object] = stop.value
        return held
    coroutine.close()
    raise AssertionError("the call yielded")


class FlatPickMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rng = random.Random(7)
        self.policy = PowerOfTwoChoices(self.rng)
        self.balance: Balance[object, object] = Balance(self.policy, clock=lambda: self.now)
        self.shared = PeakEwma()
        self.held: list[Held[object]] = []
        self.made: list[Endpoint[object, object]] = []

    def _new(self, key: str, kind: str) -> Endpoint[object, object]:
        tracker: LoadTracker
        service: object = service_fn(_echo)
        if kind == "inflight":
            tracker = InFlight()
        elif kind == "slow_start":
            tracker = PeakEwma(slow_start=5.0)
        elif kind == "shared":
            tracker = self.shared
        elif kind == "no_age_floor":
            tracker = PeakEwma(age_floor=False, default_rtt=0.01)
        else:
            tracker = PeakEwma(default_rtt=0.02, decay=2.0)
            if kind == "limit":
                service = ConcurrencyLimit(service_fn(_echo), 1)
        ep: Endpoint[object, object] = Endpoint(key, service, tracker=tracker)  # type: ignore[arg-type]
        self.made.append(ep)
        return ep

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

    @rule(request=st.integers())
    def call(self, request: int) -> None:
        try:
            ready = self.balance.ready_nowait()
        except SelectionError:
            return
        if ready:
            held = _run(self.balance.call_held(request))
            assert held.response == request
            self.held.append(held)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), how=st.sampled_from(["ok", "failed", "cancel"]))
    def release(self, data: st.DataObject, how: str) -> None:
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if how == "cancel":
            held.cancel()
        else:
            held.complete(failed=how == "failed")

    @rule(flat_first=st.booleans())
    def pick_agrees(self, flat_first: bool) -> None:
        b = self.balance
        try:
            b.ready_nowait()
        except SelectionError:
            return
        if not b._ready or b._table.unbound:
            return
        state = self.rng.getstate()
        runs: dict[str, int] = {}
        order = ["flat", "policy"] if flat_first else ["policy", "flat"]
        for which in order:
            self.rng.setstate(state)
            if which == "flat":
                runs[which] = b._table.pick(b._rslots, self.rng.random, self.now)
            else:
                runs[which] = self.policy.pick(b._ready, None, self.now)
        assert runs["flat"] == runs["policy"]

    # -- invariants -------------------------------------------------------------

    @invariant()
    def table_mirrors_the_trackers(self) -> None:
        assert_flat_mirrors(self.balance)
        members = {id(ep) for ep in self.balance.endpoints}
        for ep in self.made:
            if id(ep) not in members:
                assert ep._fslot == -1
                tracker = ep.tracker
                if isinstance(tracker, PeakEwma) and tracker is not self.shared:
                    assert tracker._table is None
        for ep in self.balance.endpoints:
            if ep.state is ReadinessState.READY:
                assert ep.eligible

    def teardown(self) -> None:
        for held in self.held:
            held.cancel()


FlatPickMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_flat_pick_machine = FlatPickMachine.TestCase
