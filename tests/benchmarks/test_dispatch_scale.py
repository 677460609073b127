"""Smoke run of the dispatch-scale benchmark: it runs and prints a sane table."""

from __future__ import annotations

import pytest

from benchmarks import dispatch_scale


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = dispatch_scale.main(["--smoke"])
    out = capsys.readouterr().out
    for shape in dispatch_scale.SHAPES:
        assert shape in out
    assert result.sizes == (10, 100, 1000)
    assert all(ns > 0 for ns in result.ns.values())
    # Not the target (a smoke run on a busy machine is noisy): measured
    # 1.0-1.6x, bounded at 10x that; a scan that walked drained or busy
    # endpoints would cost ~n times more at 1,000.
    assert result.worst_ratio < 16.0, out
    assert "as many ready endpoints" in out
    assert "load average before" in out and "median of per-round" in out
    assert all(result.busy_to_matched(n) < 15.0 for n in result.sizes), out


def test_the_busy_pool_is_really_half_busy() -> None:
    balance = dispatch_scale.build(100, "50% busy", seed=1)
    assert balance.ready_nowait()
    stats = balance.statistics()
    assert stats.ready == 50 and stats.pending == 50
    drained = dispatch_scale.build(1000, "99.9% drained", seed=1)
    assert drained.statistics().ineligible == 999
