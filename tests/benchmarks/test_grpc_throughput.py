"""Smoke run of the gRPC throughput benchmark: it runs all four clients and prints the table."""

from __future__ import annotations

import pytest

from benchmarks import grpc_throughput


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = grpc_throughput.main(["--smoke"])
    out = capsys.readouterr().out
    for label in (*grpc_throughput.CLIENTS, "unary c=1", "unary c=64", "stream 1000 msgs"):
        assert label in out
    assert "load average" in out
    assert len(result.rate) == len(result.rows) * len(grpc_throughput.CLIENTS)
    assert all(rate > 0 for rate in result.rate.values())
    assert all(cpu > 0 for cpu in result.cpu_us.values())
    assert all(len(rounds) == result.rounds for rounds in result.per_round.values())
    assert "median over rounds" in out
    assert "h2 alone" in out
    assert result.h2_floor_us[0] > 0 and result.h2_floor_us[1] > 0
