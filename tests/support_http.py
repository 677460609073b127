"""In-process HTTP backends for integration tests (not a test module).

Each :class:`HttpBackend` is a tiny ASGI app served by hypercorn on trio at
127.0.0.1 on an ephemeral port. Its latency, status and body can be changed
while it runs, and it records every request it received (method, path, time
on the event-loop clock)::

    async with serve_backends(HttpBackend("a"), HttpBackend("b", latency=0.05)) as (a, b):
        ...  # a.port, a.instance(), a.requests
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from nadisc import Instance

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    at: float
    host: str = ""


@dataclass
class HttpBackend:
    """An ASGI backend: answers every request with ``status`` and its name as body.

    ``latency`` (seconds) passes before the response starts. With
    ``chunks > 0`` the body is streamed as that many chunks, ``chunk_delay``
    apart. Requests to ``/status/<code>`` answer with that code.
    """

    name: str
    latency: float = 0.0
    status: int = 200
    chunks: int = 0
    chunk_delay: float = 0.0
    weight: float = 1.0
    port: int = 0
    requests: list[Received] = field(default_factory=list)
    #: Requests whose handling started and has not finished.
    active: int = 0

    def instance(self, identity: str | None = None, **changes: Any) -> Instance:
        """The discovery instance of this backend (identity defaults to its name)."""
        return Instance(
            identity or self.name,
            "127.0.0.1",
            changes.pop("port", self.port),
            weight=changes.pop("weight", self.weight),
            **changes,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def served(self) -> int:
        return len(self.requests)

    def served_after(self, moment: float) -> int:
        return sum(1 for r in self.requests if r.at >= moment)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode()
        self.requests.append(Received(scope["method"], path, anyio.current_time(), host))
        self.active += 1
        try:
            while True:  # drain the request body
                message = await receive()
                if not message.get("more_body"):
                    break
            if self.latency > 0:
                await anyio.sleep(self.latency)
            status = self.status
            if path.startswith("/status/"):
                status = int(path.rsplit("/", 1)[1])
            body = self.name.encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"text/plain"), (b"x-backend", body)],
                }
            )
            for _ in range(self.chunks):
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if self.chunk_delay > 0:
                    await anyio.sleep(self.chunk_delay)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            self.active -= 1


def _config() -> Config:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tests.support_http")
    config.graceful_timeout = 0.1
    config.keep_alive_timeout = 30.0
    return config


@asynccontextmanager
async def serve_backends(*backends: HttpBackend) -> AsyncIterator[tuple[HttpBackend, ...]]:
    """Run ``backends`` for the block (each on its own ephemeral port)."""
    try:
        async with trio.open_nursery() as nursery:
            for backend in backends:
                binds: list[str] = await nursery.start(_serve_one, backend)
                backend.port = int(binds[0].rsplit(":", 1)[1])
            try:
                yield backends
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The servers never fail on their own: hand the block's error back as is.
        if len(group.exceptions) != 1:
            raise
        raise group.exceptions[0] from None


async def _serve_one(backend: HttpBackend, *, task_status: trio.TaskStatus[list[str]]) -> None:
    await serve(backend, _config(), task_status=task_status, mode="asgi")  # type: ignore[arg-type]


@dataclass
class TcpCounter:
    """A loopback listener that counts the TCP connections it accepts (and closes them)."""

    port: int = 0
    accepted: int = 0

    def instance(self, identity: str, **changes: Any) -> Instance:
        return Instance(identity, "127.0.0.1", self.port, **changes)


@asynccontextmanager
async def count_connections() -> AsyncIterator[TcpCounter]:
    """Run a :class:`TcpCounter` for the block."""
    counter = TcpCounter()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    counter.port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def accept(stream: anyio.abc.SocketStream) -> None:
        counter.accepted += 1
        await stream.aclose()

    async with listener, anyio.create_task_group() as tasks:
        tasks.start_soon(listener.serve, accept)
        try:
            yield counter
        finally:
            tasks.cancel_scope.cancel()
