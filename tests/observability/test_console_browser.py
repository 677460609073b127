"""The console in real headless Chromium, against the Consul fake on loopback.

The page is loaded from the console served by hypercorn; an instance is
registered in the fake; the page's DOM must show it within one second of
the registry change. A screenshot is checked to be a PNG of the viewport.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.fakes.consul import run_consul_fake
from tests.observability.chromium import open_chromium, png_size, require_chromium
from tests.observability.support import CONSUL_TOKEN, consul_console, orders_instance

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
        assert row[:4] == ["orders-1", "10.0.0.1:8001", "1", "registry_health"]
        html = await page.evaluate("document.documentElement.outerHTML")
        # Never a secret or metadata on the page.
        for secret in (CONSUL_TOKEN, "hunter2-meta", "ops@example.com"):
            assert secret not in html
        assert app.clients == 1

        shot = await page.screenshot(tmp_path / "console.png")
        assert len(shot) > 1000
        assert png_size(shot) == (1280, 800)
        assert (tmp_path / "console.png").read_bytes() == shot
