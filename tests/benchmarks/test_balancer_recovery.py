"""Smoke run of the recovery benchmark: it runs, prints, and shows recovery."""

from __future__ import annotations

import pytest

from benchmarks import balancer_recovery


def test_smoke_run_prints_the_tables_and_backend_0_recovers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = balancer_recovery.main(["--smoke"])
    out = capsys.readouterr().out
    assert "requests per virtual minute" in out and "Low-load fairness" in out
    runs = {(r.scenario, r.tracker): r for r in report.faults}
    fair = 6.0 * 60.0 / balancer_recovery.BACKENDS  # the smoke rate is 6/s
    for scenario in ("slow second", "failing second", "hang"):
        ewma = runs[(scenario, "P2C + PeakEwma")]
        assert len(ewma.per_minute) == 3
        # After its bad second (or ten), backend 0 gets traffic again.
        assert min(ewma.later_minutes) >= 0.5 * fair, (scenario, ewma.per_minute)
    # The hung backend costs timeouts; they stay few with cancellations as evidence.
    hang = runs[("hang", "P2C + PeakEwma")]
    ignored = runs[("hang", "PeakEwma, cancellations ignored")]
    assert 1 <= hang.timeouts[0] <= ignored.timeouts[0]
    for runs_ in report.fairness.values():
        for r in runs_:
            assert abs(sum(r.shares) - 1.0) < 1e-9


def test_reference_ewma_moves_toward_each_duration() -> None:
    ref = balancer_recovery.ReferenceEwma(default_rtt=0.030, decay=10.0)
    guard = ref.start(0.0)
    assert ref.load(0.0) == pytest.approx(0.060)  # one in flight
    guard.complete(10.0)  # a 10 s call after 10 s: weight 1 - 1/e
    assert ref.load(10.0) == pytest.approx(0.030 * 0.36788 + 10.0 * 0.63212, rel=1e-4)
    before = ref.load(10.0)
    ref.start(10.0).cancel(11.0)  # a timeout counts as a call of its duration (1 s)
    w = 0.904837  # exp(-1 / 10)
    assert ref.load(11.0) == pytest.approx(before * w + 1.0 * (1 - w), rel=1e-4)
