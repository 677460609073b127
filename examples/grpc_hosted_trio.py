"""A gRPC server hosted on trio: bind, register with the gRPC metadata, drain on SIGTERM.

    python examples/grpc_hosted_trio.py CONFIG.yaml [--host 127.0.0.1] [--port 0]
        [--advertised-host 10.0.0.5] [--allow-loopback]

Generates ``echo_pb2`` / ``echo_pb2_grpc`` from ``examples/protos/echo.proto``
(as a build step would; needs ``grpcio-tools``) and serves the ``Echo``
service on the listener ``grpc`` with ``nadisc.hosting``: a grpcio server
with the standard health service. The config's registrations that name
``listener_ref: grpc`` advertise the bound port and carry the gRPC protocol
metadata, so ``nadisc.grpc.discovery_channel`` dials them with no
``DiscoveryProtocol`` (see ``examples/grpc_discovery_trio.py`` for the
calling side). On SIGTERM or SIGINT: health NOT_SERVING and deregister, the
grace, ``server.stop(grace)``, then exit with the close report logged.

Exit code: 0 when the shutdown was clean (``HostReport.clean``: every
registration removed, no RPC abandoned, no thread left, within the budget),
1 when it was not (the close report, logged as a warning, says why) or when
the startup failed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import trio

import nadisc
from nadisc.hosting import Bind, GrpcServe, Host, serve

PROTOS = Path(__file__).parent / "protos"


def generate(out: Path) -> tuple[ModuleType, ModuleType]:
    """The build step: grpcio-tools writes the echo stubs into ``out``."""
    from grpc_tools import protoc

    argv = [
        "protoc",
        f"-I{PROTOS}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "echo.proto",
    ]
    if protoc.main(argv) != 0:
        raise SystemExit("grpcio-tools could not generate the echo stubs")
    sys.path.insert(0, str(out))
    return importlib.import_module("echo_pb2"), importlib.import_module("echo_pb2_grpc")


def echo_servicer(pb: ModuleType, pb_grpc: ModuleType, name: str) -> Any:
    class Echo(pb_grpc.EchoServicer):  # type: ignore[misc,name-defined]
        # A plain function: the host runs servicers on grpcio's thread pool.
        def Say(self, request: Any, context: Any) -> Any:
            return pb.EchoReply(text=request.text, server=name)

    return Echo()


async def main(argv: list[str], pb: ModuleType, pb_grpc: ModuleType) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertised-host")
    parser.add_argument("--allow-loopback", action="store_true")
    parser.add_argument("--drain-timeout-ms", type=int, default=10_000)
    args = parser.parse_args(argv)
    config = nadisc.load_config_file(args.config)
    servicer = echo_servicer(pb, pb_grpc, f"pid {os.getpid()}")
    grpc = Bind(
        args.host,
        args.port,
        advertised_host=args.advertised_host,
        grpc=GrpcServe(servicers=[(pb_grpc.add_EchoServicer_to_server, servicer)]),
    )
    async with trio.open_nursery() as nursery:
        host: Host = await nursery.start(
            lambda task_status: serve(
                None,
                config,
                listeners={"grpc": grpc},
                allow_loopback=args.allow_loopback,
                drain_timeout_ms=args.drain_timeout_ms,
                task_status=task_status,
            )
        )
        if host.shutting_down:  # a signal came during the startup
            print("stopping before the startup completed", flush=True)
        else:
            bound = " ".join(f"{n}={h}:{p}" for n, (h, p) in host.bound.items())
            print("serving", bound, flush=True)
    report = host.report
    assert report is not None
    steps = report.grpc["grpc"]
    logging.getLogger("example").info(
        "gRPC listener stopped: %d RPCs, %d in flight at stop, %d abandoned",
        steps.rpcs,
        steps.in_flight_at_stop,
        steps.abandoned,
    )
    return 0 if report.clean else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as out:
        pb, pb_grpc = generate(Path(out))
        sys.exit(trio.run(main, sys.argv[1:], pb, pb_grpc))
