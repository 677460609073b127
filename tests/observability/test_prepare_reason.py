"""A connection that fails to prepare says why: in the observer snapshot, in
what the console page receives, and in ``nadisc watch`` (local and
``--connect``), with its secrets nowhere in that output.

The failing Consul connection meets a reflecting proxy (the fake answers
prepare's ``GET /v1/catalog/services`` with a 500 whose body echoes the token,
as a debug page would); the failing etcd connection carries a password and
points at a port nothing listens on.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from nadisc import DiscoveryConfig, open_discovery
from nadisc.observability import console_app, format_table
from nadisc.observability._commands import _View, _watch_local, failed_connections
from tests.fakes.consul import Fault, run_consul_fake
from tests.observability.chromium import open_chromium, require_chromium
from tests.observability.support import CONSUL_TOKEN, apply_message, served, watch_once

# It drives the console with trio_websocket and trio.fail_after: trio only.
pytestmark = pytest.mark.trio_only

ETCD_PASSWORD = "etcd-pa55word-e91c"
SECRETS = (CONSUL_TOKEN, ETCD_PASSWORD)


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def failing_config(consul_url: str) -> DiscoveryConfig:
    common: dict[str, Any] = {"startup_required": False, "request_timeout_ms": 2000}
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    **common,
                    "provider": "consul",
                    "consul": {
                        "url": consul_url,
                        "token": CONSUL_TOKEN,
                        "services": {"orders": {"name": "orders"}},
                    },
                },
                "kv": {
                    **common,
                    "provider": "etcd",
                    "etcd": {
                        "endpoints": [f"http://127.0.0.1:{_closed_port()}"],
                        "username": "svc",
                        "password": ETCD_PASSWORD,
                    },
                },
            },
            "shutdown_timeout_ms": 5000,
        }
    )


def reflecting_proxy() -> Fault:
    body = f"proxy error; request had X-Consul-Token: {CONSUL_TOKEN} ({CONSUL_TOKEN})"
    return Fault("status", status=500, body=body.encode())


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


async def test_the_observer_snapshot_names_the_redacted_reason() -> None:
    async with run_consul_fake() as fake:
        fake.inject("/v1/catalog/services", reflecting_proxy())
        async with open_discovery(failing_config(fake.url)) as owner:
            snap = owner.observer().snapshot()
    consul, etcd = snap.connection("primary"), snap.connection("kv")
    assert consul.prepared is False and etcd.prepared is False
    assert consul.prepare_error_kind is not None and consul.prepare_error is not None
    assert consul.prepare_error.startswith(consul.prepare_error_kind + ":")
    assert "500" in consul.prepare_error and "***" in consul.prepare_error
    assert etcd.prepare_error_kind is not None and etcd.prepare_error is not None
    assert len(consul.prepare_error) <= 200 and len(etcd.prepare_error) <= 200
    assert_no_secret(repr(snap))


async def test_the_page_and_state_receive_the_reason() -> None:
    async with run_consul_fake() as fake:
        fake.inject("/v1/catalog/services", reflecting_proxy())
        async with open_discovery(failing_config(fake.url)) as owner:
            reasons = {
                c.name: (c.prepare_error_kind, c.prepare_error)
                for c in owner.observer().snapshot().connections
            }
            async with served(console_app(owner, interval=0.05)) as base:
                async with open_websocket_url(base.replace("http", "ws") + "/ws") as socket:
                    text = await socket.get_message()
                    state: dict[str, Any] = {}
                    apply_message(state, text)
                async with httpx.AsyncClient() as client:
                    state_text = (await client.get(base + "/state")).text
    shown = {
        c["name"]: (c["prepare_error_kind"], c["prepare_error"])
        for c in state["overview"]["connections"]
    }
    assert shown == reasons and all(reason is not None for _kind, reason in shown.values())
    assert json.loads(state_text)["overview"]["connections"] == state["overview"]["connections"]
    assert_no_secret(str(text))
    assert_no_secret(state_text)


async def test_watch_renders_the_reason_locally_and_through_the_console() -> None:
    async with run_consul_fake() as fake:
        fake.inject("/v1/catalog/services", reflecting_proxy(), times=2)
        config = failing_config(fake.url)
        # Local: the watch opens its own owner and shows the failure, in the
        # table and as JSON lines.
        table, lines = io.StringIO(), io.StringIO()
        keys = ["primary/orders"]
        with trio.fail_after(10):
            await _watch_local(config, keys, _View(table, as_json=False, updates=1), 5)
            await _watch_local(config, keys, _View(lines, as_json=True, updates=1), 5)
        async with (
            open_discovery(config) as owner,
            served(console_app(owner, interval=0.05)) as base,
        ):
            remote = await watch_once(base)
    said = [line for line in table.getvalue().splitlines() if line.startswith("connection ")]
    assert sorted(line.partition(" failed to prepare: ")[0] for line in said) == [
        "connection kv",
        "connection primary",
    ]
    assert all(line.partition(" failed to prepare: ")[2] for line in said)
    records = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert sorted(r["connection"] for r in records) == ["kv", "primary"]
    assert all(r["prepare_error"] for r in records)
    # The console's owner met a healthy Consul (two faults were used up): only etcd failed.
    remote_said = [x for x in remote.splitlines() if x.startswith("connection ")]
    assert [line.partition(" failed to prepare: ")[0] for line in remote_said] == ["connection kv"]
    for output in (table.getvalue(), lines.getvalue(), remote):
        assert_no_secret(output)


def test_format_table_lists_failed_connections_under_the_services() -> None:
    overview: list[dict[str, Any]] = [
        {"name": "a", "prepare_error": None},
        {"name": "b", "prepare_error": "ProviderUnavailable: refused"},
    ]
    failed = failed_connections(overview)
    assert failed == (("b", "ProviderUnavailable: refused"),)
    text = format_table([], failed)
    assert text.splitlines()[-1] == "connection b failed to prepare: ProviderUnavailable: refused"


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_the_page_shows_the_reason_in_the_connection_row(tmp_path: Path) -> None:
    require_chromium()
    async with run_consul_fake() as fake:
        fake.inject("/v1/catalog/services", reflecting_proxy())
        async with (
            open_discovery(failing_config(fake.url)) as owner,
            served(console_app(owner, interval=0.05)) as base,
            open_chromium(tmp_path / "profile") as browser,
        ):
            expected = owner.observer().snapshot().connection("primary")
            page = await browser.open_page(base + "/", width=1280, height=800)
            reason = "document.querySelector('[data-connection=\"primary\"] [data-prepare-error]')"
            await page.wait_for(f"{reason} !== null")
            assert await page.evaluate(f"{reason}.textContent") == expected.prepare_error
            assert (
                await page.evaluate(f"{reason}.dataset.prepareError") == expected.prepare_error_kind
            )
            html = await page.evaluate("document.documentElement.outerHTML")
    assert_no_secret(str(html))
