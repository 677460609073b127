"""Rolling restart: three hosted instances, each replaced in turn, while a
caller sends requests through ``DiscoveryTransport`` without pause.

Expected, for real etcd and the Consul fake, on trio and on asyncio:
0 failed requests, and 0 requests reaching an instance's app after its
deregistration was acknowledged (the host refuses those with 503 and the
caller, retrying GETs on another instance, never sees them fail).
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from nadisc import DiscoveryConfig, DiscoveryTransport, open_discovery
from nadisc.hosting import Host, serve
from tests.hosting.support import (
    BACKENDS,
    RecordingApp,
    ThreadedConsul,
    consul_config,
    etcd_config,
    run_on,
    unique_prefix,
)
from tests.providers.etcd.conftest import EtcdServer

pytestmark = pytest.mark.real_server


RETRYING = {
    "request_timeout_ms": 5000,
    "connect_timeout_ms": 500,
    "max_attempts": 4,
    "retry_get_head_on_transport_error": True,
    "retry_get_head_on_retryable_status": True,
}


def caller_config(hosted: DiscoveryConfig, rest: dict[str, Any] | None = None) -> DiscoveryConfig:
    """The same connection without registrations, retrying GETs elsewhere
    unless ``rest`` says otherwise (``{}``: the defaults, no retries)."""
    document = hosted.model_dump(mode="json")
    document["registrations"] = {}
    document["eligibility_probe"] = False
    document["connections"]["primary"]["rest"] = RETRYING if rest is None else rest
    return DiscoveryConfig.model_validate(document)


async def roll(
    config: DiscoveryConfig,
    *,
    rounds: int = 3,
    rest: dict[str, Any] | None = None,
    posts: bool = False,
) -> dict[str, Any]:
    outcome: dict[str, Any] = {"ok": 0, "failed": [], "late": {}, "served": {}}
    apps: list[RecordingApp] = []
    stop = anyio.Event()

    async with anyio.create_task_group() as hosts:

        async def start(index: int) -> Host:
            app = RecordingApp(f"i{index}")
            apps.append(app)
            host: Host = await hosts.start(
                lambda task_status: serve(
                    app,
                    config,
                    allow_loopback=True,
                    handle_signals=False,
                    drain_timeout_ms=2000,
                    task_status=task_status,
                )
            )
            return host

        running = [await start(i) for i in range(3)]
        async with open_discovery(caller_config(config, rest)) as caller:
            transport = DiscoveryTransport(caller)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:

                async def send(worker: int) -> None:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        method = "POST" if posts and n % 2 else "GET"
                        try:
                            answer = await http.request(
                                method, f"nadisc://primary/self/work/{worker}-{n}", content=b"x"
                            )
                        except Exception as exc:  # every failure is counted
                            outcome["failed"].append(repr(exc))
                            continue
                        if answer.status_code == 200:
                            outcome["ok"] += 1
                        else:
                            outcome["failed"].append(answer.status_code)

                async with anyio.create_task_group() as callers:
                    for worker in range(4):
                        callers.start_soon(send, worker)
                    await anyio.sleep(0.2)
                    for index in range(rounds):
                        old = running.pop(0)
                        old_app = apps[index]
                        running.append(await start(3 + index))
                        await anyio.sleep(0.2)  # the new one gets traffic
                        old.shutdown()
                        with anyio.fail_after(15):
                            report = await old.wait_closed()
                        assert report.refusing_at is not None
                        # Served on through the grace; nothing arrives once it refuses.
                        outcome["late"][old_app.name] = old_app.arrived_after(report.refusing_at)
                        outcome["served"][old_app.name] = len(old_app.arrivals)
                    await anyio.sleep(0.2)
                    stop.set()
        for host in running:
            host.shutdown()
    outcome["served"].update({app.name: len(app.arrivals) for app in apps[rounds:]})
    return outcome


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("registry", ["etcd", "consul"])
def test_a_rolling_restart_fails_no_request(
    backend: str, registry: str, request: pytest.FixtureRequest
) -> None:
    if registry == "etcd":
        server: EtcdServer = request.getfixturevalue("etcd_server")
        config = etcd_config(server.url, unique_prefix())
        outcome = run_roll(backend, config)
    else:
        with ThreadedConsul() as consul:
            outcome = run_roll(backend, consul_config(consul.url))
    assert outcome["failed"] == []
    assert outcome["ok"] > 50
    assert outcome["late"] == {"i0": 0, "i1": 0, "i2": 0}
    # Every instance, old and new, took part.
    assert all(count > 0 for count in outcome["served"].values()), outcome["served"]


@pytest.mark.parametrize("registry", ["etcd", "consul"])
def test_a_rolling_restart_fails_no_request_for_callers_with_the_defaults(
    registry: str, request: pytest.FixtureRequest
) -> None:
    # No retries, POSTs among the requests: the hosts' deregistration grace
    # (callers stop picking an instance before it refuses) and the transparent
    # retry of a refused connection are what keeps every request whole.
    if registry == "etcd":
        server: EtcdServer = request.getfixturevalue("etcd_server")
        outcome = run_roll("trio", etcd_config(server.url, unique_prefix()), rest={}, posts=True)
    else:
        with ThreadedConsul() as consul:
            outcome = run_roll("trio", consul_config(consul.url), rest={}, posts=True)
    assert outcome["failed"] == []
    assert outcome["ok"] > 50
    assert outcome["late"] == {"i0": 0, "i1": 0, "i2": 0}


def run_roll(backend: str, config: DiscoveryConfig, **options: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}

    async def scenario() -> None:
        result.update(await roll(config, **options))

    run_on(backend, scenario)
    return result
