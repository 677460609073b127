"""Does a backend that had one bad second get its traffic back? And low-load fairness.

All scenarios run the real :class:`poise.Balance` with
:class:`poise.PowerOfTwoChoices` on trio's virtual clock
(``MockClock(autojump_threshold=0)``): 10 backends whose replies take an
exponentially distributed time with a 20 ms mean, and an open-loop client
sending 100 requests/s (Poisson arrivals) for 5 virtual minutes.

Each scenario is run with two load trackers:

``P2C + PeakEwma``
    :class:`poise.PeakEwma` with its defaults (30 ms default RTT, 10 s
    decay, 1 s failure penalty, age floor, cancelled calls as evidence).
``reference EWMA``
    the least a hand-written latency EWMA does: the estimate moves toward
    each call's duration with weight ``1 - exp(-gap / 10 s)``, ``gap`` being
    the time since its previous update; a failure or a timeout counts as a
    call of its duration; cost = estimate x (calls in flight + 1). No peak
    rule, no fade, no failure penalty.

Scenarios
    * **slow second**: from t = 30 s to 31 s backend 0 answers in 2 s.
    * **failing second**: from t = 30 s to 31 s backend 0 fails in 1 ms.
    * **hang**: from t = 30 s to 40 s backend 0 does not answer (calls
      started then return at t = 40 s); the client gives up after 1 s
      (``trio.move_on_after``; only in this scenario). The table counts the
      timeouts backend 0 caused, also for ``PeakEwma(cancel_evidence=False)``
      (cancellations ignored, the behaviour before cancelled calls became
      evidence).
    * **fairness**: no fault; min and max share of the 10 backends over
      three seeds (fair: 10% each).

Target: backend 0's requests per minute after the second minute are at least
50% of a fair share (600 a minute). Before the fade was added to
``PeakEwma`` it received 0 a minute after its bad second, for good.

Run: ``python -m benchmarks.balancer_recovery [--smoke] [--seed S]``
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import trio.testing

from benchmarks._sim import open_loop, run_virtual
from poise import (
    Balance,
    Endpoint,
    EndpointError,
    LoadTracker,
    PeakEwma,
    PowerOfTwoChoices,
    service_fn,
)

BACKENDS = 10
MEAN_LATENCY = 0.020
RATE = 100.0
DURATION = 300.0
FAULT_AT = 30.0
TIMEOUT = 1.0
TARGET_SHARE = 0.5


class _RefGuard:
    __slots__ = ("_ended", "_started", "_tracker")

    def __init__(self, tracker: ReferenceEwma, started: float) -> None:
        self._tracker = tracker
        self._started = started
        self._ended = False

    def complete(self, now: float, *, failed: bool = False) -> None:
        if not self._ended:
            self._ended = True
            self._tracker._observe(now - self._started, now)

    def cancel(self, now: float) -> None:
        # A timeout is a call of its duration, as a hand loop that measures
        # "from send to give-up" would record it.
        self.complete(now)


class ReferenceEwma:
    """The minimal reference: a symmetric, time-weighted EWMA of call durations."""

    __slots__ = ("_decay", "_estimate", "_pending", "_updated")

    def __init__(self, default_rtt: float = 0.030, decay: float = 10.0) -> None:
        self._estimate = default_rtt
        self._decay = decay
        self._updated: float | None = None
        self._pending = 0

    def load(self, now: float) -> float:
        return self._estimate * (self._pending + 1)

    def start(self, now: float) -> _RefGuard:
        if self._updated is None:
            self._updated = now
        self._pending += 1
        return _RefGuard(self, now)

    def _observe(self, rtt: float, now: float) -> None:
        self._pending -= 1
        updated = self._updated if self._updated is not None else now
        w = math.exp(-max(now - updated, 0.0) / self._decay)
        self._estimate = self._estimate * w + rtt * (1.0 - w)
        self._updated = now


TRACKERS: dict[str, Callable[[], LoadTracker]] = {
    "P2C + PeakEwma": PeakEwma,
    "reference EWMA": ReferenceEwma,
    "PeakEwma, cancellations ignored": lambda: PeakEwma(cancel_evidence=False),
}
#: The trackers of each scenario (the last one only where it differs).
SCENARIOS: dict[str, tuple[str, ...]] = {
    "slow second": ("P2C + PeakEwma", "reference EWMA"),
    "failing second": ("P2C + PeakEwma", "reference EWMA"),
    "hang": ("P2C + PeakEwma", "PeakEwma, cancellations ignored", "reference EWMA"),
}


@dataclass
class Run:
    tracker: str
    scenario: str
    duration: float
    counts: list[int] = field(default_factory=lambda: [0] * BACKENDS)
    per_minute: list[int] = field(default_factory=list)  # backend 0
    timeouts: list[int] = field(default_factory=lambda: [0] * BACKENDS)
    errors: int = 0

    @property
    def shares(self) -> list[float]:
        total = sum(self.counts)
        return [c / total for c in self.counts]

    @property
    def later_minutes(self) -> list[int]:
        """Backend 0's counts in the minutes after the second."""
        return self.per_minute[2:]


def run(tracker: str, scenario: str, *, seed: int, duration: float, rate: float) -> Run:
    result = Run(tracker, scenario, duration)
    minutes = math.ceil(duration / 60.0)
    result.per_minute = [0] * minutes
    rng = random.Random(seed)
    make = TRACKERS[tracker]

    def fault(index: int, now: float) -> str | None:
        if index != 0:
            return None
        if scenario in ("slow second", "failing second") and FAULT_AT <= now < FAULT_AT + 1.0:
            return scenario
        if scenario == "hang" and FAULT_AT <= now < FAULT_AT + 10.0:
            return scenario
        return None

    def endpoint(index: int) -> Endpoint[int, int]:
        async def serve(request: int) -> int:
            now = trio.current_time()
            result.counts[index] += 1
            if index == 0:
                result.per_minute[min(int(now // 60.0), minutes - 1)] += 1
            what = fault(index, now)
            if what == "slow second":
                await trio.sleep(2.0)
            elif what == "failing second":
                await trio.sleep(0.001)
                raise ConnectionError("backend 0 is failing")
            elif what == "hang":
                await trio.sleep_until(FAULT_AT + 10.0)
            else:
                await trio.sleep(rng.expovariate(1.0 / MEAN_LATENCY))
            return index

        return Endpoint(index, service_fn(serve), tracker=make())

    async def main() -> None:
        balance: Balance[int, int] = Balance(
            PowerOfTwoChoices(random.Random(seed + 1)), [endpoint(i) for i in range(BACKENDS)]
        )

        timeout = TIMEOUT if scenario == "hang" else math.inf

        async def request(n: int) -> None:
            with trio.move_on_after(timeout) as scope:
                try:
                    await balance.dispatch(n)
                except EndpointError:
                    result.errors += 1
            if scope.cancelled_caught:
                # Only backend 0 can be that slow; count where it went.
                result.timeouts[0] += 1

        await open_loop(rng, rate, duration, request)

    run_virtual(main)
    return result


@dataclass(frozen=True)
class Report:
    faults: list[Run]
    fairness: dict[str, list[Run]]
    wall_seconds: float


def run_all(
    *,
    seed: int,
    duration: float,
    rate: float,
    fairness_seeds: int,
    fairness_duration: float,
) -> Report:
    wall = time.perf_counter()
    faults = [
        run(tracker, scenario, seed=seed, duration=duration, rate=rate)
        for scenario, trackers in SCENARIOS.items()
        for tracker in trackers
    ]
    fairness = {
        tracker: [
            run(tracker, "fairness", seed=seed + s, duration=fairness_duration, rate=rate)
            for s in range(fairness_seeds)
        ]
        for tracker in ("P2C + PeakEwma", "reference EWMA")
    }
    return Report(faults, fairness, time.perf_counter() - wall)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [f"{row[0]:<{widths[0]}}", f"{row[1]:<{widths[1]}}"]
        cells += [f"{cell:>{w}}" for cell, w in zip(row[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def format_report(report: Report, rate: float) -> str:
    minutes = len(report.faults[0].per_minute)
    fair = rate * 60.0 / BACKENDS
    header = (
        "scenario",
        "tracker",
        *(f"min {m + 1}" for m in range(minutes)),
        "later / fair",
        "timeouts",
        "errors",
    )
    rows: list[tuple[str, ...]] = [header]
    for r in report.faults:
        later = r.later_minutes
        worst = min(later) / fair if later else math.nan
        rows.append(
            (
                r.scenario,
                r.tracker,
                *(str(c) for c in r.per_minute),
                f"{worst * 100:.0f}%",
                str(r.timeouts[0]),
                str(r.errors),
            )
        )
    lines = [f"Backend 0's requests per virtual minute (fair share: {fair:.0f})"]
    lines += _table(rows)
    lines.append(
        f"'later / fair' = backend 0's worst minute after the second, over a fair share "
        f"(target >= {TARGET_SHARE:.0%}); timeouts: calls abandoned after {TIMEOUT:g} s"
    )
    lines.append("")
    frows: list[tuple[str, ...]] = [("fairness", "tracker", "min share", "max share", "seeds")]
    for tracker, runs in report.fairness.items():
        shares = [s for r in runs for s in r.shares]
        frows.append(
            (
                "no fault",
                tracker,
                f"{min(shares) * 100:.1f}%",
                f"{max(shares) * 100:.1f}%",
                str(len(runs)),
            )
        )
    lines.append(f"Low-load fairness: {BACKENDS} identical backends, shares over the whole run")
    lines += _table(frows)
    lines.append(
        f"{BACKENDS} backends, exponential latency with a {MEAN_LATENCY * 1e3:g} ms mean, "
        f"{rate:g} requests/s open loop, {report.faults[0].duration:g} virtual s; "
        f"wall {report.wall_seconds:.1f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="3 virtual minutes at 6 requests/s")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.smoke:
        duration, rate, seeds, fairness = 180.0, 6.0, 1, 60.0
    else:
        duration, rate, seeds, fairness = DURATION, RATE, 3, DURATION
    report = run_all(
        seed=args.seed,
        duration=duration,
        rate=rate,
        fairness_seeds=seeds,
        fairness_duration=fairness,
    )
    print(format_report(report, rate))
    return report


if __name__ == "__main__":
    main()
