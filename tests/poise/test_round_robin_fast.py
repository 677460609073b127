"""RoundRobin's fast path (the same ready list as at the last pick) against
the rule written out plainly: the least recently picked ready key, never
picked first, ties to the first in ready order, keys forgotten after
``max(horizon, 2 x len(ready))`` picks.

The machine mutates one ready list in place (as a Balance does), replaces
it, repeats picks on an unchanged list and reorders it, with a horizon
small enough that sweeps happen; every pick and peek must equal the
model's, and so must the number of keys remembered.
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import RoundRobin

KEYS = [f"k{n}" for n in range(8)]


class Item:
    """A ready endpoint as a policy sees it (compared by identity, like Endpoint)."""

    __slots__ = ("key", "weight")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.weight = 1.0

    def load(self, now: float) -> float:
        return 0.0


class Model:
    """The rule, with no shortcut."""

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.stamps: dict[Hashable, int] = {}
        self.tick = 0
        self.sweep_at = horizon

    def pick(self, keys: list[Hashable]) -> int:
        stamps = [self.stamps.get(key, 0) for key in keys]
        best = stamps.index(min(stamps))
        self.tick += 1
        self.stamps[keys[best]] = self.tick
        if self.tick >= self.sweep_at:
            cutoff = self.tick - max(self.horizon, 2 * len(keys))
            self.stamps = {k: s for k, s in self.stamps.items() if s > cutoff}
            self.sweep_at = self.tick + self.horizon
        return best

    def peek(self, keys: list[Hashable], avoid: set[Hashable]) -> int:
        candidates = [(self.stamps.get(k, 0), i) for i, k in enumerate(keys) if k not in avoid]
        return min(candidates)[1]


class RoundRobinMachine(RuleBasedStateMachine):
    @rule(horizon=st.integers(1, 24))
    @precondition(lambda self: not hasattr(self, "policy"))
    def start(self, horizon: int) -> None:
        self.policy = RoundRobin(horizon=horizon)
        self.model = Model(horizon)
        self.ready = [Item(key) for key in KEYS[:3]]

    def keys(self) -> list[Hashable]:
        return [item.key for item in self.ready]

    @rule(times=st.integers(1, 12))
    @precondition(lambda self: hasattr(self, "policy") and self.ready)
    def pick(self, times: int) -> None:
        for _ in range(times):
            expected = self.model.pick(self.keys())
            assert self.policy.pick(self.ready, None, 0.0) == expected

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "policy") and self.ready)
    def peek(self, data: st.DataObject) -> None:
        avoid = set(data.draw(st.lists(st.sampled_from(self.keys()), max_size=2)))
        if avoid >= set(self.keys()):
            return
        assert self.policy.peek(self.ready, None, 0.0, avoid) == self.model.peek(self.keys(), avoid)

    @rule(key=st.sampled_from(KEYS), at=st.integers(0, 8))
    @precondition(lambda self: hasattr(self, "policy"))
    def insert_in_place(self, key: str, at: int) -> None:
        if key not in self.keys():
            self.ready.insert(min(at, len(self.ready)), Item(key))

    @rule(at=st.integers(0, 8))
    @precondition(lambda self: hasattr(self, "policy") and self.ready)
    def remove_in_place(self, at: int) -> None:
        del self.ready[at % len(self.ready)]

    @rule(at=st.integers(0, 8), key=st.sampled_from(KEYS))
    @precondition(lambda self: hasattr(self, "policy") and self.ready)
    def replace_in_place(self, at: int, key: str) -> None:
        # Same length, another endpoint in one place (or the same key anew).
        if key not in self.keys() or self.ready[at % len(self.ready)].key == key:
            self.ready[at % len(self.ready)] = Item(key)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "policy") and len(self.ready) > 1)
    def reorder(self, data: st.DataObject) -> None:
        self.ready[:] = data.draw(st.permutations(self.ready))

    @rule()
    @precondition(lambda self: hasattr(self, "policy"))
    def new_list_same_items(self) -> None:
        self.ready = list(self.ready)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "policy") and self.ready)
    def tuple_of_the_same(self, data: st.DataObject) -> None:
        # Any sequence works (without the fast path).
        expected = self.model.pick(self.keys())
        assert self.policy.pick(tuple(self.ready), None, 0.0) == expected

    @invariant()
    def same_memory(self) -> None:
        if hasattr(self, "policy"):
            assert self.policy.tracked_keys == len(self.model.stamps)


TestRoundRobinMachine = RoundRobinMachine.TestCase
TestRoundRobinMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_a_stable_set_rotates_in_order_on_the_fast_path() -> None:
    ready = [Item(key) for key in KEYS]
    policy = RoundRobin()
    picks = [policy.pick(ready, None, 0.0) for _ in range(3 * len(ready))]
    assert picks == list(range(len(ready))) * 3
    assert policy._positions is not None  # the second pick on took the fast path


def test_repeated_keys_take_the_plain_scan() -> None:
    ready = [Item("a"), Item("b"), Item("a")]
    policy = RoundRobin()
    picks = [policy.pick(ready, None, 0.0) for _ in range(4)]
    # "a" at 0 and 2 share one pick number: the first "a" stands for both.
    assert picks == [0, 1, 0, 1]
    assert policy._positions is None


def test_a_key_forgotten_while_ready_counts_as_never_picked_on_the_fast_path() -> None:
    # X is picked once, then not ready for a while; it comes back beside two
    # new endpoints, and the sweep at the second pick on the unchanged list
    # forgets X's old pick: X has never been picked now, so it goes before
    # A, whose pick is remembered.
    policy = RoundRobin(horizon=4)
    model = Model(4)
    x, c = Item("X"), Item("C")
    assert policy.pick([x], None, 0.0) == model.pick(["X"]) == 0
    alone = [c]
    for _ in range(5):
        assert policy.pick(alone, None, 0.0) == model.pick(["C"]) == 0
    ready = [Item("A"), Item("B"), x]
    picks = [policy.pick(ready, None, 0.0) for _ in range(3)]
    assert picks == [model.pick(["A", "B", "X"]) for _ in range(3)] == [0, 1, 2]
