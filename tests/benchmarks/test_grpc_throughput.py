"""Smoke run of the gRPC throughput benchmark: it runs all four clients and prints the table."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

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


async def test_a_row_times_its_calls_alone() -> None:
    """The timing is of the row's calls on a connected channel: what the
    client did before (connect, warm up) is not in it, and every call or
    streamed message is counted."""
    made: list[str] = []

    async def unary() -> bytes:
        made.append("unary")
        return b""

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b""

    def busy(seconds: float) -> None:
        until = time.process_time() + seconds
        while time.process_time() < until:
            pass

    busy(0.05)  # a client's set-up: not in the row's timing
    spent = await grpc_throughput._run_row("unary c=4", 8, unary, stream)
    assert spent.calls == 8 == len(made)
    assert spent.cpu < 0.05
    spent = await grpc_throughput._run_row("stream 1000 msgs", 400, unary, stream)
    assert spent.calls == 2 * 3  # two streams (400 // 200) of three messages
