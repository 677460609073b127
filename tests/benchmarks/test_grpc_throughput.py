"""Smoke run of the gRPC throughput benchmark: it runs all four clients and prints the table."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

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


def test_smoke_sweep_streams_in_turn_on_a_channel_per_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = grpc_throughput.main(["--smoke", "--sweep", "off,80e-6"])
    out = capsys.readouterr().out
    assert set(result.sweep) == {"trio", "asyncio"} and not result.rate
    for loop, swept in result.sweep.items():
        assert f"receive coalescing on {loop}: 2 pairs" in out
        assert [entry.wait for entry in swept] == [None, 80e-6]
        for entry in swept:
            assert len(entry.streams) == 2
            assert all(wall > 0 and cpu > 0 for wall, cpu in entry.streams)
            assert entry.server_cpu >= 0
        # Each pair's ratio is taken within the pair: the first wait over itself is 1.
        assert swept[0].throughput_over(swept[0]) == [1.0, 1.0]
        assert all(ratio > 0 for ratio in swept[1].throughput_over(swept[0]))
    assert "80 us" in out and "rate / off" in out and "load average" in out


def test_sweep_waits_are_checked_like_the_option() -> None:
    assert grpc_throughput._waits("off, 40e-6,1e-3") == [None, 40e-6, 1e-3]
    with pytest.raises(SystemExit):
        grpc_throughput.main(["--sweep", "off,2e-3"])


async def test_a_row_times_its_calls_alone() -> None:
    """The timing is of the row's calls on a connected channel: what the
    client did before (connect, warm up) is not in it, and every call or
    streamed message is counted."""
    made: list[str] = []

    async def unary() -> bytes:
        made.append("unary")
        return b""

    async def stream() -> int:
        busy(0.02)
        return 3

    def busy(seconds: float) -> None:
        until = time.process_time() + seconds
        while time.process_time() < until:
            pass

    busy(0.05)  # a client's set-up: not in the row's timing
    spent = await grpc_throughput._run_row("unary c=4", 8, unary)
    assert spent.calls == 8 == len(made)
    assert spent.cpu < 0.05
    spent = await grpc_throughput._timed(stream)
    assert spent.calls == 3 and spent.cpu >= 0.02


class _Turns:
    """The stream row's clients, faked: each turn is recorded and reads 1,000 messages."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def turn(self, client: str) -> grpc_throughput.Spent:
        self.order.append(client)
        return grpc_throughput.Spent(grpc_throughput.STREAM_MESSAGES, 0.04, 0.02)


def test_the_stream_row_takes_turns_reversing_the_order_every_other_turn() -> None:
    result = grpc_throughput.Result(400, 1)
    turns = _Turns()
    row = "stream 1000 msgs"
    me = SimpleNamespace(pid=os.getpid())
    grpc_throughput._stream_round(result, row, 400, turns, me)  # type: ignore[arg-type]
    clients = list(grpc_throughput.CLIENTS)
    # One untimed turn, then two (400 // 200 streams each), the second reversed.
    assert turns.order == clients + clients + clients[::-1]
    for client in clients:
        # Two streams of 1,000 messages in 0.08 s, 20 us of CPU per message.
        [(rate, cpu_us)] = result.per_round[(row, client)]
        assert rate == 2000 / 0.08 and cpu_us == 0.04 / 2000 * 1e6
        assert result.rate[(row, client)] == rate
