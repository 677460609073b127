"""Smoke run of the runtime-at-scale benchmark (starts its own etcd servers)."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks import runtime_scale

pytestmark = [pytest.mark.real_server, pytest.mark.trio_only]


def test_smoke_run_prints_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = runtime_scale.main(["--smoke"])
    out = capsys.readouterr().out
    sizes = runtime_scale.SMOKE
    assert [r.scenario for r in rows] == [
        f"{sizes.registrations} registrations",
        f"{sizes.raised_registrations} registrations (raised limits)",
        f"{sizes.watches} watched services (poll 5 s, gc.freeze)",
        f"{sizes.watches} watched services (poll 5 s, no gc.freeze)",
        f"{sizes.watches} watched services (poll 20 s, gc.freeze)",
        f"{sizes.watches} watched services idle (poll 5 s)",
        f"{sizes.burst}-distinct-key burst",
        f"{sizes.burst}-distinct-key burst (no gc.freeze)",
        f"{sizes.rewrite_keys}-key burst rewritten {sizes.rewrite_rounds} times",
    ]
    for row in rows:
        assert row.scenario in out and row.measured in out
    registered, raised, watched, unfrozen, slow_poll, idle, burst, burst_unfrozen, rewrites = rows
    # Correctness holds at any size; timings are only bounded loosely here.
    for row in (registered, raised):
        assert row.ok, row.measured
        assert row.values["keys"] == 0 and row.values["leases"] == 0
    for row in (watched, unfrozen, slow_poll):
        assert row.values["seen_p99_ms"] < 2000
        # One stream for every watched service, counted once.
        assert row.values["streams"] == 1
    # Idle watched services: every listing usable, and no re-read is needed
    # while the watch confirms them (the count is exact; CPU is noise here).
    assert idle.values["queries"] == 0, idle.measured
    assert f"{sizes.watches}/{sizes.watches} listings usable" in idle.measured
    for row in (burst, burst_unfrozen):
        assert row.values["final_s"] < 30
        assert "a full collection of the heap before the burst" in row.measured
    assert rewrites.values["final_ms"] < 5000


def test_step_clock_ignores_a_step_it_joined_half_way() -> None:
    clock = runtime_scale.StepClock()
    clock.after_task_step(object())  # type: ignore[arg-type]
    assert clock.longest == 0.0
