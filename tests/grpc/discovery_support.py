"""Real grpcio servers on loopback for the discovery-channel tests.

Each :class:`Backend` is a ``grpc.server`` (grpcio's own threads, so it runs
beside a trio or asyncio test) serving the interop ``TestService`` and the
standard ``grpc.health.v1`` service. ``UnaryCall`` answers with the
backend's name in ``username`` (after sleeping ``response_size`` ms, or,
for ``response_size=HOLD``, once the backend's ``release`` is set);
``StreamingOutputCall`` streams one message per ``response_parameters``
entry, sleeping ``interval_us`` before each (real time: the tests that use
it wait on events, not on the clock). ``StreamingInputCall`` adds up the
request payloads and ``FullDuplexCall`` answers each request with the
backend's name and its payload; both note the payloads in ``received``.
The health answer is set per backend: SERVING, NOT_SERVING or ``hang``
(Check never answers until the backend stops).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nadisc import Instance
from nadisc._grpc_protocol import GRPC_TLS_KEY

#: ``UnaryCall`` with this ``response_size`` answers once ``Backend.release`` is set;
#: another non-zero size sleeps that many milliseconds first.
HOLD = 99_999


class _Health(health_pb2_grpc.HealthServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def Check(self, request: Any, context: Any) -> Any:
        backend = self.backend
        backend.health_checks += 1
        gate = backend.serve_after
        if gate is not None:
            # Hold this answer until the gate opens (bounded), so that a test
            # can see every other probe arrive before the winner cancels them.
            until = time.monotonic() + 10.0
            while not gate() and time.monotonic() < until:
                time.sleep(0.002)
        if backend.health == "hang":
            backend.stopped.wait()
            context.abort(grpc.StatusCode.UNAVAILABLE, "stopped")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if backend.health == "serving"
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


class Backend:
    """One grpcio server on 127.0.0.1 (port chosen by the kernel unless given)."""

    def __init__(
        self, name: str, pb: ModuleType, pb_grpc: ModuleType, workers: int = 24, port: int = 0
    ) -> None:
        self.name = name
        self.health = "serving"
        self.health_checks = 0
        #: When set, a health check answers only once this returns True (at most 10 s).
        self.serve_after: Callable[[], bool] | None = None
        self.calls = 0
        self.stopped = threading.Event()
        #: Set by every UnaryCall; a call with ``response_size=HOLD`` waits for ``release``.
        self.arrived = threading.Event()
        self.release = threading.Event()
        #: Set while a streaming call is running on this backend.
        self.streaming = threading.Event()
        #: The payload bodies of every request a stream-request call received, in order.
        self.received: list[bytes] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        backend = self

        class Service(pb_grpc.TestServiceServicer):  # type: ignore[misc,name-defined]
            def UnaryCall(self, request: Any, context: Any) -> Any:
                with backend._lock:
                    backend.calls += 1
                backend.arrived.set()
                if request.response_size == HOLD:
                    backend.release.wait(30)
                elif request.response_size:
                    time.sleep(request.response_size / 1000)
                status = request.response_status
                if status.code:
                    code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
                    context.abort(code, status.message)
                return pb.SimpleResponse(username=backend.name)

            def StreamingOutputCall(self, request: Any, context: Any) -> Any:
                with backend._lock:
                    backend.calls += 1
                backend.streaming.set()
                for parameters in request.response_parameters:
                    if parameters.interval_us:
                        time.sleep(parameters.interval_us / 1e6)
                    if not context.is_active():
                        return
                    yield pb.StreamingOutputCallResponse(
                        payload=pb.Payload(body=backend.name.encode())
                    )

            def StreamingInputCall(self, request_iterator: Any, context: Any) -> Any:
                with backend._lock:
                    backend.calls += 1
                size = 0
                for request in request_iterator:
                    size += len(request.payload.body)
                    backend.received.append(request.payload.body)
                return pb.StreamingInputCallResponse(aggregated_payload_size=size)

            def FullDuplexCall(self, request_iterator: Any, context: Any) -> Any:
                with backend._lock:
                    backend.calls += 1
                for request in request_iterator:
                    backend.received.append(request.payload.body)
                    yield pb.StreamingOutputCallResponse(
                        payload=pb.Payload(body=backend.name.encode() + b":" + request.payload.body)
                    )

        pb_grpc.add_TestServiceServicer_to_server(Service(), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(self), self._server)
        # ``port``: a restarted server listening where its predecessor did.
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()

    def instance(self, **metadata: str) -> Instance:
        meta = metadata or {GRPC_TLS_KEY: "plaintext"}
        return Instance(self.name, "127.0.0.1", self.port, metadata=meta)

    def stop(self) -> None:
        self.stopped.set()
        self.release.set()
        self._server.stop(None).wait(10)


@contextmanager
def backends(
    pb: ModuleType, pb_grpc: ModuleType, count: int, *, workers: int = 24
) -> Iterator[list[Backend]]:
    with ExitStack() as stack:
        started = []
        for i in range(count):
            backend = Backend(f"b{i}", pb, pb_grpc, workers)
            stack.callback(backend.stop)
            started.append(backend)
        yield started


def failing(pb: ModuleType, code: grpc.StatusCode, message: str = "no") -> object:
    """A request the test service answers with ``code`` and ``message``."""
    return pb.SimpleRequest(response_status=pb.EchoStatus(code=code.value[0], message=message))
