"""Hosted gRPC listeners: a real grpcio server bound by ``nadisc.hosting``, its
registrations' gRPC metadata (and no other registration's), the standard health
service, the shutdown order (NOT_SERVING and deregister, the ack, the grace,
``server.stop(grace)``, close) and the typed refusals. On trio and asyncio; the
shutdown order is checked by the order of events and by timer lower bounds."""

from __future__ import annotations

import socket
import threading
from types import ModuleType
from typing import Any

import anyio
import grpc
import pytest

from nadisc import DiscoveryConfig
from nadisc._grpc_protocol import GRPC_AUTHORITY_KEY, GRPC_METADATA_PREFIX, GRPC_TLS_KEY
from nadisc._provider import Registered
from nadisc.grpc import Channel, HealthClient, HealthStatus, RpcError
from nadisc.grpc._health import decode_request, encode_response
from nadisc.hosting import Bind, GrpcServe, Host, HostingError, open_host, serve
from nadisc.hosting._grpc import GrpcListener
from nadisc.testing import MemoryProvider, MemoryRegistry
from tests.grpc.conftest import TLSFiles

UNARY = "/grpc.testing.TestService/UnaryCall"
STREAM = "/grpc.testing.TestService/StreamingOutputCall"


class Events:
    """What happened, in order, across the loop and grpcio's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[str] = []
        self.release = threading.Event()
        self.holding = threading.Event()

    def add(self, event: str) -> None:
        with self.lock:
            self.log.append(event)


def servicer(pb: ModuleType, pb_grpc: ModuleType, events: Events) -> Any:
    class Service(pb_grpc.TestServiceServicer):  # type: ignore[misc,name-defined]
        def UnaryCall(self, request: Any, context: Any) -> Any:
            events.add("unary")
            return pb.SimpleResponse(username="hosted")

        def StreamingOutputCall(self, request: Any, context: Any) -> Any:
            events.add("stream")
            for index, _ in enumerate(request.response_parameters):
                if index == 1:
                    # Held after the first message until released, or cancelled.
                    events.holding.set()
                    context.add_callback(events.release.set)
                    events.release.wait(30)
                    if not context.is_active():
                        events.add("stream cancelled")
                        return
                yield pb.StreamingOutputCallResponse(payload=pb.Payload(body=b"x"))
            events.add("stream done")

    return Service()


class RecordingRegistry(MemoryRegistry):
    """A memory registry that logs the deregistration and answers it late."""

    def __init__(self, events: Events, health: Any = None, delay: float = 0.2) -> None:
        super().__init__()
        self.events = events
        self.health = health
        self.delay = delay
        #: Set when a deregistration arrives.
        self.asked = anyio.Event()

    async def deregister(self, registered: Registered, deadline: float) -> None:
        health = self.health() if self.health is not None else None
        self.asked.set()
        self.events.add(f"deregister {registered.record.registration} (health {health})")
        await anyio.sleep(self.delay)
        await super().deregister(registered, deadline)
        self.events.add(f"deregistered {registered.record.registration}")


def config(probe: bool = False, **registrations: dict[str, Any]) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "eligibility_probe": probe,
            "connections": {
                "primary": {
                    "provider": "memory",
                    "request_timeout_ms": 500,
                    "monitor_interval_ms": 200,
                    "observation_grace_ms": 1000,
                    "memory": {"services": {"self": {"name": "order-api"}}},
                }
            },
            "registrations": registrations
            or {"rpc": {"service_name": "self", "listener_ref": "grpc"}},
            "shutdown_timeout_ms": 2000,
        }
    )


async def http_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_health_messages_round_trip() -> None:
    from grpc_health.v1 import health_pb2

    raw = health_pb2.HealthCheckRequest(service="grpc.testing.TestService").SerializeToString()
    assert decode_request(raw) == "grpc.testing.TestService"
    assert decode_request(b"") == ""
    for status in (1, 2, 3):
        parsed = health_pb2.HealthCheckResponse.FromString(encode_response(status))
        assert parsed.status == status
    with pytest.raises(ValueError, match="truncated"):
        decode_request(b"\x0a\x05ab")


async def test_a_grpc_listener_serves_registers_its_port_and_reports_serving(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    events = Events()
    registry = MemoryRegistry()
    grpc_serve = GrpcServe(
        servicers=[(pb_grpc.add_TestServiceServicer_to_server, servicer(pb, pb_grpc, events))]
    )
    settings = config(
        rpc={"service_name": "self", "listener_ref": "grpc", "metadata": {"zone": "a"}},
        web={"service_name": "self", "listener_ref": "web"},
    )
    async with open_host(
        http_app,
        settings,
        listeners={"grpc": Bind("127.0.0.1", 0, grpc=grpc_serve), "web": Bind()},
        providers={"primary": MemoryProvider(registry=registry)},
        handle_signals=False,
        allow_loopback=True,
    ) as host:
        port = host.bound["grpc"][1]
        assert port > 0 and host.target("grpc") == f"127.0.0.1:{port}"
        rpc = host.owner.registrations()["rpc"]
        web = host.owner.registrations()["web"]
        assert rpc.instance_id is not None and web.instance_id is not None
        stored_rpc = registry.get(rpc.instance_id)
        stored_web = registry.get(web.instance_id)
        assert stored_rpc is not None and stored_web is not None
        # The real bound port, the gRPC metadata beside the user's own.
        assert stored_rpc.record.port == port
        assert stored_rpc.record.metadata == {"zone": "a", GRPC_TLS_KEY: "plaintext"}
        # The HTTP listener's registration claims nothing about gRPC.
        assert stored_web.record.port == host.bound["web"][1]
        assert not any(k.startswith(GRPC_METADATA_PREFIX) for k in stored_web.record.metadata)
        async with Channel(host.target("grpc")) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            answer = await stub.UnaryCall(pb.SimpleRequest())
            assert answer.username == "hosted"
            request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()])
            received = [message async for message in stub.StreamingOutputCall(request)]
            assert len(received) == 1
            health = HealthClient(channel)
            assert await health.check() is HealthStatus.SERVING
            assert await health.check("grpc.testing.TestService") is HealthStatus.SERVING
            with pytest.raises(RpcError) as caught:
                await health.check("no.such.Service")
            assert caught.value.code() is grpc.StatusCode.NOT_FOUND
            watched = health.watch()
            assert await watched.__anext__() is HealthStatus.SERVING
            await watched.aclose()
        assert host.in_flight("grpc") == 0
    report = host.report
    assert report is not None
    assert report.grpc["grpc"].rpcs == 2  # health RPCs are not counted
    assert report.grpc["grpc"].abandoned == 0 and report.grpc["grpc"].threads_left == 0
    assert events.log == ["unary", "stream", "stream done"]


async def test_a_tls_grpc_listener_publishes_tls_and_its_authority_and_nothing_else_inherits_it(
    pb: ModuleType, pb_grpc: ModuleType, tls_files: TLSFiles
) -> None:
    credentials = grpc.ssl_server_credentials(
        [(tls_files.key.read_bytes(), tls_files.cert.read_bytes())]
    )
    grpc_serve = GrpcServe(
        servicers=[(pb_grpc.add_TestServiceServicer_to_server, servicer(pb, pb_grpc, Events()))],
        server_credentials=credentials,
        authority="localhost",
    )
    registry = MemoryRegistry()
    settings = config(
        rpc={"service_name": "self", "listener_ref": "grpc"},
        web={"service_name": "self", "listener_ref": "web"},
        admin={"service_name": "self", "listener_ref": "ops", "metadata": {"role": "ops"}},
    )
    async with open_host(
        http_app,
        settings,
        listeners={
            "grpc": Bind(grpc=grpc_serve),
            "web": Bind(),
            "ops": Bind(app=http_app),
        },
        providers={"primary": MemoryProvider(registry=registry)},
        handle_signals=False,
        allow_loopback=True,
    ) as host:
        records = {
            name: registry.get(status.instance_id or "")
            for name, status in host.owner.registrations().items()
        }
        assert records["rpc"] is not None
        assert records["rpc"].record.metadata == {
            GRPC_TLS_KEY: "tls",
            GRPC_AUTHORITY_KEY: "localhost",
        }
        for other in ("web", "admin"):
            stored = records[other]
            assert stored is not None
            assert not any(k.startswith(GRPC_METADATA_PREFIX) for k in stored.record.metadata)
        assert records["admin"] is not None and records["admin"].record.metadata == {"role": "ops"}
        # The server really speaks TLS with that authority.
        async with Channel(
            host.target("grpc"), ssl_context=tls_files.client_context(), authority="localhost"
        ) as channel:
            answer = await pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest())
            assert answer.username == "hosted"


async def _serve_in(
    tg: Any,
    pb: ModuleType,
    pb_grpc: ModuleType,
    events: Events,
    registry: MemoryRegistry,
    *,
    served: Any = None,
    **kw: Any,
) -> tuple[Host, GrpcListener]:
    """A gRPC host run by ``serve`` in ``tg`` (its shutdown cancels its own
    block, not the caller's), and its listener; ``served`` replaces the
    recording servicer."""
    add = pb_grpc.add_TestServiceServicer_to_server
    chosen = served if served is not None else servicer(pb, pb_grpc, events)
    listeners = {"grpc": Bind(grpc=GrpcServe(servicers=[(add, chosen)]))}
    host: Host = await tg.start(
        lambda task_status: serve(
            None,
            config(),
            listeners=listeners,
            providers={"primary": MemoryProvider(registry=registry)},
            handle_signals=False,
            allow_loopback=True,
            task_status=task_status,
            **kw,
        )
    )
    listener = host._listeners["grpc"]
    assert isinstance(listener, GrpcListener)
    return host, listener


def _held_stream(pb: ModuleType, pb_grpc: ModuleType, target: str, failures: list[Any]) -> Any:
    """A server-streaming call of two messages (the servicer holds the second),
    made by grpcio's own client in a worker thread: what is checked is the
    server's drain, seen by the reference client."""
    request = pb.StreamingOutputCallRequest(
        response_parameters=[pb.ResponseParameters(), pb.ResponseParameters()]
    )
    received: list[Any] = []

    def call() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            try:
                for message in stub.StreamingOutputCall(request, timeout=30):
                    received.append(message)
            except grpc.RpcError as exc:
                failures.append((exc.code(), exc.details()))

    async def stream() -> None:
        await anyio.to_thread.run_sync(call)

    return stream, received


async def test_shutdown_goes_not_serving_and_deregisters_then_waits_the_ack_and_grace_then_stops(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    events = Events()
    holder: dict[str, Any] = {}
    registry = RecordingRegistry(events, health=lambda: holder["health"]())
    failures: list[Any] = []
    async with anyio.create_task_group() as tg:
        host, listener = await _serve_in(
            tg, pb, pb_grpc, events, registry, deregister_grace_ms=300, drain_timeout_ms=5000
        )
        holder["health"] = lambda: listener.health.get("")
        stream, received = _held_stream(pb, pb_grpc, host.target("grpc"), failures)
        watched: list[Any] = []
        watching = threading.Event()

        def watch() -> None:
            from grpc_health.v1 import health_pb2

            with grpc.insecure_channel(host.target("grpc")) as channel:
                method = channel.unary_stream(
                    "/grpc.health.v1.Health/Watch",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                for answer in method(health_pb2.HealthCheckRequest(service=""), timeout=30):
                    watched.append(answer.status)
                    watching.set()
            watched.append("ended")

        async with anyio.create_task_group() as calls:
            calls.start_soon(stream)
            calls.start_soon(anyio.to_thread.run_sync, watch)
            await anyio.to_thread.run_sync(events.holding.wait, 10)
            await anyio.to_thread.run_sync(watching.wait, 10)
            host.shutdown()
            # The held stream outlives the deregistration and the grace;
            # it is released once the server began stopping.
            await host.wait_draining()
            await listener.stopping.wait()
            events.add("released")
            events.release.set()
        assert failures == [] and len(received) == 2  # the stream in flight finished whole
        # The health Watch saw SERVING, then NOT_SERVING, and ended cleanly at the stop.
        assert watched == [1, 2, "ended"]
        report = await host.wait_closed()
    g = report.grpc["grpc"]
    # Order of events: NOT_SERVING before the deregistration was sent; the
    # stream finished after the stop began (it was in flight through it).
    assert events.log == [
        "stream",
        "deregister rpc (health 2)",
        "deregistered rpc",
        "released",
        "stream done",
    ]
    assert report.deregistered_at is not None and g.not_serving_at is not None
    assert g.stop_at is not None and g.stopped_at is not None
    # The ack took the registry's 0.2 s; the grace is served after it; the stop comes after.
    assert report.started_at <= g.not_serving_at
    assert report.deregistered_at - g.not_serving_at >= 0.2
    assert report.refusing_at is not None and g.stop_at >= report.refusing_at
    assert report.refusing_at - report.deregistered_at >= 0.3
    assert g.stop_at <= g.stopped_at <= report.started_at + report.total_seconds
    # The open health Watch did not hold the stop to its 5 s drain budget.
    assert g.stopped_at - g.stop_at < 2.5
    assert g.in_flight_at_stop == 1 and g.abandoned == 0 and g.threads_left == 0
    assert g.stop_grace_seconds == 5.0
    assert not report.over_budget


async def test_an_rpc_running_past_the_drain_budget_is_cancelled_and_counted(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    events = Events()
    failures: list[Any] = []
    async with anyio.create_task_group() as tg:
        host, listener = await _serve_in(
            tg, pb, pb_grpc, events, MemoryRegistry(), deregister_grace_ms=0, drain_timeout_ms=300
        )
        prefix = listener.thread_prefix
        stream, _ = _held_stream(pb, pb_grpc, host.target("grpc"), failures)
        async with anyio.create_task_group() as calls:
            calls.start_soon(stream)
            await anyio.to_thread.run_sync(events.holding.wait, 10)
            host.shutdown()
        report = await host.wait_closed()
    g = report.grpc["grpc"]
    assert g.abandoned == 1 and g.in_flight_at_stop == 1
    assert g.stopped_at is not None and g.stop_at is not None
    assert g.stopped_at - g.stop_at >= 0.3  # the server's grace, a timer's lower bound
    assert failures and failures[0][0] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert "stream cancelled" in events.log
    # The cancelled servicer returned, so every thread of the listener was joined.
    assert g.threads_left == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


async def test_no_thread_of_the_listener_outlives_the_host(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    before = set(threading.enumerate())
    grpc_serve = GrpcServe(
        servicers=[(pb_grpc.add_TestServiceServicer_to_server, servicer(pb, pb_grpc, Events()))],
        max_workers=4,
    )
    async with (
        open_host(
            None,
            config(),
            listeners={"grpc": Bind(grpc=grpc_serve)},
            providers={"primary": MemoryProvider(registry=MemoryRegistry())},
            handle_signals=False,
            allow_loopback=True,
            deregister_grace_ms=0,
        ) as host,
        Channel(host.target("grpc")) as channel,
    ):
        stub = pb_grpc.TestServiceStub(channel)

        async def call() -> None:
            await stub.UnaryCall(pb.SimpleRequest())

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(call)
    # The loop's own worker threads (anyio's cache) are the loop's, not the host's.
    left = [
        t.name
        for t in set(threading.enumerate()) - before
        if t.name.startswith("nadisc-grpc-") or t.name.endswith("(_serve)")
    ]
    assert left == []


# ------------------------------------------------------------------ refusals


def _taken_port() -> tuple[socket.socket, int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, int(holder.getsockname()[1])


async def _enter(
    listeners: dict[str, Bind], settings: DiscoveryConfig | None = None, **kw: Any
) -> None:
    async with open_host(
        http_app,
        settings or config(),
        listeners=listeners,
        providers={"primary": MemoryProvider(registry=MemoryRegistry())},
        handle_signals=False,
        allow_loopback=True,
        **kw,
    ):
        pass


class AsyncService:
    async def UnaryCall(self, request: Any, context: Any) -> Any:
        return None


def _add(servicer: object, server: Any) -> None:
    """Registers nothing."""


async def test_bad_grpc_listeners_are_refused_naming_the_listener(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    add = pb_grpc.add_TestServiceServicer_to_server
    good = GrpcServe(servicers=[(add, servicer(pb, pb_grpc, Events()))])
    holder, port = _taken_port()
    with holder:
        cases: list[tuple[dict[str, Bind], dict[str, Any], str, str]] = [
            ({"grpc": Bind(grpc=GrpcServe())}, {}, "listeners.grpc", "no servicers"),
            (
                {"grpc": Bind(grpc=GrpcServe(servicers=[(add, AsyncService())]))},
                {},
                "listeners.grpc",
                "AsyncService.UnaryCall is async",
            ),
            (
                {"grpc": Bind(grpc=GrpcServe(servicers=[(_add, object())]))},
                {},
                "listeners.grpc",
                "registered no gRPC service",
            ),
            ({"grpc": Bind(port=port, grpc=good)}, {}, "listeners.grpc", "could not bind"),
            ({"grpc": Bind(grpc=good, app=http_app)}, {}, "listeners.grpc", "no app"),
            ({"grpc": Bind(grpc=good, admin=True)}, {}, "listeners.grpc", "not admin"),
            (
                {"grpc": Bind(grpc=GrpcServe(servicers=[(add, object())], max_workers=0))},
                {},
                "listeners.grpc",
                "max_workers",
            ),
            ({"grpc": Bind(grpc="yes")}, {}, "listeners.grpc", "must be a GrpcServe"),  # type: ignore[arg-type]
            ({"grpc": Bind(grpc=good)}, {"probe_on": "grpc"}, "probe_on", "serves gRPC"),
        ]
        for listeners, options, where, fragment in cases:
            settings = config(probe=True) if "probe_on" in options else None
            with pytest.raises(HostingError) as caught:
                await _enter(listeners, settings, **options)
            assert caught.value.where == where, (where, caught.value)
            assert fragment in str(caught.value), (fragment, caught.value)


async def test_the_grpc_metadata_prefix_is_the_hosts_to_write(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    good = GrpcServe(
        servicers=[(pb_grpc.add_TestServiceServicer_to_server, servicer(pb, pb_grpc, Events()))]
    )
    for listener in ("grpc", "web"):
        settings = config(
            rpc={"service_name": "self", "listener_ref": "grpc"},
            web={
                "service_name": "self",
                "listener_ref": "web",
                **({"metadata": {GRPC_TLS_KEY: "tls"}} if listener == "web" else {}),
            },
        )
        if listener == "grpc":
            settings = config(
                rpc={
                    "service_name": "self",
                    "listener_ref": "grpc",
                    "metadata": {GRPC_TLS_KEY: "tls"},
                },
                web={"service_name": "self", "listener_ref": "web"},
            )
        with pytest.raises(HostingError) as caught:
            await _enter({"grpc": Bind(grpc=good), "web": Bind()}, settings)
        name = "rpc" if listener == "grpc" else "web"
        assert caught.value.where == f"registrations.{name}.metadata.{GRPC_TLS_KEY}"


async def test_hosted_servers_are_dialled_by_the_discovery_channel_from_their_records(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    # Two hosts write their records into one in-memory registry; a caller
    # lists exactly those records (what a registry would list) and calls
    # through discovery_channel with no DiscoveryProtocol: the hosts' own
    # gRPC metadata says how to dial them. Once a host's shutdown began, its
    # health says NOT_SERVING through the grace, so first-serving calls go
    # to the other although it is still listed.
    from nadisc import ConnectionConfig, ConnectionSpec, Instance, OwnerBuilder
    from nadisc.grpc import discovery_channel

    registry = RecordingRegistry(Events())

    def named(name: str) -> Any:
        class Named(pb_grpc.TestServiceServicer):  # type: ignore[misc,name-defined]
            def UnaryCall(self, request: Any, context: Any) -> Any:
                return pb.SimpleResponse(username=name)

        return Named()

    async with anyio.create_task_group() as tg:
        started = [
            await _serve_in(
                tg, pb, pb_grpc, Events(), registry, served=named(n), deregister_grace_ms=1500
            )
            for n in ("a", "b")
        ]
        hosts = [host for host, _ in started]
        records = [registry.get(i) for i in registry.instance_ids()]
        listed = [
            Instance(r.record.instance_id, r.record.host, r.record.port, metadata=r.record.metadata)
            for r in records
            if r is not None
        ]
        assert len(listed) == 2
        memory = MemoryProvider(services={"orders": "order-api"})
        memory.set("order-api", listed)
        builder = OwnerBuilder()
        builder.connection(ConnectionSpec("primary", memory, ConnectionConfig(provider="memory")))
        async with builder.open() as caller:
            await caller.prepare(anyio.current_time() + 5)
            async with discovery_channel(caller, "primary", "orders") as channel:
                stub = pb_grpc.TestServiceStub(channel)
                names = {(await stub.UnaryCall(pb.SimpleRequest())).username for _ in range(8)}
                assert names == {"a", "b"}
                hosts[0].shutdown()
                # Health turns NOT_SERVING before the deregistration is sent.
                await registry.asked.wait()
                assert started[0][1].health.get("") == 2
                assert hosts[0].report is None  # still serving through its grace
                probed = set()
                for _ in range(4):
                    call = stub.UnaryCall(pb.SimpleRequest(), timeout=5, first_serving=True)
                    probed.add((await call).username)
                assert probed == {"b"}
        for host in hosts:
            host.shutdown()
