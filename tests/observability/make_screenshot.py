"""Take the console screenshot used by docs/observability.md (not a test module).

Run: ``python -m tests.observability.make_screenshot docs/console.png``

The console of an owner on the Consul fake (two services, a few
instances), opened in headless Chromium, captured at 1280x800.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

from nadisc import DiscoveryConfig, open_discovery
from nadisc.observability import console_app
from tests.fakes.consul import run_consul_fake
from tests.observability.chromium import open_chromium
from tests.observability.support import orders_instance, served


async def main(target: Path) -> None:
    async with run_consul_fake() as fake:
        now = trio.current_time()
        for n in (1, 2, 3):
            fake.register(orders_instance(n), now=now)
        for n in (1, 2):
            fake.register(
                {
                    "Name": "billing",
                    "ID": f"billing-{n}",
                    "Address": f"10.0.2.{n}",
                    "Port": 9443,
                    "Check": {"CheckID": f"service:billing-{n}", "TTL": "1h", "Status": "passing"},
                },
                now=now,
            )
        config = DiscoveryConfig.model_validate(
            {
                "enabled": True,
                "connections": {
                    "primary": {
                        "provider": "consul",
                        "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
                        "consul": {
                            "url": fake.url,
                            "wait": 20,
                            "services": {
                                "orders": {"name": "orders"},
                                "billing": {"name": "billing"},
                            },
                        },
                    }
                },
            }
        )
        async with open_discovery(config) as owner:
            held = [
                await owner.client().observe(s, trio.current_time() + 5)
                for s in ("orders", "billing")
            ]
            async with served(console_app(owner, interval=0.05)) as base:
                with tempfile.TemporaryDirectory() as profile:
                    async with open_chromium(Path(profile)) as browser:
                        page = await browser.open_page(base + "/", width=1280, height=800)
                        await page.wait_for(
                            "document.querySelectorAll('[data-instance]').length === 5"
                        )
                        await trio.sleep(4)  # let the evidence age a little
                        await page.screenshot(target)
            del held


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
