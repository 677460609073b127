"""RetryBudget: the token bucket's bound, exhaustively over request/retry schedules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise import InvalidInput, RetryBudget

events = st.lists(
    st.tuples(st.floats(0.0, 2.0), st.booleans()),  # (time step, True = request / False = retry)
    max_size=200,
)


@given(
    events,
    st.floats(0.0, 1.0),
    st.floats(0.0, 50.0),
)
def test_retries_never_exceed_percent_of_requests_plus_minimum_per_second(
    schedule: list[tuple[float, bool]], percent: float, minimum: float
) -> None:
    budget = RetryBudget(percent, minimum)
    now = 0.0
    requests = allowed = refused = 0
    for step, is_request in schedule:
        now += step
        if is_request:
            budget.deposit(now)
            requests += 1
        elif budget.try_withdraw(now):
            allowed += 1
        else:
            refused += 1
        assert 0.0 <= budget.balance(now) <= budget.capacity
    # The balance starts at zero: what was allowed was earned.
    assert allowed <= percent * requests + minimum * now + 1e-6
    assert (budget.deposits, budget.withdrawals, budget.refusals) == (requests, allowed, refused)


@given(st.integers(1, 400))
def test_a_retry_is_allowed_exactly_when_a_whole_token_is_there(requests: int) -> None:
    budget = RetryBudget(0.25, 0.0, capacity=1000.0)
    for _ in range(requests):
        budget.deposit(0.0)
    assert budget.balance(0.0) == pytest.approx(0.25 * requests)
    granted = sum(budget.try_withdraw(0.0) for _ in range(requests))
    assert granted == math.floor(0.25 * requests + 1e-9)
    assert budget.refusals == requests - granted


def test_the_minimum_refills_with_time_up_to_the_capacity() -> None:
    budget = RetryBudget(0.0, 10.0, capacity=20.0)
    assert budget.balance(0.0) == 0.0
    assert not budget.try_withdraw(0.05)  # half a token
    assert budget.try_withdraw(0.1)
    assert budget.balance(100.0) == 20.0  # capped
    assert budget.balance(50.0) == 20.0  # an earlier time: no time passes


def test_all_failing_at_1000_per_second_gives_at_most_1_21_attempts() -> None:
    budget = RetryBudget(0.2, 10.0)
    attempts = 0
    requests = 10_000
    for n in range(requests):
        now = n / 1000.0
        budget.deposit(now)
        attempts += 1
        for _ in range(3):  # max_attempts 4, every attempt fails
            if not budget.try_withdraw(now):
                break
            attempts += 1
    assert 1.2 <= attempts / requests <= 1.21


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"percent": -0.1}, "percent"),
        ({"percent": float("nan")}, "percent"),
        ({"min_per_second": float("inf")}, "min_per_second"),
        ({"capacity": 0.5}, "capacity"),
        ({"percent": True}, "percent"),
    ],
)
def test_bad_parameters_name_themselves(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(InvalidInput, match=word):
        RetryBudget(**kwargs)  # type: ignore[arg-type]


def test_non_finite_time_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="time"):
        RetryBudget().deposit(float("nan"))
