"""Restart latency of a hosted instance: SIGTERM to record gone, and
registration write to the first caller request landing.

The experiment
    One registry per run: a throw-away real etcd on loopback (started by
    this script) and the Consul fake (``tests/fakes/consul.py``, served by
    hypercorn on loopback in this process). A stable instance and a caller
    run all the time; the caller (its own discovery owner watching the
    registry) sends GETs through ``DiscoveryTransport`` from two workers
    without pause, retrying GETs on another instance. Each restart starts a
    new instance with ``nadisc.hosting.serve`` (hypercorn on an ephemeral
    port, registration without ip/port) and measures:

    * **write -> first request**: from the moment the host hands the
      registration to the provider (``register`` called) until the first
      caller request arrives in the new instance's app (the caller's watch
      or blocking query saw it, the balance committed it, a request landed);
    * **SIGTERM -> record gone**: the instance handles signals; the script
      sends SIGTERM to its own process and polls the registry's HTTP API
      (every 2 ms) until the instance's record is gone.

    The instance then drains and closes; failed caller requests over the
    whole run are counted (0 expected). Median and p99 (nearest rank) over
    the restarts; 50 by default.

Run: ``python -m benchmarks.hosting_restart [--smoke] [--restarts N]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import trio

from benchmarks.etcd_latency import EtcdProcess, nearest_rank
from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryTransport,
    Provider,
    open_discovery,
    validate_provider_block,
)
from nadisc._registry import load_factory
from nadisc.hosting import Host, serve
from tests.fakes.consul import run_consul_fake
from tests.hosting.support import (
    RecordingApp,
    consul_addresses,
    consul_config,
    etcd_addresses,
    etcd_config,
    unique_prefix,
)

RESTARTS = 50
SMOKE_RESTARTS = 3


@dataclass(frozen=True)
class Row:
    registry: str
    restarts: int
    gone_median_ms: float
    gone_p99_ms: float
    land_median_ms: float
    land_p99_ms: float
    requests: int
    failed: int


def _provider(config: DiscoveryConfig, writes: list[float]) -> Provider:
    """The connection's provider, its ``register`` timed (the write moment)."""
    connection = config.connections["primary"]
    factory = load_factory(connection.provider, path="discovery.connections.primary.provider")
    settings = validate_provider_block("primary", connection, factory.settings_model)
    context = ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=config.limits.max_instances_per_service,
        max_response_bytes=config.limits.max_snapshot_bytes,
    )
    provider = factory.create(context, settings)
    register = provider.register

    async def timed(record: Any, deadline: float) -> Any:
        writes.append(trio.current_time())
        return await register(record, deadline)

    provider.register = timed  # type: ignore[method-assign]
    return provider


def _caller(config: DiscoveryConfig) -> DiscoveryConfig:
    document = config.model_dump(mode="json")
    document["registrations"] = {}
    document["eligibility_probe"] = False
    document["connections"]["primary"]["rest"] = {
        "request_timeout_ms": 5000,
        "connect_timeout_ms": 500,
        "max_attempts": 4,
        "retry_get_head_on_transport_error": True,
        "retry_get_head_on_retryable_status": True,
    }
    return DiscoveryConfig.model_validate(document)


async def _measure(
    name: str,
    config: DiscoveryConfig,
    addresses: Callable[[httpx.AsyncClient], Awaitable[list[str]]],
    restarts: int,
) -> Row:
    gone: list[float] = []
    landed: list[float] = []
    counts = {"ok": 0, "failed": 0}
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def start(app: RecordingApp, writes: list[float], signals: bool) -> Host:
            host: Host = await tg.start(
                lambda task_status: serve(
                    app,
                    config,
                    providers={"primary": _provider(config, writes)},
                    allow_loopback=True,
                    handle_signals=signals,
                    drain_timeout_ms=2000,
                    task_status=task_status,
                )
            )
            return host

        stable = await start(RecordingApp("stable"), [], False)
        async with open_discovery(_caller(config)) as caller:
            transport = DiscoveryTransport(caller)
            async with (
                httpx.AsyncClient(mounts={"nadisc://": transport}) as http,
                httpx.AsyncClient(timeout=5, trust_env=False) as reader,
            ):

                async def send() -> None:
                    while not stop.is_set():
                        try:
                            answer = await http.get("nadisc://primary/self/work")
                            counts["ok" if answer.status_code == 200 else "failed"] += 1
                        except Exception:
                            counts["failed"] += 1

                async with anyio.create_task_group() as callers:
                    for _ in range(2):
                        callers.start_soon(send)
                    for _ in range(restarts):
                        app = RecordingApp("restarted")
                        writes: list[float] = []
                        host = await start(app, writes, True)
                        address = "{}:{}".format(*host.bound["web"])
                        with anyio.fail_after(30):
                            await app.wait_arrival()
                        landed.append(app.arrivals[0][1] - writes[0])
                        sent = anyio.current_time()
                        os.kill(os.getpid(), signal.SIGTERM)
                        with anyio.fail_after(30):
                            while address in await addresses(reader):  # noqa: ASYNC110 - polling a registry
                                await anyio.sleep(0.002)
                        gone.append(anyio.current_time() - sent)
                        with anyio.fail_after(30):
                            await host.wait_closed()
                    stop.set()
        stable.shutdown()
    return Row(
        registry=name,
        restarts=restarts,
        gone_median_ms=nearest_rank(gone, 0.5) * 1000,
        gone_p99_ms=nearest_rank(gone, 0.99) * 1000,
        land_median_ms=nearest_rank(landed, 0.5) * 1000,
        land_p99_ms=nearest_rank(landed, 0.99) * 1000,
        requests=counts["ok"] + counts["failed"],
        failed=counts["failed"],
    )


async def _run_all(etcd_url: str, restarts: int) -> list[Row]:
    prefix = unique_prefix()
    rows = [
        await _measure(
            "etcd (real)",
            etcd_config(etcd_url, prefix),
            lambda http: etcd_addresses(etcd_url, prefix, http=http),
            restarts,
        )
    ]
    async with run_consul_fake() as fake:
        rows.append(
            await _measure(
                "Consul fake",
                consul_config(fake.url),
                lambda http: consul_addresses(fake.url, http=http),
                restarts,
            )
        )
    return rows


def render(rows: Sequence[Row]) -> str:
    header = (
        f"{'registry':<12} {'restarts':>8} {'SIGTERM->gone p50':>18} {'p99':>8} "
        f"{'write->1st req p50':>19} {'p99':>8} {'requests':>9} {'failed':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.registry:<12} {r.restarts:>8} {r.gone_median_ms:>15.1f} ms "
            f"{r.gone_p99_ms:>5.1f} ms {r.land_median_ms:>16.1f} ms {r.land_p99_ms:>5.1f} ms "
            f"{r.requests:>9} {r.failed:>7}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_RESTARTS} restarts")
    parser.add_argument("--restarts", type=int, default=None, help=f"default {RESTARTS}")
    args = parser.parse_args(argv)
    restarts = args.restarts or (SMOKE_RESTARTS if args.smoke else RESTARTS)
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd binary is not installed (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="hosting-restart-") as root:
        server = EtcdProcess(binary, Path(root))
        try:
            rows = trio.run(_run_all, server.client, restarts)
        finally:
            server.stop()
    print(f"hosted instance restarts on loopback, {restarts} per registry (trio, hypercorn)")
    print(render(rows))
    return rows


if __name__ == "__main__":
    main()
