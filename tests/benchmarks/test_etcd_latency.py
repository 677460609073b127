"""Smoke run of the etcd change-latency benchmark (starts its own etcd and
measures through the discovery owner)."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks import etcd_latency

pytestmark = pytest.mark.real_server


def test_smoke_run_measures_both_stages(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = etcd_latency.main(["--smoke"])
    out = capsys.readouterr().out
    assert [r.stage for r in rows] == [
        "put -> observation changed",
        "put -> streaming balance commit",
    ]
    for r in rows:
        assert r.stage in out
        assert r.samples == etcd_latency.SMOKE_CHANGES
        assert 0 < r.median_ms <= r.p99_ms <= r.max_ms
    observed, commit = rows
    # The commit happens after the observation that carried the instance.
    assert commit.median_ms >= observed.median_ms
    # Loopback: generous bound, a smoke check, not the benchmark's target.
    assert observed.median_ms < 500


def test_nearest_rank() -> None:
    assert etcd_latency.nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert etcd_latency.nearest_rank([float(v) for v in range(1, 101)], 0.99) == 99.0
