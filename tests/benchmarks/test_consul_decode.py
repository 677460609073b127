"""Smoke run of the Consul decode benchmark (small sizes, a few seconds)."""

from __future__ import annotations

import pytest

from benchmarks import consul_decode


def test_consul_decode_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    results = consul_decode.main(["--smoke"])
    printed = capsys.readouterr().out
    for row in ("/ json.loads (median)", "(worst round)", "max loop stall", "longest gc pause"):
        assert row in printed
    assert "target <= 0.50x" in printed and "target <= 25 ms" in printed
    assert "target <= 1.20x" in printed and "minimal msgspec + same walk (floor)" in printed
    assert "load average (1, 5, 15 min)" in printed
    # The floor builds the same listing (the benchmark asserts it) and is timed.
    assert results["floor"] > 0 and results["floor_decode"] > 0
    assert 0 < results["floor_ratio"] <= results["worst_floor_ratio"]
    assert results["decode_only_ratio"] > 0 and results["floor_loads_ratio"] > 0
    assert len(results["load_average"]) == 3
    assert results["loads"] > 0 and results["decode"] > 0 and results["cooperative"] > 0
    assert 0 < results["ratio"] <= results["worst_ratio"]
    assert 0 < results["cooperative_ratio"] <= results["worst_cooperative_ratio"]
    assert 0 <= results["stall"] <= results["worst_stall"]
    assert results["longest_step"] > 0
