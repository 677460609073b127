"""InFlight: the default load tracker counts open guards; each guard ends once."""

from __future__ import annotations

import pytest

from poise import InFlight, InFlightGuard, LoadTracker


def _as_tracker(tracker: LoadTracker) -> LoadTracker:
    return tracker


def test_load_is_the_number_of_open_guards() -> None:
    tracker = InFlight()
    assert tracker.load(0.0) == 0
    guards = [tracker.start(float(i)) for i in range(3)]
    assert tracker.load(10.0) == 3
    assert tracker.in_flight == 3
    guards[0].complete(11.0)
    guards[1].complete(11.0, failed=True)
    assert tracker.load(12.0) == 1
    guards[2].cancel(12.0)
    assert tracker.load(13.0) == 0


def test_load_ignores_time() -> None:
    tracker = InFlight()
    tracker.start(0.0)
    assert tracker.load(0.0) == tracker.load(1e9) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("complete", "complete"),
        ("complete", "cancel"),
        ("cancel", "complete"),
        ("cancel", "cancel"),
    ],
)
def test_a_guard_ends_exactly_once(first: str, second: str) -> None:
    tracker = InFlight()
    guard = tracker.start(0.0)
    other = tracker.start(0.0)
    getattr(guard, first)(1.0)
    assert guard.ended
    assert tracker.load(1.0) == 1
    getattr(guard, second)(2.0)
    assert tracker.load(2.0) == 1  # the second end did not count
    assert not other.ended


def test_failed_completion_counts_like_success() -> None:
    tracker = InFlight()
    guard = tracker.start(0.0)
    guard.complete(1.0, failed=True)
    assert tracker.load(1.0) == 0


def test_fits_the_protocol_and_reprs() -> None:
    tracker = _as_tracker(InFlight())
    guard = tracker.start(0.0)
    assert isinstance(guard, InFlightGuard)
    assert "in_flight=1" in repr(tracker)
    assert "open" in repr(guard)
    guard.cancel(0.0)
    assert "ended" in repr(guard)
