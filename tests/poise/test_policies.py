"""Selection policies, tested over small fake endpoints (the Weighted protocol)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise import (
    InvalidInput,
    LeastLoaded,
    Policy,
    PowerOfTwoChoices,
    RoundRobin,
    SelectionError,
    Weighted,
    WeightedRendezvous,
    WeightedRoundRobin,
)
from poise._policies import _encode


class Fake:
    """A Weighted endpoint with a fixed load that records who read it."""

    __slots__ = ("cost", "key", "reads", "weight")

    def __init__(self, key: Hashable, weight: float = 1.0, cost: float = 0.0) -> None:
        self.key = key
        self.weight = weight
        self.cost = cost
        self.reads = 0

    def load(self, now: float) -> float:
        self.reads += 1
        return self.cost

    def __repr__(self) -> str:
        return f"Fake({self.key!r}, w={self.weight}, cost={self.cost})"


def fakes(*keys: Hashable) -> list[Fake]:
    return [Fake(k) for k in keys]


ALL_POLICIES = [RoundRobin, WeightedRoundRobin, PowerOfTwoChoices, LeastLoaded, WeightedRendezvous]


def test_policies_satisfy_the_protocol() -> None:
    policies: list[Policy[object]] = [
        RoundRobin(),
        WeightedRoundRobin(),
        PowerOfTwoChoices(),
        LeastLoaded(),
        WeightedRendezvous(),
    ]
    ready: Sequence[Weighted] = fakes("a", "b")
    for policy in policies:
        assert policy.pick(ready, "ctx", 0.0) in (0, 1)


@pytest.mark.parametrize("policy_type", ALL_POLICIES)
def test_empty_ready_raises_selection_error(policy_type: type) -> None:
    with pytest.raises(SelectionError, match="no ready endpoint"):
        policy_type().pick([], "ctx", 0.0)


@pytest.mark.parametrize("policy_type", ALL_POLICIES)
def test_single_endpoint_is_always_picked(policy_type: type) -> None:
    policy = policy_type()
    ready = fakes("only")
    assert [policy.pick(ready, f"c{i}", 0.0) for i in range(5)] == [0] * 5


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=30),
    weights=st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=12, max_size=12),
    costs=st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=12, max_size=12),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_pick_always_returns_a_valid_index(
    sizes: list[int], weights: list[float], costs: list[float], seed: int
) -> None:
    policies: list[Policy[object]] = [
        RoundRobin(horizon=2),
        WeightedRoundRobin(horizon=3),
        PowerOfTwoChoices(random.Random(seed)),
        LeastLoaded(),
        WeightedRendezvous(),
    ]
    pool = [Fake(f"e{i}", weights[i], costs[i]) for i in range(12)]
    chooser = random.Random(seed)
    for step, size in enumerate(sizes):
        ready = chooser.sample(pool, size)  # changing ready sets, any order
        for policy in policies:
            index = policy.pick(ready, ("ctx", step), float(step))
            assert isinstance(index, int)
            assert 0 <= index < size


# -- RoundRobin ----------------------------------------------------------------------


def test_round_robin_rotates_in_order() -> None:
    policy = RoundRobin()
    ready = fakes("a", "b", "c")
    assert [policy.pick(ready, None, 0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_resumes_a_returning_endpoint_without_skipping_anyone() -> None:
    policy = RoundRobin()
    a, b, c, d = fakes("a", "b", "c", "d")
    assert [policy.pick([a, b, c, d], None, 0.0) for _ in range(2)] == [0, 1]  # a, b
    # c is busy for a while: the others keep rotating.
    without_c = [a, b, d]
    assert [without_c[policy.pick(without_c, None, 0.0)].key for _ in range(3)] == ["d", "a", "b"]
    # c is back: it has waited longest, so it goes first, then the rotation goes on.
    full = [a, b, c, d]
    assert [full[policy.pick(full, None, 0.0)].key for _ in range(5)] == ["c", "d", "a", "b", "c"]


def test_round_robin_alternates_when_the_picked_endpoint_is_briefly_not_ready() -> None:
    # The balance pattern: the endpoint just picked is often still busy.
    policy = RoundRobin()
    pool = fakes("a", "b", "c")
    last = None
    sequence = []
    for _ in range(9):
        ready = [e for e in pool if e is not last]
        last = ready[policy.pick(ready, None, 0.0)]
        sequence.append(last.key)
    assert sequence == ["a", "b", "c"] * 3


@pytest.mark.parametrize("availability", [0.5, 0.8, 0.95])
def test_round_robin_is_fair_when_readiness_flickers(availability: float) -> None:
    policy = RoundRobin()
    pool = fakes("a", "b", "c", "d", "e")
    rng = random.Random(3)
    picked: Counter[Hashable] = Counter()
    for _ in range(5000):
        ready = [e for e in pool if rng.random() < availability] or pool
        picked[ready[policy.pick(ready, None, 0.0)].key] += 1
    assert max(picked.values()) - min(picked.values()) <= 50, picked


def test_round_robin_is_fair_when_endpoints_stay_busy_for_a_while() -> None:
    policy = RoundRobin()
    pool = fakes(*"abcdefgh")
    rng = random.Random(1)
    busy_until: dict[Hashable, int] = {}
    picked: Counter[Hashable] = Counter()
    for t in range(8000):
        ready = [e for e in pool if busy_until.get(e.key, -1) < t] or pool
        chosen = ready[policy.pick(ready, None, 0.0)]
        picked[chosen.key] += 1
        busy_until[chosen.key] = t + rng.randint(0, 3)
    assert max(picked.values()) - min(picked.values()) <= 8, picked


def test_round_robin_forgets_keys_that_disappear() -> None:
    policy = RoundRobin(horizon=4)
    ready = fakes("a", "b", "c")
    for _ in range(3):
        policy.pick(ready, None, 0.0)
    assert policy.tracked_keys == 3
    for _ in range(12):
        policy.pick(ready[:2], None, 0.0)
    assert policy.tracked_keys == 2


# -- WeightedRoundRobin ---------------------------------------------------------------


def test_smooth_wrr_interleaves_like_nginx() -> None:
    policy = WeightedRoundRobin()
    ready = [Fake("a", 5), Fake("b", 1), Fake("c", 1)]
    seq = "".join(str(ready[policy.pick(ready, None, 0.0)].key) for _ in range(14))
    assert seq == "aabacaa" * 2


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=8),
    cycles=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_wrr_distribution_is_exactly_proportional_over_each_cycle(
    weights: list[int], cycles: int, seed: int
) -> None:
    policy = WeightedRoundRobin()
    ready = [Fake(f"e{i}", float(w)) for i, w in enumerate(weights)]
    total = sum(weights)
    for cycle in range(cycles):
        # Reordering the ready list does not disturb the state (it is keyed).
        random.Random(seed + cycle).shuffle(ready)
        counts: Counter[Hashable] = Counter()
        for _ in range(total):
            counts[ready[policy.pick(ready, None, 0.0)].key] += 1
        assert counts == {f"e{i}": w for i, w in enumerate(weights)}


def test_wrr_fractional_weights_are_proportional() -> None:
    policy = WeightedRoundRobin()
    ready = [Fake("a", 0.5), Fake("b", 1.5)]
    counts = Counter(ready[policy.pick(ready, None, 0.0)].key for _ in range(400))
    assert counts == {"a": 100, "b": 300}


def test_wrr_forgets_keys_that_disappear() -> None:
    policy = WeightedRoundRobin(horizon=4)
    ready = fakes("a", "b", "c")
    for _ in range(3):
        policy.pick(ready, None, 0.0)
    assert policy.tracked_keys == 3
    survivors = ready[:2]
    for _ in range(8):
        policy.pick(survivors, None, 0.0)
    assert policy.tracked_keys == 2


def test_wrr_keeps_state_of_a_key_that_is_briefly_not_ready() -> None:
    policy = WeightedRoundRobin(horizon=100)
    ready = [Fake("a", 3), Fake("b", 1)]
    policy.pick(ready, None, 0.0)
    policy.pick(ready[:1], None, 0.0)
    assert policy.tracked_keys == 2


def test_wrr_zero_weights_are_last_resort() -> None:
    policy = WeightedRoundRobin()
    ready = [Fake("z", 0.0), Fake("a", 1.0)]
    assert {policy.pick(ready, None, 0.0) for _ in range(10)} == {1}
    only_zero = [Fake("x", 0.0), Fake("y", 0.0)]
    counts = Counter(policy.pick(only_zero, None, 0.0) for _ in range(10))
    assert counts == {0: 5, 1: 5}


@pytest.mark.parametrize("weight", [math.nan, math.inf, -1.0])
@pytest.mark.parametrize("policy_type", [WeightedRoundRobin, WeightedRendezvous])
def test_bad_weights_are_rejected(policy_type: type, weight: float) -> None:
    ready = [Fake("a"), Fake("bad", weight)]
    with pytest.raises(InvalidInput, match="'bad'"):
        policy_type().pick(ready, "ctx", 0.0)


@pytest.mark.parametrize("horizon", [0, -1, 1.5, True])
@pytest.mark.parametrize("policy_type", [RoundRobin, WeightedRoundRobin])
def test_bad_horizon_is_rejected(policy_type: type, horizon: object) -> None:
    with pytest.raises(InvalidInput, match="horizon"):
        policy_type(horizon=horizon)


# -- PowerOfTwoChoices ----------------------------------------------------------------


class NoRandom(random.Random):
    def random(self) -> float:
        raise AssertionError("the generator must not be consulted")


def test_p2c_with_one_endpoint_does_not_draw() -> None:
    assert PowerOfTwoChoices(NoRandom()).pick(fakes("a"), None, 0.0) == 0


def test_p2c_is_deterministic_for_a_seeded_generator() -> None:
    ready = [Fake(i, cost=float(i % 3)) for i in range(10)]
    a = PowerOfTwoChoices(random.Random(42))
    b = PowerOfTwoChoices(random.Random(42))
    assert [a.pick(ready, None, 0.0) for _ in range(200)] == [
        b.pick(ready, None, 0.0) for _ in range(200)
    ]


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=0, max_value=5), min_size=2, max_size=10),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_p2c_never_picks_the_worse_of_its_two_samples(costs: list[int], seed: int) -> None:
    policy = PowerOfTwoChoices(random.Random(seed))
    ready = [Fake(i, cost=float(c)) for i, c in enumerate(costs)]
    for _ in range(20):
        for e in ready:
            e.reads = 0
        index = policy.pick(ready, None, 0.0)
        sampled = [e for e in ready if e.reads]
        assert len(sampled) == 2 and all(e.reads == 1 for e in sampled)  # two distinct
        assert ready[index] in sampled
        assert ready[index].cost == min(e.cost for e in sampled)


def test_p2c_equal_loads_share_traffic_evenly() -> None:
    policy = PowerOfTwoChoices(random.Random(1))
    ready = fakes("a", "b", "c")
    counts = Counter(policy.pick(ready, None, 0.0) for _ in range(6000))
    assert all(1700 < counts[i] < 2300 for i in range(3)), counts


def test_p2c_steers_away_from_the_most_loaded() -> None:
    policy = PowerOfTwoChoices(random.Random(5))
    ready = [Fake("idle", cost=0.0), Fake("busy", cost=10.0), Fake("idle2", cost=0.0)]
    counts = Counter(policy.pick(ready, None, 0.0) for _ in range(900))
    assert counts[1] == 0  # the worst is never the better of two distinct samples


def test_p2c_rejects_a_generator_of_the_wrong_type() -> None:
    with pytest.raises(InvalidInput, match="rng"):
        PowerOfTwoChoices(rng=42)  # type: ignore[arg-type]


# -- LeastLoaded ----------------------------------------------------------------------


def test_least_loaded_picks_the_minimum_after_a_full_scan() -> None:
    policy = LeastLoaded()
    ready = [Fake("a", cost=3.0), Fake("b", cost=1.0), Fake("c", cost=2.0)]
    assert policy.pick(ready, None, 0.0) == 1
    assert all(e.reads == 1 for e in ready)


def test_least_loaded_ties_rotate() -> None:
    policy = LeastLoaded()
    ready = fakes("a", "b", "c")
    assert [policy.pick(ready, None, 0.0) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    tied = [Fake("x", cost=5.0), Fake("y", cost=1.0), Fake("z", cost=1.0)]
    assert [policy.pick(tied, None, 0.0) for _ in range(4)] == [1, 2, 1, 2]


# -- WeightedRendezvous ----------------------------------------------------------------


def _owner(policy: WeightedRendezvous, ready: Sequence[Fake], context: object) -> Hashable:
    return ready[policy.pick(ready, context, 0.0)].key


def test_rendezvous_requires_a_context() -> None:
    with pytest.raises(SelectionError, match="affinity context"):
        WeightedRendezvous().pick(fakes("a", "b"), None, 0.0)


def test_rendezvous_is_stable_and_independent_of_order() -> None:
    policy = WeightedRendezvous()
    ready = fakes(*(f"node-{i}" for i in range(8)))
    owners = {ctx: _owner(policy, ready, ctx) for ctx in range(200)}
    shuffled = list(ready)
    random.Random(9).shuffle(shuffled)
    fresh = WeightedRendezvous()
    assert {ctx: _owner(fresh, shuffled, ctx) for ctx in range(200)} == owners
    assert len(set(owners.values())) == 8  # every node owns some contexts


@settings(max_examples=40, deadline=None)
@given(
    keys=st.sets(st.text(min_size=1, max_size=6), min_size=2, max_size=8),
    removed_at=st.integers(min_value=0, max_value=7),
    contexts=st.lists(st.integers(), min_size=50, max_size=200, unique=True),
)
def test_rendezvous_removing_or_adding_one_endpoint_moves_only_its_keys(
    keys: set[str], removed_at: int, contexts: list[int]
) -> None:
    policy = WeightedRendezvous()
    full = fakes(*sorted(keys))
    gone = full[removed_at % len(full)]
    fewer = [e for e in full if e is not gone]
    for ctx in contexts:
        before = _owner(policy, full, ctx)
        after = _owner(policy, fewer, ctx)
        if before != gone.key:
            assert after == before  # removal: everyone else stays put
        # Adding `gone` back moves a context only if it goes to `gone`.
        assert _owner(policy, full, ctx) in (after, gone.key)


def test_rendezvous_falls_back_to_the_next_ranked_when_the_preferred_is_not_ready() -> None:
    policy = WeightedRendezvous()
    ready = fakes(*(f"n{i}" for i in range(6)))
    for ctx in range(100):
        first = _owner(policy, ready, ctx)
        without_first = [e for e in ready if e.key != first]
        second = _owner(policy, without_first, ctx)
        assert second != first
        # The fallback is the second of the full ranking: removing any other
        # non-preferred endpoint does not change where the context goes.
        third_removed = [e for e in without_first if e.key not in (second,)][:1]
        others = [e for e in without_first if e not in third_removed]
        assert _owner(policy, others, ctx) == second
        # And the context returns home once the preferred one is ready again.
        assert _owner(policy, ready, ctx) == first


def test_rendezvous_shares_follow_weights() -> None:
    policy = WeightedRendezvous()
    ready = [Fake("a", 1.0), Fake("b", 2.0), Fake("c", 3.0), Fake("d", 4.0)]
    n = 20000
    counts = Counter(_owner(policy, ready, f"user-{i}") for i in range(n))
    for e in ready:
        expected = e.weight / 10.0
        assert abs(counts[e.key] / n - expected) < 0.015, counts


def test_rendezvous_weight_change_moves_keys_only_towards_the_heavier() -> None:
    policy = WeightedRendezvous()
    ready = [Fake("a", 1.0), Fake("b", 1.0), Fake("c", 1.0)]
    before = {i: _owner(policy, ready, i) for i in range(3000)}
    ready[0].weight = 2.0
    after = {i: _owner(policy, ready, i) for i in range(3000)}
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(after[i] == "a" for i in moved)
    share_a = sum(1 for v in after.values() if v == "a") / 3000
    assert abs(share_a - 0.5) < 0.04  # 2 / (2 + 1 + 1)


def test_rendezvous_zero_weights_are_last_resort() -> None:
    policy = WeightedRendezvous()
    ready = [Fake("zero", 0.0), Fake("one", 1.0)]
    assert {_owner(policy, ready, i) for i in range(50)} == {"one"}
    only_zero = [Fake("x", 0.0), Fake("y", 0.0), Fake("z", 0.0)]
    assert len({_owner(policy, only_zero, i) for i in range(100)}) == 3


def test_rendezvous_does_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "from poise import WeightedRendezvous\n"
        "class E:\n"
        "    def __init__(self, k): self.key, self.weight = k, 1.0\n"
        "    def load(self, now): return 0.0\n"
        "ready = [E(('svc', i)) for i in range(7)] + [E('x'), E(b'y'), E(3.5)]\n"
        "p = WeightedRendezvous()\n"
        "print([p.pick(ready, ('user', i), 0.0) for i in range(60)])\n"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert len(set(eval(outputs.pop()))) > 3  # a printed list; contexts spread out


def test_encoding_separates_types_and_boundaries() -> None:
    values: list[object] = [
        1,
        "1",
        1.0,
        True,
        b"1",
        None,
        ("a", "bc"),
        ("ab", "c"),
        ("a", ("b", "c")),
        "",
        (),
    ]
    encoded = [_encode(v) for v in values]
    assert len(set(encoded)) == len(values)
    assert _encode(("svc", 1)) == _encode(("svc", 1))


def test_reprs_are_informative() -> None:
    policy = WeightedRoundRobin()
    policy.pick(fakes("a", "b"), None, 0.0)
    assert "tracked_keys=2" in repr(policy)
    assert "tracked_keys=0" in repr(RoundRobin())
    assert "LeastLoaded" in repr(LeastLoaded())
    assert "PowerOfTwoChoices" in repr(PowerOfTwoChoices())
    assert "WeightedRendezvous" in repr(WeightedRendezvous())
