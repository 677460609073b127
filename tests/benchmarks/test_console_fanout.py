"""Smoke run of the console fan-out benchmark (real hypercorn, real WebSocket clients)."""

from __future__ import annotations

import pytest

from benchmarks import console_fanout
from tests.observability.chromium import require_chromium

pytestmark = pytest.mark.trio_only


def test_smoke_run_prints_the_table_and_slow_clients_reach_the_newest_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = console_fanout.main(["--smoke"])
    out = capsys.readouterr().out
    assert result is not None
    assert "p99 ms" in out and "added CPU" in out and "slow at newest" in out
    assert result.instances == 100 and result.clients == console_fanout.SMOKE["clients"]
    assert result.changes >= 50
    assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms < 5000
    # Latest-only: every slow client ends at the newest state, having
    # received far fewer messages than a fast one.
    assert result.slow_converged == result.slow
    assert result.slow_messages < result.fast_messages


@pytest.mark.real_server
def test_pages_smoke_run_is_fast_for_every_browser_and_sends_what_changed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The page scenario, small: real Chromium following a 200-instance
    service and small ones under churn, beside a deliberately slow client."""
    require_chromium()
    result, cfg = console_fanout.run_pages(smoke=True)
    out = capsys.readouterr().out
    assert "where the time goes" in out and "bytes/instance" in out and "load average" in out
    # Every browser saw the changes it shows: the one with the big card open
    # every change, the others those to the small services.
    assert result.pages[0][1] == result.changes
    assert all(seen == result.small_changes for _, seen, *_ in result.pages[1:])
    # change -> page p99, per browser: the goal is 500 ms; measured 70-210 ms
    # here at load average 2-3 (more in the benchmark's table). 10x the goal.
    p99_ms = max(p99 for _, _, _, p99, _ in result.pages)
    assert p99_ms <= 5000.0, out
    # First render: the goal is 1.5 s, measured 110-450 ms; 10x the goal.
    assert max(result.first_render_ms) <= 15_000.0, out
    # The slow client reads a sample at most one interval old: measured
    # 83-98 ms against 100 ms; bounded at 10x the interval.
    assert result.slow_reads >= 3
    assert result.slow_max_lag_ms <= 10 * console_fanout.PAGES_INTERVAL * 1000, out
    # Bytes proportional to what changed (bytes are exact, no clock): n
    # instances changed at once cost n times about the same, whatever the
    # service's size, and one change is a small fraction of the full state.
    per = {(svc, n): size / n for svc, n, size, _ in result.calibration}
    one_big, one_small = per[("big", 1)], per[("sm00", 1)]
    assert one_big <= 4 * one_small, out
    assert all(one_small / 2 <= v <= one_big for (svc, n), v in per.items() if svc == "big"), out
    assert per[("big", 20)] * 20 >= 8 * one_big, out  # grows with what changed
    assert result.one_change_max <= result.full_bytes / 5, out
    assert cfg["big"] == 200
