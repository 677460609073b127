"""Calling through a dead and a hung instance with the defaults, against real
loopback servers (hypercorn) and real sockets.

* dead: a port nothing listens on (what a caller sees once a killed
  process's sockets are gone: the connection is refused);
* hung: a socket that listens and is never accepted (what a stopped
  process looks like: the kernel completes the handshake and buffers the
  request, nothing ever answers);
* a listener whose accept queue is full (a stopped process under load:
  the SYN is dropped and the connect times out).

Each of these failed requests on the code before ejection, the attempt
timeout and the transparent retry (benchmarks/calling_faults.py has the
full-size runs with hosted processes and real etcd).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import anyio
import httpx
import pytest

from nadisc import (
    CallTimeout,
    DiscoveryOwner,
    DiscoveryTransport,
    Instance,
    ResponseTooLarge,
    RestConfig,
    RestDiscoveryClient,
    RestOptions,
)
from tests.nadisc.owner_support import memory_owner, policy
from tests.nadisc.test_transport import SERVICE, closed_port_instance, provider
from tests.support_http import HttpBackend, serve_backends


@asynccontextmanager
async def calling(
    *instances: Instance, **rest: Any
) -> AsyncIterator[tuple[DiscoveryOwner, DiscoveryTransport, httpx.AsyncClient]]:
    memory = provider(*instances)
    async with memory_owner(
        {"primary": memory}, policies={"primary": policy(rest=RestConfig(**rest))}
    ) as owner:
        transport = DiscoveryTransport(owner)
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            yield owner, transport, http


@contextmanager
def hung_instance(identity: str, *, full: bool = False) -> Iterator[Instance]:
    """A listening socket never accepted; ``full``: its accept queue is full too."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0 if full else 16)
        port = listener.getsockname()[1]
        if full:
            # Linux queues backlog + 1 connections; later SYNs are dropped.
            for _ in range(2):
                filler = socket.socket()
                filler.setblocking(False)
                with suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
                fillers.append(filler)
        yield Instance(identity, "127.0.0.1", port)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_a_dead_instance_fails_no_request_and_is_ejected() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        dead = closed_port_instance("dead")
        async with calling(a.instance(), dead, b.instance()) as (_, transport, http):
            for n in range(60):
                method = "POST" if n % 2 else "GET"  # every method moves on
                answer = await http.request(method, "nadisc://primary/orders/x", content=b"x")
                assert answer.status_code == 200
            route = transport.route("primary", SERVICE)
            assert route is not None
            stats = route.statistics()
            # Five refusals in a row (the default rule) ejected it; nothing since.
            assert stats.sent["dead"] == 5
            assert list(stats.ejected) == ["dead"] and stats.ejections == 1
            assert stats.failures["transport"] == 5
            assert a.served + b.served == 60


async def test_without_the_transparent_retry_ejection_alone_bounds_the_failures() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        dead = closed_port_instance("dead")
        async with calling(a.instance(), dead, b.instance(), retry_on_connect_failure=False) as (
            _,
            _transport,
            http,
        ):
            failed = []
            for _ in range(60):
                try:
                    await http.get("nadisc://primary/orders/x")
                except httpx.ConnectError as exc:
                    failed.append(str(exc))
            assert len(failed) == 5  # outlier.consecutive_failures
            assert all(text.startswith("instance 'dead' (127.0.0.1:") for text in failed)


async def test_a_hung_instance_costs_an_attempt_timeout_and_is_ejected() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        with hung_instance("hung") as hung:
            async with calling(
                a.instance(),
                hung,
                b.instance(),
                request_timeout_ms=5000,
                max_attempts=3,
                attempt_timeout_ms=200,
            ) as (_, transport, http):
                for _ in range(30):
                    answer = await http.get("nadisc://primary/orders/x")
                    assert answer.status_code == 200
                route = transport.route("primary", SERVICE)
                assert route is not None
                stats = route.statistics()
                assert stats.sent["hung"] == 5 and stats.failures["timeout"] == 5
                assert list(stats.ejected) == ["hung"]


async def test_a_post_to_a_hung_instance_is_not_retried_and_names_it() -> None:
    # The request may have reached the application: only GET/HEAD move on.
    with hung_instance("hung") as hung:
        async with calling(
            hung, request_timeout_ms=5000, max_attempts=3, attempt_timeout_ms=200
        ) as (_, transport, http):
            with pytest.raises(httpx.ReadTimeout, match=r"^instance 'hung' \(127\.0\.0\.1:\d+\)"):
                await http.post("nadisc://primary/orders/x", content=b"order")
            route = transport.route("primary", SERVICE)
            assert route is not None and route.statistics().sent == {"hung": 1}


async def test_a_connect_timeout_moves_on_and_its_message_names_the_instance() -> None:
    async with serve_backends(HttpBackend("good")) as (good,):
        with hung_instance("full", full=True) as full:
            async with calling(full, good.instance(), connect_timeout_ms=200) as (_, _t, http):
                for _ in range(4):
                    assert (await http.post("nadisc://primary/orders/x", content=b"x")).text == (
                        "good"
                    )
            async with calling(full, connect_timeout_ms=200, retry_on_connect_failure=False) as (
                _,
                _t,
                http,
            ):
                with pytest.raises(httpx.ConnectTimeout) as caught:
                    await http.get("nadisc://primary/orders/x")
                assert str(caught.value).startswith(f"instance 'full' ({full.address}) of ")


async def test_route_statistics_outlive_the_client_that_closed_the_transport() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        async with calling(a.instance()) as (_, transport, http):
            await http.get("nadisc://primary/orders/x")
        assert transport.closed
        route = transport.route("primary", SERVICE)
        assert route is not None and route.statistics().sent == {"a": 1}
        with pytest.raises(httpx.RequestError, match="closed"):
            await transport.handle_async_request(httpx.Request("GET", "nadisc://primary/orders/x"))


async def test_ejection_switched_off_never_ejects() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        dead = closed_port_instance("dead")
        async with calling(a.instance(), dead, outlier={"enabled": False}) as (_, transport, http):
            for _ in range(30):
                assert (await http.get("nadisc://primary/orders/x")).status_code == 200
            route = transport.route("primary", SERVICE)
            assert route is not None
            stats = route.statistics()
            assert stats.ejected == {} and stats.ejections == 0 and route.detector is None
            # Never ejected: picked again and again (the retry moves the round
            # robin past it, so it comes first for nearly every call).
            assert stats.sent["dead"] >= 15


async def test_the_attempt_timeout_ends_a_hung_attempt_on_a_pool_that_ignores_timeouts() -> None:
    # A pool not known to honour httpx's timeout extension gets the attempt
    # timeout as a scope around the send.
    async def hang_or_answer(request: httpx.Request) -> httpx.Response:
        if request.url.port == 1:
            await anyio.sleep_forever()
        return httpx.Response(200, text="ok")

    memory = provider(Instance("slow", "127.0.0.1", 1), Instance("fast", "127.0.0.1", 2))
    async with memory_owner(
        {"primary": memory},
        policies={"primary": policy(rest=RestConfig(max_attempts=2, attempt_timeout_ms=100))},
    ) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(hang_or_answer))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            for _ in range(4):
                assert (await http.get("nadisc://primary/orders/x")).text == "ok"
        route = transport.route("primary", SERVICE)
        assert route is not None
        stats = route.statistics()
        assert stats.failures["timeout"] == stats.sent["slow"] >= 1


async def test_through_the_rest_client_a_hung_instance_is_a_counted_timeout_and_ejected() -> None:
    """owner.rest() with no attempt timeout: each call sent to the hung
    instance ends at the budget as that attempt's timeout (counted against
    it, so it is ejected like through the transport), and the CallTimeout
    names the service and chains the attempt's error."""
    async with serve_backends(HttpBackend("a")) as (a,):
        with hung_instance("hung") as hung:
            memory = provider(a.instance(), hung)
            async with (
                memory_owner(
                    {"primary": memory}, policies={"primary": policy(rest=RestConfig())}
                ) as owner,
                # A connect bound near the budget (it must stay below): the
                # hung listener's backlog takes the handshake, and a loop
                # starved for a moment (a busy machine) must not turn a call
                # to it into a connect error retried elsewhere.
                RestDiscoveryClient(
                    owner, options=RestOptions(request_timeout=0.5, connect_timeout=0.45)
                ) as rest,
            ):
                outcomes: list[str] = []
                for _ in range(14):
                    try:
                        await rest.get("/x", service=SERVICE)
                        outcomes.append("ok")
                    except CallTimeout as exc:
                        outcomes.append("timeout")
                        assert "service 'orders'" in str(exc)
                        assert isinstance(exc.__cause__, httpx.TimeoutException)
                        assert "instance 'hung'" in str(exc.__cause__)
                assert rest.transport is not None
                route = rest.transport.route("primary", SERVICE)
                assert route is not None
                stats = route.statistics()
                # Five timeouts in a row (the default rule) ejected it.
                assert outcomes.count("timeout") == stats.failures["timeout"] == 5
                assert list(stats.ejected) == ["hung"]
                assert outcomes[-4:] == ["ok"] * 4
                assert stats.in_flight == {"a": 0, "hung": 0}


@pytest.mark.parametrize("method", ["HEAD", "GET"])
async def test_the_body_cap_leaves_a_bodyless_answer_alone(method: str) -> None:
    """A HEAD answer (and a 304 or 204) declares the size a GET would get and
    carries no body: the cap does not refuse it."""
    big = b"x" * 20_000

    async def answer(request: httpx.Request) -> httpx.Response:
        status = 304 if request.url.path == "/cached" else 200
        headers = {"content-length": str(len(big))}
        body = b"" if request.method == "HEAD" or status == 304 else big
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))

    memory = provider(Instance("a", "127.0.0.1", 9))
    async with (
        memory_owner({"primary": memory}) as owner,
        RestDiscoveryClient(
            owner, transport=httpx.MockTransport(answer), max_body_bytes=5_000
        ) as rest,
    ):
        cached = await rest.request(method, service=SERVICE, path="/cached")
        assert cached.status_code == 304 and cached.content == b""
        if method == "HEAD":
            head = await rest.head("/", service=SERVICE)
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == "20000"
        else:
            with pytest.raises(ResponseTooLarge):
                await rest.get("/", service=SERVICE)
