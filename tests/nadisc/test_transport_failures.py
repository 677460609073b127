"""Each way a call can fail adds one to the right failure kind of its route.

The loopback scenario (a refusing port, a 503 server, a slow server, an
empty listing) is in ``tests/observability/test_balancer_failures.py``;
these are the branches a real server cannot be made to take on demand: a
body that breaks off while it is read, a pool raising something that is not
an httpx error or answering with a body that is not async, a pool ignoring
the timeout extension, headers that arrive after the budget, an instance
declaring another scheme, and a call its caller cancels (which counts as
nothing).
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest

from nadisc import (
    CallFailureKind,
    CallTimeout,
    DiscoveryTransport,
    Instance,
    InstanceSchemeMismatch,
    RestOptions,
)
from nadisc._route import Route
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner

SERVICE = "orders"
URL = f"nadisc://primary/{SERVICE}/x"
NONE = dict.fromkeys((kind.value for kind in CallFailureKind), 0)

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Pool(httpx.AsyncBaseTransport):
    """A pool answering through ``handler``; says whether it honours timeouts."""

    def __init__(self, handler: Handler, *, enforces: bool = True) -> None:
        self.handler = handler
        self.nadisc_enforces_timeouts = enforces

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.handler(request)


class BreakingBody(httpx.AsyncByteStream):
    """Yields one chunk, then raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"part"
        raise self.error


@asynccontextmanager
async def transport(
    pool: httpx.AsyncBaseTransport, *instances: Instance, budget: float = 2.0
) -> AsyncIterator[tuple[httpx.AsyncClient, DiscoveryTransport]]:
    memory = MemoryProvider(services={SERVICE: SERVICE})
    memory.set(SERVICE, instances or (Instance("a", "10.0.0.1", 80),))
    async with memory_owner({"primary": memory}) as owner:
        options = RestOptions(request_timeout=budget, connect_timeout=budget / 2)
        async with (
            DiscoveryTransport(owner, options=options, transport=pool) as discovery,
            httpx.AsyncClient(mounts={"nadisc://": discovery}, timeout=None) as http,
        ):
            yield http, discovery


def route_of(discovery: DiscoveryTransport) -> Route:
    route = discovery.route("primary", SERVICE)
    assert route is not None
    return route


@pytest.mark.parametrize(
    ("status", "error", "kind"),
    [
        (200, httpx.ReadError("reset while reading"), "transport"),
        (200, httpx.ReadTimeout("stalled while reading"), "timeout"),
        # A 5xx was counted when its headers came: its broken body adds nothing.
        (503, httpx.ReadError("reset while reading"), "status"),
    ],
)
async def test_a_body_that_breaks_off_counts_once(status: int, error: Exception, kind: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=BreakingBody(error))

    async with transport(Pool(handler)) as (http, discovery):
        with pytest.raises(type(error)):
            await http.get(URL)
        stats = route_of(discovery).statistics()
        assert stats.failures == {**NONE, kind: 1}
        assert stats.failed == {"a": 1}
        assert stats.sent == {"a": 1}


async def test_a_pool_raising_a_non_httpx_error_counts_other() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a broken pool")

    async with transport(Pool(handler)) as (http, discovery):
        with pytest.raises(RuntimeError, match="a broken pool"):
            await http.get(URL)
        assert route_of(discovery).statistics().failures == {**NONE, "other": 1}


class SyncOnlyBody(httpx.SyncByteStream):
    def __iter__(self) -> Iterator[bytes]:
        yield b"sync"


async def test_a_pool_answering_with_a_sync_body_counts_other() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=SyncOnlyBody())

    async with transport(Pool(handler)) as (http, discovery):
        with pytest.raises(TypeError, match="not an async one"):
            await http.get(URL)
        stats = route_of(discovery).statistics()
        assert stats.failures == {**NONE, "other": 1}
        assert stats.in_flight == {"a": 0}


async def test_the_budget_ending_in_a_pool_that_ignores_timeouts_counts_timeout() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with transport(Pool(handler, enforces=False), budget=0.2) as (http, discovery):
        with pytest.raises(CallTimeout):
            await http.get(URL)
        stats = route_of(discovery).statistics()
        assert stats.failures == {**NONE, "timeout": 1}
        assert stats.in_flight == {"a": 0}


async def test_headers_after_the_budget_count_timeout() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.3)  # a pool claiming to honour timeouts, late anyway
        return httpx.Response(200, content=b"late")

    async with transport(Pool(handler), budget=0.2) as (http, discovery):
        with pytest.raises(CallTimeout):
            await http.get(URL)
        stats = route_of(discovery).statistics()
        assert stats.failures == {**NONE, "timeout": 1}
        assert stats.failed == {"a": 1}


async def test_an_instance_declaring_another_scheme_counts_no_endpoint() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be sent")

    https = Instance("a", "10.0.0.1", 443, metadata={"scheme": "https"})
    async with transport(Pool(handler), https) as (http, discovery):
        with pytest.raises(InstanceSchemeMismatch):
            await http.get(URL)
        stats = route_of(discovery).statistics()
        assert stats.failures == {**NONE, "no_endpoint": 1}
        assert stats.failed == {} and stats.sent == {}


async def test_a_call_its_caller_cancels_and_a_success_count_nothing() -> None:
    started = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slow":
            started.set()
            await anyio.sleep_forever()
        return httpx.Response(200, content=b"fine")

    async with transport(Pool(handler)) as (http, discovery):
        assert (await http.get(URL)).status_code == 200
        with anyio.move_on_after(0.05):
            await http.get(f"nadisc://primary/{SERVICE}/slow")
        assert started.is_set()
        stats = route_of(discovery).statistics()
        assert stats.failures == NONE
        assert stats.sent == {"a": 2} and stats.in_flight == {"a": 0}


async def test_a_body_left_unfinished_by_a_broken_send_leaves_nothing_to_finalize() -> None:
    # An instance killed while the request is being written: the pool took
    # the body's first chunk and the connection broke. With httpx's own
    # ``ByteStream`` the abandoned async generator made trio warn whenever
    # the garbage collector found it (an unraisable warning at an arbitrary
    # later point); the body each attempt gets is a plain iterator instead.
    seen: list[bytes] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        chunks = request.stream.__aiter__()  # type: ignore[union-attr]
        assert not inspect.isasyncgen(chunks)
        seen.append(await chunks.__anext__())
        del chunks
        gc.collect()
        raise httpx.WriteError("connection reset while sending the body")

    async with transport(Pool(handler)) as (http, discovery):
        with pytest.raises(httpx.WriteError):
            await http.post(URL, content=b"payload")
        gc.collect()
        assert seen == [b"payload"]
        assert route_of(discovery).statistics().failures == {**NONE, "transport": 1}
