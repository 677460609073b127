"""Serve an ASGI app with hypercorn on the running loop (trio or asyncio).

``urls = await task_group.start(serve, app, "127.0.0.1:0")`` binds,
reports the bound URLs (``http://host:port``) through ``task_status`` and
serves until cancelled. The listening socket is bound here and handed to
hypercorn as ``fd://`` (a duplicate: hypercorn owns what it is given), so
port 0 works the same on both loops, and so its kernel send buffer is
small (``send_buffer`` bytes, inherited by accepted connections on Linux):
a WebSocket client that stops reading then blocks the console's send
after a few messages, and the latest-only rule takes over instead of the
kernel queueing megabytes of stale updates. Access and error logs are off.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import anyio
import anyio.abc
import sniffio
from hypercorn.config import Config

__all__ = ["serve"]


def _config(bind: str) -> Config:
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = None
    config.loglevel = "CRITICAL"
    config.graceful_timeout = 0.5
    config.websocket_ping_interval = None
    return config


#: Kernel send buffer of accepted connections (bytes; the kernel doubles it).
SEND_BUFFER = 64 * 1024


def _listen(bind: str, send_buffer: int) -> socket.socket:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind((host, int(port)))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(
    app: Any,
    bind: str,
    *,
    send_buffer: int = SEND_BUFFER,
    task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` (``HOST:PORT``; port 0 picks a free one) until cancelled."""
    sock = _listen(bind, send_buffer)
    try:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        config = _config(bind)
        config.bind = [f"fd://{os.dup(sock.fileno())}"]
        task_status.started([f"http://{shown}:{port}"])
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as trio_serve

            await trio_serve(app, config)
        else:
            await _serve_asyncio(app, config)
    finally:
        sock.close()


async def _serve_asyncio(app: Any, config: Config) -> None:
    # hypercorn's asyncio worker fails (InvalidStateError) when it is
    # cancelled; stop it through its shutdown trigger instead. Its run is
    # shielded, and the stop is bounded by the graceful timeout (then the
    # shield is lifted and it is cancelled after all).
    from hypercorn.asyncio import serve as asyncio_serve

    stop = anyio.Event()
    done = anyio.Event()
    shield = anyio.CancelScope(shield=True)

    async def run() -> None:
        try:
            with shield:
                await asyncio_serve(app, config, shutdown_trigger=stop.wait)
        finally:
            done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()
            with anyio.CancelScope(shield=True), anyio.move_on_after(config.graceful_timeout + 1):
                await done.wait()
            shield.cancel()
