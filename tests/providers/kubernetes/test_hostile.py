"""Hostile API servers: every answer typed, memory and work bounded, on any anyio
backend (the Makefile runs this file on asyncio too; real clock, short bounds).

The Service and its list come from the in-process fake; the hostile part is
the EndpointSlice list or watch, answered by a scripted transport.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from nadisc_kubernetes import KubernetesProvider

from nadisc import CapacityRejected, IncompleteSnapshot, ProviderFailure
from tests.fakes.kubernetes import KubernetesFake, slice_object

from .conftest import TOKEN, RecordingSink, context, endpoint, in_process

DEEP = b"[" * 200_000 + b"]" * 200_000


class Stream(httpx.AsyncByteStream):
    """A response body from an async generator of chunks: a plain iterator
    object whose ``aclose`` closes the generator (none is left to the
    garbage collector when the client abandons the body)."""

    def __init__(self, chunks: Callable[[], AsyncIterator[bytes]]) -> None:
        self._chunks = chunks()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]


class Hostile(httpx.AsyncBaseTransport):
    """The fake, except slice lists (``on_list``) and slice watches (``on_watch``)."""

    def __init__(
        self,
        fake: KubernetesFake,
        *,
        on_list: Callable[[httpx.Request], httpx.Response] | None = None,
        on_watch: Callable[[httpx.Request], httpx.Response] | None = None,
    ) -> None:
        self.inner = fake.transport()
        self.on_list, self.on_watch = on_list, on_watch
        self.watches = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if "endpointslices" in request.url.path:
            if request.url.params.get("watch"):
                self.watches += 1
                if self.on_watch is not None and self.watches == 1:
                    return self.on_watch(request)
            elif self.on_list is not None:
                return self.on_list(request)
        return await self.inner.handle_async_request(request)


def fixture(tmp_path: Path, **ctx: Any) -> tuple[KubernetesFake, KubernetesProvider]:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    uid = fake.create_service("orders")["metadata"]["uid"]
    fake.put_slice(slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid))
    provider = in_process(
        fake,
        tmp_path,
        ctx=context(request_timeout=0.5, **ctx),
        initial_backoff=0.05,
        max_backoff=0.1,
    )
    return fake, provider


def trickle(data: bytes, every: float) -> Callable[[], AsyncIterator[bytes]]:
    async def chunks() -> AsyncIterator[bytes]:
        for byte in data:
            await anyio.sleep(every)
            yield bytes([byte])

    return chunks


LIST_ROWS: dict[str, tuple[Callable[[httpx.Request], httpx.Response], type[ProviderFailure]]] = {
    "deep JSON": (lambda r: httpx.Response(200, content=DEEP, request=r), IncompleteSnapshot),
    "deep JSON in the items": (
        lambda r: httpx.Response(
            200, content=b'{"metadata":{"resourceVersion":"9"},"items":' + DEEP + b"}", request=r
        ),
        IncompleteSnapshot,
    ),
    "truncated": (
        lambda r: httpx.Response(
            200, content=b'{"metadata":{"resourceVersion":"9"},"ite', request=r
        ),
        IncompleteSnapshot,
    ),
    "declared too large": (
        lambda r: httpx.Response(
            200, headers={"content-length": str(10**12)}, content=b"{}", request=r
        ),
        CapacityRejected,
    ),
    "grows too large": (
        lambda r: httpx.Response(
            200,
            stream=Stream(lambda: _endless(b'{"items":[' + b'{"metadata":{}},' * 4096)),
            request=r,
        ),
        CapacityRejected,
    ),
    "slowloris": (
        lambda r: httpx.Response(
            200,
            stream=Stream(trickle(b'{"metadata":{"resourceVersion":"9"},"items":[]}' * 4, 0.1)),
            request=r,
        ),
        IncompleteSnapshot,
    ),
    "deep JSON error body": (
        lambda r: httpx.Response(500, content=DEEP, request=r),
        IncompleteSnapshot,
    ),
}


async def _endless(chunk: bytes) -> AsyncIterator[bytes]:
    while True:
        await anyio.lowlevel.checkpoint()
        yield chunk


@pytest.mark.parametrize("row", sorted(LIST_ROWS))
async def test_a_hostile_list_is_a_typed_failure(tmp_path: Path, row: str) -> None:
    answer, failure = LIST_ROWS[row]
    fake, provider = fixture(tmp_path, max_response_bytes=1024 * 1024)
    provider._http._client._transport = Hostile(fake, on_list=answer)
    try:
        with anyio.fail_after(10), pytest.raises(failure):
            await provider.query("orders", anyio.current_time() + 1)
    finally:
        await provider.aclose()


def watch_body(
    lines: Callable[[], AsyncIterator[bytes]],
) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Stream(lines), request=request)

    return answer


async def run_watch(
    provider: KubernetesProvider,
    sink: RecordingSink,
    until: Callable[[], bool],
) -> None:
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            await group.start(provider.watch, "orders", sink)
            await sink.wait_for(until)
            group.cancel_scope.cancel()


async def _lines(*lines: bytes) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


async def _slow_line() -> AsyncIterator[bytes]:
    while True:  # a line that never ends, 64 bytes a millisecond
        await anyio.sleep(0.001)
        yield b"x" * 64


WATCH_ROWS: dict[str, tuple[Callable[[], AsyncIterator[bytes]], type[ProviderFailure], int]] = {
    "deep JSON event": (
        lambda: _lines(b'{"type":"ADDED","object":' + DEEP + b"}\n"),
        IncompleteSnapshot,
        1024 * 1024,
    ),
    "deep JSON error event": (
        lambda: _lines(b'{"type":"ERROR","object":' + DEEP + b"}\n"),
        IncompleteSnapshot,
        1024 * 1024,
    ),
    "not JSON": (lambda: _lines(b"<html>proxy error</html>\n"), IncompleteSnapshot, 16384),
    "truncated event": (lambda: _lines(b'{"type":"ADDED","obj'), IncompleteSnapshot, 16384),
    "endless line": (lambda: _endless(b"x" * 8192), CapacityRejected, 16384),
    "slowloris line": (_slow_line, CapacityRejected, 4096),
}


@pytest.mark.parametrize("row", sorted(WATCH_ROWS))
async def test_a_hostile_watch_is_a_typed_failure_and_the_watch_goes_on(
    tmp_path: Path, row: str
) -> None:
    lines, failure, limit = WATCH_ROWS[row]
    fake, provider = fixture(tmp_path, max_response_bytes=limit)
    hostile = Hostile(fake, on_watch=watch_body(lines))
    provider._http._client._transport = hostile
    sink = RecordingSink()
    try:
        # The failure is reported, and the next watch (from the fake) serves again.
        await run_watch(provider, sink, lambda: bool(sink.failures) and hostile.watches >= 2)
        assert isinstance(sink.failures[0], failure), sink.failures
        fake.put_slice(
            slice_object("orders-b", "orders", [endpoint(2)], owner_uid=fake.service_uid("orders"))
        )
        sink2 = RecordingSink()
        await run_watch(provider, sink2, lambda: sink2.identities == ("pod-1", "pod-2"))
    finally:
        await provider.aclose()


async def test_a_bookmark_flood_costs_decoding_not_sink_work(tmp_path: Path) -> None:
    fake, provider = fixture(tmp_path)
    mark = json.dumps(
        {
            "type": "BOOKMARK",
            "object": {"kind": "EndpointSlice", "metadata": {"resourceVersion": "99"}},
        }
    ).encode()

    async def flood() -> AsyncIterator[bytes]:
        for _ in range(200):
            yield (mark + b"\n") * 250
        yield b""

    provider._http._client._transport = Hostile(fake, on_watch=watch_body(flood))
    sink = RecordingSink()
    try:
        await run_watch(provider, sink, lambda: provider.statistics.bookmarks >= 50_000)
        # 50,000 bookmarks within (much) less than a few seconds: a handful of refreshes.
        assert sink.refreshes <= 10
        assert len(sink.published) == 1
    finally:
        await provider.aclose()


async def test_an_event_flood_without_changes_publishes_nothing_new(tmp_path: Path) -> None:
    fake, provider = fixture(tmp_path)
    same = fake.objects["endpointslices"][("default", "orders-a")]
    line = json.dumps({"type": "MODIFIED", "object": same}).encode() + b"\n"

    async def flood() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield line * 100

    provider._http._client._transport = Hostile(fake, on_watch=watch_body(flood))
    sink = RecordingSink()
    try:
        await run_watch(provider, sink, lambda: provider.statistics.events >= 10_000)
        assert len(sink.published) == 1 and sink.refreshes == 0
    finally:
        await provider.aclose()
