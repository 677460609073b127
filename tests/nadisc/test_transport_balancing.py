"""A connection's ``balancing`` block through the discovery transport.

Zone preference and subsetting decide which instances a route mirrors;
hedging races a second attempt of an idempotent call; the retry budget
refuses retries once spent. The pool is an in-process handler (as in
test_transport_failures.py) so each instance's latency and status are set
per host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry

from nadisc import ConfigError, DiscoveryOwner, DiscoveryTransport, Instance, RestOptions
from nadisc._balancing import RouteBalancing, instance_zone
from nadisc._config import BalancingConfig
from nadisc._route import LbStrategy, Route
from nadisc.observability import DiscoveryCollector
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy

SERVICE = "orders"
URL = f"nadisc://primary/{SERVICE}/x"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Pool(httpx.AsyncBaseTransport):
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.nadisc_enforces_timeouts = True
        self.hosts: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.hosts.append(request.url.host)
        return await self.handler(request)


async def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text=request.url.host)


def zoned(identity: str, octet: int, zone: str) -> Instance:
    return Instance(identity, f"10.0.0.{octet}", 80, metadata={"zone": zone})


@asynccontextmanager
async def transport(
    pool: Pool, instances: list[Instance], options: RestOptions | None = None, **balancing: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, DiscoveryTransport, DiscoveryOwner]]:
    memory = MemoryProvider(services={SERVICE: SERVICE})
    memory.set(SERVICE, instances)
    policies = {"primary": policy(balancing=balancing)}
    async with (
        memory_owner({"primary": memory}, policies=policies) as owner,
        DiscoveryTransport(owner, options=options, transport=pool) as discovery,
        httpx.AsyncClient(mounts={"nadisc://": discovery}, timeout=None) as http,
    ):
        yield http, discovery, owner


def route_of(discovery: DiscoveryTransport) -> Route:
    route = discovery.route("primary", SERVICE)
    assert route is not None
    return route


async def test_equal_zones_keep_calls_in_the_callers_zone() -> None:
    fleet = [zoned(f"{z}{i}", 10 * n + i, z) for n, z in enumerate("abc", 1) for i in range(3)]
    pool = Pool(ok)
    async with transport(pool, fleet, zone="b") as (http, discovery, _):
        for _ in range(30):
            assert (await http.get(URL)).status_code == 200
        assert set(pool.hosts) == {"10.0.0.20", "10.0.0.21", "10.0.0.22"}
        stats = route_of(discovery).balancing.statistics()
        assert (stats.zone, stats.zone_mode, stats.mirrored, stats.listed) == ("b", "local", 3, 9)


async def test_a_depleted_zone_spills_to_every_zone() -> None:
    fleet = [zoned("a0", 10, "a")] + [
        zoned(f"{z}{i}", 10 * n + i, z) for n, z in enumerate("bc", 2) for i in range(3)
    ]
    pool = Pool(ok)
    async with transport(pool, fleet, zone="a") as (http, discovery, _):
        for _ in range(70):
            await http.get(URL)
        assert len(set(pool.hosts)) == 7
        plan = route_of(discovery).balancing.plan
        assert plan is not None and plan.mode == "spill"
        assert plan.local_share == pytest.approx(3 / 7)


async def test_a_subset_mirrors_only_its_instances() -> None:
    fleet = [Instance(f"i{n}", f"10.0.1.{n}", 80) for n in range(20)]
    pool = Pool(ok)
    subset = {"size": 4, "client_index": 2}
    async with transport(pool, fleet, subset=subset) as (http, discovery, _):
        for _ in range(40):
            await http.get(URL)
        route = route_of(discovery)
        assert len(route.identities()) == 4
        assert len(set(pool.hosts)) == 4
        assert route.balancing.statistics().subset_size == 4


async def test_a_slow_instance_is_hedged_and_the_loser_released(autojump_clock: object) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(5.0 if request.url.host == "10.0.0.1" else 0.1)
        return httpx.Response(200, text=request.url.host)

    fleet = [Instance("slow", "10.0.0.1", 80), Instance("fast", "10.0.0.2", 80)]
    pool = Pool(handler)
    options = RestOptions(lb_strategy="round_robin", request_timeout=30.0, connect_timeout=1.0)
    hedge = {"delay_ms": 300}
    async with transport(pool, fleet, options, hedge=hedge) as (http, discovery, _):
        answers = [(await http.get(URL)).text for _ in range(4)]
        route = route_of(discovery)
        assert answers == ["10.0.0.2"] * 4  # a hedge won every call sent to the slow one
        stats = route.balancing.statistics()
        assert stats.hedges >= 1 and stats.hedge_wins == stats.hedges
        assert route.statistics().in_flight == {"slow": 0, "fast": 0}
        # Not idempotent: no hedge, the slow answer is waited for.
        before = stats.hedges
        await http.post(URL, content=b"x")
        await http.post(URL, content=b"x")
        assert route.balancing.statistics().hedges == before


@pytest.mark.parametrize("strategy", ["round_robin", "weighted"])
async def test_a_hedge_takes_no_turn_so_first_attempts_alternate(
    autojump_clock: object, strategy: LbStrategy
) -> None:
    # One slow instance of two: only the calls whose turn is the slow one's
    # are hedged (a hedge that took the other turn made every call start on
    # the slow one).
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(5.0 if request.url.host == "10.0.0.1" else 0.1)
        return httpx.Response(200, text=request.url.host)

    fleet = [Instance("slow", "10.0.0.1", 80), Instance("fast", "10.0.0.2", 80)]
    pool = Pool(handler)
    options = RestOptions(lb_strategy=strategy, request_timeout=30.0, connect_timeout=1.0)
    async with transport(pool, fleet, options, hedge={"delay_ms": 300}) as (http, discovery, _):
        firsts = []
        for _ in range(8):
            pool.hosts.clear()
            assert (await http.get(URL)).text == "10.0.0.2"
            firsts.append(pool.hosts[0])
        assert firsts.count("10.0.0.1") == 4 and firsts.count("10.0.0.2") == 4, firsts
        assert route_of(discovery).balancing.statistics().hedges == 4
        assert route_of(discovery).statistics().in_flight == {"slow": 0, "fast": 0}


@pytest.mark.parametrize("strategy", ["weighted", "p2c_peak_ewma"])
async def test_a_hedge_goes_to_another_instance_than_the_first_attempt(
    autojump_clock: object, strategy: LbStrategy
) -> None:
    # The slow instance weighs 8 of 9: a pick that ignored the first
    # attempt's instance would send most hedges to it as well.
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(5.0 if request.url.host == "10.0.0.1" else 0.1)
        return httpx.Response(200, text=request.url.host)

    fleet = [Instance("slow", "10.0.0.1", 80, weight=8.0), Instance("fast", "10.0.0.2", 80)]
    pool = Pool(handler)
    options = RestOptions(lb_strategy=strategy, request_timeout=30.0, connect_timeout=1.0)
    async with transport(pool, fleet, options, hedge={"delay_ms": 300}) as (http, discovery, _):
        for _ in range(6):
            pool.hosts.clear()
            answer = (await http.get(URL)).text
            # Each call's attempts went to distinct instances, and it was answered.
            assert len(pool.hosts) == len(set(pool.hosts)), pool.hosts
            assert answer == "10.0.0.2"
        assert route_of(discovery).statistics().in_flight == {"slow": 0, "fast": 0}


async def test_a_hedge_with_one_instance_goes_to_it_again(autojump_clock: object) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(1.0)
        return httpx.Response(200, text=request.url.host)

    pool = Pool(handler)
    options = RestOptions(request_timeout=30.0, connect_timeout=1.0)
    fleet = [Instance("only", "10.0.0.1", 80)]
    async with transport(pool, fleet, options, hedge={"delay_ms": 300}) as (http, discovery, _):
        assert (await http.get(URL)).text == "10.0.0.1"
        assert pool.hosts == ["10.0.0.1", "10.0.0.1"]  # the hedge had nowhere else to go
        assert route_of(discovery).balancing.statistics().hedges == 1


async def test_the_retry_budget_stops_retries_once_spent() -> None:
    async def unavailable(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    fleet = [Instance(f"i{n}", f"10.0.2.{n}", 80) for n in range(3)]
    pool = Pool(unavailable)
    options = RestOptions(max_attempts=4, retry_get_head_on_retryable_status=True)
    budget = {"percent": 50, "min_per_second": 0}
    async with transport(pool, fleet, options, retry_budget=budget) as (http, discovery, owner):
        for _ in range(20):
            assert (await http.get(URL)).status_code == 503
        stats = route_of(discovery).balancing.statistics()
        # 20 calls earn 10 retries; without the budget each would take 4 attempts.
        assert len(pool.hosts) <= 20 + 10
        assert stats.budget_refused >= 10
        # Counted in the metrics too.
        registry = CollectorRegistry()
        registry.register(DiscoveryCollector(owner.observer(), transports=[discovery]))
        refused = registry.get_sample_value(
            "nadisc_discovery_balancer_retry_budget_refused_total", {"connection": "primary"}
        )
        assert refused == stats.budget_refused


def test_instance_zones_from_each_providers_metadata() -> None:
    assert instance_zone(Instance("k", "10.0.0.1", 80, metadata={"zone": "z1"})) == "z1"
    topology = {"topology.kubernetes.io/zone": "z2"}
    assert instance_zone(Instance("c", "10.0.0.1", 80, metadata=topology)) == "z2"
    nacos = Instance("10.0.0.1#80#HZ#DEFAULT_GROUP@@orders", "10.0.0.1", 80)
    assert instance_zone(nacos) == "HZ"
    assert instance_zone(Instance("plain", "10.0.0.1", 80)) is None


def test_kubernetes_hints_win_over_zones() -> None:
    hinted = [
        Instance("x", "10.0.0.1", 80, metadata={"zone": "a", "hints.for_zones": "b"}),
        Instance("y", "10.0.0.2", 80, metadata={"zone": "b", "hints.for_zones": "b"}),
        Instance("z", "10.0.0.3", 80, metadata={"zone": "a", "hints.for_zones": "a"}),
    ]
    chosen = RouteBalancing(BalancingConfig(zone="b"), environ={}).select(hinted)
    assert [i.identity for i in chosen] == ["x", "y"]


def test_zone_and_identity_from_the_environment() -> None:
    env = {"NADISC_ZONE": "q", "NADISC_CLIENT_INDEX": "1"}
    config = BalancingConfig.model_validate({"subset": {"size": 2}})
    balancing = RouteBalancing(config, environ=env)
    assert balancing.zone == "q"
    fleet = [Instance(f"i{n}", f"10.0.3.{n}", 80) for n in range(9)]
    assert len(balancing.select(fleet)) == 2
    with pytest.raises(ConfigError, match="NADISC_CLIENT_INDEX"):
        RouteBalancing(config, environ={"NADISC_CLIENT_INDEX": "one"})
    with pytest.raises(ConfigError, match="needs client_index"):
        RouteBalancing(config, environ={})
    with pytest.raises(ConfigError, match=">= 0"):
        RouteBalancing(config, environ={"NADISC_CLIENT_INDEX": "-1"})
