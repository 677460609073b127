"""Shared pieces of the hosting tests (not a test module).

* :class:`RecordingApp` — a plain ASGI app that records each request's path
  and arrival time; ``/slow/<ms>`` answers after that many milliseconds.
* registries both loops can reach over loopback: the session's real etcd
  (``tests/providers/etcd/conftest.py``) and :class:`ThreadedConsul`, the
  Consul fake served by hypercorn on trio in its own thread (the fake is
  written for trio; running it beside the test's loop lets asyncio tests
  use it too). Tests read both registries over their HTTP APIs.
* :func:`run_on` runs a scenario on the named anyio backend (each test is
  parametrized over trio and asyncio).
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import trio
import trio.from_thread
import trio.lowlevel

from nadisc import DiscoveryConfig
from tests.fakes.consul import ConsulFake, run_consul_fake

BACKENDS = ("trio", "asyncio")


def run_on(backend: str, scenario: Callable[[], Awaitable[None]]) -> None:
    anyio.run(scenario, backend=backend)


@dataclass
class RecordingApp:
    """Answers ``200 <name>``; records (path, arrival time on the loop clock)."""

    name: str = "app"
    arrivals: list[tuple[str, float]] = field(default_factory=list)
    lifespan: list[str] = field(default_factory=list)
    _arrived: anyio.Event | None = field(default=None, repr=False)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.lifespan.append("startup")
                    await send({"type": "lifespan.startup.complete"})
                else:
                    self.lifespan.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path: str = scope["path"]
        self.arrivals.append((path, anyio.current_time()))
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None
        if path.startswith("/slow/"):
            await anyio.sleep(int(path.rsplit("/", 1)[1]) / 1000)
        body = self.name.encode()
        if path.startswith("/started/"):
            # The response starts and its first half is sent; the rest after
            # the wait.
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"%d" % (2 * len(body)))],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await anyio.sleep(int(path.rsplit("/", 1)[1]) / 1000)
            await send({"type": "http.response.body", "body": body})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def wait_arrival(self, count: int = 1) -> None:
        """Wait until ``count`` requests have arrived."""
        while len(self.arrivals) < count:
            if self._arrived is None:
                self._arrived = anyio.Event()
            await self._arrived.wait()

    def arrived_after(self, moment: float) -> int:
        return sum(1 for _, at in self.arrivals if at > moment)


# ------------------------------------------------------------------ etcd


def etcd_config(
    url: str,
    prefix: str,
    *,
    registration: Mapping[str, Any] | None = None,
    probe: bool = False,
    **policy: Any,
) -> DiscoveryConfig:
    """One etcd connection ``primary`` (alias ``self`` = ``order-api``) and one
    registration ``web`` without ip/port (taken from the listener)."""
    connection: dict[str, Any] = {
        "provider": "etcd",
        "request_timeout_ms": 2000,
        "poll_interval_ms": 1000,
        "monitor_interval_ms": 500,
        "observation_grace_ms": 4000,
        "deregister_timeout_ms": 1000,
        "snapshot": {"max_age_ms": 5000, "stale_if_error_ms": 2000},
        "etcd": {
            "endpoints": [url],
            "prefix": prefix,
            "ttl_seconds": 5,
            "probe_interval_ms": 300,
            "connect_timeout_ms": 300,
            "services": {"self": {"name": "order-api"}},
        },
    }
    connection.update(policy)
    web: dict[str, Any] = {"service_name": "self", "listener_ref": "web"}
    web.update(registration or {})
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "eligibility_probe": probe,
            "connections": {"primary": connection},
            "registrations": {"web": web},
            "shutdown_timeout_ms": 3000,
        }
    )


def unique_prefix() -> str:
    return f"h-{uuid.uuid4().hex[:10]}/services"


async def etcd_addresses(
    url: str, prefix: str, service: str = "order-api", http: httpx.AsyncClient | None = None
) -> list[str]:
    """The ``Addr`` of every record under the service, read through the gateway."""
    key = f"{prefix}/{service}/".encode()
    end = key[:-1] + bytes([key[-1] + 1])
    body = {
        "key": base64.b64encode(key).decode(),
        "range_end": base64.b64encode(end).decode(),
    }
    if http is None:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as own:
            answer = await own.post(f"{url}/v3/kv/range", json=body)
    else:
        answer = await http.post(f"{url}/v3/kv/range", json=body)
    answer.raise_for_status()
    kvs = answer.json().get("kvs", [])
    return sorted(json.loads(base64.b64decode(kv["value"]))["Addr"] for kv in kvs)


# ---------------------------------------------------------------- consul


class ThreadedConsul:
    """The Consul fake on ``127.0.0.1:<ephemeral>``, run by trio in a thread."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="consul-fake", daemon=True)
        self._token: trio.lowlevel.TrioToken | None = None
        self._fake: ConsulFake | None = None
        self._error: BaseException | None = None
        self.url = ""

    def __enter__(self) -> ThreadedConsul:
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("the Consul fake did not start")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # pragma: no cover - surfaced by __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with run_consul_fake(**self._options) as fake:
            self._fake = fake
            self.url = fake.url
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            while not self._stop.is_set():  # noqa: ASYNC110 - a flag set from another thread
                await trio.sleep(0.05)

    def call(self, fn: Callable[[ConsulFake], object]) -> object:
        """Run ``fn(fake)`` on the fake's own thread (blocking briefly)."""
        fake = self._fake
        assert fake is not None and self._token is not None
        return trio.from_thread.run_sync(fn, fake, trio_token=self._token)


def consul_config(
    url: str,
    *,
    registration: Mapping[str, Any] | None = None,
    check_path: str | None = "/discovery/eligible/web",
    **policy: Any,
) -> DiscoveryConfig:
    """One Consul connection ``primary``; the agent's HTTP check probes the
    host's eligibility probe on the registered address."""
    consul: dict[str, Any] = {
        "url": url,
        "wait": 2,
        "allow_loopback": True,
        "health_check_interval": 0.2,
        "reregister_interval": 30,
        "services": {"self": {"name": "order-api"}},
    }
    if check_path is not None:
        consul["health_check_path"] = check_path
    connection: dict[str, Any] = {
        "provider": "consul",
        "request_timeout_ms": 1000,
        "poll_interval_ms": 1000,
        "monitor_interval_ms": 300,
        "observation_grace_ms": 3000,
        "deregister_timeout_ms": 1000,
        "snapshot": {"max_age_ms": 5000, "stale_if_error_ms": 2000},
        "consul": consul,
    }
    connection.update(policy)
    web: dict[str, Any] = {"service_name": "self", "listener_ref": "web"}
    web.update(registration or {})
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "eligibility_probe": check_path is not None,
            "connections": {"primary": connection},
            "registrations": {"web": web},
            "shutdown_timeout_ms": 3000,
        }
    )


async def consul_addresses(
    url: str, service: str = "order-api", http: httpx.AsyncClient | None = None
) -> list[str]:
    """``address:port`` of every agent service named ``service``."""
    if http is None:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as own:
            answer = await own.get(f"{url}/v1/agent/services")
    else:
        answer = await http.get(f"{url}/v1/agent/services")
    answer.raise_for_status()
    return sorted(
        f"{entry['Address']}:{entry['Port']}"
        for entry in answer.json().values()
        if entry["Service"] == service
    )
