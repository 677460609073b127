"""RestDiscoveryClient: options, service vs external calls, qualifiers, managed responses."""

from __future__ import annotations

from collections import Counter

import anyio
import httpx
import pytest

from nadisc import (
    ConfigError,
    DeadlineExceeded,
    DiscoveryConfig,
    InvalidRequest,
    LifecycleError,
    QualifierError,
    RestConfig,
    RestDiscoveryClient,
    RestOptions,
    UnknownService,
    open_discovery,
    rest_client,
)
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy
from tests.support_http import HttpBackend, serve_backends

SERVICE = "orders"


def provider(*backends: HttpBackend) -> MemoryProvider:
    memory = MemoryProvider(services={SERVICE: SERVICE, "payments": "payments"}, watch=True)
    memory.set(SERVICE, [b.instance() for b in backends])
    return memory


def test_options_default_to_the_seed_values() -> None:
    options = RestOptions()
    assert options.request_timeout == 10.0
    assert options.connect_timeout == 2.0
    assert options.lb_strategy == "round_robin"
    assert options.instance_scheme == "http"
    assert options.max_attempts == 1
    assert not options.retry_get_head_on_transport_error
    assert not options.retry_get_head_on_retryable_status
    assert RestOptions.from_config(RestConfig()) == options
    configured = RestOptions.from_config(
        RestConfig(request_timeout_ms=5000, connect_timeout_ms=1000, lb_strategy="weighted")
    )
    assert (configured.request_timeout, configured.connect_timeout) == (5.0, 1.0)
    assert configured.lb_strategy == "weighted"


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"max_attempts": 0}, "rest.max_attempts"),
        ({"max_attempts": 17}, "rest.max_attempts"),
        ({"max_attempts": True}, "rest.max_attempts"),
        ({"request_timeout": 1.0, "connect_timeout": 1.0}, "rest.connect_timeout"),
        ({"request_timeout": float("nan")}, "rest.request_timeout"),
        ({"connect_timeout": -1}, "rest.connect_timeout"),
        ({"instance_scheme": "ftp"}, "rest.instance_scheme"),
        ({"lb_strategy": "random"}, "rest.lb_strategy"),
    ],
)
def test_bad_options_are_typed_errors_naming_the_field(
    fields: dict[str, object], path: str
) -> None:
    with pytest.raises(ConfigError) as info:
        RestOptions(**fields)  # type: ignore[arg-type]
    assert info.value.path == path


async def test_service_calls_and_external_urls_are_separate() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("external")) as (a, external):
        memory = provider(a)
        async with (
            memory_owner({"primary": memory}) as owner,
            rest_client(owner, "primary") as rest,
        ):
            response = await rest.request("GET", url=external.url + "/v1/x", params={"q": 1})
            assert response.text == "external"
            assert sum(memory.query_counts.values()) == 0  # no registry was asked
            response = await rest.request("GET", service=SERVICE, path="/v1/orders?x=1")
            assert response.text == "a" and response.is_closed
            assert a.requests[-1].path == "/v1/orders"
            with pytest.raises(InvalidRequest):
                await rest.request("GET", service=SERVICE, url=external.url)
            with pytest.raises(InvalidRequest):
                await rest.request("GET")
            with pytest.raises(InvalidRequest):
                await rest.request("GET", url="nadisc://primary/orders/x")
            with pytest.raises(InvalidRequest):
                await rest.request("GET", service=SERVICE, path="no-slash")
            with pytest.raises(UnknownService):
                await rest.request("GET", service="inventory", path="/x")
            assert memory.query_counts == Counter({SERVICE: 1})
            assert external.served == 1


async def test_zero_connections_give_an_external_only_client() -> None:
    async with (
        serve_backends(HttpBackend("external")) as (external,),
        open_discovery(DiscoveryConfig()) as owner,
        rest_client(owner) as rest,
    ):
        assert rest.external_only and rest.transport is None
        assert (await rest.request("GET", url=external.url)).text == "external"
        with pytest.raises(QualifierError):
            await rest.request("GET", service=SERVICE, path="/x")


async def test_without_primary_unqualified_service_calls_fail() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a)
        async with memory_owner({"business": memory}) as owner:
            with pytest.raises(QualifierError):
                rest_client(owner, "elsewhere")
            async with rest_client(owner) as rest:
                with pytest.raises(QualifierError):
                    await rest.request("GET", service=SERVICE, path="/x")
                assert (await rest.request("GET", url=a.url)).text == "a"
            async with rest_client(owner, "business") as rest:
                assert (await rest.request("GET", service=SERVICE, path="/x")).text == "a"
                # A hand-built URL naming another connection is refused, never looked up.
                with pytest.raises(QualifierError):
                    await rest.send(httpx.Request("GET", "nadisc://other/orders/x"))
            assert memory.query_counts == Counter({SERVICE: 1})


async def test_names_that_are_not_url_hosts_travel_in_the_extension() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a)
        async with (
            memory_owner({"Business Net": memory}) as owner,
            rest_client(owner, "Business Net") as rest,
        ):
            request = rest.build_request("GET", service=SERVICE, path="/x")
            assert request.url.host == "qualified"
            assert (await rest.send(request)).text == "a"


async def test_managed_responses_are_closed_with_the_client() -> None:
    async with serve_backends(HttpBackend("s", chunks=2, chunk_delay=0.01)) as (s,):
        memory = provider(s)
        async with memory_owner({"primary": memory}) as owner:
            rest = rest_client(owner)
            managed = [
                await rest.send_managed(rest.build_request("GET", service=SERVICE, path="/m"))
                for _ in range(3)
            ]
            await managed[0].aclose()  # the caller may close one itself
            assert rest.managed == 2
            assert rest.transport is not None
            route = rest.transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"s": 2}
            await rest.aclose()
            await rest.aclose()  # idempotent
            assert rest.managed == 0 and all(r.is_closed for r in managed)
            assert route.streaming.balance.statistics().in_flight == 0
            with pytest.raises(LifecycleError):
                await rest.request("GET", service=SERVICE, path="/x")


async def test_bare_streamed_send_is_left_to_the_caller() -> None:
    async with serve_backends(HttpBackend("s", chunks=2)) as (s,):
        memory = provider(s)
        async with memory_owner({"primary": memory}) as owner, rest_client(owner) as rest:
            request = rest.build_request("GET", service=SERVICE, path="/bare")
            response = await rest.send(request, stream=True)
            assert rest.managed == 0 and not response.is_closed
            assert rest.transport is not None
            route = rest.transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"s": 1}
            assert await response.aread() == b"sss"
            await response.aclose()
            assert route.statistics().in_flight == {"s": 0}
            async with rest.stream("GET", service=SERVICE, path="/ctx") as streamed:
                assert streamed.status_code == 200
            assert streamed.is_closed


async def test_weighted_strategy_from_the_connection_config() -> None:
    async with serve_backends(HttpBackend("heavy", weight=3.0), HttpBackend("light")) as (h, li):
        memory = provider(h, li)
        rest_config = RestConfig(lb_strategy="weighted")
        async with (
            memory_owner(
                {"primary": memory}, policies={"primary": policy(rest=rest_config)}
            ) as owner,
            rest_client(owner) as rest,
        ):
            for _ in range(40):
                await rest.request("GET", service=SERVICE, path="/w")
        assert (h.served, li.served) == (30, 10)


async def test_p2c_peak_ewma_steers_away_from_a_slow_instance() -> None:
    # 1 s against an immediate answer: still 10x apart when a loaded machine
    # slows the fast one to ~100 ms.
    backends = (HttpBackend("fast"), HttpBackend("slow", latency=1.0))
    async with serve_backends(*backends) as (fast, slow):
        memory = provider(fast, slow)
        options = RestOptions(lb_strategy="p2c_peak_ewma")
        async with (
            memory_owner({"primary": memory}) as owner,
            RestDiscoveryClient(owner, "primary", options=options) as rest,
        ):

            async def worker() -> None:
                for _ in range(15):
                    await rest.request("GET", service=SERVICE, path="/p")

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(worker)
        assert fast.served + slow.served == 60
        assert slow.served < 15


async def test_the_budget_covers_reading_the_body() -> None:
    async with serve_backends(HttpBackend("s", chunks=5, chunk_delay=3.0)) as (s,):
        memory = provider(s)
        # The budget, not a tight connect bound a busy machine could trip.
        options = RestOptions(request_timeout=0.4, connect_timeout=0.35)
        async with (
            memory_owner({"primary": memory}) as owner,
            RestDiscoveryClient(owner, options=options) as rest,
        ):
            started = anyio.current_time()
            with pytest.raises(DeadlineExceeded):
                await rest.request("GET", service=SERVICE, path="/slow-body")
            # Cut at the 0.4 s budget (measured 0.41 s), not after the 15 s
            # the body takes: a bound 12x above what it measures.
            assert anyio.current_time() - started < 5.0
            assert rest.transport is not None
            route = rest.transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"s": 0}


async def test_a_caller_transport_is_shared_and_not_closed() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a)
        pool = httpx.AsyncHTTPTransport()
        async with memory_owner({"primary": memory}) as owner:
            async with rest_client(owner) as rest:
                assert (await rest.request("GET", service=SERVICE, path="/x")).text == "a"
            async with RestDiscoveryClient(owner, transport=pool) as rest:
                assert (await rest.request("GET", service=SERVICE, path="/x")).text == "a"
            # Still usable: the client did not close a pool it does not own.
            async with httpx.AsyncClient(transport=pool) as plain:
                assert (await plain.get(a.url)).text == "a"


async def test_a_client_calls_only_its_own_connection() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("infra")) as (a, infra):
        business, infrastructure = provider(a), provider(infra)
        async with (
            memory_owner({"primary": business, "infra": infrastructure}) as owner,
            rest_client(owner) as rest,
        ):
            assert (await rest.request("GET", service=SERVICE, path="/x")).text == "a"
            with pytest.raises(QualifierError):
                await rest.send(httpx.Request("GET", "nadisc://infra/orders/x"))
            assert sum(infrastructure.query_counts.values()) == 0
            assert infra.served == 0


async def test_managed_response_arriving_after_the_client_closed_is_closed_and_refused() -> None:
    async with serve_backends(HttpBackend("slow", latency=0.3, chunks=2)) as (slow,):
        memory = provider(slow)
        pool = httpx.AsyncHTTPTransport()  # not owned: closing the client leaves it running
        async with memory_owner({"primary": memory}) as owner:
            rest = RestDiscoveryClient(owner, transport=pool)
            outcome: list[BaseException] = []

            async def call() -> None:
                try:
                    await rest.send_managed(rest.build_request("GET", service=SERVICE, path="/m"))
                except LifecycleError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(call)
                for _ in range(1000):  # until the request is at the backend
                    if slow.active:
                        break
                    await anyio.sleep(0.005)
                assert slow.active == 1
                assert rest.transport is not None
                route = rest.transport.route("primary", SERVICE)
                await rest.aclose()
            assert len(outcome) == 1 and "closed" in str(outcome[0])
            assert rest.managed == 0 and slow.served == 1
            assert route is not None
            # The late response was closed: its instance's load is released.
            assert route.streaming.balance.statistics().in_flight == 0
        await pool.aclose()
