"""The policies and PeakEwma driving a real Balance."""

from __future__ import annotations

import random
from collections import Counter

import anyio
import pytest

from poise import (
    Balance,
    Endpoint,
    PeakEwma,
    PowerOfTwoChoices,
    RoundRobin,
    UseRequest,
    WeightedRendezvous,
    WeightedRoundRobin,
    service_fn,
)


def _named(key: str) -> Endpoint[str, str]:
    async def answer(request: str) -> str:
        return key

    return Endpoint(key, service_fn(answer))


async def test_affinity_through_a_balance_falls_back_and_returns() -> None:
    endpoints = [_named(f"node-{i}") for i in range(5)]
    balance: Balance[str, str] = Balance(WeightedRendezvous(), endpoints, context=UseRequest())
    homes = {user: await balance.dispatch(user) for user in (f"user-{i}" for i in range(40))}
    assert all([await balance.dispatch(user) == home for user, home in homes.items()])
    # Take one node out of rotation: only its users move, and they come back.
    drained = homes["user-0"]
    balance.endpoint(drained).eligible = False
    moved = {user: await balance.dispatch(user) for user in homes}
    for user, home in homes.items():
        if home == drained:
            assert moved[user] != drained
        else:
            assert moved[user] == home
    balance.endpoint(drained).eligible = True
    assert {user: await balance.dispatch(user) for user in homes} == homes


async def test_weighted_round_robin_through_a_balance() -> None:
    heavy, light = _named("heavy"), _named("light")
    heavy.weight = 3.0
    balance: Balance[str, str] = Balance(WeightedRoundRobin(), [heavy, light])
    counts = Counter([await balance.dispatch("x") for _ in range(40)])
    assert counts == {"heavy": 30, "light": 10}


async def test_round_robin_through_a_balance() -> None:
    balance: Balance[str, str] = Balance(RoundRobin(), [_named(k) for k in "abc"])
    assert [await balance.dispatch("x") for _ in range(6)] == list("abcabc")


@pytest.mark.trio_only
async def test_p2c_peak_ewma_steers_away_from_a_slow_endpoint(autojump_clock: object) -> None:
    def endpoint(key: str, latency: float) -> Endpoint[int, str]:
        async def answer(request: int) -> str:
            await anyio.sleep(latency)
            return key

        return Endpoint(key, service_fn(answer), tracker=PeakEwma())

    balance: Balance[int, str] = Balance(
        PowerOfTwoChoices(random.Random(4)),
        [endpoint("fast-1", 0.010), endpoint("fast-2", 0.012), endpoint("slow", 0.500)],
    )
    counts: Counter[str] = Counter()

    async def client() -> None:
        for i in range(100):
            counts[await balance.dispatch(i)] += 1

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(client)
    assert sum(counts.values()) == 500
    assert counts["slow"] < 25, counts
    assert balance.statistics().in_flight == 0
    for ep in balance.endpoints:
        assert ep.tracker.load(anyio.current_time()) > 0.0
