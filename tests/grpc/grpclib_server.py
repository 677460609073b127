"""A subset of the interop server on grpclib (pure Python, asyncio), run as a subprocess.

``python grpclib_server.py GEN_DIR CERT KEY`` serves on two loopback ports
(plaintext and TLS with ALPN h2), prints ``PORTS <plain> <tls>`` and exits
when its standard input closes.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


async def main(gen_dir: str, cert: str, key: str) -> None:
    import ssl

    sys.path.insert(0, gen_dir)
    import interop_grpc
    import interop_pb2 as pb
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError
    from grpclib.server import Server

    def payload(size: int) -> Any:
        return pb.Payload(body=b"\0" * size)

    async def echo_metadata(stream: Any) -> None:
        initial = {}
        trailing = {}
        for key, value in (stream.metadata or {}).items():
            if key == "x-grpc-test-echo-initial":
                initial[key] = value
            elif key == "x-grpc-test-echo-trailing-bin":
                trailing[key] = value
        await stream.send_initial_metadata(metadata=initial)
        stream.trailing = trailing

    def check_status(status: Any) -> None:
        if status.code:
            raise GRPCError(Status(status.code), status.message)

    class TestService(interop_grpc.TestServiceBase):  # type: ignore[misc]
        async def EmptyCall(self, stream: Any) -> None:
            await stream.recv_message()
            await echo_metadata(stream)
            await stream.send_message(pb.Empty())
            await stream.send_trailing_metadata(metadata=stream.trailing)

        async def UnaryCall(self, stream: Any) -> None:
            request = await stream.recv_message()
            await echo_metadata(stream)
            check_status(request.response_status)
            await stream.send_message(pb.SimpleResponse(payload=payload(request.response_size)))
            await stream.send_trailing_metadata(metadata=stream.trailing)

        async def StreamingOutputCall(self, stream: Any) -> None:
            request = await stream.recv_message()
            for params in request.response_parameters:
                await stream.send_message(
                    pb.StreamingOutputCallResponse(payload=payload(params.size))
                )

        async def StreamingInputCall(self, stream: Any) -> None:
            total = 0
            async for request in stream:
                total += len(request.payload.body)
            await stream.send_message(pb.StreamingInputCallResponse(aggregated_payload_size=total))

        async def FullDuplexCall(self, stream: Any) -> None:
            await echo_metadata(stream)
            async for request in stream:
                check_status(request.response_status)
                for params in request.response_parameters:
                    await stream.send_message(
                        pb.StreamingOutputCallResponse(payload=payload(params.size))
                    )
            await stream.send_trailing_metadata(metadata=stream.trailing)

        async def HalfDuplexCall(self, stream: Any) -> None:
            raise GRPCError(Status.UNIMPLEMENTED)

        async def UnimplementedCall(self, stream: Any) -> None:
            raise GRPCError(Status.UNIMPLEMENTED)

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    servers = [Server([TestService()]), Server([TestService()])]
    await servers[0].start("127.0.0.1", 0)
    await servers[1].start("127.0.0.1", 0, ssl=context)
    ports = [s._server.sockets[0].getsockname()[1] for s in servers]  # type: ignore[union-attr]
    print(f"PORTS {ports[0]} {ports[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for server in servers:
        server.close()
        await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
