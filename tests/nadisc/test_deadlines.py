"""The provider authors' deadline helpers: ``time_left`` and
``multi_request_read`` (both loops; the clock is the loop's own)."""

from __future__ import annotations

import math

import anyio
import pytest
import trio
import trio.testing

from nadisc import (
    DeadlineExceeded,
    IncompleteSnapshot,
    ProviderFailure,
    multi_request_read,
    time_left,
)
from nadisc._errors import RELATIVE_HINT_AFTER


async def test_time_left_is_exactly_the_seconds_before_the_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    deadline = trio.current_time() + 5
    assert time_left(deadline) == 5
    mock_clock.jump(3.5)
    assert time_left(deadline) == 1.5
    mock_clock.jump(1.5)
    with pytest.raises(DeadlineExceeded, match=r"deadline passed 0\.000000s ago"):
        time_left(deadline)


@pytest.mark.parametrize(
    ("deadline", "match"),
    [
        (math.nan, "NaN"),
        ("soon", "must be a number on the event-loop clock, not str"),
        (None, "not NoneType"),
        (True, "not bool"),
    ],
)
async def test_time_left_refuses_what_is_not_a_deadline(deadline: object, match: str) -> None:
    with pytest.raises(DeadlineExceeded, match=match):
        time_left(deadline)  # type: ignore[arg-type]


async def test_time_left_refuses_a_passed_deadline_and_hints_at_a_duration() -> None:
    now = anyio.current_time()
    with pytest.raises(DeadlineExceeded, match=r"deadline passed .*s ago") as late:
        time_left(now)
    assert "absolute" not in str(late.value)
    # A small number far in the past was meant as "5 seconds from now"
    # (trio's clock starts hours in; asyncio's is the machine's uptime).
    if now - 5 > RELATIVE_HINT_AFTER:
        with pytest.raises(DeadlineExceeded, match=r"current_time\(\) \+ 5"):
            time_left(5.0)


async def test_a_deadline_passing_between_requests_is_an_incomplete_read() -> None:
    deadline = anyio.current_time() + 0.05
    with (
        pytest.raises(IncompleteSnapshot) as caught,
        multi_request_read(deadline, "etcd: the range of 'orders'"),
    ):
        time_left(deadline)  # the first request starts in time ...
        await anyio.sleep(0.06)
        time_left(deadline)  # ... the next finds the deadline passed
    assert str(caught.value).startswith(
        "etcd: the range of 'orders' did not finish by its deadline"
    )
    assert isinstance(caught.value.__cause__, DeadlineExceeded)
    # Retryable for a watch loop that catches provider failures only.
    assert isinstance(caught.value, ProviderFailure)


@pytest.mark.parametrize("deadline", [-1.0, math.nan])
async def test_a_read_begun_past_its_deadline_is_the_callers_deadline(deadline: float) -> None:
    if deadline < 0:
        deadline = anyio.current_time() - 1
    with pytest.raises(DeadlineExceeded) as caught, multi_request_read(deadline, "the list"):
        time_left(deadline)
    assert not isinstance(caught.value, IncompleteSnapshot)


async def test_a_read_of_a_non_number_deadline_stays_deadline_exceeded() -> None:
    with (
        pytest.raises(DeadlineExceeded, match="not str"),
        multi_request_read("soon", "the list"),  # type: ignore[arg-type]
    ):
        time_left("soon")  # type: ignore[arg-type]


async def test_other_failures_and_a_finished_read_pass_through() -> None:
    deadline = anyio.current_time() + 10
    with (
        pytest.raises(IncompleteSnapshot, match="truncated") as caught,
        multi_request_read(deadline, "the list"),
    ):
        raise IncompleteSnapshot("the list was truncated")
    assert caught.value.__cause__ is None
    with multi_request_read(deadline, "the list"):
        left = time_left(deadline)
    assert left > 0
