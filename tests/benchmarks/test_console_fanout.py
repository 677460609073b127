"""Smoke run of the console fan-out benchmark (real hypercorn, real WebSocket clients)."""

from __future__ import annotations

import pytest

from benchmarks import console_fanout

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
