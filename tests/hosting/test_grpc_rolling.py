"""End to end: three hosted gRPC servers (processes, each a real host of ours)
registered in real etcd or the Consul fake, 200 RPC/s through
``nadisc.grpc.discovery_channel`` (unary and server-streaming, no retry
policy), restarted one by one, or one killed with SIGKILL.

The scenarios are ``benchmarks/grpc_rolling.py``'s, with fewer rounds (the
benchmark runs 20). Servers log every RPC's arrival and their shutdown
steps; the caller logs every RPC and when its observation dropped each
server, all on one clock (``perf_counter``: CLOCK_MONOTONIC, shared by the
machine's processes), so the claims are orders of events.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from benchmarks import grpc_rolling
from benchmarks.calling_faults import ConsulProcess
from tests.providers.etcd.conftest import EtcdServer

pytestmark = [pytest.mark.real_server, pytest.mark.trio_only]


def _assert_whole(row: grpc_rolling.Row, rounds: int) -> None:
    assert row.rounds == rounds
    assert row.rpcs > 200 * rounds, row  # the load ran through every round
    assert row.failed == 0, row
    # Nothing reached a server once it began refusing; nothing the caller sent
    # after it had seen a server go reached that server. The RPCs that came
    # after the ack (sent before the caller's watch event) fell in the grace.
    assert row.after_stop == 0, row
    assert row.sent_after_seen == 0, row


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_rolling_restart_of_hosted_grpc_servers_on_etcd_fails_no_rpc(
    backend: str, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    config = grpc_rolling.etcd(etcd_server.url)
    row = trio.run(
        lambda: grpc_rolling.scenario(
            "rolling", "etcd", config, tmp_path, rounds=2, backend=backend
        )
    )
    _assert_whole(row, 2)


def test_a_rolling_restart_of_hosted_grpc_servers_on_the_consul_fake_fails_no_rpc(
    tmp_path: Path,
) -> None:
    fake = ConsulProcess()
    try:
        config = grpc_rolling.consul(fake.url)
        row = trio.run(
            lambda: grpc_rolling.scenario("rolling", "Consul fake", config, tmp_path, rounds=2)
        )
    finally:
        fake.close()
    _assert_whole(row, 2)


def test_kill_9_of_one_of_three_hosted_grpc_servers_fails_at_most_one_percent(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    config = grpc_rolling.etcd(etcd_server.url)
    row = trio.run(lambda: grpc_rolling.scenario("kill -9", "etcd", config, tmp_path, after=4.0))
    assert row.rpcs > 600, row
    # Only the RPCs in flight on the killed server can fail: the calls picked
    # for it afterwards meet a refused connection and go elsewhere (the
    # channel's transparent retry) until ejection stops the picks.
    assert row.failed <= row.rpcs * 0.01, row
