"""Shared pieces of the observability tests (not a test module)."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import trio

from nadisc import DiscoveryConfig, DiscoveryOwner, open_discovery
from nadisc.observability import ConsoleApp, console_app, serve
from nadisc.observability._commands import _merge

CONSUL_TOKEN = "s3cret-consul-token-7f1d"
IN_CI = os.environ.get("CI", "").lower() == "true"


async def promtool_check(text: str) -> None:
    """``promtool check metrics`` passes on ``text`` (skipped without promtool, never in CI)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if IN_CI:
            pytest.fail("promtool is not installed (make servers installs prometheus)")
        return
    checked = await anyio.run_process(
        [promtool, "check", "metrics"], input=text.encode(), check=False
    )
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()


def orders_instance(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "Name": "orders",
        "ID": f"orders-{n}",
        "Address": f"10.0.0.{n}",
        "Port": 8000 + n,
        "Meta": {"owner-email": "ops@example.com", "db-password": "hunter2-meta"},
        "Check": {"CheckID": f"service:orders-{n}", "TTL": "1h", "Status": "passing"},
        **extra,
    }


def consul_config(url: str, **connection: Any) -> DiscoveryConfig:
    primary: dict[str, Any] = {
        "provider": "consul",
        "request_timeout_ms": 2000,
        "poll_interval_ms": 5000,
        "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        "consul": {
            "url": url,
            "token": CONSUL_TOKEN,
            "wait": 20,
            "watch_rate": 200,
            "watch_burst": 50,
            # The fake's instance ids are unique across its nodes, and the
            # page and assertions name instances by them.
            "identity_scope": "service",
            "services": {"orders": {"name": "orders"}},
        },
    }
    primary.update(connection)
    return DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": primary}, "shutdown_timeout_ms": 5000}
    )


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """``app`` served by hypercorn on a free loopback port; yields the base URL."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(serve, app, "127.0.0.1:0")
        try:
            yield urls[0]
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def consul_console(
    url: str, **options: Any
) -> AsyncIterator[tuple[DiscoveryOwner, ConsoleApp, str]]:
    """An owner on the Consul fake at ``url``, observing ``orders``, with its console served."""
    async with open_discovery(consul_config(url)) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 10)
        options.setdefault("interval", 0.05)
        app = console_app(owner, **options)
        async with served(app) as base:
            yield owner, app, base
        del observation


async def watch_once(base: str, *, as_json: bool = False) -> str:
    """What ``nadisc watch --connect <base>/ws orders`` prints for one update."""
    from nadisc.observability import watch_remote
    from nadisc.observability._commands import _View

    out = io.StringIO()
    with trio.fail_after(10):
        await watch_remote(
            base.replace("http", "ws") + "/ws",
            ["orders"],
            _View(out, as_json=as_json, updates=1),
            None,
        )
    return out.getvalue()


def apply_message(state: dict[str, Any], text: str | bytes) -> dict[str, Any]:
    """Fold one console message into ``state`` the way the page does."""
    message: dict[str, Any] = json.loads(text)
    if message["type"] == "tick":
        return message
    _merge(state.setdefault("services", {}), message)
    if "overview" in message:
        state["overview"] = message["overview"]
    state.setdefault("routes", {}).update(message.get("routes", {}))
    for key in message.get("removed_routes", []):
        state["routes"].pop(key, None)
    state["seq"] = message["seq"]
    return message


def identities(state: Mapping[str, Any], key: str = "primary/orders") -> list[str]:
    part = state.get("services", {}).get(key)
    return [] if part is None else [i["identity"] for i in part["instances"]]
