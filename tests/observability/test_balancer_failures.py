"""Balancer failure counts: calls through the transport to real loopback servers.

Hypercorn serves, on free loopback ports of the test's own loop (trio, or
asyncio in the asyncio pass), one instance answering 200, one answering
503 and one answering too slowly; a fourth instance's port is bound but not
listening, so connecting to it is refused. Calls go through
``DiscoveryTransport`` mounted on an httpx client; what each call got is
recorded on the caller's side, and the exposition (scraped through the
ASGI metrics app and parsed with ``prometheus_client.parser``), the route's
statistics and the observer's route view must all say the same.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nadisc import (
    CallEvidenceUnavailable,
    CallFailureKind,
    CallTimeout,
    DiscoveryConfig,
    DiscoveryTransport,
    Instance,
    RestOptions,
    open_discovery,
)
from nadisc._observer import route_metrics
from nadisc.observability import console_app, metrics_app, serve
from nadisc.testing import MemoryProvider

KINDS = [kind.value for kind in CallFailureKind]


def answering(status: int, delay: float = 0.0) -> Any:
    """A plain ASGI app answering every request with ``status`` after ``delay`` seconds."""
    start = {"type": "http.response.start", "status": status}
    start["headers"] = [(b"content-length", b"2")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if delay:
            await anyio.sleep(delay)
        await send(start)
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def instance(identity: str, url: str) -> Instance:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Instance(identity, host, int(port))


@asynccontextmanager
async def backends() -> AsyncIterator[dict[str, Instance]]:
    """ok (200), bad (503), slow (200 after 5 s), refused (bound, not listening)."""
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))  # held: the port stays ours, connecting is refused
    try:
        async with anyio.create_task_group() as group:
            made = {}
            for name, app in (
                ("ok", answering(200)),
                ("bad", answering(503)),  # retryable: 502, 503, 504
                ("slow", answering(200, delay=5.0)),
            ):
                (url,) = await group.start(serve, app, "127.0.0.1:0")
                made[name] = instance(name, url)
            made["refused"] = Instance("refused", "127.0.0.1", closed.getsockname()[1])
            yield made
            group.cancel_scope.cancel()
    finally:
        closed.close()


async def scrape(app: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://metrics"
    ) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def failures(samples: dict[Any, float], connection: str) -> dict[str, float]:
    return {
        kind: samples[
            (
                "nadisc_discovery_balancer_failures_total",
                (("connection", connection), ("kind", kind)),
            )
        ]
        for kind in KINDS
    }


async def test_failures_by_kind_equal_what_the_callers_saw() -> None:
    provider = MemoryProvider(services={"orders": "orders", "slow": "slow", "nothing": "nothing"})
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    async with backends() as made:
        provider.set("orders", [made["ok"], made["bad"], made["refused"]])
        provider.set("slow", [made["slow"]])
        provider.set_empty("nothing")
        async with open_discovery(config, providers={"primary": provider}) as owner:
            # The refused instance must stay a caller-visible failure here: no
            # transparent retry of the refused connection, no ejection.
            options = RestOptions(
                request_timeout=2.0,
                connect_timeout=1.0,
                retry_on_connect_failure=False,
                ejection=None,
            )
            retrying = RestOptions(
                request_timeout=2.0,
                connect_timeout=1.0,
                retry_on_connect_failure=False,
                ejection=None,
                max_attempts=3,
                retry_get_head_on_transport_error=True,
                retry_get_head_on_retryable_status=True,
            )
            async with (
                DiscoveryTransport(owner, options=options) as plain,
                DiscoveryTransport(owner, options=retrying) as retried,
                httpx.AsyncClient(mounts={"nadisc://": plain}, trust_env=False) as client,
                httpx.AsyncClient(mounts={"nadisc://": retried}, trust_env=False) as again,
            ):
                seen: Counter[str] = Counter()
                for _ in range(12):
                    try:
                        response = await client.get("nadisc://primary/orders/")
                    except httpx.ConnectError:
                        seen["transport"] += 1
                    else:
                        seen["status" if response.status_code >= 500 else "ok"] += 1
                # Each instance was reached at least once.
                assert seen["ok"] and seen["status"] and seen["transport"], seen
                assert sum(seen.values()) == 12
                # A phase limit of the caller's httpx timeout runs out at the slow
                # one (its listing read first, so that the 0.3 s cannot run out
                # before it on a loaded machine: that is no attempt).
                await owner.client().observe("slow", anyio.current_time() + 10)
                with pytest.raises(CallTimeout):
                    await client.get("nadisc://primary/slow/", timeout=0.3)
                # Nothing listed: the call reaches no instance.
                with pytest.raises(CallEvidenceUnavailable):
                    await client.get("nadisc://primary/nothing/")
                # With retries every call ends at "ok"; its failed attempts still count.
                for _ in range(6):
                    response = await again.get("nadisc://primary/orders/")
                    assert response.status_code == 200

                route = plain.route("primary", "orders")
                assert route is not None
                stats = route.statistics()
                assert stats.failures == {
                    "transport": seen["transport"],
                    "timeout": 0,
                    "status": seen["status"],
                    "no_endpoint": 0,
                    "other": 0,
                }
                assert stats.failed == {"refused": seen["transport"], "bad": seen["status"]}
                assert sum(stats.sent.values()) == 12
                slow = plain.route("primary", "slow")
                nothing = plain.route("primary", "nothing")
                assert slow is not None and nothing is not None
                assert slow.statistics().failures["timeout"] == 1
                assert slow.statistics().failed == {"slow": 1}
                assert nothing.statistics().failures["no_endpoint"] == 1
                assert sum(nothing.statistics().sent.values()) == 0

                retry_route = retried.route("primary", "orders")
                assert retry_route is not None
                retry_stats = retry_route.statistics()
                retry_sent = sum(retry_stats.sent.values())
                retry_failed = retry_stats.failures["transport"] + retry_stats.failures["status"]
                # Every call ended well: each extra attempt was a failed one.
                assert retry_sent == 6 + retry_failed
                assert retry_stats.failed.get("ok", 0) == 0
                assert retry_stats.sent.get("ok") == 6

                # The observer's route view (what the console shows) agrees.
                view = route_metrics(route)
                assert dict(view.failures) == stats.failures
                assert {e.identity: e.failed for e in view.endpoints} == {
                    "ok": 0,
                    "bad": seen["status"],
                    "refused": seen["transport"],
                }

                # The console's route card carries the same numbers.
                console = console_app(owner, transports=[plain])
                async with httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=console), base_url="http://localhost"
                ) as reader:
                    state = json.loads((await reader.get("/state")).text)
                (card,) = [r for r in state["routes"].values() if r["service"] == "orders"]
                assert card["failures"] == stats.failures
                assert {e["identity"]: e["failed"] for e in card["endpoints"]} == {
                    "ok": 0,
                    "bad": seen["status"],
                    "refused": seen["transport"],
                }

                # The exposition adds up every route of the connection, by kind.
                samples = await scrape(metrics_app(owner, transports=[plain, retried]))
                exposed = failures(samples, "primary")
                assert exposed == {
                    "transport": seen["transport"] + retry_stats.failures["transport"],
                    "timeout": 1,
                    "status": seen["status"] + retry_stats.failures["status"],
                    "no_endpoint": 1,
                    "other": 0,
                }
                calls = samples[
                    ("nadisc_discovery_balancer_calls_total", (("connection", "primary"),))
                ]
                assert calls == 12 + 1 + retry_sent  # the slow call was sent; "nothing" was not
                assert sum(v for k, v in exposed.items() if k != "no_endpoint") <= calls
