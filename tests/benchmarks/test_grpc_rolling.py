"""Smoke run of the hosted-gRPC rolling benchmark (real etcd it starts itself,
three hosted gRPC servers in their own processes, one restarted)."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks import grpc_rolling

pytestmark = [pytest.mark.real_server, pytest.mark.trio_only]


def test_smoke_run_restarts_one_hosted_grpc_server(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = grpc_rolling.main(["--smoke"])
    out = capsys.readouterr().out
    assert [(r.scenario, r.registry, r.rounds) for r in rows] == [("rolling", "etcd", 1)]
    row = rows[0]
    assert row.rpcs > 0 and row.p99_ms > 0
    assert row.failed == 0 and row.after_stop == 0 and row.sent_after_seen == 0, row
    assert "load average" in out and "rolling" in out
