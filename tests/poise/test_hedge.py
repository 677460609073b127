"""Hedging: the rolling percentile, the hedge rule, and hedged_call's race.

The race runs under trio's virtual clock (``autojump_clock``) where it needs
seconds of latency; the last test uses milliseconds and runs on both loops.
"""

from __future__ import annotations

import math

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise import (
    Balance,
    Endpoint,
    Hedging,
    InvalidInput,
    LatencyWindow,
    PeakEwma,
    PowerOfTwoChoices,
    RetryBudget,
    hedged_call,
    service_fn,
)

# -- the window -------------------------------------------------------------------------


@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=300),
    st.integers(1, 100),
    st.floats(0.01, 1.0),
)
def test_percentile_is_the_rank_of_the_latest_samples(
    samples: list[float], size: int, q: float
) -> None:
    window = LatencyWindow(size=size, horizon=1e9)
    for t, value in enumerate(samples):
        window.record(float(t), value)
    kept = sorted(samples[-size:])
    rank = min(len(kept), max(1, math.ceil(q * (len(kept) + 1))))
    assert window.percentile(float(len(samples)), q) == kept[rank - 1]
    # At most a share 1 - q of the kept samples lies above it (up to one sample).
    above = sum(v > kept[rank - 1] for v in kept)
    assert above <= (1 - q) * len(kept) + 1


def test_old_samples_leave_the_window() -> None:
    window = LatencyWindow(size=10, horizon=5.0)
    window.record(0.0, 9.0)
    window.record(4.0, 1.0)
    assert window.percentile(4.0, 1.0) == 9.0
    assert window.percentile(5.5, 1.0) == 1.0  # the 9 s sample is 5.5 s old
    assert window.percentile(100.0, 0.5) is None
    with pytest.raises(InvalidInput, match="latency"):
        window.record(1.0, -1.0)


def test_the_rule_waits_for_samples_and_honours_max_extra_and_budget() -> None:
    hedging = Hedging(percentile=0.9, min_samples=3, max_extra=1)
    assert hedging.delay(0.0) is None
    for t in range(3):
        hedging.window.record(float(t), 0.1 * (t + 1))
    assert hedging.delay(3.0) == pytest.approx(0.3)
    assert not hedging.may_hedge(3.0, 1, None)  # max_extra reached
    empty = RetryBudget(0.0, 0.0)
    assert not hedging.may_hedge(3.0, 0, empty)
    assert hedging.refused == 1 and empty.refusals == 1
    assert hedging.may_hedge(3.0, 0, None)
    assert hedging.hedges == 1


def test_an_extra_load_cap_bounds_hedges_to_its_share() -> None:
    hedging = Hedging(delay=0.1, max_extra_load=0.1)
    granted = 0
    for n in range(1000):
        hedging.admit(n / 100)
        granted += hedging.may_hedge(n / 100, 0, None)
    assert granted <= 100


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({}, "exactly one"),
        ({"delay": 1.0, "percentile": 0.9}, "exactly one"),
        ({"delay": -1.0}, "delay"),
        ({"percentile": 1.0}, "percentile"),
        ({"delay": 1.0, "max_extra": 0}, "max_extra"),
        ({"delay": 1.0, "max_extra_load": 0.0}, "max_extra_load"),
    ],
)
def test_bad_rules_are_named(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(InvalidInput, match=word):
        Hedging(**kwargs)  # type: ignore[arg-type]


# -- the race ---------------------------------------------------------------------------


class Attempts:
    """Attempt n sleeps latencies[n] then answers n (or raises if it is in fails)."""

    def __init__(self, *latencies: float, fails: frozenset[int] = frozenset()) -> None:
        self.latencies = latencies
        self.fails = fails
        self.started: list[tuple[int, float]] = []
        self.cancelled: list[int] = []

    async def __call__(self, n: int) -> int:
        self.started.append((n, anyio.current_time()))
        try:
            await anyio.sleep(self.latencies[n])
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(n)
            raise
        if n in self.fails:
            raise RuntimeError(f"attempt {n} failed")
        return n


async def test_a_slow_first_attempt_is_hedged_and_cancelled(autojump_clock: object) -> None:
    hedging = Hedging(delay=0.2)
    attempts = Attempts(2.0, 0.15)
    begun = anyio.current_time()
    assert await hedged_call(attempts, hedging, idempotent=True) == 1
    assert anyio.current_time() - begun == pytest.approx(0.35)
    assert [n for n, _ in attempts.started] == [0, 1]
    assert attempts.started[1][1] - begun == pytest.approx(0.2)
    assert attempts.cancelled == [0]
    assert (hedging.hedges, hedging.wins) == (1, 1)
    # The first attempt's sample is the time it had been out: a lower bound.
    assert hedging.window.percentile(anyio.current_time(), 1.0) == pytest.approx(0.35)


async def test_a_fast_answer_sends_no_hedge(autojump_clock: object) -> None:
    hedging = Hedging(delay=0.2)
    attempts = Attempts(0.1, 0.1)
    assert await hedged_call(attempts, hedging, idempotent=True) == 0
    assert [n for n, _ in attempts.started] == [0]
    assert hedging.hedges == 0


async def test_not_idempotent_or_no_budget_means_no_hedge(autojump_clock: object) -> None:
    hedging = Hedging(delay=0.2)
    attempts = Attempts(1.0, 0.1)
    assert await hedged_call(attempts, hedging, idempotent=False) == 0
    budget = RetryBudget(0.0, 0.0)
    attempts = Attempts(1.0, 0.1)
    assert await hedged_call(attempts, hedging, idempotent=True, budget=budget) == 0
    assert [n for n, _ in attempts.started] == [0]
    assert hedging.refused == 1 and budget.refusals == 1


async def test_up_to_max_extra_hedges_one_delay_apart(autojump_clock: object) -> None:
    hedging = Hedging(delay=0.1, max_extra=2)
    attempts = Attempts(5.0, 5.0, 0.05)
    begun = anyio.current_time()
    assert await hedged_call(attempts, hedging, idempotent=True) == 2
    assert [round(t - begun, 6) for _, t in attempts.started] == [0.0, 0.1, 0.2]
    assert sorted(attempts.cancelled) == [0, 1]


async def test_a_failed_hedge_waits_for_the_first_and_all_failing_raises(
    autojump_clock: object,
) -> None:
    hedging = Hedging(delay=0.1)
    hedge_fails = Attempts(0.5, 0.01, fails=frozenset({1}))
    assert await hedged_call(hedge_fails, hedging, idempotent=True) == 0
    both_fail = Attempts(0.5, 0.01, fails=frozenset({0, 1}))
    with pytest.raises(RuntimeError, match="attempt 0 failed"):
        await hedged_call(both_fail, hedging, idempotent=True)


async def test_a_losing_attempt_is_evidence_of_its_elapsed_time(autojump_clock: object) -> None:
    """Through a real Balance: the cancelled loser raises its backend's estimate."""
    trackers = [PeakEwma(), PeakEwma()]
    latency = [3.0, 0.1]

    def endpoint(i: int) -> Endpoint[int, int]:
        async def serve(request: int) -> int:
            await anyio.sleep(latency[i])
            return i

        return Endpoint(i, service_fn(serve), tracker=trackers[i])

    balance: Balance[int, int] = Balance(PowerOfTwoChoices(), [endpoint(0), endpoint(1)])
    # Send the first attempt to the slow backend by making the fast one look busy.
    busy = trackers[1].start(anyio.current_time())
    sent: list[int] = []

    async def attempt(n: int) -> int:
        if n == 1:
            busy.cancel(anyio.current_time())
        sent.append(n)
        return await balance.dispatch(n)

    hedging = Hedging(delay=0.3)
    assert await hedged_call(attempt, hedging, idempotent=True) == 1
    now = anyio.current_time()
    # The slow backend's call was cut off after 0.4 s: its estimate is at least that.
    assert trackers[0].estimate(now) >= 0.4 - 1e-9
    assert trackers[0].estimate(now) > trackers[1].estimate(now)
    assert trackers[0].in_flight == 0


async def test_race_on_either_loop_without_a_virtual_clock() -> None:
    hedging = Hedging(delay=0.01)
    attempts = Attempts(0.5, 0.001)  # the hedge answers long before the first
    assert await hedged_call(attempts, hedging, idempotent=True) == 1
    assert attempts.cancelled == [0]
