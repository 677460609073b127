"""Small ASGI helpers shared by the metrics app and the console (internal).

Paths: an app mounted under a prefix sees ``scope["root_path"]`` set to the
prefix; servers differ on whether ``scope["path"]`` still carries it, so
:func:`local_path` strips it when present. Tokens are compared in constant
time and never echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

__all__ = [
    "LOOPBACK_NAMES",
    "Receive",
    "RequestGuard",
    "Scope",
    "Send",
    "bearer_ok",
    "host_of",
    "lifespan",
    "local_path",
    "send_text",
]

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


async def lifespan(
    receive: Receive, send: Send, *, started: Callable[[], Awaitable[object]] | None = None
) -> None:
    """Answer the lifespan protocol; ``started`` (awaited at startup) starts
    what the app runs in the server's task group."""
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "lifespan.startup":
            if started is not None:
                await started()
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


#: Host names every console answers for (besides the address it was reached on).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _normal_host(text: str) -> str:
    """``text`` (a host name or address, IPv6 with or without brackets) lowercased,
    without brackets or a trailing dot."""
    host = text.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.rstrip(".")


def _port(text: str) -> int | None:
    """``text`` as a port number (0-65535); None when it is not one. ASCII
    digits only: ``str.isdigit`` also accepts digits such as ``'²'`` that
    ``int`` refuses, and ``int`` refuses more than 4,300 digits (leading
    zeros count), so neither reaches ``int``."""
    if not (text.isascii() and text.isdigit()):
        return None
    significant = text.lstrip("0") or "0"
    if len(significant) > 5:
        return None
    port = int(significant)
    return port if port <= 65535 else None


def _host_port(value: str) -> tuple[str, int | None] | None:
    """The normalised host and the port (None when absent) of a ``Host``
    header value (``name``, ``name:port``, ``[v6]``, ``[v6]:port``); None
    when it is malformed. Never raises."""
    text = value.strip()
    if not text or any(c in text for c in " /\\@?#"):
        return None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        rest = text[end + 1 :]
        if not rest:
            return _normal_host(text[: end + 1]), None
        port = _port(rest[1:]) if rest.startswith(":") else None
        if port is None:
            return None
        return _normal_host(text[: end + 1]), port
    name, sep, digits = text.rpartition(":")
    if not sep:
        return _normal_host(text), None
    port = _port(digits)
    if ":" in name or port is None or not name:
        return None
    return _normal_host(name), port


def host_of(value: str) -> str | None:
    """The host part of a ``Host`` header value (``name``, ``name:port``,
    ``[v6]``, ``[v6]:port``), normalised; None when it is malformed (a port
    that is not ASCII digits up to 65535 included)."""
    parts = _host_port(value)
    return None if parts is None else parts[0]


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an ``Origin`` value (``scheme://host[:port]``,
    http or https, the port defaulted by scheme); None when it is anything
    else. Never raises: a header that does not parse is refused, not an error."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        return None
    parts = _host_port(rest)
    if parts is None:
        return None
    host, port = parts
    if port is None:
        port = 443 if scheme == "https" else 80
    return scheme, host, port


class RequestGuard:
    """Which ``Host`` names a request may carry, and which ``Origin`` a WebSocket.

    Host (DNS rebinding): the host part of the ``Host`` header must be a
    loopback name (``localhost``, ``127.0.0.1``, ``::1``), the address the
    request was received on (``scope["server"]``), or one of ``hosts``.
    A request without a ``Host`` header is refused too.

    Origin (cross-site WebSocket): browsers send ``Origin`` on every
    WebSocket handshake; it must be the page's own origin (its host and port
    are the ``Host`` header's) or one of ``origins`` (``scheme://host[:port]``).
    A handshake without ``Origin`` comes from a program, not a page, and is
    let through (it still needs the token when one is set).

    A malformed value (a port that is not ASCII digits up to 65535, such as
    ``127.0.0.1:²``) is refused like a foreign one; the checks never raise.
    """

    def __init__(self, hosts: Sequence[str] = (), origins: Sequence[str] = ()) -> None:
        names = set(LOOPBACK_NAMES)
        for item in hosts:
            if not isinstance(item, str) or host_of(item) is None:
                raise ValueError(f"allowed host {item!r} is not a host name or address")
            names.add(host_of(item) or "")
        allowed: set[tuple[str, str, int]] = set()
        for item in origins:
            parts = _origin_parts(item) if isinstance(item, str) else None
            if parts is None:
                raise ValueError(f"allowed origin {item!r} is not scheme://host[:port]")
            allowed.add(parts)
        self._names = frozenset(names)
        self._origins = frozenset(allowed)

    def host_ok(self, scope: Scope) -> bool:
        value = header(scope, b"host")
        if value is None:
            return False
        host = host_of(value.decode("latin-1"))
        if host is None:
            return False
        if host in self._names:
            return True
        server = scope.get("server")
        if not server:
            return False
        return host == _normal_host(str(server[0]))

    def origin_ok(self, scope: Scope) -> bool:
        value = header(scope, b"origin")
        if value is None:
            return True
        parts = _origin_parts(value.decode("latin-1"))
        if parts is None:
            return False
        if parts in self._origins:
            return True
        own = header(scope, b"host")
        if own is None:
            return False
        text = own.decode("latin-1").strip().lower()
        secure = scope.get("scheme") in ("https", "wss")
        same = _origin_parts(("https://" if secure else "http://") + text)
        return same is not None and same == parts

    def __repr__(self) -> str:
        return f"<RequestGuard hosts={len(self._names)} origins={len(self._origins)}>"
