"""Hedges leave the turn-taking policies' rotation alone.

A hedge is an extra copy of an attempt. With a policy that takes turns
(round robin, smooth weighted round robin, least loaded's rotation of
ties) a hedge that took a turn would push the next call's first pick one
place further: with two endpoints, one of them slow, every call's first
attempt would land on the slow one and pay the hedge delay.

The calls go through the public API as a user writes them
(``hedged_call(lambda n: balance.dispatch(...), hedging, idempotent=True)``),
under trio's virtual clock or, on either loop, in an order of events the
test fixes. The pick rule itself (``peek`` and ``hedge_pick``) is checked
over fake endpoints against generated histories of picks.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Hashable

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise import (
    Balance,
    Endpoint,
    Hedging,
    LeastLoaded,
    Policy,
    RoundRobin,
    SelectionError,
    WeightedRoundRobin,
    hedged_call,
    service_fn,
)
from poise._hedge import hedge_pick

SLOW = 5.0
FAST = 0.05
DELAY = 0.3

TURN_TAKING: list[Callable[[], Policy[None]]] = [RoundRobin, WeightedRoundRobin, LeastLoaded]


class Fleet:
    """Endpoints that record which of them each attempt of each call reached."""

    def __init__(self, latencies: dict[str, float]) -> None:
        self.latencies = latencies
        # (call, attempt) -> endpoint key, in the order the attempts reached them.
        self.reached: dict[tuple[int, int], str] = {}

    def endpoint(
        self, key: str, *, weight: float = 1.0, eligible: bool = True
    ) -> Endpoint[tuple[int, int], str]:
        async def serve(request: tuple[int, int]) -> str:
            self.reached[request] = key
            await anyio.sleep(self.latencies[key])
            return key

        return Endpoint(key, service_fn(serve), weight=weight, eligible=eligible)

    def first_picks(self) -> list[str]:
        return [key for (_, attempt), key in sorted(self.reached.items()) if attempt == 0]

    def attempts_of(self, call: int) -> list[str]:
        return [key for (c, _), key in sorted(self.reached.items()) if c == call]


async def run_calls(
    balance: Balance[tuple[int, int], str], hedging: Hedging, calls: int
) -> list[str]:
    answers = []
    for call in range(calls):

        async def attempt(n: int, call: int = call) -> str:
            return await balance.dispatch((call, n))

        answers.append(await hedged_call(attempt, hedging, idempotent=True))
    return answers


@pytest.mark.parametrize("policy", TURN_TAKING)
async def test_first_picks_alternate_with_one_slow_endpoint_of_two(
    autojump_clock: object, policy: Callable[[], Policy[None]]
) -> None:
    fleet = Fleet({"slow": SLOW, "fast": FAST})
    balance = Balance(policy(), [fleet.endpoint("slow"), fleet.endpoint("fast")])
    hedging = Hedging(delay=DELAY)
    answers = await run_calls(balance, hedging, 10)
    assert answers == ["fast"] * 10
    # The first attempts take turns: the hedge sent to "fast" was no turn of its own.
    assert fleet.first_picks() == ["slow", "fast"] * 5
    # Only the calls that began on the slow endpoint were hedged, each to the other one.
    assert (hedging.hedges, hedging.wins) == (5, 5)
    for call in range(0, 10, 2):
        assert fleet.attempts_of(call) == ["slow", "fast"]


@pytest.mark.parametrize("policy", TURN_TAKING)
async def test_first_picks_rotate_evenly_over_four_endpoints(
    autojump_clock: object, policy: Callable[[], Policy[None]]
) -> None:
    keys = ["a", "b", "c", "d"]
    fleet = Fleet({"a": FAST, "b": SLOW, "c": FAST, "d": FAST})
    balance = Balance(policy(), [fleet.endpoint(key) for key in keys])
    hedging = Hedging(delay=DELAY)
    await run_calls(balance, hedging, 40)
    assert Counter(fleet.first_picks()) == dict.fromkeys(keys, 10)
    assert fleet.first_picks()[:8] == keys * 2
    assert hedging.hedges == 10
    for call, first in enumerate(fleet.first_picks()):
        attempts = fleet.attempts_of(call)
        if first == "b":
            # The hedge goes to the endpoint whose turn is next.
            assert attempts == ["b", "c"]
        else:
            assert attempts == [first]


async def test_weighted_first_picks_keep_their_weights(autojump_clock: object) -> None:
    fleet = Fleet({"slow": SLOW, "fast": FAST})
    balance = Balance(
        WeightedRoundRobin(),
        [fleet.endpoint("slow", weight=2.0), fleet.endpoint("fast", weight=1.0)],
    )
    hedging = Hedging(delay=DELAY)
    await run_calls(balance, hedging, 30)
    # Smooth weighted round robin of weights 2 and 1, undisturbed by the hedges.
    assert fleet.first_picks() == ["slow", "fast", "slow"] * 10
    assert hedging.hedges == 20


async def test_each_hedge_of_a_call_goes_to_an_endpoint_it_has_not_tried(
    autojump_clock: object,
) -> None:
    fleet = Fleet({"a": SLOW, "b": SLOW, "c": FAST})
    balance = Balance(RoundRobin(), [fleet.endpoint(key) for key in "abc"])
    hedging = Hedging(delay=DELAY, max_extra=2)
    assert await run_calls(balance, hedging, 3) == ["c", "c", "c"]
    assert fleet.attempts_of(0) == ["a", "b", "c"]
    assert fleet.attempts_of(1) == ["b", "c"]
    assert fleet.attempts_of(2) == ["c"]
    assert fleet.first_picks() == ["a", "b", "c"]


async def test_a_hedge_with_nowhere_else_to_go_goes_to_the_same_endpoint(
    autojump_clock: object,
) -> None:
    fleet = Fleet({"only": 1.0})
    balance = Balance(RoundRobin(), [fleet.endpoint("only")])
    hedging = Hedging(delay=DELAY)
    assert await run_calls(balance, hedging, 2) == ["only", "only"]
    assert fleet.attempts_of(0) == ["only", "only"]
    assert hedging.hedges == 2


async def test_a_hedge_never_goes_to_an_endpoint_that_is_not_ready(
    autojump_clock: object,
) -> None:
    fleet = Fleet({"slow": SLOW, "drained": FAST, "fast": FAST})
    balance = Balance(
        RoundRobin(),
        [
            fleet.endpoint("slow"),
            fleet.endpoint("drained", eligible=False),
            fleet.endpoint("fast"),
        ],
    )
    hedging = Hedging(delay=DELAY)
    assert await run_calls(balance, hedging, 6) == ["fast"] * 6
    assert "drained" not in fleet.reached.values()
    assert fleet.first_picks() == ["slow", "fast"] * 3


async def test_first_picks_alternate_on_either_loop() -> None:
    """No virtual clock: the slow endpoint never answers and a hedge goes out at once.

    The order of events is fixed by the test: a call's hedge starts once its
    first attempt reached an endpoint.
    """
    reached: dict[tuple[int, int], str] = {}
    first_sent: dict[int, anyio.Event] = {}

    def endpoint(key: str) -> Endpoint[tuple[int, int], str]:
        async def serve(request: tuple[int, int]) -> str:
            reached[request] = key
            if request[1] == 0:
                first_sent[request[0]].set()
            if key == "slow":
                await anyio.sleep_forever()
            return key

        return Endpoint(key, service_fn(serve))

    balance = Balance(RoundRobin(), [endpoint("slow"), endpoint("fast")])
    hedging = Hedging(delay=0.0)
    for call in range(6):
        first_sent[call] = anyio.Event()

        async def attempt(n: int, call: int = call) -> str:
            if n:
                await first_sent[call].wait()
            return await balance.dispatch((call, n))

        assert await hedged_call(attempt, hedging, idempotent=True) == "fast"
    firsts = [key for (_, n), key in sorted(reached.items()) if n == 0]
    assert firsts == ["slow", "fast"] * 3
    for call in range(6):
        attempts = [key for (c, _), key in sorted(reached.items()) if c == call]
        assert len(attempts) == len(set(attempts))  # never twice to one endpoint


async def test_a_hedge_picks_as_any_call_from_a_balance_the_call_had_not_used(
    autojump_clock: object,
) -> None:
    """Only a balance the call already picked from treats a later attempt as a copy."""
    first = Fleet({"slow": SLOW})
    second = Fleet({"x": FAST, "y": FAST})
    slow: Balance[tuple[int, int], str] = Balance(RoundRobin(), [first.endpoint("slow")])
    other: Balance[tuple[int, int], str] = Balance(
        RoundRobin(), [second.endpoint("x"), second.endpoint("y")]
    )
    hedging = Hedging(delay=DELAY)
    for call in range(4):

        async def attempt(n: int, call: int = call) -> str:
            return await (other if n else slow).dispatch((call, n))

        assert await hedged_call(attempt, hedging, idempotent=True) in ("x", "y")
    # The hedges were the only calls of the other balance, and they took turns.
    assert [second.reached[(call, 1)] for call in range(4)] == ["x", "y", "x", "y"]


class Counting:
    """A policy without peek: it is asked for every pick, hedges included."""

    def __init__(self) -> None:
        self.picks = 0

    def pick(self, ready: object, context: object, now: float) -> int:
        self.picks += 1
        return 0


async def test_a_policy_without_peek_picks_for_hedges_as_before(autojump_clock: object) -> None:
    fleet = Fleet({"slow": SLOW, "fast": FAST})
    policy = Counting()
    balance = Balance(policy, [fleet.endpoint("slow"), fleet.endpoint("fast")])
    hedging = Hedging(delay=DELAY)
    # The only answer is the slow one: the hedge went to the same endpoint.
    assert await run_calls(balance, hedging, 1) == ["slow"]
    assert fleet.attempts_of(0) == ["slow", "slow"]
    assert policy.picks == 2


# -- the pick rule, over fake endpoints ----------------------------------------------------


class Fake:
    """A Weighted endpoint with a fixed weight and load."""

    __slots__ = ("cost", "key", "weight")

    def __init__(self, key: Hashable, weight: float = 1.0, cost: float = 0.0) -> None:
        self.key = key
        self.weight = weight
        self.cost = cost

    def load(self, now: float) -> float:
        return self.cost

    def __repr__(self) -> str:
        return f"Fake({self.key!r}, w={self.weight}, cost={self.cost})"


Peeking = RoundRobin | WeightedRoundRobin | LeastLoaded
POOL = [
    Fake(key, weight, cost)
    for key, weight, cost in zip("abcdef", (1, 2, 3, 1, 0, 2), (1, 0, 2, 0, 1, 3), strict=True)
]


def state(policy: Peeking) -> object:
    # RoundRobin's copy of the last ready list holds the endpoints
    # themselves: compared by identity, as the policy compares them.
    return {
        name: [id(item) for item in value]
        if name == "_seen" and value is not None
        else copy.deepcopy(value)
        for name in type(policy).__slots__
        for value in (getattr(policy, name),)
    }


def subsets() -> st.SearchStrategy[list[Fake]]:
    """Ready sets: sub-sequences of the pool, in pool order, never empty."""
    return st.lists(st.booleans(), min_size=len(POOL), max_size=len(POOL)).map(
        lambda mask: [fake for fake, on in zip(POOL, mask, strict=True) if on] or [POOL[0]]
    )


def policies() -> st.SearchStrategy[Peeking]:
    """A policy of each turn-taking kind, after a random history of picks."""
    return st.tuples(
        st.sampled_from([RoundRobin, WeightedRoundRobin, LeastLoaded]),
        st.lists(subsets(), max_size=12),
        st.integers(1, 8),
    ).map(lambda spec: _with_history(*spec))


def _with_history(kind: type[Peeking], history: list[list[Fake]], horizon: int) -> Peeking:
    policy = kind() if kind is LeastLoaded else kind(horizon=horizon)  # type: ignore[call-arg]
    for ready in history:
        policy.pick(ready, None, 0.0)
    return policy


@given(policies(), subsets(), st.sets(st.sampled_from("abcdef")))
def test_peek_is_the_pick_among_the_others_and_changes_nothing(
    policy: Peeking, ready: list[Fake], avoid: set[str]
) -> None:
    before = state(policy)
    candidates = [fake for fake in ready if fake.key not in avoid]
    if not candidates:
        with pytest.raises(SelectionError):
            policy.peek(ready, None, 0.0, avoid)
        assert state(policy) == before
        return
    i = policy.peek(ready, None, 0.0, avoid)
    assert state(policy) == before
    assert ready[i].key not in avoid
    if not avoid:
        assert i == copy.deepcopy(policy).pick(ready, None, 0.0)
    if isinstance(policy, LeastLoaded):
        # The lowest load among the others, the first met from the rotation's start.
        start = policy._next % len(ready)
        order = [ready[(start + k) % len(ready)] for k in range(len(ready))]
        lowest = min(fake.cost for fake in candidates)
        assert ready[i] is next(f for f in order if f.key not in avoid and f.cost == lowest)
    else:
        # Exactly what pick() would answer were the avoided ones not ready.
        assert candidates[copy.deepcopy(policy).pick(candidates, None, 0.0)] is ready[i]


@given(policies(), subsets(), st.lists(st.sampled_from("abcdef"), max_size=8))
def test_a_hedge_goes_elsewhere_whenever_it_can(
    policy: Peeking, ready: list[Fake], tried: list[str]
) -> None:
    before = state(policy)
    i = hedge_pick(policy.peek, ready, None, 0.0, tried)
    assert state(policy) == before
    keys = [fake.key for fake in ready]
    if len(ready) == 1:
        assert i == 0
    elif set(keys) - set(tried):
        assert keys[i] not in tried
    else:
        assert keys[i] != tried[-1]


@given(
    st.sampled_from([RoundRobin, WeightedRoundRobin, LeastLoaded]),
    st.lists(st.tuples(subsets(), st.integers(0, 3)), min_size=1, max_size=30),
)
def test_hedges_never_change_the_sequence_of_first_picks(
    kind: type[Peeking], calls: list[tuple[list[Fake], int]]
) -> None:
    """Two twins see the same calls; one also answers each call's hedges."""
    hedged, plain = kind(), kind()
    for ready, hedges in calls:
        first = hedged.pick(ready, None, 0.0)
        assert first == plain.pick(ready, None, 0.0)
        tried = [ready[first].key]
        for _ in range(hedges):
            tried.append(ready[hedge_pick(hedged.peek, ready, None, 0.0, tried)].key)
        # Every hedge of a call went to an endpoint the call had not tried, while any was left.
        distinct = min(len(ready), hedges + 1)
        assert len(set(tried[:distinct])) == distinct


def test_round_robin_hedges_go_to_the_next_in_turn() -> None:
    policy = RoundRobin()
    ready = POOL[:4]
    firsts, hedges = [], []
    for _ in range(8):
        first = policy.pick(ready, None, 0.0)
        firsts.append(ready[first].key)
        hedges.append(ready[hedge_pick(policy.peek, ready, None, 0.0, [ready[first].key])].key)
    assert firsts == list("abcdabcd")
    assert hedges == list("bcdabcda")


def test_peek_refuses_an_empty_or_fully_avoided_ready_set() -> None:
    for policy in (RoundRobin(), WeightedRoundRobin(), LeastLoaded()):
        with pytest.raises(SelectionError, match="no ready endpoint"):
            policy.peek([], None, 0.0)
        with pytest.raises(SelectionError, match="avoided"):
            policy.peek(POOL[:2], None, 0.0, {"a", "b"})


def test_a_bad_index_from_peek_is_a_selection_error() -> None:
    def wrong(ready: object, context: object, now: float, avoid: object) -> int:
        return 7

    with pytest.raises(SelectionError, match="returned 7"):
        hedge_pick(wrong, POOL[:2], None, 0.0, ["a"])
