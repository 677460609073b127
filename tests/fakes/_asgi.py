"""The ASGI prologue every registry fake shares.

The fakes are plain ASGI apps served by hypercorn. Each acknowledges the
lifespan protocol, ignores other scopes, and reads a whole request body
before it answers; this module does those three things once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Message", "Receive", "Request", "Scope", "Send", "read_request"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Request:
    """One HTTP request as the fakes read it: body whole, header names lower-cased."""

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.body = body
        self.headers = headers


async def read_request(scope: Scope, receive: Receive, send: Send) -> Request | None:
    """Serve a lifespan scope, or read an HTTP request whole.

    ``None`` when there is nothing to answer: the scope was lifespan (now
    finished) or not HTTP, or the client went away before its body ended.
    """
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return None
    if scope["type"] != "http":
        return None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    return Request(bytes(body), headers)
