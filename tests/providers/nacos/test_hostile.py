"""Hostile servers against the Nacos provider over real loopback sockets, on
both loops: deep JSON, truncation, huge bodies (declared and streamed),
slowloris, header floods and instance floods. Every row ends in a typed
failure, within the request budget, with memory bounded by
``max_response_bytes``."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.abc
import pytest
from nadisc_nacos import NacosProvider, NacosSettings

from nadisc import CapacityRejected, IncompleteSnapshot, ProviderFailure

from .conftest import context

DEPTH = 200_000
LIMIT = 1024 * 1024  # max_response_bytes of these connections

Stream = anyio.abc.SocketStream


def head(status: int = 200, **headers: str) -> bytes:
    # One answer per connection, said so: the client never reuses a
    # connection the server is about to close (the next request of a probe
    # then always meets the same behaviour on a new connection).
    lines = [f"HTTP/1.1 {status} OK", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def deep(api: str) -> bytes:
    nest = b"[" * DEPTH + b"]" * DEPTH
    if api == "v3":
        return b'{"code":0,"message":"success","data":' + nest + b"}"
    return b'{"hosts":' + nest + b"}"


def flood_of_instances(count: int, api: str) -> bytes:
    hosts = [{"instanceId": f"i{n}", "ip": "10.0.0.1", "port": 1 + n % 60000} for n in range(count)]
    if api == "v3":
        return json.dumps({"code": 0, "message": "success", "data": hosts}).encode()
    return json.dumps({"hosts": hosts, "cacheMillis": 1000}).encode()


async def deep_json(stream: Stream, api: str) -> None:
    body = deep(api)
    await stream.send(head(content_length=str(len(body))) + body)


async def truncated(stream: Stream, api: str) -> None:
    await stream.send(head(content_length="100000") + b'{"hosts":[{"ip":"10.0.0.1",')


async def declared_huge(stream: Stream, api: str) -> None:
    await stream.send(head(content_length=str(10**12)))
    await anyio.sleep(30)  # never sends it


async def streamed_huge(stream: Stream, api: str) -> None:
    await stream.send(head(transfer_encoding="chunked"))
    chunk = b"[" * 65536
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    for _ in range(4096):  # 256 MB if nobody stopped reading
        await stream.send(framed)


async def slowloris(stream: Stream, api: str) -> None:
    await stream.send(head(content_length="100000") + b'{"hosts":[')
    for _ in range(10_000):
        await anyio.sleep(0.05)
        await stream.send(b" ")


async def header_flood(stream: Stream, api: str) -> None:
    await stream.send(b"HTTP/1.1 200 OK\r\n")
    for n in range(100_000):
        await stream.send(f"X-Flood-{n}: {'x' * 100}\r\n".encode())


async def instance_flood(stream: Stream, api: str) -> None:
    body = flood_of_instances(10_000, api)  # under the byte budget, over max_instances
    await stream.send(head(content_length=str(len(body))) + body)


Behaviour = Callable[[Stream, str], Awaitable[None]]


@asynccontextmanager
async def hostile(behaviour: Behaviour, api: str) -> AsyncIterator[str]:
    """A loopback server that answers every request with ``behaviour``."""

    async def handle(stream: Stream) -> None:
        async with stream:
            request = b""
            with anyio.move_on_after(5):
                while b"\r\n\r\n" not in request:
                    request += await stream.receive()
            # The client stopping to read is what a bounded client does.
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await behaviour(stream, api)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, handle)
        try:
            yield f"http://127.0.0.1:{port}/nacos"
        finally:
            group.cancel_scope.cancel()


def provider_for(url: str, operation: str) -> NacosProvider:
    block: dict[str, object] = {"server_addr": url}
    if operation == "login":
        block.update(username="svc", password="pw", api="v3")
    elif operation.startswith("query"):
        block["api"] = operation.rsplit("-", 1)[1]
    ctx = context(max_response_bytes=LIMIT, max_instances_per_service=4096)
    return NacosProvider(ctx, NacosSettings.model_validate(block))


async def run(provider: NacosProvider, operation: str, deadline: float) -> None:
    if operation.startswith("query"):
        await provider.query("orders", deadline)
    else:
        await provider.prepare(deadline)


#: Reading stops mid-body, and httpx/httpcore iterate a body through nested
#: async generators the client cannot reach: only the outermost is closed,
#: trio finalizes the inner ones itself and warns that they were collected
#: unexhausted (asyncio finalizes them silently). The warning is expected here.
ABANDONED_BODY = pytest.mark.filterwarnings(
    r"ignore:Async generator 'http(x|core)\..*:ResourceWarning"
)
ROWS = [
    ("deep-json", deep_json, IncompleteSnapshot),
    ("truncated", truncated, IncompleteSnapshot),
    ("declared-huge", declared_huge, CapacityRejected),
    pytest.param("streamed-huge", streamed_huge, CapacityRejected, marks=ABANDONED_BODY),
    ("slowloris", slowloris, IncompleteSnapshot),
    ("header-flood", header_flood, IncompleteSnapshot),
]
OPERATIONS = ["login", "probe", "query-v1", "query-v3"]


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize(
    ("name", "behaviour", "expected"),
    ROWS,
    ids=["deep-json", "truncated", "declared-huge", "streamed-huge", "slowloris", "header-flood"],
)
async def test_hostile_answers_are_typed_and_bounded(
    name: str, behaviour: Behaviour, expected: type[ProviderFailure], operation: str
) -> None:
    api = "v1" if operation == "query-v1" else "v3"
    async with hostile(behaviour, api) as url:
        provider = provider_for(url, operation)
        tracemalloc.start()
        cpu = time.process_time()
        try:
            # Rows that only time can end get a 0.5 s budget (they end at it;
            # the guard is 40x it). The others get 5 s they do not need
            # (measured: a few ms to 0.3 s, more on a loaded machine): they
            # must end by what they send, not by the clock.
            budget = 0.5 if name in ("slowloris", "header-flood") else 5.0
            with anyio.fail_after(20):
                with pytest.raises(ProviderFailure) as caught:
                    await run(provider, operation, anyio.current_time() + budget)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await provider.aclose()
        spent = time.process_time() - cpu
    failure = caught.value
    if name == "deep-json" and operation == "probe":
        # The probe finds no API in such an answer: still typed, still incomplete.
        assert "offers neither" in str(failure)
    else:
        assert isinstance(failure, expected), repr(failure)
    # Memory: a few times the byte budget at most (the body is read into one
    # buffer and joined once), never the 256 MB a streamed body offers.
    assert peak < 8 * LIMIT, peak
    # CPU: measured 0.01-0.3 s per row on this machine under load; 10x bound.
    assert spent < 5.0, spent


@pytest.mark.parametrize("api", ["v1", "v3"])
async def test_an_instance_flood_is_capacity_rejected(api: str) -> None:
    async with hostile(instance_flood, api) as url:
        provider = provider_for(url, f"query-{api}")
        try:
            with anyio.fail_after(20), pytest.raises(CapacityRejected, match="max_instances"):
                await provider.query("orders", anyio.current_time() + 5)
        finally:
            await provider.aclose()
