"""Session fixtures of the gRPC tests: generated stubs, a TLS certificate, real servers.

``discovery`` opens the owner and discovery channel of the discovery
tests: an in-memory registry listing the given instances as service
``orders`` on connection ``primary``.

The stubs are generated from ``protos/interop.proto`` by ``grpcio-tools``
(and grpclib's plugin) into a temporary directory once per test process, so
the tree holds no generated code that lint and type checks would have to
skip. Each server is one subprocess per test process (xdist worker), started
on first use and stopped at the end of the session.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from benchmarks._grpc_server import serving
from nadisc import DiscoveryOwner, Instance
from nadisc.grpc import DiscoveryChannel, discovery_channel
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def grpc_gen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("grpc_gen")
    plugin = Path(sys.executable).parent / "protoc-gen-grpclib_python"
    args = [
        "protoc",
        f"-I{HERE / 'protos'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-grpclib_python={plugin}",
        f"--grpclib_python_out={out}",
        "interop.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("grpcio-tools could not generate the interop stubs")
    sys.path.insert(0, str(out))
    return out


@pytest.fixture(scope="session")
def pb(grpc_gen: Path) -> ModuleType:
    return importlib.import_module("interop_pb2")


@pytest.fixture(scope="session")
def pb_grpc(grpc_gen: Path) -> ModuleType:
    return importlib.import_module("interop_pb2_grpc")


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is needed for the TLS certificate (make servers)")
    out = tmp_path_factory.mktemp("grpc_tls")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TLSFiles(cert, key)


@dataclasses.dataclass(frozen=True)
class Server:
    plain: int
    tls: int | None
    tls_files: TLSFiles

    def target(self, transport: str) -> str:
        return f"127.0.0.1:{self.plain if transport == 'plain' else self.tls}"

    def ssl_context(self, transport: str) -> ssl.SSLContext | None:
        return self.tls_files.client_context() if transport == "tls" else None


def _start(argv: list[str], tls_files: TLSFiles) -> Iterator[Server]:
    with serving(argv) as ports:
        yield Server(ports[0], ports[1] if len(ports) > 1 else None, tls_files)


@pytest.fixture(scope="session")
def grpcio_server(grpc_gen: Path, tls_files: TLSFiles) -> Iterator[Server]:
    yield from _start(
        [
            sys.executable,
            str(HERE / "interop_server.py"),
            str(grpc_gen),
            str(tls_files.cert),
            str(tls_files.key),
        ],
        tls_files,
    )


@pytest.fixture(scope="session")
def grpclib_server(grpc_gen: Path, tls_files: TLSFiles) -> Iterator[Server]:
    yield from _start(
        [
            sys.executable,
            str(HERE / "grpclib_server.py"),
            str(grpc_gen),
            str(tls_files.cert),
            str(tls_files.key),
        ],
        tls_files,
    )


@pytest.fixture(params=["plain", "tls"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: The service the ``discovery`` fixture lists its instances under.
SERVICE = "orders"


class Discovered(NamedTuple):
    owner: DiscoveryOwner
    channel: DiscoveryChannel
    memory: MemoryProvider


Opener = Callable[..., AbstractAsyncContextManager[Discovered]]


@pytest.fixture
def discovery() -> Opener:
    """``async with discovery(*instances, watch=False, **channel_options) as (owner, channel,
    memory):`` a prepared owner whose connection ``primary`` lists ``instances`` as
    :data:`SERVICE` (``watch``: changes are pushed), and a discovery channel for it."""

    @asynccontextmanager
    async def open_discovery(
        *instances: Instance, watch: bool = False, **options: Any
    ) -> AsyncIterator[Discovered]:
        memory = MemoryProvider(services={SERVICE: SERVICE})
        memory.set(SERVICE, instances)
        if watch:
            memory.set_watch(True)
        async with (
            memory_owner({"primary": memory}) as owner,
            discovery_channel(owner, "primary", SERVICE, **options) as channel,
        ):
            yield Discovered(owner, channel, memory)

    return open_discovery
