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
    # The server's side: its CPU per call in every round, read from /proc.
    assert "server CPU per call" in out
    assert set(result.server_us) == set(result.per_round)
    assert all(len(rounds) == result.rounds for rounds in result.server_us.values())
    assert all(us >= 0 for rounds in result.server_us.values() for us in rounds)
    # Over the whole run the server did work (the smoke rounds are short,
    # so one row's reading may be zero ticks, never all of them).
    assert sum(us for rounds in result.server_us.values() for us in rounds) > 0
