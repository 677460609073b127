"""The host against real registries: real hypercorn on loopback, a real etcd
and the Consul fake over HTTP, each on trio and on asyncio.

* an ephemeral port: the registry holds the port the server really bound;
* a configured port that differs from the bound one is refused, both named,
  and nothing is written;
* the host is never reported started before the startup-required
  registration is Active (the registry holds it, the status reads ACTIVE);
* a registry that refuses the write fails startup naming the registration;
* shutdown: the record is gone while a request that was in flight is still
  running, that request completes with 200, requests arriving after the
  deregistration are refused with 503 and never reach the app.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

from nadisc import DiscoveryConfig, RegistrationError, RegistrationState
from nadisc.hosting import Host, HostPhase, open_host, serve
from tests.fakes.consul import Fault
from tests.hosting.support import (
    BACKENDS,
    RecordingApp,
    ThreadedConsul,
    consul_addresses,
    consul_config,
    etcd_addresses,
    etcd_config,
    run_on,
    unique_prefix,
)
from tests.providers.etcd.conftest import EtcdServer

pytestmark = pytest.mark.real_server


@dataclass
class Registry:
    """One registry under test: how to configure a host for it and read it back."""

    kind: str
    config: Callable[..., DiscoveryConfig]
    addresses: Callable[[], Awaitable[list[str]]]
    consul: ThreadedConsul | None = None


@pytest.fixture(scope="module")
def consul() -> Iterator[ThreadedConsul]:
    with ThreadedConsul() as fake:
        yield fake


@pytest.fixture(params=["etcd", "consul"])
def registry(request: pytest.FixtureRequest) -> Registry:
    if request.param == "etcd":
        server: EtcdServer = request.getfixturevalue("etcd_server")
        prefix = unique_prefix()
        return Registry(
            "etcd",
            lambda **kw: etcd_config(server.url, prefix, **kw),
            lambda: etcd_addresses(server.url, prefix),
        )
    fake: ThreadedConsul = request.getfixturevalue("consul")
    fake.call(lambda f: f.services.clear())
    return Registry(
        "consul",
        lambda **kw: consul_config(fake.url, **kw),
        lambda: consul_addresses(fake.url),
        consul=fake,
    )


@contextlib.asynccontextmanager
async def hosted(
    config: DiscoveryConfig, app: Any = None, **options: Any
) -> AsyncIterator[tuple[Host, RecordingApp]]:
    recording = app if app is not None else RecordingApp()
    options.setdefault("handle_signals", False)
    options.setdefault("drain_timeout_ms", 2000)
    # These tests are about registering and draining; tests/hosting/test_grace.py
    # and the rolling-restart tests cover the deregistration grace.
    options.setdefault("deregister_grace_ms", 0)
    async with open_host(recording, config, allow_loopback=True, **options) as host:
        yield host, recording


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ephemeral_port_is_registered_as_bound(backend: str, registry: Registry) -> None:
    async def scenario() -> None:
        assert await registry.addresses() == []
        async with hosted(registry.config()) as (host, app):
            # Entry means Active: the record is there with the real port.
            host_ip, port = host.bound["web"]
            assert port != 0 and host_ip == "127.0.0.1"
            assert host.phase is HostPhase.RUNNING
            assert host.owner.registrations()["web"].state is RegistrationState.ACTIVE
            assert await registry.addresses() == [f"127.0.0.1:{port}"]
            async with httpx.AsyncClient(trust_env=False) as http:
                answer = await http.get(host.url("web") + "/hello")
            assert answer.status_code == 200 and app.arrivals[-1][0] == "/hello"
            assert app.lifespan == ["startup"]
        assert await registry.addresses() == []
        assert app.lifespan == ["startup", "shutdown"]
        report = host.report
        assert report is not None and report.reason == "exit" and not report.over_budget
        assert report.close_report is not None
        (entry,) = report.close_report.registrations
        assert entry.outcome.value == "deregistered"  # type: ignore[attr-defined]
        assert host.phase.value == HostPhase.CLOSED.value

    run_on(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_configured_port_that_differs_from_the_bound_one_is_refused(
    backend: str, registry: Registry
) -> None:
    async def scenario() -> None:
        config = registry.config(registration={"port": 18080})
        with pytest.raises(RegistrationError) as caught:
            async with hosted(config):
                raise AssertionError("must not start")
        error = caught.value
        assert error.registration == "web" and error.path == "discovery.registrations.web.port"
        message = str(error)
        assert "18080" in message and "advertised_port" in message
        bound = int(message.split("bound to port ")[1].split(":")[0])
        assert bound not in (0, 18080)
        assert await registry.addresses() == []
        # The listener was closed again: nothing answers on the bound port.
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", bound)

    run_on(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_advertised_port_is_published_instead_of_the_bound_one(
    backend: str, registry: Registry
) -> None:
    async def scenario() -> None:
        # A NAT/container mapping: peers dial 18080, the server bound elsewhere.
        # (The Consul fake's HTTP check would dial the mapped port, so use
        # no check there.)
        kw: dict[str, Any] = {"registration": {"advertised_port": 18080}}
        if registry.kind == "consul":
            kw["check_path"] = None
        async with hosted(registry.config(**kw)) as (host, _):
            assert host.bound["web"][1] != 18080
            assert await registry.addresses() == ["127.0.0.1:18080"]

    run_on(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_started_is_never_reported_before_the_registration_is_active(
    backend: str, registry: Registry
) -> None:
    if registry.consul is not None:
        # The agent answers the register call late: startup must wait.
        def slow_register(fake: Any) -> None:
            fake.requests.clear()
            fake.inject("/v1/agent/service/register", Fault("slow", delay=0.05))

        registry.consul.call(slow_register)

    async def scenario() -> None:
        seen: list[tuple[RegistrationState, list[str]]] = []
        async with anyio.create_task_group() as tg:
            host: Host = await tg.start(
                lambda task_status: serve(
                    RecordingApp(),
                    registry.config(),
                    allow_loopback=True,
                    handle_signals=False,
                    deregister_grace_ms=0,  # startup is under test (test_grace: the grace)
                    task_status=task_status,
                )
            )
            # What the registry had finished when startup was reported: the
            # register call's answer (the last of its 8 slow pieces) was sent.
            answered = None
            if registry.consul is not None:
                answered = await anyio.to_thread.run_sync(
                    registry.consul.call, lambda f: f.outcomes("/v1/agent/service/register")
                )
            seen.append((host.owner.registrations()["web"].state, await registry.addresses()))
            host.shutdown()
        state, addresses = seen[0]
        assert state is RegistrationState.ACTIVE
        assert addresses == [f"127.0.0.1:{host.bound['web'][1]}"]
        if registry.consul is not None:
            # Order of events, not elapsed time: the record is in the fake's
            # state before the answer trickles out, so a host that reported
            # startup on seeing the record would find the call still "open".
            assert answered == ["answered"]
        report = host.report
        assert report is not None and report.reason == "shutdown()"
        assert await registry.addresses() == []

    run_on(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registry_that_refuses_the_write_fails_startup_naming_the_registration(
    backend: str, registry: Registry
) -> None:
    if registry.consul is not None:
        registry.consul.call(
            lambda f: f.inject(
                "/v1/agent/service/register",
                Fault("status", status=400, body=b"Invalid service address"),
                times=5,
            )
        )
        config = registry.config()
    else:
        # etcd refuses a put larger than its request limit (1.5 MiB).
        config = registry.config(registration={"metadata": {"blob": "x" * 2_000_000}})
        etcd = dict(config.connections["primary"].model_dump()["etcd"])
        etcd["max_record_bytes"] = 4_000_000
        config = registry.config(registration={"metadata": {"blob": "x" * 2_000_000}}, etcd=etcd)

    async def scenario() -> None:
        app = RecordingApp()
        with pytest.raises(RegistrationError) as caught:
            async with hosted(config, app):
                raise AssertionError("must not start")
        assert caught.value.registration == "web"
        assert "'web'" in str(caught.value)
        assert await registry.addresses() == []
        # The app's server did start (the check needs it) and was stopped.
        assert app.lifespan == ["startup", "shutdown"]

    try:
        run_on(backend, scenario)
    finally:
        if registry.consul is not None:
            registry.consul.call(lambda f: f._faults.clear())


async def start_host(tg: Any, config: DiscoveryConfig, app: RecordingApp, **options: Any) -> Host:
    """A host served in ``tg`` (so callers outside it survive its shutdown)."""
    options.setdefault("handle_signals", False)
    options.setdefault("deregister_grace_ms", 0)
    host: Host = await tg.start(
        lambda task_status: serve(
            app, config, allow_loopback=True, task_status=task_status, **options
        )
    )
    return host


@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_deregisters_first_then_drains_in_flight_requests(
    backend: str, registry: Registry
) -> None:
    async def scenario() -> None:
        results: dict[str, Any] = {}
        app = RecordingApp()
        async with httpx.AsyncClient(trust_env=False) as http:

            async def slow(url: str) -> None:
                answer = await http.get(url + "/slow/1500")
                results["slow"] = (answer.status_code, anyio.current_time())

            async with anyio.create_task_group() as tg:
                # No deregistration grace: the drain itself is under test
                # (test_units covers the grace).
                host = await start_host(
                    tg, registry.config(), app, drain_timeout_ms=3000, deregister_grace_ms=0
                )
                url = host.url("web")
                tg.start_soon(slow, url)
                await app.wait_arrival()
                host.shutdown()
                # The record goes while the slow request still runs.
                with anyio.fail_after(5):
                    while await registry.addresses():  # noqa: ASYNC110 - polling a registry
                        await anyio.sleep(0.02)
                results["gone"] = anyio.current_time()
                assert "slow" not in results
                # Arriving after the deregistration: refused, never reaches the app.
                with anyio.fail_after(5):
                    await host.wait_draining()
                if backend == "trio":
                    # (On asyncio, a connection accepted while hypercorn closes
                    # its server can be left to the garbage collector, which
                    # warns; docs/hosting.md, Notes. The gate's 503 is covered
                    # on asyncio by the unit and rolling-restart tests.)
                    try:
                        late = await http.get(url + "/late", headers={"connection": "close"})
                        results["late"] = late.status_code
                    except httpx.TransportError:
                        results["late"] = "refused"  # the listener had already closed
                else:
                    results["late"] = "not sent"
        assert results["slow"][0] == 200
        assert results["gone"] < results["slow"][1]
        assert results["late"] in (503, "refused", "not sent")
        assert [path for path, _ in app.arrivals] == ["/slow/1500"]
        report = host.report
        assert report is not None and report.deregistered_at is not None
        assert report.abandoned_requests == 0 and not report.over_budget
        assert app.arrived_after(report.deregistered_at) == 0
        # The drain ended only after the in-flight handler's 1.5 s had run
        # (both readings on the loop's clock): it waited for that request.
        ((_, arrived),) = app.arrivals
        assert report.deregistered_at + report.drain_seconds >= arrived + 1.5

    run_on(backend, scenario)
