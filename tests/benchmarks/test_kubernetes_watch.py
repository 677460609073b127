"""Smoke run of the Kubernetes benchmark (fake API server on loopback, small decode rounds)."""

from __future__ import annotations

import pytest

from benchmarks import kubernetes_watch

pytestmark = pytest.mark.trio_only


def test_kubernetes_watch_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    results = kubernetes_watch.main(["--smoke"])
    printed = capsys.readouterr().out
    for line in (
        "slice update -> observation changed",
        "slice update -> balance commit",
        "typed decode (median)",
        "target <= 0.50x",
    ):
        assert line in printed
    observed, committed = results["rows"]
    for row in (observed, committed):
        assert row.samples == kubernetes_watch.SMOKE_CHANGES
        assert 0 < row.median_ms <= row.p99_ms <= row.max_ms
    assert committed.median_ms >= observed.median_ms * 0.5
    assert results["loads_ms"] > 0
    assert 0 < results["typed_ratio"] <= results["worst_typed_ratio"]
    assert results["listing_ratio"] > results["typed_ratio"]
    assert "one watch event (1 of 40 slices)" in printed
    assert "vs the minimal msgspec floor" in printed and "load average" in printed
    # Both floors measured in the same rounds (ratios, so no wall-clock bound).
    assert results["typed_floor_ratio"] > 0 and results["listing_floor_ratio"] > 0
    assert results["floor_listing_ratio"] > 0
    # One slice's event reuses the other 39 slices' instances.
    assert 0 < results["event_ms"] < results["listing_ms"]
