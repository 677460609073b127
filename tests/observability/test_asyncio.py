"""Metrics and the console on either loop (the asyncio pass runs this file too).

The owner runs on the test's loop; ``serve`` runs hypercorn's worker for
that loop (trio or asyncio) on a free loopback port; an httpx client
scrapes ``/metrics`` and reads ``/state`` and the page.
"""

from __future__ import annotations

import json

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from nadisc import DiscoveryConfig, open_discovery
from nadisc.observability import console_app, serve
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import inst


async def test_console_and_metrics_served_by_hypercorn_on_this_loop() -> None:
    provider = MemoryProvider(services={"orders": "order-worker"})
    provider.set("order-worker", [inst("w1"), inst("w2")])
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    async with open_discovery(config, providers={"primary": provider}) as owner:
        held = await owner.client().observe("orders", anyio.current_time() + 5)
        app = console_app(owner, metrics=True)
        async with anyio.create_task_group() as group:
            (base,) = await group.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=base, trust_env=False) as client:
                with anyio.fail_after(10):
                    while True:
                        try:
                            page = await client.get("/")
                            break
                        except httpx.ConnectError:
                            await anyio.sleep(0.05)
                assert page.status_code == 200 and "console.js" in page.text
                state = json.loads((await client.get("/state")).text)
                assert state["services"]["primary/orders"]["chunks"] == 1
                chunk = state["instances"]["primary/orders#0"]
                assert [i["identity"] for i in chunk] == ["w1", "w2"]
                metrics = (await client.get("/metrics")).text
            group.cancel_scope.cancel()
        del held
    served = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.labels.get("connection") == "primary" and len(sample.labels) == 1
    }
    assert served["nadisc_discovery_instances_served"] == 2
    assert served["nadisc_discovery_observations"] == 1
