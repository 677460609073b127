"""Listeners: what to bind, binding it, and serving it with hypercorn.

A :class:`Bind` names an address (port ``0`` = ephemeral), optionally the
host peers should dial (``advertised_host``, for wildcard binds) and the app
it serves. :func:`bind_socket` binds and listens *before* hypercorn starts,
so the real port is known at once on both loops (``hypercorn.asyncio.serve``
reports nothing back). The bound socket is handed to hypercorn through its
``Config.create_sockets`` hook, which hypercorn calls once the app's
lifespan startup completed: that call is the "serving" signal, unless the
app failed its startup (hypercorn on trio still calls the hook then, a
moment before it stops: "serving" never comes, so the host never
registers an app that did not start). Ownership of
the socket object moves to hypercorn there (it closes it when it stops
accepting); :meth:`Listener.close` closes it in any case, idempotently::

    BOUND ─hypercorn took the socket─► SERVING ─stop()─► STOPPING ─► STOPPED

*Keep-alive.* An idle connection is closed by the server after
:data:`KEEP_ALIVE_TIMEOUT` (hypercorn's own default is 5 s, exactly httpx's
pool expiry): a server that closes an idle connection at the moment a
caller reuses it makes that request fail (``RemoteProtocolError``, or
``ECONNRESET`` when the request bytes were already in the server's buffer
as it closed). The server's idle timeout must be the longer one, so that
the caller's pool always drops an idle connection first.

``serve_listener`` picks ``hypercorn.trio.serve`` or ``hypercorn.asyncio.serve``
for the running loop. Costs: one socket and one hypercorn server per listener.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import sniffio
from hypercorn.config import Config, Sockets

#: Seconds an idle keep-alive connection stays open on the server: three
#: times the pool expiry of httpx (5 s), the callers' default.
KEEP_ALIVE_TIMEOUT = 15.0

#: Seconds after the drain budget at which hypercorn cancels what still
#: runs on a listener (its ``graceful_timeout``): the host's gate cuts
#: every request at the budget itself, answering what it can (see
#: :meth:`~nadisc.hosting._asgi.Gate.cut`); this only catches an app that
#: does not end when cancelled.
CUT_BACKSTOP = 1.0

if TYPE_CHECKING:
    from ._asgi import ASGIApp, Message, Receive, Scope, Send
    from ._grpc import GrpcServe

__all__ = ["CUT_BACKSTOP", "KEEP_ALIVE_TIMEOUT", "Bind", "Listener", "bind_socket"]

logger = logging.getLogger("nadisc.hosting")


@dataclass(frozen=True, slots=True)
class Bind:
    """One listener to bind.

    ``port=0`` takes an ephemeral port. ``advertised_host`` is what
    registrations on this listener advertise when they give no ``ip``
    (required for a wildcard bind such as ``0.0.0.0``, which is never
    advertised). ``app`` overrides the host's app for this listener.
    ``admin=True`` makes it an operations listener: it serves the
    eligibility probe and the host's ``mounts`` only, never the app.
    ``grpc=GrpcServe(...)`` makes it a gRPC listener: a grpcio server with
    those servicers and the standard health service, no ASGI app (see
    :mod:`nadisc.hosting._grpc`); its registrations publish the gRPC
    protocol metadata, and only theirs do.
    """

    host: str = "127.0.0.1"
    port: int = 0
    advertised_host: str | None = None
    app: ASGIApp | None = field(default=None, compare=False)
    admin: bool = False
    backlog: int = 128
    grpc: GrpcServe | None = field(default=None, compare=False)

    def check(self, name: str) -> None:
        """Raise ``ValueError`` naming the listener when a field is wrong."""
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"listener {name!r}: host must be a non-empty string")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"listener {name!r}: port must be an integer, not {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"listener {name!r}: port {self.port} is not in 0-65535")
        if self.advertised_host is not None and (
            not isinstance(self.advertised_host, str) or not self.advertised_host.strip()
        ):
            raise ValueError(f"listener {name!r}: advertised_host must be a non-empty string")
        if self.advertised_host is not None and is_wildcard(self.advertised_host):
            raise ValueError(
                f"listener {name!r}: advertised_host {self.advertised_host} is a wildcard "
                "address; give the address peers dial"
            )
        if self.app is not None and not callable(self.app):
            raise ValueError(f"listener {name!r}: app is not an ASGI application")
        if self.admin and self.app is not None:
            raise ValueError(f"listener {name!r}: an admin listener serves no app")
        if isinstance(self.backlog, bool) or not isinstance(self.backlog, int) or self.backlog < 1:
            raise ValueError(f"listener {name!r}: backlog must be a positive integer")
        if self.grpc is not None:
            from ._grpc import GrpcServe

            if not isinstance(self.grpc, GrpcServe):
                raise ValueError(
                    f"listener {name!r}: grpc must be a GrpcServe, not {type(self.grpc).__name__}"
                )
            if self.app is not None or self.admin:
                raise ValueError(
                    f"listener {name!r}: a gRPC listener serves its servicers only "
                    "(no app, not admin)"
                )
            self.grpc.check(name)


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::`` (and ``""``/``*``): bind everywhere, reachable nowhere."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def bind_socket(name: str, bind: Bind) -> socket.socket:
    """Bind and listen; ``OSError`` gains a note naming the listener."""
    host = bind.host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6 and is_wildcard(host):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, bind.port))
        sock.listen(bind.backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        exc.add_note(f"binding listener {name!r} to {bind.host}:{bind.port}")
        raise
    return sock


class _HandOver(Config):
    """A hypercorn config that serves one already-bound socket."""

    def __init__(self, listener: Listener) -> None:
        super().__init__()
        self._listener = listener

    def create_sockets(self) -> Sockets:
        self._listener._taken()
        return Sockets(secure_sockets=[], insecure_sockets=[self._listener.sock], quic_sockets=[])


class Listener:
    """One bound socket and the hypercorn server that serves it."""

    def __init__(
        self, name: str, bind: Bind, sock: socket.socket, app: ASGIApp, *, drain_timeout: float
    ) -> None:
        self.name = name
        self.bind = bind
        self.sock = sock
        self.app = app
        address = sock.getsockname()
        #: The real bound (host, port).
        self.bound: tuple[str, int] = (str(address[0]), int(address[1]))
        self.serving = anyio.Event()
        self.stopped = anyio.Event()
        #: The app sent ``lifespan.startup.failed`` (or the gate did for it).
        self.startup_failed = False
        self._stop = anyio.Event()
        self._scope = anyio.CancelScope(shield=True)
        self.config = _HandOver(self)
        # The host's gate cuts what still runs when the drain budget is
        # spent; hypercorn cancels whatever outlives that a little later.
        self.config.graceful_timeout = drain_timeout + CUT_BACKSTOP
        self.config.accesslog = None
        self.config.errorlog = logging.getLogger("nadisc.hosting.server")
        self.config.loglevel = "WARNING"
        self.config.backlog = bind.backlog
        self.config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT

    def _taken(self) -> None:
        """hypercorn takes the socket: serving, unless the app's startup failed
        (hypercorn on trio still takes it then, and stops at its next step)."""
        if not self.startup_failed:
            self.serving.set()

    async def _served(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app as hypercorn runs it: a failed lifespan startup is noted on
        its way out (one extra call per request otherwise)."""
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def noted(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                self.startup_failed = True
            await send(message)

        await self.app(scope, receive, noted)

    def stop(self) -> None:
        """Stop accepting and drain (hypercorn's graceful shutdown). Idempotent."""
        if not self._stop.is_set() and sniffio.current_async_library() == "asyncio":
            # Stop accepting now, in this step: a connection asyncio accepts
            # while hypercorn closes its server can outlive the server's
            # drain (left to the garbage collector). Shutting the listening
            # socket down stops the kernel's listening at once too (Linux
            # resets what waits in the backlog and refuses new connections),
            # so a caller connecting from now on is refused, as on trio,
            # instead of having its request taken into the backlog and reset.
            import asyncio

            with contextlib.suppress(OSError, ValueError, RuntimeError):
                fd = self.sock.fileno()
                if fd >= 0:
                    asyncio.get_running_loop().remove_reader(fd)
                    self.sock.shutdown(socket.SHUT_RD)
        self._stop.set()

    def close(self) -> None:
        """Close the socket if hypercorn has not (idempotent)."""
        self.sock.close()

    def kill(self) -> None:
        """Cancel the server now (past the drain budget). Idempotent."""
        self._scope.cancel()

    async def run(self) -> None:
        """Serve until :meth:`stop` and the drain finished (or :meth:`kill`).

        Shielded: a cancellation of the surrounding scope does not cut the
        server; the host stops it in order (after deregistering) and kills
        it only past the drain budget."""
        try:
            with self._scope:
                await self._serve()
        except Exception:
            if not self._scope.cancel_called:
                raise
            # hypercorn's cleanup can trip over a kill; the socket is closed below.
            logger.debug("listener %r: error while killed", self.name, exc_info=True)
        finally:
            self.close()
            self.stopped.set()

    async def _serve(self) -> None:
        kwargs: dict[str, Any] = {"shutdown_trigger": self._stop.wait}
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as trio_serve

            await trio_serve(self._served, self.config, **kwargs)  # type: ignore[arg-type]
        else:
            from hypercorn.asyncio import serve as asyncio_serve

            await asyncio_serve(self._served, self.config, **kwargs)  # type: ignore[arg-type]
