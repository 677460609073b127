"""Smoke run of the dispatch-overhead benchmark: it runs and prints a sane table."""

from __future__ import annotations

import pytest

from benchmarks import dispatch_overhead


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = dispatch_overhead.main(["--smoke"])
    out = capsys.readouterr().out
    assert "Balance.dispatch" in out and "trio-native hand loop" in out and "ratio" in out
    assert "anyio-native hand loop" in out
    assert result.anyio_ns > 0
    assert result.ops == 3000
    assert result.balance_ns > 0 and result.hand_ns > 0
    # Not the target (a smoke run on a busy machine is noisy): measured
    # 1.1-1.8x, bounded at 10x that, so only a gross regression of the hot
    # path (an O(n) step per pick) fails it.
    assert "load average before" in out
    assert "median of per-round ratios" in out
    assert set(result.ratios) == set(result.ns)
    for n in result.sizes:
        assert result.ratio(n) < 18.0, out
        assert f"{result.ratio(n):.2f}" in out
