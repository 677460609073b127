"""A hedge under ``WeightedRendezvous`` goes to the context's next-ranked endpoint.

Without a ``peek`` the balance picked a hedge as any call, and rendezvous
hashing, deterministic per context, gave the hedge the very endpoint its
first attempt was waiting on. The rule (``peek`` with ``avoid``) is checked
over generated endpoints, weights and contexts; the whole path through the
public API (``hedged_call`` over ``Balance.dispatch``) on either loop, in an
order of events the test fixes.
"""

from __future__ import annotations

from collections.abc import Hashable

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise import (
    Balance,
    Endpoint,
    Hedging,
    RequestContext,
    SelectionError,
    WeightedRendezvous,
    hedged_call,
    service_fn,
)
from poise._hedge import hedge_pick


class Fake:
    """What a policy reads of an endpoint: its key and weight."""

    def __init__(self, key: Hashable, weight: float) -> None:
        self.key = key
        self.weight = weight

    def load(self, now: float) -> float:
        return 0.0


fleets = st.lists(
    st.tuples(
        st.integers(0, 40),
        st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0]),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda item: item[0],
).map(lambda items: [Fake(f"e{key}", weight) for key, weight in items])
contexts = st.one_of(st.integers(), st.text(max_size=8), st.tuples(st.integers(), st.text()))


def ranking(policy: WeightedRendezvous, ready: list[Fake], context: object) -> list[int]:
    """Every ready endpoint in the order successive peeks, each avoiding the ones before, give."""
    order: list[int] = []
    while len(order) < len(ready):
        order.append(policy.peek(ready, context, 0.0, {ready[i].key for i in order}))
    return order


@given(fleets, contexts)
def test_peek_ranks_as_pick_falls_back(ready: list[Fake], context: object) -> None:
    policy = WeightedRendezvous()
    order = ranking(policy, ready, context)
    assert sorted(order) == list(range(len(ready)))
    # Nothing avoided: exactly the first pick (first picks are unchanged).
    assert order[0] == policy.pick(ready, context, 0.0)
    # The next-best is what pick gives once the best is not ready: the
    # context's fallback endpoint, the same in every process.
    for rank in range(1, len(ready)):
        rest = [ready[i] for i in range(len(ready)) if i not in order[:rank]]
        assert rest[policy.pick(rest, context, 0.0)] is ready[order[rank]]
    # Deterministic: another policy, the endpoints in another order, the same ranking.
    reverse = ready[::-1]
    again = ranking(WeightedRendezvous(), reverse, context)
    assert [reverse[i].key for i in again] == [ready[i].key for i in order]


@given(fleets, contexts, st.data())
def test_a_hedge_never_repeats_an_endpoint_while_another_is_ready(
    ready: list[Fake], context: object, data: st.DataObject
) -> None:
    policy = WeightedRendezvous()
    first = policy.pick(ready, context, 0.0)
    tried = [ready[first].key]
    extra = data.draw(st.integers(1, 8))
    for _ in range(extra):
        i = hedge_pick(policy.peek, ready, context, 0.0, tried)
        if len(tried) < len(ready):
            assert ready[i].key not in tried
        elif len(ready) > 1:
            assert ready[i].key != tried[-1]
        tried.append(ready[i].key)
    # Peeking changed nothing: the next first pick is where it was.
    assert policy.pick(ready, context, 0.0) == first


def test_peek_refuses_what_pick_refuses() -> None:
    policy = WeightedRendezvous()
    ready = [Fake("a", 1.0), Fake("b", 1.0)]
    with pytest.raises(SelectionError, match="affinity context"):
        policy.peek(ready, None, 0.0)
    with pytest.raises(SelectionError, match="every ready endpoint is to be avoided"):
        policy.peek(ready, "user", 0.0, {"a", "b"})
    with pytest.raises(SelectionError, match="no ready endpoint"):
        policy.peek([], "user", 0.0)


async def test_the_hedge_goes_to_the_next_ranked_endpoint_on_either_loop() -> None:
    """The first attempt never answers; the hedge goes out at once (delay 0).

    Order of events, fixed by the test: a call's hedge starts once its first
    attempt reached an endpoint, and the first attempt waits until the call ends.
    """
    keys = ["a", "b", "c", "d", "e"]
    reached: dict[tuple[str, int], str] = {}
    first_in: dict[str, anyio.Event] = {}
    holder: dict[str, str] = {}

    def endpoint(key: str) -> Endpoint[tuple[str, int], str]:
        async def serve(request: tuple[str, int]) -> str:
            user, attempt = request
            reached[request] = key
            if attempt == 0:
                first_in[user].set()
                await anyio.sleep_forever()
            return key

        return Endpoint(key, service_fn(serve))

    policy = WeightedRendezvous()
    balance = Balance(
        WeightedRendezvous(),
        [endpoint(key) for key in keys],
        context=RequestContext(lambda request: request[0]),
    )
    fakes = [Fake(key, 1.0) for key in keys]
    users = [f"user-{n}" for n in range(12)]
    for user in users:
        first_in[user] = anyio.Event()

        async def attempt(n: int, user: str = user) -> str:
            if n:
                await first_in[user].wait()
            return await balance.dispatch((user, n))

        holder[user] = await hedged_call(attempt, Hedging(delay=0.0), idempotent=True)
    for user in users:
        assert reached[(user, 1)] != reached[(user, 0)]
    for user in users:
        order = ranking(policy, fakes, user)
        # The first attempt where it always went; the hedge to the second-ranked one.
        assert reached[(user, 0)] == keys[order[0]]
        assert reached[(user, 1)] == keys[order[1]] == holder[user]
