"""The live console: a read-only page that follows an owner over a WebSocket.

Contract: :class:`ConsoleApp` is a plain ASGI callable (HTTP + WebSocket +
lifespan) that works at the root of a server or mounted under any prefix
(it reads ``scope["root_path"]``; every URL in the page is relative). It
reads the owner's observer only and starts no task outside the handler of
the request it serves. Routes, relative to the mount point::

    /             the page (static HTML; no data, so no token needed)
    /console.js   /console.css   the page's script and style (package files)
    /ws           WebSocket: one "full" message, then "delta" messages
    /state        the newest full state as JSON (one-shot, for scripts)
    /metrics      the Prometheus exposition (when ``metrics=True``)

Who may read it: every route needs a ``Host`` that is a loopback name, the
address the request arrived on, or one of ``allowed_hosts`` (403 otherwise:
DNS rebinding); ``/ws`` also needs the page's own ``Origin`` or one of
``allowed_origins`` when the handshake carries one (403 otherwise).

Sampling: the lifespan runs :meth:`ConsoleModel.run` in the server's task
group (``ConsoleApp.run`` for a server without lifespan), so the owner is
read every interval with or without clients.

Per WebSocket client::

    accept ─▶ [token?] ─▶ send full ─▶ [ack?] ─▶ wait_newer(seq) or 1 s ─▶ delta/tick ─┐
                                          ▲─────────────────────────────────────────────┘
    disconnect (any time) ─▶ the handler's scope is cancelled, nothing left

Latest-only: a message is built at send time from the newest sample and
what this client saw; a slow client blocks only its own send. With
``/ws?ack=1`` the next message waits for ``{"ack": ...}``, so one frame at
most is in flight (no socket or browser buffer keeps stale frames).

Token: with ``token`` set, ``/ws`` needs ``Authorization: Bearer <token>``
(a wrong one is refused at once) or a first text message
``{"token": "<token>"}`` within 5 s (browsers
cannot set WebSocket headers; the page takes the token from its URL
fragment ``#token=...``, which never reaches the server or its logs);
``/state`` and ``/metrics`` need the header. A wrong token closes with
code 4401 (HTTP 401). Tokens are compared in constant time and never
logged.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry

from .._observer import RuntimeObserver
from ._asgi import (
    Receive,
    RequestGuard,
    Scope,
    Send,
    bearer_ok,
    header,
    lifespan,
    local_path,
    send_text,
)
from ._metrics import MetricsApp, register_metrics
from ._model import DEFAULT_INTERVAL, HEARTBEAT, ConsoleModel

if TYPE_CHECKING:
    from .._owner import DiscoveryOwner
    from .._transport import DiscoveryTransport

__all__ = ["ConsoleApp", "console_app"]

#: Seconds a client may take to send its token message.
AUTH_TIMEOUT = 5.0
_CLOSE_UNAUTHORIZED = 4401
_CLOSE_FORBIDDEN = 4403

_STATIC = {
    "/": ("console.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}
_PAGE_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
    ),
    (b"referrer-policy", b"no-referrer"),
]


def _read_static(name: str) -> bytes:
    return (importlib.resources.files("nadisc.observability") / "static" / name).read_bytes()


class ConsoleApp:
    """The console's ASGI app; see the module docstring. Build it with :func:`console_app`."""

    def __init__(
        self,
        model: ConsoleModel,
        *,
        token: str | None = None,
        metrics: MetricsApp | None = None,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("the console token must be a non-empty string")
        self.model = model
        self._token = token
        self._metrics = metrics
        self._guard = RequestGuard(allowed_hosts, allowed_origins)
        self._files = {path: (_read_static(name), kind) for path, (name, kind) in _STATIC.items()}
        #: WebSocket clients connected now.
        self.clients = 0
        #: Requests and handshakes refused for their Host or Origin (diagnostic).
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"<ConsoleApp clients={self.clients} token={'set' if self._token else 'none'} "
            f"metrics={self._metrics is not None}>"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            if not self._guard.host_ok(scope):
                self.refused += 1
                await send_text(send, 403, "this console does not answer for that Host name\n")
                return
            await self._http(scope, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        else:
            raise RuntimeError(f"the console does not serve {kind!r} connections")

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sample the owner on the console's schedule until cancelled.

        The lifespan does this for a server that runs it (hypercorn, and a
        host's admin listener); a host that serves the app without lifespan
        starts it in its own task group (``await group.start(app.run)``).
        """
        await self.model.run(task_status=task_status)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            try:
                await lifespan(receive, send, started=lambda: group.start(self.run))
            finally:
                group.cancel_scope.cancel()

    async def _http(self, scope: Scope, send: Send) -> None:
        path = local_path(scope)
        if path == "/metrics" and self._metrics is not None:
            await self._metrics.serve_http(scope, send)
            return
        if scope.get("method") not in ("GET", "HEAD"):
            await send_text(send, 405, "method not allowed\n", extra=[(b"allow", b"GET, HEAD")])
            return
        if path == "":
            root = str(scope.get("root_path") or "").rstrip("/")
            await send_text(send, 308, "", extra=[(b"location", f"{root}/".encode())])
            return
        if path == "/state":
            if not bearer_ok(scope, self._token):
                await send_text(send, 401, "unauthorized\n")
                return
            model = self.model
            sample = model.fresh()
            body = sample.delta(
                {},
                full=True,
                now=anyio.current_time(),
                sampled=model.sampled_at,
                interval=model.interval,
            )
            await send_text(send, 200, body or "{}", content_type="application/json")
            return
        found = self._files.get(path)
        if found is None:
            await send_text(send, 404, "not found\n")
            return
        data, content_type = found
        await send_text(
            send,
            200,
            data if scope.get("method") == "GET" else b"",
            content_type=content_type,
            length=len(data),
            extra=list(_PAGE_HEADERS),
        )

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message.get("type") != "websocket.connect":
            return
        if not (self._guard.host_ok(scope) and self._guard.origin_ok(scope)):
            # Refused before the handshake completes: the client sees HTTP 403.
            self.refused += 1
            await send({"type": "websocket.close", "code": _CLOSE_FORBIDDEN})
            return
        if local_path(scope) != "/ws":
            await send({"type": "websocket.close", "code": 4404})
            return
        # A token in the header is judged at once: a wrong one is refused
        # without the wait for a token message (a client that sent one knows it).
        offered = header(scope, b"authorization") is not None
        authorized = self._token is None or (offered and bearer_ok(scope, self._token))
        credit = _Credit(b"ack=1" in bytes(scope.get("query_string") or b"").split(b"&"))
        await send({"type": "websocket.accept"})
        self.clients += 1
        try:
            if not authorized and (offered or not await self._token_message(receive)):
                await send({"type": "websocket.close", "code": _CLOSE_UNAUTHORIZED})
                # Let the closing handshake finish before the handler returns.
                with anyio.move_on_after(AUTH_TIMEOUT):
                    while (await receive()).get("type") != "websocket.disconnect":
                        pass
                return
            async with anyio.create_task_group() as group:

                async def read() -> None:
                    while True:
                        incoming = await receive()
                        if incoming.get("type") == "websocket.disconnect":
                            group.cancel_scope.cancel()
                            return
                        credit.read(incoming.get("text"))

                group.start_soon(read)
                await self._push(send, credit)
                group.cancel_scope.cancel()
        finally:
            self.clients -= 1

    async def _token_message(self, receive: Receive) -> bool:
        with anyio.move_on_after(AUTH_TIMEOUT):
            incoming = await receive()
            if incoming.get("type") != "websocket.receive":
                return False
            try:
                given = json.loads(incoming.get("text") or "")
            except ValueError:
                return False
            candidate = given.get("token") if isinstance(given, dict) else None
            if not isinstance(candidate, str):
                return False
            return bearer_ok(
                {"headers": [(b"authorization", f"Bearer {candidate}".encode())]}, self._token
            )
        return False

    async def _push(self, send: Send, credit: _Credit) -> None:
        """Full state, then per-part deltas; a tick when nothing changed for a
        heartbeat. With ``?ack=1`` one message is in flight at a time: the
        next one is built (from the newest sample) only once the client acked
        the previous one, so no socket or browser buffer holds old frames."""
        model = self.model
        seen: dict[str, int] = {}
        sample = model.fresh()
        first = sample.delta(
            seen,
            full=True,
            now=anyio.current_time(),
            sampled=model.sampled_at,
            interval=model.interval,
        )
        assert first is not None
        await send({"type": "websocket.send", "text": first})
        credit.spend()
        sent_at = anyio.current_time()
        while True:
            await credit.wait()
            with anyio.move_on_after(max(0.0, sent_at + HEARTBEAT - anyio.current_time())):
                sample = await model.wait_newer(sample.seq)
            # A sampler that fell behind (a busy loop) is not waited for: the
            # message is built from a sample at most one interval old.
            sample = model.fresh()
            now = anyio.current_time()
            text = sample.delta(seen, now=now, sampled=model.sampled_at, interval=model.interval)
            if text is None:
                if now - sent_at < HEARTBEAT:
                    continue
                text = sample.tick(now=now, sampled=model.sampled_at, interval=model.interval)
            await send({"type": "websocket.send", "text": text})
            credit.spend()
            sent_at = anyio.current_time()


class _Credit:
    """Flow control of one WebSocket client: unlimited, or (``?ack=1``) one
    message in flight until the client sends ``{"ack": <seq>}``."""

    __slots__ = ("_acking", "_event", "_left")

    def __init__(self, acking: bool) -> None:
        self._acking = acking
        self._left = 1
        self._event = anyio.Event()

    def spend(self) -> None:
        if self._acking:
            self._left = 0

    def read(self, text: object) -> None:
        if not self._acking or not isinstance(text, str) or '"ack"' not in text:
            return
        self._left = 1
        self._event.set()

    async def wait(self) -> None:
        while self._left <= 0:
            self._event = anyio.Event()
            await self._event.wait()


def console_app(
    owner: DiscoveryOwner | RuntimeObserver,
    *,
    token: str | None = None,
    interval: float = DEFAULT_INTERVAL,
    services: Sequence[str] | None = None,
    transports: Sequence[DiscoveryTransport] = (),
    metrics: bool = False,
    registry: CollectorRegistry | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
) -> ConsoleApp:
    """The console of ``owner`` (or of an observer) as an ASGI app.

    ``interval``: seconds between samples (taken whether or not a client
    is connected, while the server runs the app's lifespan or ``app.run``).
    ``allowed_hosts``: ``Host`` names answered besides the loopback names
    and the address a request arrived on; ``allowed_origins``: page origins
    (``scheme://host[:port]``) whose WebSocket is accepted besides the
    console's own.
    ``services``: show only these ``"connection/service"`` keys.
    ``metrics=True`` also serves ``/metrics`` (from ``registry`` when given,
    else a private registry); it needs the owner, not an observer.
    """
    if isinstance(interval, bool) or not (
        isinstance(interval, int | float) and math.isfinite(interval) and interval > 0
    ):
        raise ValueError(f"interval must be a finite number of seconds > 0, got {interval!r}")
    observer = owner if isinstance(owner, RuntimeObserver) else owner.observer()
    model = ConsoleModel(observer, interval=interval, services=services, transports=transports)
    metrics_app: MetricsApp | None = None
    if metrics:
        if isinstance(owner, RuntimeObserver):
            raise TypeError("metrics=True needs the owner (the collector reads its observer)")
        target = registry if registry is not None else CollectorRegistry(auto_describe=False)
        register_metrics(owner, target, transports=transports)
        metrics_app = MetricsApp(target, token=token)
    return ConsoleApp(
        model,
        token=token,
        metrics=metrics_app,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    )
