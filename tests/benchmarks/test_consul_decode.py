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
    assert results["loads"] > 0 and results["decode"] > 0 and results["cooperative"] > 0
    assert 0 < results["ratio"] <= results["worst_ratio"]
    assert 0 < results["cooperative_ratio"] <= results["worst_cooperative_ratio"]
    assert 0 <= results["stall"] <= results["worst_stall"]
    assert results["longest_step"] > 0
