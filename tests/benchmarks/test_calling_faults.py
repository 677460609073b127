"""Smoke run of the calling-faults benchmark (real etcd it starts itself,
three hosted instances in their own processes, one killed with SIGKILL)."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks import calling_faults

pytestmark = [pytest.mark.real_server, pytest.mark.trio_only]


def test_smoke_run_survives_a_killed_instance(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = calling_faults.main(["--smoke"])
    out = capsys.readouterr().out
    assert [(r.scenario, r.registry, r.settings) for r in rows] == [
        ("kill -9", "etcd", calling_faults.NEW)
    ]
    row = rows[0]
    assert row.requests > 0 and row.p99_ms > 0
    # The bound at full size; the smoke run is one second of it
    # (only requests in flight at the kill can fail).
    assert row.failed <= 10, row
    assert "keep-alive race" in out and "kill -9" in out
