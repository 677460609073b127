"""The console in real headless Chromium, against the Consul fake on loopback.

The page is loaded from the console served by hypercorn; an instance is
registered in the fake; the page's DOM must show it within one second of
the registry change. A screenshot is checked to be a PNG of the viewport.
A route card shows the route's failures by kind and each endpoint's failed
attempts, after calls through a transport whose pool answers 503 for one
of two instances.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from nadisc import DiscoveryConfig, DiscoveryTransport, open_discovery
from nadisc.observability import console_app
from nadisc.testing import MemoryProvider
from tests.fakes.consul import run_consul_fake
from tests.nadisc.owner_support import inst
from tests.observability.chromium import open_chromium, png_size, require_chromium
from tests.observability.support import CONSUL_TOKEN, consul_console, orders_instance, served

pytestmark = [pytest.mark.trio_only, pytest.mark.real_server]

HAS_ORDERS_1 = (
    "document.querySelector("
    '\'[data-service="primary/orders"] [data-instance="orders-1"]\') !== null'
)


async def test_the_page_shows_a_registered_instance_within_a_second(tmp_path: Path) -> None:
    require_chromium()
    async with (
        run_consul_fake() as fake,
        consul_console(fake.url) as (_owner, app, base),
        open_chromium(tmp_path / "profile") as browser,
    ):
        page = await browser.open_page(base + "/", width=1280, height=800)
        # The page is live: it shows the observed service (empty so far).
        await page.wait_for("document.querySelector('[data-service=\"primary/orders\"]') !== null")
        assert await page.evaluate(HAS_ORDERS_1) is False
        assert await page.evaluate("document.getElementById('link').dataset.state") == "live"

        changed_at = trio.current_time()
        fake.register(orders_instance(1), now=changed_at)
        with trio.fail_after(1.0):
            await page.wait_for(HAS_ORDERS_1, timeout=1.0)
        latency = trio.current_time() - changed_at
        assert latency < 1.0

        row = await page.evaluate(
            "Array.from(document.querySelector('[data-instance=\"orders-1\"]').cells)"
            ".map(c => c.textContent)"
        )
        assert row[:3] == ["orders-1", "10.0.0.1:8001", "1"]
        html = await page.evaluate("document.documentElement.outerHTML")
        # Never a secret or metadata on the page.
        for secret in (CONSUL_TOKEN, "hunter2-meta", "ops@example.com"):
            assert secret not in html
        assert app.clients == 1

        shot = await page.screenshot(tmp_path / "console.png")
        assert len(shot) > 1000
        assert png_size(shot) == (1280, 800)
        assert (tmp_path / "console.png").read_bytes() == shot


ROUTE_FAILURES = "document.querySelector('[data-route=\"primary/orders\"] [data-failures]')"


async def test_a_route_card_shows_failures_by_kind_and_per_endpoint(tmp_path: Path) -> None:
    require_chromium()
    provider = MemoryProvider(services={"orders": "order-worker"})
    provider.set("order-worker", [inst("w1"), inst("w2", 2)])
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.2":
            return httpx.Response(503, text="down")
        return httpx.Response(200, text="up")

    async with (
        open_discovery(config, providers={"primary": provider}) as owner,
        DiscoveryTransport(owner, transport=httpx.MockTransport(answer)) as transport,
        httpx.AsyncClient(mounts={"nadisc://": transport}) as http,
    ):
        statuses = sorted(
            [(await http.get("nadisc://primary/orders/")).status_code for _ in range(4)]
        )
        assert statuses == [200, 200, 503, 503]
        app = console_app(owner, transports=[transport], interval=0.05)
        async with served(app) as base, open_chromium(tmp_path / "profile") as browser:
            page = await browser.open_page(base + "/", width=1280, height=800)
            await page.wait_for(f"{ROUTE_FAILURES} !== null")
            assert await page.evaluate(f"{ROUTE_FAILURES}.textContent") == "2 failed (status 2)"
            rows = await page.evaluate(
                'Array.from(document.querySelectorAll(\'[data-route="primary/orders"] '
                "[data-endpoint]')).map(r => [r.dataset.endpoint, r.cells[3].textContent, "
                "r.cells[4].textContent])"
            )
            assert sorted(rows) == [["w1", "2", "0"], ["w2", "2", "2"]]
