"""gRPC listeners: a grpcio server the host binds, serves, reports healthy and drains.

``Bind(..., grpc=GrpcServe(servicers=[(add_EchoServicer_to_server, Echo())]))``
makes a listener a gRPC listener. Its server is grpcio's **synchronous**
``grpc.server``, on trio and on asyncio alike: grpcio's event-loop server
(``grpc.aio``) runs on asyncio only, and one server kind means one servicer
serves under both loops. Servicer methods are plain functions run on the
listener's thread pool (``max_workers`` threads, created and joined by the
host); a servicer with ``async def`` methods is refused, naming the listener.
To reach the host's loop from a servicer, use ``anyio.from_thread`` with a
token taken on the loop.

Lifecycle of one listener (driven by :mod:`nadisc.hosting._host`)::

    BOUND ─start()─► SERVING (health SERVING) ─not_serving()─► NOT_SERVING
        ─stop()─► STOPPING: server.stop(grace): new RPCs refused, the running
                  ones get ``grace`` seconds, then are cancelled
        ─► STOPPED: health Watch streams ended, thread pool and grpcio's
                  own server threads joined (bounded), report kept

*Binding.* The port is bound when the listener is built (``port=0`` takes an
ephemeral one; the real port is what registrations advertise), with
``grpc.so_reuseport`` off, so a port another process holds is a bind error
(:class:`~nadisc.hosting.HostingError` naming the listener) instead of a
silently shared port.

*Health.* The standard ``grpc.health.v1.Health`` service (Check and Watch,
the published ``health.proto``; its two one-field messages are encoded by
:mod:`nadisc.grpc._health`, beside the client's side of them) answers for the whole
server (``""``) and for every service the servicers registered: SERVING
once the server runs, NOT_SERVING from the start of the shutdown. A service
it does not know is ``NOT_FOUND`` on Check and ``SERVICE_UNKNOWN`` on Watch.
Watch streams end (status OK) when the stop begins, so they never hold the
drain; each open one occupies a thread of the pool while it waits.

*Counting.* An interceptor counts the RPCs each listener started and has in
flight (health RPCs excluded), for :class:`GrpcListenerReport`.

Costs: one grpcio server, ``max_workers`` threads at most (started lazily by
the pool), O(1) per RPC for the counting.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from .._grpc_protocol import GRPC_AUTHORITY_KEY, GRPC_TLS_KEY

if TYPE_CHECKING:
    import grpc

    from ._listen import Bind

__all__ = ["GrpcListener", "GrpcListenerReport", "GrpcServe"]

logger = logging.getLogger("nadisc.hosting")

HEALTH_SERVICE = "grpc.health.v1.Health"
_THREADS_JOIN_TIMEOUT = 5.0

#: ``HealthCheckResponse.ServingStatus`` values.
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3

#: What registers a servicer: a generated ``add_XServicer_to_server`` function.
AddServicer = Callable[[Any, Any], object]


@dataclass(frozen=True, slots=True)
class GrpcServe:
    """What a gRPC listener serves.

    ``servicers``: ``(add_XServicer_to_server, servicer)`` pairs as generated
    by grpcio-tools; ``handlers``: extra ``grpc.GenericRpcHandler`` objects
    (raw-bytes methods, for one). At least one of the two. ``server_credentials``
    (``grpc.ssl_server_credentials(...)``) serves TLS and publishes
    ``tls`` in the registrations' metadata, else ``plaintext``;
    ``authority`` is published when given (the ``:authority`` callers send).
    ``max_workers`` bounds the RPCs running at once; ``options`` go to
    ``grpc.server`` (``grpc.so_reuseport`` is always 0).
    """

    servicers: Sequence[tuple[AddServicer, object]] = ()
    handlers: Sequence[Any] = ()
    server_credentials: Any = field(default=None, repr=False)
    authority: str | None = None
    max_workers: int = 16
    options: Sequence[tuple[str, Any]] = ()

    def check(self, name: str) -> None:
        """Raise ``ValueError`` naming the listener when a field is wrong."""
        where = f"listener {name!r}"
        if isinstance(self.servicers, str | bytes) or not isinstance(self.servicers, Sequence):
            raise ValueError(f"{where}: servicers must be a sequence of (add_fn, servicer) pairs")
        if not isinstance(self.handlers, Sequence) or isinstance(self.handlers, str | bytes):
            raise ValueError(f"{where}: handlers must be a sequence of grpc.GenericRpcHandler")
        if not self.servicers and not self.handlers:
            raise ValueError(
                f"{where}: a gRPC listener with no servicers: give "
                "GrpcServe(servicers=[(add_XServicer_to_server, servicer)]) or handlers"
            )
        for index, pair in enumerate(self.servicers):
            if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[0])):
                raise ValueError(
                    f"{where}: servicers[{index}] is not an (add_XServicer_to_server, "
                    f"servicer) pair: {type(pair).__name__}"
                )
            servicer = pair[1]
            for attribute in dir(type(servicer)):
                if attribute.startswith("_"):
                    continue
                method = getattr(type(servicer), attribute, None)
                if inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method):
                    raise ValueError(
                        f"{where}: {type(servicer).__name__}.{attribute} is async; the host "
                        "serves gRPC with grpcio's thread-pool server on both loops, so "
                        "servicer methods are plain functions"
                    )
        for index, handler in enumerate(self.handlers):
            if not callable(getattr(handler, "service", None)):
                raise ValueError(
                    f"{where}: handlers[{index}] is not a grpc.GenericRpcHandler "
                    f"({type(handler).__name__} has no service())"
                )
        if self.authority is not None and (
            not isinstance(self.authority, str) or not self.authority or "/" in self.authority
        ):
            raise ValueError(f"{where}: authority {self.authority!r} is not host[:port]")
        if (
            isinstance(self.max_workers, bool)
            or not isinstance(self.max_workers, int)
            or self.max_workers < 1
        ):
            raise ValueError(f"{where}: max_workers must be a positive integer")

    @property
    def tls_mode(self) -> str:
        return "plaintext" if self.server_credentials is None else "tls"

    def metadata(self) -> dict[str, str]:
        """The gRPC protocol metadata the listener's registrations publish."""
        published = {GRPC_TLS_KEY: self.tls_mode}
        if self.authority is not None:
            published[GRPC_AUTHORITY_KEY] = self.authority
        return published


@dataclass(frozen=True, slots=True)
class GrpcListenerReport:
    """What one gRPC listener's shutdown did (loop-clock seconds, like ``HostReport``)."""

    #: Health turned NOT_SERVING (the start of the shutdown, before deregistering).
    not_serving_at: float | None
    #: ``server.stop(grace)`` was called: from here new RPCs are refused.
    stop_at: float | None
    #: The server had stopped (every RPC finished or cancelled).
    stopped_at: float | None
    #: The grace ``server.stop`` got (the drain budget left), seconds.
    stop_grace_seconds: float
    #: RPCs the listener started (health RPCs excluded).
    rpcs: int
    #: RPCs running when ``server.stop(grace)`` was called.
    in_flight_at_stop: int
    #: RPCs still running when the grace ran out (cancelled by the server).
    abandoned: int
    #: Threads of the listener (its pool, grpcio's server threads) still
    #: alive after the bounded join (a servicer that ignores cancellation).
    threads_left: int


# ------------------------------------------------------------------ health


class HealthState:
    """The statuses the health service answers with; thread-safe."""

    def __init__(self, services: Sequence[str]) -> None:
        self._condition = threading.Condition()
        self._status: dict[str, int] = dict.fromkeys(("", *services), SERVING)
        self._version = 0
        self._closed = False

    def get(self, service: str) -> int | None:
        with self._condition:
            return self._status.get(service)

    def set_all(self, status: int) -> None:
        with self._condition:
            for service in self._status:
                self._status[service] = status
            self._version += 1
            self._condition.notify_all()

    def close(self) -> None:
        """End every Watch stream (the server is stopping)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def watch(self, service: str, active: Callable[[], bool]) -> Iterator[bytes]:
        from ..grpc._health import encode_response

        seen: int | None = None
        version = -1
        while True:
            with self._condition:
                while version == self._version and not self._closed and active():
                    self._condition.wait(0.5)
                if self._closed or not active():
                    return
                version = self._version
                status = self._status.get(service, SERVICE_UNKNOWN)
            if status != seen:
                seen = status
                yield encode_response(status)


def health_handler(state: HealthState) -> Any:
    import grpc

    # The grpc extra (this module is imported without it: HTTP-only hosts).
    from ..grpc._health import decode_request, encode_response

    def check(request: str, context: grpc.ServicerContext) -> bytes:
        status = state.get(request)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request!r}")
        return encode_response(status or 0)

    def watch(request: str, context: grpc.ServicerContext) -> Iterator[bytes]:
        return state.watch(request, context.is_active)

    return grpc.method_handlers_generic_handler(
        HEALTH_SERVICE,
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                check, request_deserializer=decode_request
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                watch, request_deserializer=decode_request
            ),
        },
    )


# ------------------------------------------------------------------ counting


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = 0
        self.in_flight = 0

    def enter(self) -> None:
        with self.lock:
            self.started += 1
            self.in_flight += 1

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _counting_interceptor(counter: _Counter) -> Any:
    import grpc

    def unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: Any) -> Any:
            counter.enter()
            try:
                return behaviour(request, context)
            finally:
                counter.leave()

        return run

    def streaming(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: Any) -> Iterator[Any]:
            counter.enter()
            try:
                yield from behaviour(request, context)
            finally:
                counter.leave()

        return run

    class Counting(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = continuation(details)
            if handler is None or details.method.startswith(f"/{HEALTH_SERVICE}/"):
                return handler
            codec = {
                "request_deserializer": handler.request_deserializer,
                "response_serializer": handler.response_serializer,
            }
            if handler.unary_unary is not None:
                return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codec)
            if handler.unary_stream is not None:
                return grpc.unary_stream_rpc_method_handler(
                    streaming(handler.unary_stream), **codec
                )
            if handler.stream_unary is not None:
                return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codec)
            return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **codec)

    return Counting()


# ------------------------------------------------------------------ the listener


class _Recorder:
    """Stands in for the server while servicers register: records the service names."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.services: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        for handler in handlers:
            name = getattr(handler, "service_name", None)
            if callable(name):
                self.services.append(str(name()))
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        self.services.append(service)
        self._server.add_registered_method_handlers(service, handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def _grpc_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """grpcio's own server threads started since ``before`` (named after their target)."""
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before
        and (thread.name.endswith("(_serve)") or "cancel_all_calls_after_grace" in thread.name)
    ]


class GrpcListener:
    """One gRPC listener: its bound grpcio server (see the module documentation).

    Offers what the host drives every listener through (``name``, ``bind``,
    ``bound``, ``serving``, ``stopped``, :meth:`run`, :meth:`stop`,
    :meth:`kill`, :meth:`close`) plus :meth:`not_serving` and :meth:`report`.
    """

    def __init__(self, name: str, bind: Bind, serve: GrpcServe, *, drain_timeout: float) -> None:
        import grpc

        from ._host import HostingError

        self.name = name
        self.bind = bind
        self.serve = serve
        self.serving = anyio.Event()
        self.stopped = anyio.Event()
        #: Set once ``server.stop(grace)`` was called (new RPCs refused).
        self.stopping = anyio.Event()
        self._stop = anyio.Event()
        self._scope = anyio.CancelScope(shield=True)
        self._drain = drain_timeout
        self._counter = _Counter()
        #: The pool's threads are named with this (unique per listener object).
        self.thread_prefix = f"nadisc-grpc-{name}-{id(self):x}"
        self._pool = futures.ThreadPoolExecutor(
            max_workers=serve.max_workers, thread_name_prefix=self.thread_prefix
        )
        options = [(k, v) for k, v in serve.options if k != "grpc.so_reuseport"]
        self._server = grpc.server(
            self._pool,
            interceptors=[_counting_interceptor(self._counter)],
            options=[*options, ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=None,
        )
        recorder = _Recorder(self._server)
        try:
            for add, servicer in serve.servicers:
                add(servicer, recorder)
            if serve.handlers:
                recorder.add_generic_rpc_handlers(tuple(serve.handlers))
        except Exception as exc:
            self._pool.shutdown(wait=False)
            raise HostingError(
                f"listeners.{name}", f"registering the servicers failed: {exc!r}"
            ) from exc
        if not recorder.services:
            self._pool.shutdown(wait=False)
            raise HostingError(f"listeners.{name}", "the servicers registered no gRPC service")
        self.services = tuple(recorder.services)
        self.health = HealthState(self.services)
        self._server.add_generic_rpc_handlers((health_handler(self.health),))
        host = bind.host.strip("[]")
        address = f"[{host}]:{bind.port}" if ":" in host else f"{host}:{bind.port}"
        try:
            if serve.server_credentials is not None:
                port = self._server.add_secure_port(address, serve.server_credentials)
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            self._pool.shutdown(wait=False)
            raise HostingError(
                f"listeners.{name}",
                f"could not bind the gRPC server to {bind.host}:{bind.port} "
                "(the port is taken, or the address is not this machine's)",
            ) from exc
        #: The real bound (host, port).
        self.bound: tuple[str, int] = (host, int(port))
        self._before: set[threading.Thread] = set()
        self._threads: list[threading.Thread] = []
        self._not_serving_at: float | None = None
        self._stop_at: float | None = None
        self._stopped_at: float | None = None
        self._grace = 0.0
        self._in_flight_at_stop = 0
        self._abandoned = 0
        self._threads_left = 0
        self._started = False

    @property
    def in_flight(self) -> int:
        return self._counter.in_flight

    @property
    def rpcs(self) -> int:
        return self._counter.started

    def not_serving(self) -> None:
        """Health answers NOT_SERVING from now on (idempotent)."""
        if self._not_serving_at is None:
            self._not_serving_at = anyio.current_time()
            self.health.set_all(NOT_SERVING)

    def stop(self) -> None:
        """Begin ``server.stop(grace)`` with the drain budget (idempotent)."""
        self._stop.set()

    def kill(self) -> None:
        """Cut the server now (past the drain budget). Idempotent."""
        self._scope.cancel()

    def close(self) -> None:
        """Release the port of a server that never ran (idempotent; :meth:`run`
        releases its own)."""
        if not self._started:
            self._server.stop(None)  # never started: returns at once
            self._pool.shutdown(wait=False)

    def report(self) -> GrpcListenerReport:
        return GrpcListenerReport(
            not_serving_at=self._not_serving_at,
            stop_at=self._stop_at,
            stopped_at=self._stopped_at,
            stop_grace_seconds=self._grace,
            rpcs=self._counter.started,
            in_flight_at_stop=self._in_flight_at_stop,
            abandoned=self._abandoned,
            threads_left=self._threads_left,
        )

    async def run(self) -> None:
        """Serve until :meth:`stop`, then stop within the drain budget and join the threads.

        Shielded like the HTTP listeners: the host stops it in order and
        kills it only past the drain budget."""
        try:
            with self._scope:
                self._before = set(threading.enumerate())
                self._server.start()
                self._started = True
                self._threads = _grpc_threads(self._before)
                self.serving.set()
                await self._stop.wait()
                await self._graceful()
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()
            self.stopped.set()

    async def _graceful(self) -> None:
        self._stop_at = anyio.current_time()
        self._grace = self._drain
        self._in_flight_at_stop = self._counter.in_flight
        # Health Watch streams end now: they must not hold the drain.
        self.health.close()
        before = set(threading.enumerate())
        # grpcio's own grace is set past ours: the host decides when the
        # grace is over, so what still runs then is counted before anything
        # is cancelled; then stop(None) cancels it.
        done = self._server.stop(self._drain + 60.0)
        self._threads.extend(_grpc_threads(before))
        self.stopping.set()
        finished = await anyio.to_thread.run_sync(done.wait, self._drain, abandon_on_cancel=True)
        if not finished:
            self._abandoned = self._counter.in_flight
            with anyio.move_on_after(2.0):
                await anyio.to_thread.run_sync(self._server.stop, None, abandon_on_cancel=True)
        self._stopped_at = anyio.current_time()

    async def _finish(self) -> None:
        """Stop now if not stopped yet; end the Watch streams; join the threads (bounded)."""
        self.health.close()
        if self._started and self._stopped_at is None:
            # Killed (past the drain budget) or never asked to stop gracefully.
            if self._stop_at is None:
                self._stop_at = anyio.current_time()
                self._in_flight_at_stop = self._counter.in_flight
            self._abandoned = self._counter.in_flight
            # stop(None) cancels every RPC and blocks until the server stopped.
            with anyio.move_on_after(2.0):
                await anyio.to_thread.run_sync(self._server.stop, None, abandon_on_cancel=True)
            self._stopped_at = anyio.current_time()
        pool, threads = self._pool, self._threads

        def join() -> int:
            deadline = time.monotonic() + _THREADS_JOIN_TIMEOUT
            pool.shutdown(wait=False, cancel_futures=True)
            prefix = self.thread_prefix + "_"
            workers = [t for t in threading.enumerate() if t.name.startswith(prefix)]
            for thread in [*threads, *workers]:
                thread.join(max(0.0, deadline - time.monotonic()))
            return sum(1 for thread in [*threads, *workers] if thread.is_alive())

        with anyio.move_on_after(_THREADS_JOIN_TIMEOUT + 1.0):
            self._threads_left = await anyio.to_thread.run_sync(join, abandon_on_cancel=True)
        if self._threads_left:
            logger.warning(
                "gRPC listener %r: %d thread(s) still running after the server stopped "
                "(a servicer that does not return when its RPC is cancelled)",
                self.name,
                self._threads_left,
            )
