"""The sans-IO blocking-query rules: index cursor, token bucket, backoff."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nadisc_consul import Backoff, BlockingCursor, IndexOutcome, TokenBucket
from nadisc_consul._blocking import read_timeout


def test_first_read_is_non_blocking_then_blocks_on_the_last_index() -> None:
    cursor = BlockingCursor()
    assert cursor.request_index() is None
    assert cursor.observe(10) is IndexOutcome.CHANGED
    assert cursor.request_index() == 10
    assert cursor.observe(10) is IndexOutcome.UNCHANGED
    assert cursor.observe(12) is IndexOutcome.CHANGED
    assert cursor.request_index() == 12


def test_index_going_backwards_resets_to_a_fresh_read() -> None:
    cursor = BlockingCursor()
    cursor.observe(100)
    assert cursor.observe(7) is IndexOutcome.RESET
    assert cursor.index == 0 and cursor.request_index() is None
    assert cursor.resets == 1
    assert cursor.observe(7) is IndexOutcome.CHANGED
    assert cursor.request_index() == 7


def test_zero_index_is_never_sent() -> None:
    cursor = BlockingCursor()
    assert cursor.observe(0) is IndexOutcome.CHANGED
    assert cursor.request_index() == 1
    assert cursor.observe(0) is IndexOutcome.UNCHANGED
    cursor2 = BlockingCursor()
    cursor2.observe(50)
    assert cursor2.observe(0) is IndexOutcome.CHANGED  # complete listing, index unknowable
    assert cursor2.request_index() == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1000), max_size=40))
def test_cursor_never_requests_zero_and_never_moves_backwards_silently(indexes: list[int]) -> None:
    cursor = BlockingCursor()
    for new in indexes:
        before = cursor.index
        outcome = cursor.observe(new)
        requested = cursor.request_index()
        assert requested is None or requested >= 1
        if outcome is IndexOutcome.RESET:
            assert requested is None and new < before
        elif outcome is IndexOutcome.UNCHANGED:
            assert cursor.index == before
        else:
            assert cursor.index == max(new, 1)


def test_token_bucket_allows_a_burst_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3)
    assert [bucket.reserve(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve(0.0) == pytest.approx(0.5)
    assert bucket.reserve(0.0) == pytest.approx(1.0)  # reservations queue up
    assert bucket.reserve(10.0) == 0.0  # refilled (to the burst) after a quiet spell


@settings(max_examples=100, deadline=None)
@given(
    st.floats(min_value=0.1, max_value=50),
    st.integers(min_value=1, max_value=10),
    st.lists(st.floats(min_value=0, max_value=5), min_size=1, max_size=60),
)
def test_token_bucket_never_exceeds_burst_plus_rate_times_time(
    rate: float, burst: int, gaps: list[float]
) -> None:
    bucket = TokenBucket(rate=rate, burst=burst)
    now = 0.0
    issued: list[float] = []
    for gap in gaps:
        now += gap
        start = now + bucket.reserve(now)
        issued.append(start)
        now = start  # the caller waits, then issues
    span = issued[-1] - issued[0]
    assert len(issued) <= burst + rate * span + 1e-6 + 1


def test_token_bucket_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, burst=1)
    with pytest.raises(ValueError):
        TokenBucket(rate=1.0, burst=0)


def test_backoff_grows_with_jitter_and_resets() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0)
    delays = [backoff.next_delay(0.0) for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.next_delay(0.999) == pytest.approx(8.0, rel=1e-3)
    backoff.succeeded()
    assert backoff.next_delay(1.0) == 1.0


def test_read_timeout_covers_wait_and_jitter() -> None:
    assert read_timeout(32.0, 3.0) == 32.0 * 17 / 16 + 3.0
    assert read_timeout(300.0, 0.0) > 300.0 * 17 / 16 - 1e-9
