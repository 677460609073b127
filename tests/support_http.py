"""In-process HTTP backends for integration tests (not a test module).

Each :class:`HttpBackend` is a tiny ASGI app served by hypercorn (its trio
or asyncio server, following the running loop) on an ephemeral port of an
address of its own in 127.0.0.0/8. Its latency, status and body can be changed
while it runs, and it records every request it received (method, path, time
on the event-loop clock)::

    async with serve_backends(HttpBackend("a"), HttpBackend("b", latency=0.05)) as (a, b):
        ...  # a.port, a.instance(), a.requests
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import sniffio
from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve
from hypercorn.utils import wrap_app

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


def loopback_address() -> str:
    """A random loopback address other than 127.0.0.1.

    Ports are reused: a client of another test (another worker process) still
    calling a port whose server is gone would reach a backend that was given
    the same port number on the same address, and that backend's request
    counts would be off. An address of its own keeps each backend's counts to
    its own test's requests.
    """
    return f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"


@dataclass
class HttpBackend:
    """An ASGI backend: answers every request with ``status`` and its name as body.

    ``latency`` (seconds) passes before the response starts. With
    ``chunks > 0`` the body is streamed as that many chunks, ``chunk_delay``
    apart. Requests to ``/status/<code>`` answer with that code. While
    ``hold`` is an unset event, every response waits for it (after
    ``latency``): a call that stays in flight until the test lets it go.
    """

    name: str
    latency: float = 0.0
    status: int = 200
    chunks: int = 0
    chunk_delay: float = 0.0
    weight: float = 1.0
    port: int = 0
    #: The loopback address it listens on (its own; see :func:`loopback_address`).
    host: str = field(default_factory=loopback_address)
    requests: list[Received] = field(default_factory=list)
    #: Requests whose handling started and has not finished.
    active: int = 0
    hold: anyio.Event | None = None

    def instance(self, identity: str | None = None, **changes: Any) -> Instance:
        """The discovery instance of this backend (identity defaults to its name)."""
        return Instance(
            identity or self.name,
            self.host,
            changes.pop("port", self.port),
            weight=changes.pop("weight", self.weight),
            **changes,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
            if self.hold is not None:
                await self.hold.wait()
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


def _config(host: str = "127.0.0.1") -> Config:
    config = Config()
    config.bind = [f"{host}:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tests.support_http")
    config.graceful_timeout = 0.1
    config.keep_alive_timeout = 30.0
    return config


def stop_serving(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    """End what :func:`serve_app` serves in ``scope``: trio's server is
    cancelled; hypercorn's asyncio server does not take cancellation well, so
    it is asked to shut down (bounded by ``graceful_timeout``, and 5 s)."""
    stop.set()
    if sniffio.current_async_library() == "trio":
        scope.cancel()
    else:
        scope.deadline = anyio.current_time() + 5


@asynccontextmanager
async def serve_backends(*backends: HttpBackend) -> AsyncIterator[tuple[HttpBackend, ...]]:
    """Run ``backends`` for the block (each on its own ephemeral port)."""
    try:
        stop = anyio.Event()
        async with anyio.create_task_group() as nursery:
            for backend in backends:
                binds: list[str] = await nursery.start(_serve_one, backend, stop)
                backend.port = int(binds[0].rsplit(":", 1)[1])
            try:
                yield backends
            finally:
                stop_serving(stop, nursery.cancel_scope)
    except BaseExceptionGroup as group:
        # The servers never fail on their own: hand the block's error back as is.
        if len(group.exceptions) != 1:
            raise
        raise group.exceptions[0] from None


async def _serve_one(
    backend: HttpBackend, stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[list[str]]
) -> None:
    await serve_app(backend, _config(backend.host), stop, task_status=task_status)


async def serve_app(
    app: Any,
    config: Config,
    stop: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` with hypercorn on the running loop until ``stop``
    is set; ``task_status`` receives the bound URLs (``http://<host>:<port>``).

    ``config.bind`` must be one ``<loopback address>:0``. On trio, hypercorn
    reports its binds itself; its asyncio server does not, so the socket is
    bound here and handed over as a descriptor.
    """
    if sniffio.current_async_library() == "trio":
        await serve(
            app,
            config,
            task_status=task_status,  # type: ignore[arg-type]
            shutdown_trigger=stop.wait,
            mode="asgi",
        )
        return
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = config.bind[0].rsplit(":", 1)[0]
        listener.bind((host, 0))
        listener.listen(128)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        secure = config.ssl_enabled
        sockets = Sockets(
            secure_sockets=[listener] if secure else [],
            insecure_sockets=[] if secure else [listener],
            quic_sockets=[],
        )
        scheme = "https" if secure else "http"
        task_status.started([f"{scheme}://{host}:{port}"])
        await worker_serve(
            wrap_app(app, config.wsgi_max_body_size, "asgi"),
            config,
            sockets=sockets,
            shutdown_trigger=stop.wait,
        )


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
