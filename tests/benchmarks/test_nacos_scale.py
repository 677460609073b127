"""Smoke run of the Nacos scale benchmark (4,096-host decode, 32 registrations)."""

from __future__ import annotations

import pytest

from benchmarks import nacos_scale


def test_nacos_scale_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    results = nacos_scale.main(["--smoke"])
    printed = capsys.readouterr().out
    assert "typed snapshot / json.loads (median)" in printed and "target <= 0.50x" in printed
    assert "32 ephemeral registrations" in printed and "stall ms" in printed
    assert "frozen" in printed and "full gc" in printed
    decoded = results["decode"]
    assert decoded["hosts"] == 4096 and decoded["loads"] > 0
    assert 0 < decoded["ratio"] <= decoded["worst_ratio"]
    assert "typed snapshot / floor (median)" in printed and "target <= 1.20x" in printed
    assert "minimal msgspec + same walk (floor) / json.loads" in printed
    assert "load average " in printed and len(decoded["load_average"]) == 3
    assert 0 < decoded["floor_ratio"] <= decoded["worst_floor_ratio"]
    assert decoded["floor_loads_ratio"] > 0
    assert decoded["after_loads_ratio"] > 0
    # An unchanged poll hashes the body and decodes nothing: measured 0.07x
    # against the careful path's 0.9x (13x apart), so the order holds however
    # noisy the machine is.
    assert 0 < decoded["unchanged_ratio"] < decoded["careful_ratio"]
    assert decoded["distinct_ratio"] > 0 and decoded["careful_ratio"] > 0
    assert results["variants"] == [(0.5, False), (0.5, True)]
    assert results["heap"] > 0
    assert results["full_collection_s"] > results["frozen_collection_s"]
    for row in (*results["beats"], *results["memory"]):
        assert row["beats_per_s"] > 0 and row["cpu_per_beat_us"] > 0
        assert row["p50_ms"] <= row["p99_ms"] and row["stall_ms"] >= 0
        assert 0 <= row["step_cpu_without_gc_ms"] <= row["step_cpu_ms"] + 1e-6
        assert row["full_collections"] <= row["collections"]
        assert row["gc_pause_ms"] >= 0 and row["gc_pause_cpu_ms"] >= 0
