"""A refresh that fails says why, like a failed prepare: in the observer's
listings, in what the console page receives (``/ws`` and ``/state``), on
the page itself, and in ``nadisc watch`` (``--connect``), redacted with the
connection's own secrets; once a complete listing arrives the reason is gone.

The Consul fake serves ``orders`` until a reflecting proxy answers every
``/v1/health/service/orders`` with a 500 whose body echoes the token (as a
debug page would): the listing is then served from its grace window with
``last_failure`` and the reason, and the token appears in no output,
log record, metric or repr.
"""

# Polling here waits on the owner's reaction to the fake's answers; the
# reason moves no listing revision that an event could follow.
# ruff: noqa: ASYNC110

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from nadisc import DiscoveryOwner, ServiceListing, open_discovery
from nadisc.observability import console_app
from tests.fakes.consul import Fault, run_consul_fake
from tests.observability.chromium import open_chromium, require_chromium
from tests.observability.support import (
    CONSUL_TOKEN,
    apply_message,
    consul_config,
    orders_instance,
    served,
    watch_once,
)

pytestmark = pytest.mark.trio_only

QUERY = "/v1/health/service/orders"


def reflecting_proxy() -> Fault:
    body = f"upstream failed; X-Consul-Token: {CONSUL_TOKEN} token={CONSUL_TOKEN}"
    return Fault("status", status=500, body=body.encode())


def orders(owner: DiscoveryOwner) -> ServiceListing:
    (listing,) = (x for x in owner.observer().listings() if x.service == "orders")
    return listing


async def wait_for_reason(owner: DiscoveryOwner) -> ServiceListing:
    with trio.fail_after(15):
        while orders(owner).failure_reason is None:
            await trio.sleep(0.02)
    return orders(owner)


async def test_a_failed_refresh_shows_its_redacted_reason_everywhere_until_it_heals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_chromium()
    caplog.set_level(logging.DEBUG)
    outputs: list[str] = []
    async with run_consul_fake() as fake:
        fake.register(orders_instance(1), now=trio.current_time())
        config = consul_config(fake.url, poll_interval_ms=200)
        async with open_discovery(config) as owner:
            held = await owner.client().observe("orders", trio.current_time() + 10)
            app = console_app(owner, interval=0.05, metrics=True)
            async with served(app) as base, open_chromium(tmp_path / "profile") as browser:
                with trio.fail_after(10):
                    while not orders(owner).instances:
                        await trio.sleep(0.02)
                assert orders(owner).failure_reason is None
                fake.inject(QUERY, reflecting_proxy(), times=10_000)
                # A change ends the blocking query in flight; the next one fails.
                fake.register(orders_instance(2), now=trio.current_time())
                listing = await wait_for_reason(owner)
                reason = listing.failure_reason
                assert reason is not None and listing.last_failure is not None
                assert "500" in reason and "***" in reason and len(reason) <= 200
                assert reason.split(":", 1)[0].isidentifier()  # "<kind>: <message>"
                assert listing.instances  # still served from its grace window
                outputs += [repr(listing), repr(owner.observer().snapshot())]
                # The console's next sample has it (samples are taken every 50 ms).
                taken = app.model.samples
                with trio.fail_after(10):
                    while app.model.samples < taken + 2:
                        await trio.sleep(0.01)

                # /ws and /state carry it in the service's part.
                async with open_websocket_url(base.replace("http", "ws") + "/ws") as socket:
                    text = await socket.get_message()
                state: dict[str, Any] = {}
                apply_message(state, text)
                assert state["services"]["primary/orders"]["failure_reason"] == reason
                async with httpx.AsyncClient() as client:
                    state_text = (await client.get(base + "/state")).text
                    metrics_text = (await client.get(base + "/metrics")).text
                part = json.loads(state_text)["services"]["primary/orders"]
                assert part["failure_reason"] == reason
                outputs += [str(text), state_text, metrics_text]

                # nadisc watch --connect: the table names the failure and why.
                remote = await watch_once(base)
                as_json = await watch_once(base, as_json=True)
                (row,) = [line for line in remote.splitlines() if "orders" in line]
                assert row.endswith(reason)
                (record,) = [json.loads(x) for x in as_json.splitlines()]
                assert record["failure_reason"] == reason
                outputs += [remote, as_json]

                # The page shows it on the service's card.
                page = await browser.open_page(base + "/", width=1280, height=800)
                shown = (
                    'document.querySelector(\'[data-service="primary/orders"] '
                    "[data-failure-reason]')"
                )
                await page.wait_for(f"{shown} !== null")
                assert await page.evaluate(f"{shown}.textContent") == reason
                outputs.append(str(await page.evaluate("document.documentElement.outerHTML")))

                # The registry heals: the next complete listing clears the reason,
                # on the page too.
                fake.clear_faults()
                with trio.fail_after(15):
                    while orders(owner).failure_reason is not None:
                        await trio.sleep(0.02)
                await page.wait_for(f"{shown} === null", timeout=15)
            del held
    outputs.append(caplog.text)
    for output in outputs:
        assert CONSUL_TOKEN not in output
