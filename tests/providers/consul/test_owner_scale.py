"""Many watches and many registrations on one Consul connection (reduced size).

The full-size runs are in ``benchmarks/runtime_scale.py``; these pin the
design: every watch's blocking queries ride a connection of their own,
outside the request pool, and registration writes go through the owner's
``max_parallel_operations`` bound.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
import trio
import trio.testing
from nadisc_consul import ConsulProvider, ConsulSettings, factory

from nadisc import (
    CloseOutcome,
    ConnectionContext,
    DiscoveryConfig,
    Eligibility,
    RegistrationState,
    open_discovery,
    validate_provider_block,
)
from tests.fakes.consul import ConsulFake, open_consul_fake, run_consul_fake
from tests.nadisc.owner_support import all_tasks

from .test_owner_registration import agent_probes

pytestmark = pytest.mark.trio_only

SERVICES = 100


def instance(service: str, n: int) -> dict[str, Any]:
    return {
        "Name": service,
        "ID": f"{service}-{n}",
        "Address": f"10.0.{n // 250}.{n % 250 + 1}",
        "Port": 8000 + n,
        "Check": {"CheckID": f"service:{service}-{n}", "TTL": "1h", "Status": "passing"},
    }


def blocked(fake: ConsulFake) -> int:
    """Health reads the fake is holding open right now (blocking queries)."""
    return sum(
        1 for r in fake.requests if r.path.startswith("/v1/health/service/") and r.outcome == "open"
    )


def watch_config(url: str) -> DiscoveryConfig:
    services = {f"s{n:03d}": {"name": f"s{n:03d}"} for n in range(SERVICES)}
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "limits": {"max_watch_streams": SERVICES},
            "connections": {
                "primary": {
                    "provider": "consul",
                    "request_timeout_ms": 3000,
                    "poll_interval_ms": 5000,
                    "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
                    "consul": {"url": url, "wait": 30, "services": services},
                }
            },
        }
    )


async def test_each_watch_holds_a_connection_of_its_own_outside_the_pool() -> None:
    before = all_tasks()
    async with run_consul_fake() as fake:
        for n in range(SERVICES):
            fake.register(instance(f"s{n:03d}", 0), now=trio.current_time())
        cfg = watch_config(fake.url)
        connection = cfg.connections["primary"]
        provider = ConsulProvider(
            ConnectionContext(
                name="primary",
                request_timeout=3.0,
                max_instances_per_service=4096,
                max_response_bytes=8 << 20,
            ),
            validate_provider_block("primary", connection, ConsulSettings),
        )
        async with open_discovery(cfg, providers={"primary": provider}) as owner:
            client = owner.client()
            observations = [
                await client.observe(f"s{n:03d}", trio.current_time() + 10) for n in range(SERVICES)
            ]
            http = provider.http
            with anyio.fail_after(30):
                while blocked(fake) < SERVICES or http.channels_open < SERVICES:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            # One channel (one socket) per watch; every blocking query rode one.
            assert http.channels_open == SERVICES
            # The request pool holds no long poll: only what the first, short
            # reads of the 100 services opened (a handful here, 20 on a loaded
            # machine, where more of those reads overlap), never one per watch.
            pool = http._client._transport._pool  # type: ignore[attr-defined]
            assert len(pool.connections) < SERVICES // 2
            # A change to one service reaches its observation through its own channel.
            last = observations[-1]
            fake.register(instance(f"s{SERVICES - 1:03d}", 1), now=trio.current_time())
            with anyio.fail_after(10):
                while len(last.snapshot().instances) != 2:
                    await last.changed(trio.current_time() + 10)
            assert http.channel_requests >= 2 * SERVICES
            assert http.pool_blocking_requests == 0  # the pool saw no blocking query
        assert provider.http.channels_open == 0
    assert all_tasks() == before


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts registration writes in flight through the in-process fake."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        writing = request.method == "PUT"
        if writing:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # Each write takes a little while at the agent.
            if writing:
                await trio.sleep(0.01)
            return await self.inner.handle_async_request(request)
        finally:
            if writing:
                self.in_flight -= 1


def registration_config(url: str, count: int) -> DiscoveryConfig:
    registrations = {
        f"r{n:03d}": {
            "service_name": "self",
            "ip": "10.0.0.5",
            "port": 10_000 + n,
            "eligibility_ref": f"r{n:03d}",
        }
        for n in range(count)
    }
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "limits": {"max_parallel_operations": 4, "max_registrations": count},
            "connections": {
                "primary": {
                    "provider": "consul",
                    "request_timeout_ms": 2000,
                    "monitor_interval_ms": 5000,
                    "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
                    "consul": {
                        "url": url,
                        "health_check_path": "/health",
                        "services": {"self": {"name": "order-api"}},
                    },
                }
            },
            "registrations": registrations,
            "shutdown_timeout_ms": 20_000,
        }
    )


async def test_many_registrations_queue_under_the_bound_and_all_leave_at_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    count = 120
    async with open_consul_fake() as fake, trio.open_nursery() as nursery:
        nursery.start_soon(agent_probes, fake)
        cfg = registration_config(fake.url, count)
        connection = cfg.connections["primary"]
        transport = CountingTransport(fake.transport())
        provider = factory.create_with(
            ConnectionContext(
                name="primary",
                request_timeout=2.0,
                max_instances_per_service=4096,
                max_response_bytes=8 << 20,
            ),
            validate_provider_block("primary", connection, ConsulSettings),
            transport=transport,
        )
        eligibility = {f"r{n:03d}": Eligibility.always() for n in range(count)}
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            eligibility=eligibility,
            publish_deadline=trio.current_time() + 60,
        ) as owner:
            assert {s.state for s in owner.registrations().values()} == {RegistrationState.ACTIVE}
            assert sum(1 for key in fake.services if key[1].startswith("order-api")) == count
        assert transport.max_in_flight <= 4
        report = owner.close_report
        assert report is not None
        outcomes = {getattr(e, "outcome", None) for e in report.registrations}
        assert outcomes == {CloseOutcome.DEREGISTERED}
        assert not any(key[1].startswith("order-api") for key in fake.services)
        nursery.cancel_scope.cancel()
