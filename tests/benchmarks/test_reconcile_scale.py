"""Smoke run of the reconcile-scale benchmark: it runs and prints a sane table."""

from __future__ import annotations

import pytest

from benchmarks import reconcile_scale


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rows = reconcile_scale.main(["--smoke"])
    out = capsys.readouterr().out
    assert "apply ms" in out and "set floor ms" in out and "equal-rev us" in out
    assert [row.members for row in rows] == list(reconcile_scale.SMOKE_SIZES)
    for row in rows:
        assert row.rebuilt == len(range(0, row.members, 100))
        assert row.apply_ms > 0 and row.floor_ms > 0
        # The balance's commit (a splice for directory snapshots) is timed.
        assert row.commit_ms > 0 and row.splices > 0, out
        assert row.commit_ms < row.apply_ms
        assert f"{row.apply_ms:.3f}" in out
    # Equal revision is O(1): it does not grow with the pool (a generous bound,
    # smoke runs on a busy machine are noisy).
    small, large = rows[0], rows[-1]
    assert large.equal_us < 50 * max(small.equal_us, 1.0), out
    # An apply is far from quadratic: 10x the members costs well under 100x.
    assert large.apply_ms < 60 * small.apply_ms + 5, out
