"""The ASGI pieces the host puts in front of the served apps.

:class:`Gate` wraps a public app. It counts the HTTP requests in flight and,
once :meth:`Gate.close` was called (the host does so at the end of the
deregistration grace, in the same step as its server stops accepting, so
only a request already on its way through an accepted connection meets
it), answers every *new* HTTP request with ``503`` and ``Connection:
close`` without calling the app, and refuses new websocket handshakes.
From :meth:`Gate.end_connections` on (the start of the grace) every
HTTP/1.x response says ``Connection: close``, so that no caller still
sending here holds a kept-alive connection when the server stops.
Requests already inside the app run to completion, or until
:meth:`Gate.cut` (the host calls it when the drain budget is spent): it
cancels every HTTP request and websocket session inside the app and
answers what it can, the same on trio and asyncio: ``503``,
``Connection: close`` and ``Retry-After: 0`` for a request whose response
had not started, close code 1012 (service restart) for a websocket; a
response already started is left unfinished, so the server closes its
connection (hypercorn alone disconnected such requests on trio and
answered ``500`` on asyncio). Lifespan messages
always pass through; an app that returns from the lifespan scope
without finishing it (the ASGI way to say "no lifespan support", which
hypercorn 0.18 on trio turns into a failed startup) has the rest of the
protocol answered for it: startup and shutdown complete at once. An app
that raises after it received ``lifespan.startup`` (and before it answered
it) failed its startup: ``lifespan.startup.failed`` is sent for it, naming
the exception's type, its message (redacted) and where it was raised, so
the server stops instead of serving an app that never started. An app that
raises before reading any lifespan message does not support lifespan; its
exception goes to the server, which serves it without lifespan (ASGI)::

    OPEN ──end_connections()──► ENDING ──close()──► CLOSED ──cut()──► CUT
                                    (in_flight counts down to 0 as requests finish)

:class:`PrefixRouter` dispatches on path prefixes (``/metrics`` -> an app),
setting ``root_path`` the way Starlette's ``Mount`` does, with a fallback
for everything else (a 404 app by default). Both cost O(1) per request
(the router: one comparison per mount).
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import PurePath
from typing import Any

import anyio

from .._redact import redacted_excerpt

__all__ = ["ASGIApp", "Gate", "PrefixRouter", "not_found"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: Any ASGI 3 application.
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


#: ``Connection: close`` ends a kept-alive HTTP/1.x connection after the
#: response; HTTP/2 has no such header (h2 refuses it), its server says
#: GOAWAY instead.
_CLOSE = (b"connection", b"close")


def _one_per_request(scope: Scope) -> bool:
    """Whether ``Connection: close`` applies: HTTP/1.0 and 1.1 only."""
    return scope.get("http_version", "1.1") in ("1.0", "1.1")


async def _respond(
    send: Send, status: int, body: bytes, *, close: bool = False, retry: bool = False
) -> None:
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"%d" % len(body)),
    ]
    if close:
        headers.append(_CLOSE)
    if retry:
        headers.append((b"retry-after", b"0"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _shutting_down(send: Send, scope: Scope) -> None:
    """``503`` for a request the stopping host will not (or no longer) serve."""
    await _respond(send, 503, b"shutting down\n", close=_one_per_request(scope), retry=True)


async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """The fallback of an admin listener: ``404`` for HTTP, lifespan acknowledged."""
    if scope["type"] == "http":
        await _respond(send, 404, b"not found\n")
    elif scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
    elif scope["type"] == "lifespan":
        await _lifespan(receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


_STARTUP_ANSWERS = frozenset({"lifespan.startup.complete", "lifespan.startup.failed"})
#: ``scheme://user:password@``: the credentials part of a URL.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def startup_failure(exc: BaseException) -> str:
    """``Type: message (raised in function at file:line)`` for an app's
    startup exception: credentials in the message (``password=...``, a URL's
    ``user:password@``) masked, at most 300 characters of it, the place by
    file name only."""
    message = redacted_excerpt(_USERINFO.sub(r"\1***@", str(exc)), limit=300)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (raised in {last.name} at {PurePath(last.filename).name}:{last.lineno})"
    return text


async def _lifespan_of(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app``'s lifespan; finish the protocol for it if it returns early."""
    seen: set[str] = set()

    async def watched_receive() -> Message:
        message = await receive()
        seen.add(message["type"])
        return message

    async def watched_send(message: Message) -> None:
        seen.add(message["type"])
        await send(message)

    failure: str | None = None
    try:
        await app(scope, watched_receive, watched_send)
    except Exception as exc:
        if "lifespan.startup" not in seen or seen & _STARTUP_ANSWERS:
            # Raised before reading anything (no lifespan support: the server
            # goes on without it), or after answering the startup: the
            # server's to handle, as ASGI says.
            raise
        failure = startup_failure(exc)
    if failure is not None:
        # Sent outside the handler, so what the server raises for it does not
        # carry the app's exception (and its unredacted message) along.
        await send({"type": "lifespan.startup.failed", "message": failure})
        return
    if seen & {"lifespan.startup.failed", "lifespan.shutdown.complete", "lifespan.shutdown.failed"}:
        return  # the app took part and ended it (or failed it): nothing to add
    if "lifespan.startup.complete" not in seen:
        if "lifespan.startup" not in seen:
            await receive()
        await send({"type": "lifespan.startup.complete"})
    if "lifespan.shutdown" not in seen:
        while (await receive())["type"] != "lifespan.shutdown":
            pass
    await send({"type": "lifespan.shutdown.complete"})


class Gate:
    """Counts in-flight HTTP requests; refuses new ones once closed (see module docs)."""

    __slots__ = (
        "_app",
        "_closed",
        "_ending",
        "_inside",
        "cancelled",
        "cut_requests",
        "in_flight",
        "refused",
        "served",
    )

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._closed = False
        self._ending = False
        #: The cancel scope of every HTTP request and websocket session
        #: inside the app (what :meth:`cut` cancels).
        self._inside: set[anyio.CancelScope] = set()
        #: HTTP requests inside the app now.
        self.in_flight = 0
        #: HTTP requests handed to the app so far.
        self.served = 0
        #: Requests answered 503 because the gate was closed.
        self.refused = 0
        #: HTTP requests cancelled inside the app (by :meth:`cut`, or by the
        #: server).
        self.cancelled = 0
        #: HTTP requests :meth:`cut` cancelled before their response
        #: started, answered 503 in their place.
        self.cut_requests = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ending(self) -> bool:
        return self._ending

    def end_connections(self) -> None:
        """From now on, every HTTP/1.x response says ``Connection: close``
        (synchronous, idempotent).

        The host calls it when the deregistration grace begins: a caller
        that still sends here then opens a new connection for its next
        request, which is refused cleanly once the server stops accepting,
        instead of reusing a kept-alive one that the stopping server may
        close under a request already on its way."""
        self._ending = True

    def close(self) -> None:
        """From now on, new requests are refused (synchronous, idempotent)."""
        self._closed = True
        self._ending = True

    def cut(self) -> int:
        """Cancel every HTTP request and websocket session inside the app
        (the drain budget is spent) and close the gate; returns how many
        were cancelled (synchronous, idempotent). Each is answered as the
        module docs say once its cancellation has run through the app."""
        self.close()
        for scope in self._inside:
            scope.cancel()
        return len(self._inside)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan_of(self._app, scope, receive, send)
            return
        if self._closed:
            self.refused += 1
            if kind == "http":
                await _shutting_down(send, scope)
            else:
                await send({"type": "websocket.close", "code": 1012})  # service restart
            return
        if kind != "http":
            await self._session(scope, receive, send)
            return
        self.in_flight += 1
        self.served += 1
        if self._ending and _one_per_request(scope):
            send = _closing(send)
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        inside = anyio.CancelScope()
        self._inside.add(inside)
        try:
            with inside:
                await self._app(scope, receive, watched_send)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
            self._inside.discard(inside)
        if inside.cancelled_caught:
            self.cancelled += 1
            if not started:
                self.cut_requests += 1
                await _shutting_down(send, scope)

    async def _session(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket session (or any other non-HTTP scope) inside the app,
        cancellable by :meth:`cut`: closed with code 1012 when cut."""
        inside = anyio.CancelScope()
        self._inside.add(inside)
        try:
            with inside:
                await self._app(scope, receive, send)
        finally:
            self._inside.discard(inside)
        if inside.cancelled_caught and scope["type"] == "websocket":
            with contextlib.suppress(Exception):
                # Accepted or not, 1012 (service restart) tells the caller
                # to come back elsewhere; a server that took the socket away
                # already refuses the message.
                await send({"type": "websocket.close", "code": 1012})


def _closing(send: Send) -> Send:
    """``send`` whose response says ``Connection: close`` (in place of any
    ``Connection`` header the app set)."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [
                *(item for item in message.get("headers", ()) if item[0].lower() != b"connection"),
                _CLOSE,
            ]
        await send(message)

    return closing_send


class PrefixRouter:
    """Routes ``/prefix`` and ``/prefix/...`` to mounted apps, the rest to ``fallback``.

    The longest matching prefix wins. A mounted app sees the full ``path``
    and the prefix appended to ``root_path``; an ``unchanged`` one gets the
    scope as it came (the eligibility probe routes on its own full path).
    Lifespan goes to ``fallback`` only (mounted apps are started by whoever
    owns them).
    """

    __slots__ = ("_fallback", "_mounts")

    def __init__(
        self,
        mounts: Mapping[str, ASGIApp],
        fallback: ASGIApp = not_found,
        *,
        unchanged: Mapping[str, ASGIApp] | None = None,
    ) -> None:
        checked: list[tuple[str, ASGIApp, bool]] = []
        for table, rooted in ((mounts, True), (unchanged or {}, False)):
            for prefix, app in table.items():
                if not isinstance(prefix, str) or not prefix.startswith("/") or prefix == "/":
                    raise ValueError(f"a mount prefix starts with '/' and names a path: {prefix!r}")
                if not callable(app):
                    raise ValueError(f"mount {prefix!r}: {type(app).__name__} is not an ASGI app")
                checked.append((prefix.rstrip("/"), app, rooted))
        checked.sort(key=lambda item: len(item[0]), reverse=True)
        self._mounts = tuple(checked)
        self._fallback = fallback

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(prefix for prefix, _, _ in self._mounts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            path: str = scope.get("path", "")
            for prefix, app, rooted in self._mounts:
                if path == prefix or path.startswith(prefix + "/"):
                    if rooted:
                        scope = dict(scope)
                        scope["root_path"] = scope.get("root_path", "") + prefix
                    await app(scope, receive, send)
                    return
        await self._fallback(scope, receive, send)
