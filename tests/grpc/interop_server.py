"""The server side of the interop cases, on grpcio (C core), run as a subprocess.

``python interop_server.py GEN_DIR CERT KEY`` serves the test service, the
suite's ``Control`` service and the standard health service on two loopback
ports (plaintext and TLS) and prints ``PORTS <plain> <tls>`` when ready. It
exits when its standard input closes, so a crashed test run never leaves it
behind.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any


async def main(gen_dir: str, cert: str, key: str) -> None:
    sys.path.insert(0, gen_dir)
    import grpc
    import grpc.aio
    import interop_pb2 as pb
    import interop_pb2_grpc as pb_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    state = {"active": 0, "started": 0}

    def enter() -> None:
        state["active"] += 1
        state["started"] += 1

    def leave() -> None:
        state["active"] -= 1

    def payload(size: int) -> pb.Payload:
        return pb.Payload(body=b"\0" * size)

    async def echo_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        initial = []
        for key_, value in context.invocation_metadata() or ():
            if key_ == "x-grpc-test-echo-initial":
                initial.append((key_, value))
            elif key_ == "x-grpc-test-echo-trailing-bin":
                context.set_trailing_metadata(((key_, value),))
        if initial:
            await context.send_initial_metadata(tuple(initial))

    async def maybe_status(
        status: pb.EchoStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        if status.code:
            await context.abort(grpc.StatusCode(_code(status.code)), status.message)

    def _code(number: int) -> tuple[int, str]:
        for code in grpc.StatusCode:
            if code.value[0] == number:
                return code.value
        return grpc.StatusCode.UNKNOWN.value

    class TestService(pb_grpc.TestServiceServicer):  # type: ignore[misc]
        async def EmptyCall(self, request, context):
            enter()
            try:
                await echo_metadata(context)
                return pb.Empty()
            finally:
                leave()

        async def UnaryCall(self, request, context):
            enter()
            try:
                # Compression is chosen before the initial metadata goes out.
                # (grpcio's servicer API does not tell whether the request
                # was compressed, so expect_compressed is not checked here.)
                # The server's default is gzip; an uncompressed answer opts out.
                if not request.response_compressed.value:
                    context.disable_next_message_compression()
                await echo_metadata(context)
                await maybe_status(request.response_status, context)
                if request.response_size == 7:
                    await asyncio.sleep(3600)  # the cancellation storm's slow unary
                return pb.SimpleResponse(payload=payload(request.response_size))
            finally:
                leave()

        async def StreamingOutputCall(self, request, context):
            enter()
            try:
                for params in request.response_parameters:
                    if params.interval_us:
                        await asyncio.sleep(params.interval_us / 1e6)
                    yield pb.StreamingOutputCallResponse(payload=payload(params.size))
                await maybe_status(request.response_status, context)
            finally:
                leave()

        async def StreamingInputCall(self, request_iterator, context):
            enter()
            try:
                total = 0
                async for request in request_iterator:
                    total += len(request.payload.body)
                return pb.StreamingInputCallResponse(aggregated_payload_size=total)
            finally:
                leave()

        async def FullDuplexCall(self, request_iterator, context):
            enter()
            try:
                await echo_metadata(context)
                async for request in request_iterator:
                    await maybe_status(request.response_status, context)
                    for params in request.response_parameters:
                        if params.interval_us:
                            await asyncio.sleep(params.interval_us / 1e6)
                        yield pb.StreamingOutputCallResponse(payload=payload(params.size))
            finally:
                leave()

    class Control(pb_grpc.ControlServicer):  # type: ignore[misc]
        async def Stats(self, request, context):
            return pb.ServerStats(active_calls=state["active"], calls_started=state["started"])

    server = grpc.aio.server(
        options=[("grpc.max_concurrent_streams", 1000)], compression=grpc.Compression.Gzip
    )
    pb_grpc.add_TestServiceServicer_to_server(TestService(), server)
    pb_grpc.add_ControlServicer_to_server(Control(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("grpc.testing.TestService", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("down", health_pb2.HealthCheckResponse.NOT_SERVING)
    plain = server.add_insecure_port("127.0.0.1:0")
    cert_bytes = Path(cert).read_bytes()  # noqa: ASYNC240 - start-up, before serving
    key_bytes = Path(key).read_bytes()  # noqa: ASYNC240
    tls = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(key_bytes, cert_bytes)])
    )
    await server.start()
    print(f"PORTS {plain} {tls}", flush=True)
    loop = asyncio.get_running_loop()
    # Flip "flip" between SERVING and NOT_SERVING so Watch sees changes.
    flips = asyncio.create_task(_flip(health_servicer, health_pb2))
    await loop.run_in_executor(None, sys.stdin.read)
    flips.cancel()
    await server.stop(0)


async def _flip(servicer, health_pb2) -> None:
    serving = True
    while True:
        await servicer.set(
            "flip",
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        serving = not serving
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
