"""gRPC calls through discovery, counted by status code with latency, in Prometheus."""

from __future__ import annotations

import shutil
from types import ModuleType

import anyio
import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nadisc.grpc import RpcError, discovery_channel
from nadisc.observability import grpc_call_metrics, register_grpc_metrics
from nadisc.testing import MemoryProvider
from tests.grpc.discovery_support import backends
from tests.nadisc.owner_support import memory_owner


async def test_calls_by_code_and_latency_reach_prometheus(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        memory = MemoryProvider(services={"orders": "orders"})
        memory.set("orders", [s.instance() for s in servers])
        async with (
            memory_owner({"primary": memory}) as owner,
            discovery_channel(owner, "primary", "orders") as channel,
        ):
            assert grpc_call_metrics(owner)[0].codes["OK"] == 0
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(5):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            bad = pb.SimpleRequest(response_status=pb.EchoStatus(code=5, message="gone"))
            with pytest.raises(RpcError):
                await stub.UnaryCall(bad, timeout=10)
            (row,) = grpc_call_metrics(owner)
            assert (row.connection, row.service) == ("primary", "orders")
            assert row.codes["OK"] == 5
            assert row.codes["NOT_FOUND"] == 1
            assert set(row.codes) == {code.name for code in grpc.StatusCode}
            assert sum(row.latency) == 6
            registry = CollectorRegistry()
            register_grpc_metrics(owner, registry)
            text = generate_latest(registry).decode()
            assert (
                'nadisc_discovery_grpc_calls_total{code="OK",connection="primary",'
                'service="orders"} 5.0' in text
            )
            assert (
                'nadisc_discovery_grpc_call_duration_seconds_count{connection="primary",'
                'service="orders"} 6.0' in text
            )
            promtool = shutil.which("promtool")
            if promtool is not None:
                checked = await anyio.run_process(
                    [promtool, "check", "metrics"], input=text.encode(), check=False
                )
                output = (checked.stdout + checked.stderr).decode().lower()
                assert "error" not in output
        assert grpc_call_metrics(owner) == ()  # a closed channel is no longer read
