"""PeakEwma: the peak rule, the decay blend, failures, slow start, guards, validation."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise import InvalidInput, LoadTracker, PeakEwma, PeakEwmaGuard, PowerOfTwoChoices


def test_satisfies_the_load_tracker_protocol() -> None:
    tracker: LoadTracker = PeakEwma()
    guard = tracker.start(0.0)
    guard.complete(0.01)
    assert tracker.load(0.02) > 0.0


def test_defaults_are_the_linkerd_ones() -> None:
    tracker = PeakEwma()
    assert tracker.default_rtt == 0.030
    assert tracker.decay == 10.0
    assert tracker.failure_penalty == 1.0
    assert tracker.slow_start == 0.0
    assert tracker.age_floor is True


def test_no_history_costs_default_rtt_times_in_flight_plus_one() -> None:
    tracker = PeakEwma(default_rtt=0.05)
    assert tracker.load(0.0) == pytest.approx(0.05)
    tracker.start(0.0)
    tracker.start(0.0)
    assert tracker.in_flight == 2
    assert tracker.load(0.0) == pytest.approx(0.05 * 3)


def test_slower_observation_jumps_the_estimate_to_it() -> None:
    tracker = PeakEwma(default_rtt=0.030)
    tracker.start(1.0).complete(1.250)
    assert tracker.rtt_estimate == pytest.approx(0.250)
    assert tracker.updated_at == 1.250
    # Without new evidence the estimate fades with the time constant decay.
    assert tracker.load(1.3) == pytest.approx(0.250 * math.exp(-0.05 / 10.0))


def test_faster_observation_blends_with_weight_exp_minus_elapsed_over_decay() -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=10.0)
    tracker.start(0.0).complete(0.010)  # first use at 0.0, so elapsed = 0.010
    w = math.exp(-0.010 / 10.0)
    # The prior is the estimate as faded at the completion time (0.030 x w).
    expected = 0.030 * w * w + 0.010 * (1 - w)
    assert tracker.rtt_estimate == pytest.approx(expected)

    tracker.start(5.0).complete(5.002)  # elapsed since the last update: 4.992
    w2 = math.exp(-(5.002 - 0.010) / 10.0)
    faded = expected * w2
    assert faded > 0.002  # so the blend rule applies, not the peak rule
    assert tracker.rtt_estimate == pytest.approx(faded * w2 + 0.002 * (1 - w2))


def test_peak_then_slow_recovery_over_about_decay_seconds() -> None:
    tracker = PeakEwma(default_rtt=0.010, decay=10.0)
    tracker.start(0.0).complete(1.0)  # a 1 s spike
    assert tracker.rtt_estimate == pytest.approx(1.0)
    # Fast answers right after the spike barely move the estimate...
    tracker.start(1.0).complete(1.01)
    assert tracker.rtt_estimate > 0.99
    # ...while after several decay periods of quiet the new evidence dominates.
    tracker.start(60.0).complete(60.01)
    assert tracker.rtt_estimate < 0.02


def test_failure_counts_as_at_least_the_penalty() -> None:
    tracker = PeakEwma(default_rtt=0.030, failure_penalty=0.5)
    tracker.start(0.0).complete(0.001, failed=True)  # failed fast
    assert tracker.rtt_estimate == pytest.approx(0.5)
    # A failure slower than the penalty counts with its real duration.
    tracker.start(1.0).complete(3.0, failed=True)
    assert tracker.rtt_estimate == pytest.approx(2.0)


def test_fast_failures_do_not_make_an_endpoint_look_fast() -> None:
    failing = PeakEwma()
    healthy = PeakEwma()
    now = 0.0
    for _ in range(20):
        failing.start(now).complete(now + 0.0001, failed=True)
        healthy.start(now).complete(now + 0.020)
        now += 0.1
    assert failing.load(now) > 10 * healthy.load(now)


def test_zero_failure_penalty_measures_failures_like_successes() -> None:
    tracker = PeakEwma(default_rtt=0.030, failure_penalty=0.0)
    tracker.start(0.0).complete(0.100, failed=True)
    assert tracker.rtt_estimate == pytest.approx(0.100)


def test_cancel_of_a_call_older_than_the_estimate_raises_it_to_the_age() -> None:
    tracker = PeakEwma(default_rtt=0.030)
    assert tracker.cancel_evidence is True
    guard = tracker.start(0.0)
    guard.cancel(5.0)  # a client timeout after 5 s: the RTT is at least 5 s
    assert tracker.in_flight == 0
    assert tracker.observations == 0  # cancellations are not counted
    assert tracker.rtt_estimate == pytest.approx(5.0)
    assert tracker.updated_at == 5.0
    # ...exactly as a completion of that age would have done.
    completed = PeakEwma(default_rtt=0.030)
    completed.start(0.0).complete(5.0)
    assert completed.load(7.0) == pytest.approx(tracker.load(7.0))


def test_cancel_of_a_young_call_changes_nothing() -> None:
    tracker = PeakEwma(default_rtt=0.030)
    tracker.start(0.0).complete(0.5)
    before = (tracker.rtt_estimate, tracker.updated_at)
    guard = tracker.start(1.0)
    guard.cancel(1.1)  # 100 ms: younger than the faded 0.5 s estimate
    assert (tracker.rtt_estimate, tracker.updated_at) == before
    # A cancellation at the dispatch time (what Balance does for a declined
    # call) has age zero and is never evidence.
    tracker.start(2.0).cancel(2.0)
    assert (tracker.rtt_estimate, tracker.updated_at) == before


def test_cancel_evidence_off_makes_every_cancellation_evidence_free() -> None:
    tracker = PeakEwma(default_rtt=0.030, cancel_evidence=False)
    tracker.start(0.0).cancel(5.0)
    assert tracker.in_flight == 0
    assert tracker.rtt_estimate == pytest.approx(0.030)


def test_bad_cancel_evidence_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="cancel_evidence"):
        PeakEwma(cancel_evidence=1)  # type: ignore[arg-type]


def test_estimate_fades_as_a_pure_function_of_now() -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=10.0)
    tracker.start(0.0).complete(2.0)  # a 2 s peak at t=2
    # However often it is read, the value at a given time is the same.
    reads = [tracker.load(t) for t in (3.0, 12.0, 12.0, 40.0)]
    again = PeakEwma(default_rtt=0.030, decay=10.0)
    again.start(0.0).complete(2.0)
    assert again.load(40.0) == reads[-1]
    assert reads[1] == reads[2]
    assert reads[1] == pytest.approx(2.0 * math.exp(-1.0))
    assert tracker.estimate(40.0) == pytest.approx(2.0 * math.exp(-3.8))
    assert tracker.rtt_estimate == 2.0  # the stored value moves only with evidence


def test_a_peaked_endpoint_becomes_cheaper_than_its_peers_after_decay_ln_ratio() -> None:
    peer = PeakEwma(default_rtt=0.020)
    peaked = PeakEwma(default_rtt=0.020)
    peaked.start(0.0).complete(2.0)
    now = 2.0
    # The peer keeps answering in 20 ms; the peaked one is not called.
    while peaked.load(now) >= peer.load(now):
        peer.start(now).complete(now + 0.020)
        now += 0.1
    # About decay x ln(2 s / 20 ms) = 46 s after the peak it is probed again.
    assert 40.0 < now - 2.0 < 50.0
    # One healthy answer after that long a gap nearly resets it.
    peaked.start(now).complete(now + 0.020)
    assert peaked.rtt_estimate < 0.045


@pytest.mark.parametrize("first", ["complete", "fail", "cancel"])
def test_a_guard_ends_exactly_once(first: str) -> None:
    tracker = PeakEwma(default_rtt=0.030)
    other = tracker.start(0.0)
    guard = tracker.start(0.0)
    if first == "cancel":
        guard.cancel(0.2)
    else:
        guard.complete(0.2, failed=first == "fail")
    estimate, observations = tracker.rtt_estimate, tracker.observations
    assert guard.ended and tracker.in_flight == 1
    guard.complete(9.0)
    guard.complete(9.0, failed=True)
    guard.cancel(9.0)
    assert tracker.in_flight == 1
    assert (tracker.rtt_estimate, tracker.observations) == (estimate, observations)
    other.complete(0.3)
    assert tracker.in_flight == 0


def test_out_of_order_completions_never_give_negative_elapsed() -> None:
    tracker = PeakEwma(default_rtt=0.5)
    late = tracker.start(0.0)
    tracker.start(0.0).complete(2.0)  # peak 2.0, updated at 2.0
    late.complete(1.0)  # reported after, but it ended earlier: no time passed
    assert tracker.rtt_estimate == pytest.approx(2.0)


def test_estimate_never_reaches_zero_so_in_flight_still_counts() -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=1.0)
    now = 0.0
    for _ in range(50):
        tracker.start(now).complete(now)  # zero RTT, long gaps
        now += 100.0
    idle = tracker.load(now)
    tracker.start(now)
    assert idle > 0.0
    assert tracker.load(now) == pytest.approx(2 * idle)


# The age-floor and slow-start tests use a huge decay so that the fade does not
# blur the arithmetic they check.
STILL = 1e12


def test_age_floor_raises_the_cost_while_a_call_is_outstanding() -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=STILL, cancel_evidence=False)
    classic = PeakEwma(default_rtt=0.030, decay=STILL, age_floor=False)
    tracker.start(0.0)
    slow = tracker.start(0.0)
    classic.start(0.0)
    assert tracker.load(0.010) == pytest.approx(0.030 * 3)  # younger than the estimate
    assert tracker.load(2.0) == pytest.approx(2.0 * 3)
    assert classic.load(2.0) == pytest.approx(0.030 * 2)
    # The floor follows the oldest call still outstanding.
    newer = tracker.start(1.5)
    slow.cancel(2.0)
    assert tracker.in_flight == 2
    assert tracker.load(2.0) == pytest.approx(2.0 * 3)  # the first call (t=0) is still open
    newer.cancel(2.0)
    assert tracker.in_flight == 1


def test_age_floor_does_not_change_the_estimate() -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=STILL, cancel_evidence=False)
    guard = tracker.start(0.0)
    assert tracker.load(3.0) == pytest.approx(3.0 * 2)
    guard.cancel(3.0)
    assert tracker.rtt_estimate == pytest.approx(0.030)
    assert tracker.load(3.0) == pytest.approx(0.030)


def test_slow_start_multiplier_falls_linearly_to_one() -> None:
    tracker = PeakEwma(default_rtt=0.1, decay=STILL, slow_start=10.0, slow_start_scale=5.0)
    assert tracker.load(100.0) == pytest.approx(0.1 * 5.0)  # first use starts the window
    assert tracker.load(102.5) == pytest.approx(0.1 * 4.0)
    assert tracker.load(105.0) == pytest.approx(0.1 * 3.0)
    assert tracker.load(110.0) == pytest.approx(0.1)
    assert tracker.load(500.0) == pytest.approx(0.1)


def test_slow_start_window_begins_at_the_first_start_too() -> None:
    tracker = PeakEwma(
        default_rtt=0.1,
        decay=STILL,
        slow_start=4.0,
        slow_start_scale=3.0,
        age_floor=False,
        cancel_evidence=False,
    )
    guard = tracker.start(10.0)
    assert tracker.load(12.0) == pytest.approx(0.1 * 2 * 2.0)
    guard.cancel(14.0)
    assert tracker.load(14.0) == pytest.approx(0.1)


def test_slow_start_off_by_default() -> None:
    tracker = PeakEwma(default_rtt=0.1)
    assert tracker.load(0.0) == pytest.approx(0.1)


BAD_SECONDS = [math.nan, math.inf, -math.inf, -1.0, 0.0, "0.03", None, True]


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_bad_default_rtt_is_rejected(value: object) -> None:
    with pytest.raises(InvalidInput, match="default_rtt"):
        PeakEwma(default_rtt=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_bad_decay_is_rejected(value: object) -> None:
    with pytest.raises(InvalidInput, match="decay"):
        PeakEwma(decay=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"failure_penalty": -0.1}, "failure_penalty"),
        ({"failure_penalty": math.nan}, "failure_penalty"),
        ({"failure_penalty": math.inf}, "failure_penalty"),
        ({"slow_start": -1.0}, "slow_start"),
        ({"slow_start": math.inf}, "slow_start"),
        ({"slow_start_scale": 0.5}, "slow_start_scale"),
        ({"slow_start_scale": math.nan}, "slow_start_scale"),
        ({"age_floor": 1}, "age_floor"),
    ],
)
def test_bad_keyword_parameters_are_rejected(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidInput, match=name):
        PeakEwma(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf])
def test_non_finite_times_are_rejected_where_they_enter(now: float) -> None:
    tracker = PeakEwma()
    with pytest.raises(InvalidInput):
        tracker.load(now)
    with pytest.raises(InvalidInput):
        tracker.start(now)
    assert tracker.in_flight == 0
    guard = tracker.start(0.0)
    with pytest.raises(InvalidInput):
        guard.complete(now)
    with pytest.raises(InvalidInput):
        guard.cancel(now)
    assert not guard.ended and tracker.in_flight == 1  # nothing half-applied
    guard.complete(0.01)
    assert guard.ended and tracker.in_flight == 0


def test_completion_before_start_is_a_negative_rtt_and_rejected() -> None:
    tracker = PeakEwma()
    guard = tracker.start(5.0)
    with pytest.raises(InvalidInput, match="negative RTT"):
        guard.complete(4.0)
    assert not guard.ended and tracker.in_flight == 1
    guard.complete(5.5)
    assert tracker.rtt_estimate == pytest.approx(0.5)


def test_repr_shows_estimate_and_in_flight() -> None:
    tracker = PeakEwma()
    guard = tracker.start(0.0)
    assert "in_flight=1" in repr(tracker)
    assert "open" in repr(guard)
    guard.cancel(0.0)
    assert "ended" in repr(guard)


# -- a new endpoint among loaded ones: neither starved nor flooded ------------------


@dataclass
class _Member:
    key: str
    latency: float
    tracker: PeakEwma = field(default_factory=PeakEwma)
    weight: float = 1.0

    def load(self, now: float) -> float:
        return self.tracker.load(now)


def _simulate(members: list[_Member], picks: int, concurrency: int, start: float) -> list[int]:
    """A small discrete-event loop: `concurrency` callers, each call lasts its latency."""
    policy = PowerOfTwoChoices(random.Random(7))
    counts = [0] * len(members)
    pending: list[tuple[float, int, PeakEwmaGuard]] = []
    now = start
    seq = 0
    issued = 0
    while issued < picks:
        while len(pending) < concurrency and issued < picks:
            index = policy.pick(members, None, now)
            counts[index] += 1
            guard = members[index].tracker.start(now)
            heapq.heappush(pending, (now + members[index].latency, seq, guard))
            seq += 1
            issued += 1
        now, _, done = heapq.heappop(pending)
        done.complete(now)
    while pending:  # let every call end, so no guard outlives the run
        now, _, done = heapq.heappop(pending)
        done.complete(now)
    return counts


def test_a_new_endpoint_among_loaded_ones_gets_traffic_but_not_all_of_it() -> None:
    members = [_Member(f"old-{i}", latency=0.050) for i in range(5)]
    _simulate(members, picks=2000, concurrency=20, start=0.0)  # warm the old ones
    members.append(_Member("new", latency=0.050))
    counts = _simulate(members, picks=600, concurrency=20, start=100.0)
    share = counts[-1] / sum(counts)
    # A fair share is 1/6; the 30 ms default makes it slightly attractive at first.
    assert 0.08 < share < 0.35, counts


def test_a_slow_new_endpoint_is_not_flooded_before_its_first_answer() -> None:
    members = [_Member(f"old-{i}", latency=0.050) for i in range(5)]
    _simulate(members, picks=2000, concurrency=20, start=0.0)
    members.append(_Member("hanging", latency=30.0))
    counts = _simulate(members, picks=400, concurrency=20, start=100.0)
    # Its first calls do not answer for 30 s; the age floor stops it from
    # collecting more than a few of them.
    assert 0 < counts[-1] <= 6, counts


# -- invariants under any sequence of operations ------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["start", "complete", "fail", "cancel", "load"]),
            st.integers(min_value=0, max_value=7),  # which guard
            st.floats(min_value=0.0, max_value=2.0),  # time step
        ),
        max_size=60,
    )
)
def test_in_flight_and_estimate_invariants(ops: list[tuple[str, int, float]]) -> None:
    tracker = PeakEwma(default_rtt=0.030, decay=1.0)
    guards: list[PeakEwmaGuard] = []
    now = 0.0
    ended = 0
    for op, which, step in ops:
        now += step
        if op == "start":
            guards.append(tracker.start(now))
        elif op == "load":
            first = tracker.load(now)
            assert tracker.load(now) == first  # reading does not change anything
            estimate = tracker.estimate(now)
            assert first >= estimate * (tracker.in_flight + 1) > 0.0
            if tracker.updated_at is not None and now >= tracker.updated_at:
                assert estimate <= tracker.rtt_estimate
        elif guards:
            guard = guards[which % len(guards)]
            was_open = not guard.ended
            if op == "cancel":
                guard.cancel(now)
            else:
                guard.complete(now, failed=op == "fail")
            ended += was_open
        assert tracker.in_flight == len(guards) - ended >= 0
        assert tracker.rtt_estimate > 0.0 and math.isfinite(tracker.rtt_estimate)


# -- failures are never evidence of speed ---------------------------------------------


def _tracker_after(history: list[tuple[float, bool]], penalty: float) -> tuple[PeakEwma, float]:
    """A tracker that saw ``history`` (rtt, failed) calls back to back from t=0."""
    tracker = PeakEwma(default_rtt=0.030, failure_penalty=penalty)
    now = 0.0
    for rtt, failed in history:
        tracker.start(now).complete(now + rtt, failed=failed)
        now += rtt
    return tracker, now


def _at_least(value: float, bound: float) -> bool:
    # Up to float rounding: an RTT is computed as (start + rtt) - start.
    return value >= bound * (1.0 - 1e-12) - 1e-12


_RTTS = (0.0, 0.0001, 0.02, 0.3, 1.0, 2.0, 15.0)
_HISTORIES = [
    [(a, fa), (b, fb)] for a in _RTTS for b in _RTTS for fa in (False, True) for fb in (False, True)
]


@pytest.mark.parametrize("penalty", [0.5, 1.0])
@pytest.mark.parametrize("gap", [0.0, 0.5, 30.0])
@pytest.mark.parametrize("rtt", _RTTS)
def test_a_failure_never_lowers_the_estimate_exhaustively(
    penalty: float, gap: float, rtt: float
) -> None:
    for history in _HISTORIES:
        failing, now = _tracker_after(history, penalty)
        succeeding, _ = _tracker_after(history, penalty)
        start = now + gap
        before = failing.estimate(start + rtt)
        failing.start(start).complete(start + rtt, failed=True)
        succeeding.start(start).complete(start + rtt)
        after = failing.estimate(start + rtt)
        assert _at_least(after, before), (history, gap, rtt)
        assert _at_least(after, max(rtt, penalty))
        assert _at_least(after, succeeding.estimate(start + rtt))
        # Each failure at least doubles the estimate until ten penalties.
        assert _at_least(after, min(2.0 * before, max(rtt, 10.0 * penalty)))


def test_repeated_fast_failures_double_up_to_ten_penalties() -> None:
    tracker = PeakEwma(failure_penalty=1.0)
    seen = []
    for n in range(8):
        tracker.start(float(n)).complete(float(n), failed=True)
        seen.append(tracker.rtt_estimate)
    assert seen[0] == pytest.approx(1.0)
    assert seen[-1] == pytest.approx(10.0)
    assert all(b >= a for a, b in itertools.pairwise(seen))


def test_a_fast_failing_endpoint_loses_to_peers_slower_than_the_penalty() -> None:
    # Peers answer in 2 s, more than the 1 s penalty: a flat penalty alone
    # would make the endpoint that fails in 1 ms the cheapest of them.
    members = [_Member(f"m{n}", latency=0.001 if n == 0 else 2.0) for n in range(3)]
    policy = PowerOfTwoChoices(random.Random(7))
    picks = [0, 0, 0]
    now = 0.0
    for _ in range(600):
        index = policy.pick(members, None, now)
        picks[index] += 1
        member = members[index]
        member.tracker.start(now).complete(now + member.latency, failed=index == 0)
        now += 0.1
    assert picks[0] < min(picks[1], picks[2]) / 3, picks


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 20.0), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
def test_no_sequence_of_calls_lets_a_failure_lower_the_estimate(
    calls: list[tuple[float, float, bool]],
) -> None:
    tracker = PeakEwma(failure_penalty=1.0)
    now = 0.0
    for gap, rtt, failed in calls:
        now += gap
        before = tracker.estimate(now + rtt)
        tracker.start(now).complete(now + rtt, failed=failed)
        if failed:
            assert _at_least(tracker.estimate(now + rtt), max(before, rtt, 1.0))
        now += rtt
