"""Serve an ASGI app with hypercorn on the running loop (trio or asyncio).

``urls = await task_group.start(serve, app, "127.0.0.1:0")`` binds,
reports the bound URLs (``http://host:port``) through ``task_status`` and
serves until cancelled. On trio hypercorn reports its binds itself; on
asyncio (where it reports nothing) the socket is bound here first and
handed over as ``fd://``, so port 0 works the same on both loops. Access
and error logs are off.
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


def _listen(bind: str) -> socket.socket:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
    task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` (``HOST:PORT``; port 0 picks a free one) until cancelled."""
    never = anyio.Event()
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, _config(bind), shutdown_trigger=never.wait, task_status=task_status)
        return
    from hypercorn.asyncio import serve as asyncio_serve

    sock = _listen(bind)
    try:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        # hypercorn owns the descriptor it is given: hand it a duplicate.
        config = _config(bind)
        config.bind = [f"fd://{os.dup(sock.fileno())}"]
        task_status.started([f"http://{shown}:{port}"])
        await asyncio_serve(app, config, shutdown_trigger=never.wait)
    finally:
        sock.close()
