"""gRPC calls through discovery, counted by the owner: observer, Prometheus, ``/state``, console.

The counts live in the owner per connection, so a closed channel's calls stay
in the exposition and a counter never goes backwards when a new channel opens
on the same connection. Labels are the connection and the closed set of
status code names: no service name, no address.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nadisc import GrpcCallMetrics
from nadisc.grpc import RpcError, discovery_channel
from nadisc.observability import console_app
from nadisc.testing import MemoryProvider
from tests.grpc.conftest import Opener
from tests.grpc.discovery_support import backends
from tests.nadisc.owner_support import memory_owner
from tests.observability.chromium import open_chromium, require_chromium
from tests.observability.support import promtool_check, served

CALLS = "nadisc_discovery_grpc_calls"
DURATION = "nadisc_discovery_grpc_call_duration_seconds"


def row_of(rows: tuple[GrpcCallMetrics, ...]) -> GrpcCallMetrics:
    (row,) = rows
    return row


async def ok_and_not_found(pb: ModuleType, stub: Any, *, ok: int) -> None:
    """``ok`` calls that end OK, then one that ends NOT_FOUND."""
    for _ in range(ok):
        await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
    bad = pb.SimpleRequest(response_status=pb.EchoStatus(code=5, message="gone"))
    with pytest.raises(RpcError) as info:
        await stub.UnaryCall(bad, timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def scrape(client: httpx.AsyncClient) -> tuple[str, dict[str, float], float]:
    """The exposition, its gRPC call counts by code, and the duration histogram's count."""
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    codes: dict[str, float] = {}
    for sample in families[CALLS].samples:
        if sample.name == f"{CALLS}_total":
            assert set(sample.labels) == {"connection", "code"}
            assert sample.labels["connection"] == "primary"
            codes[sample.labels["code"]] = sample.value
    (count,) = [s.value for s in families[DURATION].samples if s.name == f"{DURATION}_count"]
    return text, codes, count


async def test_calls_stay_counted_after_the_channel_closes(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        memory = MemoryProvider(services={"orders": "orders"})
        memory.set("orders", [s.instance() for s in servers])
        async with (
            memory_owner({"primary": memory}) as owner,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=console_app(owner, metrics=True)),
                base_url="http://localhost",
            ) as client,
        ):
            observer = owner.observer()
            assert observer.snapshot().grpc_calls == ()  # no channel yet: no row
            async with discovery_channel(owner, "primary", "orders") as channel:
                row = row_of(observer.snapshot().grpc_calls)
                assert row.calls == 0 and row.quantile(0.99) is None
                await ok_and_not_found(pb, pb_grpc.TestServiceStub(channel), ok=5)
                open_row = row_of(observer.snapshot().grpc_calls)
            # Closed: the same counts, in the observer and in the exposition.
            row = row_of(observer.snapshot().grpc_calls)
            assert row == open_row
            assert row.connection == "primary"
            assert [code for code, _count in row.codes] == [c.name for c in grpc.StatusCode]
            assert dict(row.codes)["OK"] == 5 and dict(row.codes)["NOT_FOUND"] == 1
            assert row.calls == 6 and sum(row.latency) == 6 and row.latency_sum > 0
            assert row.quantile(0.99) is not None
            text, codes, count = await scrape(client)
            assert codes["OK"] == 5.0 and codes["NOT_FOUND"] == 1.0
            assert set(codes) == {c.name for c in grpc.StatusCode}
            assert count == 6.0
            assert "orders" not in text and "127.0.0.1" not in text
            await promtool_check(text)

            state = (await client.get("/state")).json()
            (grpc_row,) = state["overview"]["grpc"]
            assert grpc_row["connection"] == "primary"
            assert grpc_row["calls"] == 6
            assert grpc_row["codes"] == [["OK", 5], ["NOT_FOUND", 1]]  # code order, non-zero
            assert grpc_row["p99"] is not None and grpc_row["p99"] > 0
            assert "127.0.0.1" not in json.dumps(state["overview"])

            # A new channel on the same connection goes on from there.
            async with discovery_channel(owner, "primary", "orders") as again:
                await pb_grpc.TestServiceStub(again).UnaryCall(pb.SimpleRequest(), timeout=10)
            _text, later, count = await scrape(client)
            assert later["OK"] == 6.0 and later["NOT_FOUND"] == 1.0
            assert all(later[code] >= value for code, value in codes.items())
            assert count == 7.0


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_the_console_page_shows_the_grpc_row(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, tmp_path: Path
) -> None:
    require_chromium()
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (owner, channel, _memory):
            await ok_and_not_found(pb, pb_grpc.TestServiceStub(channel), ok=2)
            app = console_app(owner, interval=0.05)
            async with served(app) as base, open_chromium(tmp_path / "profile") as browser:
                page = await browser.open_page(base + "/", width=1280, height=800)
                await page.wait_for(f"{GRPC_ROW} !== null")
                cells = await page.evaluate(f"Array.from({GRPC_ROW}.cells).map(c => c.textContent)")
                assert cells[:3] == ["primary", "3", "OK 2, NOT_FOUND 1"]
                assert cells[3].startswith("≤ ")


GRPC_ROW = "document.querySelector('#grpc [data-grpc=\"primary\"]')"
