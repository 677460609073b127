"""The deregistration grace: its per-provider default (sans-IO), the budget
that includes it, and a host that serves through it and refuses after it
(in-memory registry behind real hypercorn on loopback, trio and asyncio)."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import DiscoveryConfig
from nadisc.hosting import (
    DEREGISTER_GRACE_MS,
    HostingError,
    ShutdownBudget,
    default_deregister_grace,
    open_host,
    serve,
)
from nadisc.testing import MemoryProvider, MemoryRegistry
from tests.hosting.support import BACKENDS, RecordingApp, run_on

PROVIDERS = ("etcd", "consul", "kubernetes", "nacos", "memory", "static")


def config_of(providers: list[str], registered: list[int], poll_ms: int = 5000) -> DiscoveryConfig:
    connections: dict[str, Any] = {}
    for index, provider in enumerate(providers):
        name = "primary" if index == 0 else f"c{index}"
        block: dict[str, Any] = {"services": {"self": {"name": "order-api"}}}
        if provider == "static":
            block = {"services": {"self": [{"host": "10.0.0.1", "port": 80}]}}
        connections[name] = {"provider": provider, "poll_interval_ms": poll_ms, provider: block}
    registrations = {
        f"r{i}": {
            "qualifier": "primary" if i == 0 else f"c{i}",
            "service_name": "self",
            "listener_ref": "web",
        }
        for i in registered
        if providers[i] != "static"
    }
    return DiscoveryConfig.model_validate(
        {"enabled": True, "connections": connections, "registrations": registrations}
    )


def test_the_documented_defaults() -> None:
    # docs/hosting.md lists these values; a polled provider waits a poll and a request.
    assert default_deregister_grace(config_of(["etcd"], [0])) == 1.0
    assert default_deregister_grace(config_of(["consul"], [0])) == 2.0
    assert default_deregister_grace(config_of(["kubernetes"], [0])) == 3.0
    assert default_deregister_grace(config_of(["memory"], [0])) == 0.0
    assert default_deregister_grace(config_of(["nacos"], [0], poll_ms=2000)) == 2.0 + 3.0
    assert default_deregister_grace(config_of(["etcd"], [])) == 0.0


@settings(max_examples=40, deadline=None)  # each example validates a whole config
@given(
    st.lists(st.sampled_from(PROVIDERS), min_size=1, max_size=4).flatmap(
        lambda providers: st.tuples(
            st.just(providers),
            st.sets(st.integers(0, len(providers) - 1)),
            st.integers(1000, 10_000),  # poll + request timeout < max_age (15 s)
        )
    )
)
def test_the_default_is_the_longest_over_the_registered_connections(
    case: tuple[list[str], set[int], int],
) -> None:
    providers, registered, poll = case
    config = config_of(providers, sorted(registered), poll_ms=poll)
    expected = 0
    for index in registered:
        provider = providers[index]
        if provider == "static":
            continue
        expected = max(expected, DEREGISTER_GRACE_MS.get(provider, poll + 3000))
    assert default_deregister_grace(config) == expected / 1000.0


@given(
    st.floats(0, 1e6),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 100),
)
def test_the_budget_includes_the_grace(
    started: float, quiesce: float, drain: float, grace: float, after: float
) -> None:
    budget = ShutdownBudget(started, quiesce, drain, grace)
    assert budget.deadline == started + quiesce + grace + drain
    assert budget.refuse_at(started + after) == started + after + grace
    assert budget.over(budget.deadline) == 0.0


def test_a_negative_grace_is_refused_naming_it() -> None:
    async def scenario() -> None:
        registry = MemoryRegistry()
        with pytest.raises(HostingError, match="deregister_grace_ms: must not be negative"):
            async with open_host(
                RecordingApp(),
                config_of(["memory"], [0]),
                providers={"primary": MemoryProvider(registry=registry)},
                deregister_grace_ms=-1,
                handle_signals=False,
            ):
                pass
        assert registry.instance_ids() == ()  # refused before anything was bound or written

    run_on("trio", scenario)


def serving(app: RecordingApp, registry: MemoryRegistry, *, grace_ms: int) -> Any:
    """``serve`` of ``app`` registered in ``registry`` (for ``task_group.start``)."""
    return lambda task_status: serve(
        app,
        config_of(["memory"], [0]),
        providers={"primary": MemoryProvider(registry=registry)},
        handle_signals=False,
        allow_loopback=True,
        deregister_grace_ms=grace_ms,
        drain_timeout_ms=500,
        task_status=task_status,
    )


async def deregistered(registry: MemoryRegistry) -> None:
    """Until ``registry`` lists no instance (it has no event to wait for)."""
    with anyio.fail_after(5):
        while registry.instance_ids():  # noqa: ASYNC110
            await anyio.sleep(0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_after_the_deregistration_are_served_until_the_grace_ends(backend: str) -> None:
    registry = MemoryRegistry()
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        app = RecordingApp()
        async with anyio.create_task_group() as tg, httpx.AsyncClient(trust_env=False) as http:
            host = await tg.start(serving(app, registry, grace_ms=600))
            url = host.url("web")
            assert registry.instance_ids()
            host.shutdown()
            await deregistered(registry)
            # Deregistered, and still serving: a caller that has not seen the
            # removal yet is answered.
            answer = await http.get(url + "/during-grace", headers={"connection": "close"})
            seen["during"] = (answer.status_code, host.shutting_down)
            with anyio.fail_after(5):
                await host.wait_draining()
        report = host.report
        seen["report"] = report
        seen["paths"] = [path for path, _ in app.arrivals]

    run_on(backend, scenario)
    assert seen["during"] == (200, True)
    assert seen["paths"] == ["/during-grace"]
    report = seen["report"]
    assert report.deregistered_at is not None and report.refusing_at is not None
    # sleep_until never ends early: the refusal starts a full grace later.
    assert report.refusing_at >= report.deregistered_at + 0.6
    assert report.grace_seconds == report.refusing_at - report.deregistered_at
    assert report.abandoned_requests == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_caller_still_sending_after_the_grace_holds_no_kept_alive_connection(
    backend: str,
) -> None:
    # A caller that has not learnt of the removal keeps sending over its
    # pooled connection. Each answer during the grace ends that connection,
    # so its first request after the grace opens a new one, which the
    # stopped server refuses: a connect error (or the gate's 503 if the
    # connection was accepted just before), never a request cut off on a
    # kept-alive connection the stopping server closed.
    registry = MemoryRegistry()
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        app = RecordingApp()
        async with anyio.create_task_group() as tg, httpx.AsyncClient(trust_env=False) as http:
            host = await tg.start(serving(app, registry, grace_ms=400))
            url = host.url("web")
            before = await http.get(url + "/before")
            seen["before"] = before.headers.get("connection")
            host.shutdown()
            await deregistered(registry)
            during = await http.get(url + "/during-grace")
            seen["during"] = (during.status_code, during.headers.get("connection"))
            with anyio.fail_after(5):
                await host.wait_draining()
            try:
                after = await http.get(url + "/after")
            except httpx.ConnectError:
                seen["after"] = "refused"
            except httpx.TransportError as exc:
                seen["after"] = type(exc).__name__
            else:
                seen["after"] = after.status_code
        seen["paths"] = [path for path, _ in app.arrivals]

    run_on(backend, scenario)
    assert seen["before"] != "close"  # kept alive while registered
    assert seen["during"] == (200, "close")
    assert seen["after"] in ("refused", 503)
    assert seen["paths"] == ["/before", "/during-grace"]
