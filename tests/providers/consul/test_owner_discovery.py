"""Consul discovery through the owner: config, entry point, blocking watch, evidence rules.

In-process cases run the fake through ``fake.transport()`` under trio's
MockClock (the provider is built from the same config block by the factory
and injected); loopback cases load the provider through the
``nadisc.providers`` entry point and talk to the fake served by hypercorn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import ConsulProvider, ConsulSettings, factory

from nadisc import (
    ConfigError,
    ConnectionContext,
    DiscoveryConfig,
    EvidenceUnavailable,
    Observation,
    ObservationSnapshot,
    Provider,
    open_discovery,
    validate_provider_block,
)
from tests.fakes.consul import ConsulFake, Fault, open_consul_fake, run_consul_fake
from tests.nadisc.owner_support import all_tasks

pytestmark = pytest.mark.trio_only

HEALTH = "/v1/health/service/orders"


def instance(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "Name": "orders",
        "ID": f"orders-{n}",
        "Address": f"10.0.0.{n}",
        "Port": 8000 + n,
        "Tags": ["grpc"],
        "Check": {"CheckID": f"service:orders-{n}", "TTL": "1h", "Status": "passing"},
        **extra,
    }


def config(
    url: str, *, connection: Mapping[str, Any] | None = None, **block: Any
) -> DiscoveryConfig:
    consul: dict[str, Any] = {
        "url": url,
        "identity_scope": "service",  # see SERVICE_SCOPE in conftest.py
        "wait": 20,
        "watch_rate": 50,
        "watch_burst": 10,
        "initial_backoff": 1,
        "max_backoff": 4,
        "services": {"orders": {"name": "orders"}},
    }
    consul.update(block)
    primary: dict[str, Any] = {
        "provider": "consul",
        "request_timeout_ms": 2000,
        "poll_interval_ms": 5000,
        "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        "retry": {"initial_backoff_ms": 1000, "max_backoff_ms": 4000},
        "consul": consul,
    }
    primary.update(connection or {})
    return DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": primary}, "shutdown_timeout_ms": 5000}
    )


def in_process(cfg: DiscoveryConfig, fake: ConsulFake) -> dict[str, Provider]:
    """The provider the entry point would build, wired to the in-process fake."""
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, ConsulSettings)
    context = ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
    return {"primary": factory.create_with(context, settings, transport=fake.transport())}


async def wait_until(observation: Observation, predicate: Callable[[], bool]) -> None:
    """Wait (on the observation's changes) until ``predicate()`` holds."""
    with anyio.fail_after(120):
        while not predicate():
            await observation.changed(anyio.current_time() + 120)


def identities(observation: Observation) -> tuple[str, ...]:
    try:
        return observation.snapshot().identities()
    except EvidenceUnavailable:
        return ()


def refusal(observation: Observation, *, strict: bool = False) -> str | None:
    try:
        observation.snapshot(strict=strict)
    except EvidenceUnavailable as exc:
        return exc.reason
    return None


# -- the entry point, over loopback ----------------------------------------------------------


async def test_provider_consul_is_loaded_through_the_entry_point() -> None:
    assert "consul" in {p.name for p in entry_points(group="nadisc.providers")}
    before = all_tasks()
    async with run_consul_fake() as fake:
        fake.register(instance(1), now=anyio.current_time())
        fake.register(instance(2, Tags=["http"]), now=anyio.current_time())
        cfg = config(fake.url, services={"orders": {"name": "orders", "tag": "grpc"}})
        async with open_discovery(cfg) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            snapshot = observation.snapshot()
            # The alias's tag survives the owner asking by remote name.
            assert snapshot.identities() == ("orders-1",)
            assert snapshot.instances[0].tags == ("grpc",)
            assert snapshot.evidence.value == "registry_health"
            reads = [r for r in fake.requests if r.path == HEALTH]
            assert reads and all(r.query.get("tag") == "grpc" for r in reads)
            assert any(r.path == "/v1/catalog/services" for r in fake.requests)  # prepare
        report = owner.close_report
        assert report is not None and report.tasks_left == 0 and not report.provider_errors
    assert all_tasks() == before


async def test_truncated_bodies_over_loopback_are_incomplete_and_served_from_grace() -> None:
    before = all_tasks()
    async with run_consul_fake() as fake:
        fake.register(instance(1), now=anyio.current_time())
        cfg = config(
            fake.url,
            connection={
                "poll_interval_ms": 300,
                "request_timeout_ms": 500,
                "snapshot": {"max_age_ms": 5000, "stale_if_error_ms": 3000},
            },
            wait=1,
        )
        async with open_discovery(cfg) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            fake.inject(HEALTH, Fault("truncate"), times=1000)
            await wait_until(observation, lambda: observation.snapshot().degraded)
            assert observation.snapshot().identities() == ("orders-1",)
            assert refusal(observation, strict=True) == "incomplete"
            assert "disconnected" in fake.outcomes(HEALTH) or "aborted" in fake.outcomes(HEALTH)

    # -- in process, under MockClock ---------------------------------------------------------------
    assert all_tasks() == before


async def test_instances_appear_and_disappear_and_recover_within_one_round_trip(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        cfg = config(fake.url)
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert identities(observation) == ("orders-1",)

            async def moved_within(
                action: Callable[[], object], expected: tuple[str, ...]
            ) -> float:
                start = anyio.current_time()
                action()
                await wait_until(observation, lambda: identities(observation) == expected)
                return anyio.current_time() - start

            now = trio.current_time
            assert (
                await moved_within(
                    lambda: fake.register(instance(2), now=now()), ("orders-1", "orders-2")
                )
                < 1.0
            )
            assert (
                await moved_within(
                    lambda: fake.set_check("service:orders-2", "critical", now=now()), ("orders-1",)
                )
                < 1.0
            )
            # critical -> passing: the blocking query wakes on the health change,
            # far sooner than the 20 s wait or the 5 s confirmation poll.
            assert (
                await moved_within(
                    lambda: fake.set_check("service:orders-2", "passing", now=now()),
                    ("orders-1", "orders-2"),
                )
                < 1.0
            )
            assert await moved_within(lambda: fake.deregister("orders-1"), ("orders-2",)) < 1.0
            blocking = [r for r in fake.requests if r.path == HEALTH and "index" in r.query]
            assert blocking and all(r.query["wait"] == "20s" for r in blocking)
    assert all_tasks() == before


@pytest.mark.parametrize(
    "fault",
    [
        Fault("status", status=500, body=b"rpc error making call"),
        Fault("status", status=503, body=b"No cluster leader"),
        Fault("body", body=b'[{"Node": {"Node": "fake-node-1", "Addr'),
    ],
    ids=["500", "503", "truncated-json"],
)
async def test_failed_refreshes_get_grace_then_go_stale_then_recover(
    autojump_clock: trio.testing.MockClock, fault: Fault
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        cfg = config(fake.url)
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            fake.inject(HEALTH, fault, times=10_000)
            await wait_until(observation, lambda: observation.snapshot().degraded)
            graced: ObservationSnapshot = observation.snapshot()
            assert graced.identities() == ("orders-1",)
            assert refusal(observation, strict=True) == "incomplete"
            await wait_until(observation, lambda: refusal(observation) is not None)
            assert refusal(observation) == "stale"
            # The grace is stale_if_error (10 s) from the last complete listing.
            assert anyio.current_time() - graced.confirmed_at == pytest.approx(10.0, abs=0.01)
            fake._faults.clear()
            await wait_until(observation, lambda: refusal(observation) is None)
            fresh = observation.snapshot()
            assert not fresh.degraded and fresh.identities() == ("orders-1",)
    assert all_tasks() == before


async def test_acl_revocation_refuses_at_once_without_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        fake.enable_acl()
        fake.add_token("s3cr3t-token")
        cfg = config(fake.url, token="s3cr3t-token")
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert identities(observation) == ("orders-1",)
            revoked_at = anyio.current_time()
            fake.revoke_token("s3cr3t-token")
            await wait_until(observation, lambda: refusal(observation) is not None)
            # No grace although stale_if_error is 10 s: a revocation is not incomplete.
            assert refusal(observation) == "revoked"
            assert anyio.current_time() - revoked_at < 1.0
            with pytest.raises(EvidenceUnavailable) as info:
                observation.snapshot()
            assert "s3cr3t" not in str(info.value)
            stats = owner.observer().snapshot().connection("primary")
            assert stats.identity_revocations >= 1
    assert all_tasks() == before


async def test_trimmed_service_read_refuses_at_once_as_revoked_without_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Real Consul answers a valid token that lost ``service:read`` with 200
    ``[]`` and ``X-Consul-Results-Filtered-By-ACLs: true``: that is a trimmed
    permission, never an explicit empty listing."""
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        fake.enable_acl()
        fake.add_token("s3cr3t-token", read=("orders",), write=())
        cfg = config(fake.url, token="s3cr3t-token")
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert identities(observation) == ("orders-1",)
            trimmed_at = anyio.current_time()
            fake.set_token_rules("s3cr3t-token", read=("billing",))
            await wait_until(observation, lambda: refusal(observation) is not None)
            assert refusal(observation) == "revoked"
            # Consul's index does not move when a policy changes, so the blocked
            # watch sleeps on and confirms nothing; the re-read due one
            # confirmation window (5 s poll + 1.25 s) after the last listing
            # sees the trimmed answer and refuses at once: no 10 s grace.
            assert anyio.current_time() - trimmed_at <= 6.25 + 0.01
            with pytest.raises(EvidenceUnavailable) as info:
                observation.snapshot()
            assert "s3cr3t" not in str(info.value)
            stats = owner.observer().snapshot().connection("primary")
            assert stats.identity_revocations >= 1
    assert all_tasks() == before


async def test_index_reset_is_followed_end_to_end(autojump_clock: trio.testing.MockClock) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        fake.register(instance(2), now=0.0)
        cfg = config(fake.url)
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert identities(observation) == ("orders-1", "orders-2")
            await anyio.sleep(1)  # the watch is blocking on its index now
            high = max(int(r.query["index"]) for r in fake.requests if "index" in r.query)
            count = len(fake.requests)
            fake.reset_index(to=1)  # snapshot restore: the index goes backwards
            start = anyio.current_time()
            fake.deregister("orders-1")
            # Like Consul, the fake keeps a request blocked on the old, higher
            # index until its wait ends; the re-read (a fresh, non-blocking
            # query one confirmation window, 6.25 s, after the last listing,
            # which the silent blocked watch did not renew) sees it first.
            await wait_until(observation, lambda: identities(observation) == ("orders-2",))
            assert anyio.current_time() - start <= 6.25 + 0.01
            await anyio.sleep(25)  # the blocked watch returns (20 s wait + jitter) and resets
            after = [r for r in fake.requests[count:] if r.path == HEALTH]
            blocking = [int(r.query["index"]) for r in after if "index" in r.query]
            assert any("index" not in r.query for r in after)
            assert blocking[-1] < high  # blocking again, on the new, low index
            start = anyio.current_time()
            fake.register(instance(3), now=anyio.current_time())
            await wait_until(observation, lambda: "orders-3" in identities(observation))
            assert anyio.current_time() - start < 1.0  # the watch wakes at once again
            assert not observation.snapshot().degraded
    assert all_tasks() == before


async def test_alias_tags_are_kept_and_ambiguous_bindings_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(instance(1), now=0.0)
        fake.register(instance(2, Tags=["http"]), now=0.0)
        fake.register({**instance(3), "Name": "payments", "ID": "pay-1", "Tags": []}, now=0.0)
        cfg = config(
            fake.url,
            services={
                "rpc": {"name": "orders", "tag": "http"},
                # An alias equal to a remote name of *this* binding is fine.
                "payments": {"name": "payments"},
            },
        )
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            handle = owner.client()
            rpc = await handle.observe("rpc", anyio.current_time() + 5)
            assert identities(rpc) == ("orders-2",)
            assert rpc.service == "rpc"
            assert identities(await handle.observe("payments", anyio.current_time() + 5)) == (
                "pay-1",
            )
    for services, message in [
        (
            {"a": {"name": "orders", "tag": "grpc"}, "b": {"name": "orders", "tag": "http"}},
            "different tags",
        ),
        ({"orders": {"name": "order-worker"}, "legacy": {"name": "orders"}}, "remote name"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            await _open(config(fake.url, services=services))
        assert info.value.path == "discovery.connections.primary.consul.services"
    assert all_tasks() == before


async def _open(cfg: DiscoveryConfig) -> None:
    async with open_discovery(cfg):
        pytest.fail("an ambiguous binding must be refused before anything runs")


def test_the_provider_type_is_the_consul_provider() -> None:
    cfg = config("http://127.0.0.1:8500")
    providers = in_process(cfg, ConsulFake())
    assert isinstance(providers["primary"], ConsulProvider)
