"""Smoke run of the hosted-restart benchmark (real etcd it starts itself,
the Consul fake in process, real hypercorn, SIGTERM to this process)."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks import hosting_restart

pytestmark = [pytest.mark.real_server, pytest.mark.trio_only]


def test_smoke_run_measures_both_registries(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = hosting_restart.main(["--smoke"])
    out = capsys.readouterr().out
    assert [r.registry for r in rows] == ["etcd (real)", "Consul fake"]
    for r in rows:
        assert r.registry in out
        assert r.restarts == hosting_restart.SMOKE_RESTARTS
        assert 0 < r.gone_median_ms <= r.gone_p99_ms
        assert 0 < r.land_median_ms <= r.land_p99_ms
        assert r.requests > 0 and r.failed == 0
