"""Smoke run of the discovery-channel benchmark: both clients run and the table prints."""

from __future__ import annotations

import pytest

from benchmarks import grpc_discovery


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = grpc_discovery.main(["--smoke"])
    out = capsys.readouterr().out
    for label in (*grpc_discovery.CLIENTS, *grpc_discovery.ROWS, "/ plain"):
        assert label in out
    assert "load average" in out
    assert len(result.rate) == len(grpc_discovery.ROWS) * len(grpc_discovery.CLIENTS)
    assert all(rate > 0 for rate in result.rate.values())
    # Discovery over the same three connections taken by hand, per row.
    assert "over the same three connections by hand" in out
    for row in grpc_discovery.ROWS:
        assert result.round_ratio(row, grpc_discovery.CLIENTS[2], grpc_discovery.HAND) > 0


def test_smoke_run_with_one_server_lists_it_three_times(capsys: pytest.CaptureFixture[str]) -> None:
    result = grpc_discovery.main(["--smoke", "--one-server"])
    assert result.one_server
    assert "ONE server process listed three times" in capsys.readouterr().out
    assert all(rate > 0 for rate in result.rate.values())
