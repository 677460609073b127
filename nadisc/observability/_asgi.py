"""Small ASGI helpers shared by the metrics app and the console (internal).

Paths: an app mounted under a prefix sees ``scope["root_path"]`` set to the
prefix; servers differ on whether ``scope["path"]`` still carries it, so
:func:`local_path` strips it when present. Tokens are compared in constant
time and never echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Receive", "Scope", "Send", "bearer_ok", "lifespan", "local_path", "send_text"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def local_path(scope: Scope) -> str:
    """The request path below the app's mount point (always starts with ``/``)."""
    path = str(scope.get("path") or "/")
    root = str(scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path or ""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if bytes(key).lower() == name:
            return bytes(value)
    return None


def token_ok(given: str | None, token: str | None) -> bool:
    if token is None:
        return True
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


def bearer_ok(scope: Scope, token: str | None) -> bool:
    """True without a token, or when ``Authorization: Bearer <token>`` matches."""
    if token is None:
        return True
    value = header(scope, b"authorization")
    if value is None:
        return False
    scheme, _, given = value.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and token_ok(given.strip(), token)


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the lifespan protocol (nothing to start: the apps own no task)."""
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif kind == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_text(
    send: Send,
    status: int,
    body: str | bytes,
    *,
    content_type: str = "text/plain; charset=utf-8",
    extra: list[tuple[bytes, bytes]] | None = None,
    length: int | None = None,
) -> None:
    data = body.encode() if isinstance(body, str) else body
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(data) if length is None else length).encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
