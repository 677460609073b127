"""The enclosing scope's deadline is read when a call starts, not when its object is made.

A unary call starts when first awaited, a streaming call when first read or
written (docs/grpc.md, "Deadlines and cancellation"). The server sees it as
``grpc-timeout``; the channel's own ``timeout=`` still counts from the call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from nadisc.grpc import Channel

from .support import Record, answer_ok, h2_server

METHOD = "/deadline.Service/Call"


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[Channel, Record]]:
    async with h2_server(answer_ok) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        yield channel, server.record


#: Makes a call object (nothing sent), and starts it and takes its answer.
Kind = tuple[Callable[[Channel], Any], Callable[[Any], Awaitable[Any]]]


async def _await(call: Any) -> Any:
    return await call


async def _first_read(call: Any) -> Any:
    async for response in call:
        return response
    return None


async def _write_first(call: Any) -> Any:
    await call.write(b"x")
    await call.done_writing()
    return await call.read()


KINDS: dict[str, Kind] = {
    "unary_unary": (lambda ch: ch.unary_unary(METHOD)(b"x"), _await),
    "unary_stream": (lambda ch: ch.unary_stream(METHOD)(b"x"), _first_read),
    "stream_unary": (lambda ch: ch.stream_unary(METHOD)(iter([b"x"])), _await),
    "stream_stream": (lambda ch: ch.stream_stream(METHOD)(iter([b"x"])), _first_read),
    "stream_stream_write": (lambda ch: ch.stream_stream(METHOD)(), _write_first),
}


def timeout_seconds(headers: dict[bytes, bytes]) -> float | None:
    raw = headers.get(b"grpc-timeout")
    if raw is None:
        return None
    unit = {b"n": 1e-9, b"u": 1e-6, b"m": 1e-3, b"S": 1.0, b"M": 60.0, b"H": 3600.0}
    return int(raw[:-1]) * unit[raw[-1:]]


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_made_outside_a_scope_started_inside_it_carries_its_deadline(kind: str) -> None:
    make, start = KINDS[kind]
    async with serving() as (channel, record):
        call = make(channel)  # no deadline around it
        with anyio.move_on_after(30):
            assert await start(call) == b"ok"
        ((_, headers),) = record.requests
    sent = timeout_seconds(headers)
    assert sent is not None and 25 < sent <= 30


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_made_inside_a_scope_started_outside_it_has_no_deadline(kind: str) -> None:
    make, start = KINDS[kind]
    async with serving() as (channel, record):
        with anyio.move_on_after(0.5):  # noqa: ASYNC100 - made inside, started outside
            call = make(channel)
        assert await start(call) == b"ok"
        ((_, headers),) = record.requests
    assert b"grpc-timeout" not in headers


async def test_the_call_timeout_still_counts_from_the_call_and_the_earlier_wins() -> None:
    async with serving() as (channel, record):
        call = channel.unary_unary(METHOD)(b"x", timeout=60)
        with anyio.move_on_after(30):
            await call
        call = channel.unary_unary(METHOD)(b"x", timeout=5)
        with anyio.move_on_after(30):
            await call
        (_, first), (_, second) = record.requests
    first_sent, second_sent = timeout_seconds(first), timeout_seconds(second)
    assert first_sent is not None and 25 < first_sent <= 30
    assert second_sent is not None and 4 < second_sent <= 5
