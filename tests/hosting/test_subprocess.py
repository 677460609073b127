"""The example apps run as real processes and get SIGTERM.

For each example (Starlette on trio, plain ASGI on asyncio) and each
registry (real etcd, the Consul fake): start the process, find its record
in the registry, start a slow request and wait until its first line arrived
(it is inside the app), send SIGTERM, then check that

* the registry record is gone while the process is still running,
* the in-flight request then completes with 200 and its whole body,
* the process exits 0 after logging the close report.

The gRPC example (``examples/grpc_hosted_trio.py``) on real etcd: a
discovery channel dials its record with no ``DiscoveryProtocol``, and
SIGTERM removes the record before the process exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from nadisc import DiscoveryConfig
from tests.hosting.support import (
    ThreadedConsul,
    consul_addresses,
    consul_config,
    etcd_addresses,
    etcd_config,
    run_on,
    unique_prefix,
)
from tests.providers.etcd.conftest import EtcdServer

pytestmark = pytest.mark.real_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "starlette-trio": ROOT / "examples" / "starlette_trio.py",
    "asgi-asyncio": ROOT / "examples" / "plain_asgi_asyncio.py",
}
GRPC_EXAMPLE = ROOT / "examples" / "grpc_hosted_trio.py"


@contextlib.contextmanager
def running(
    script: Path, config: DiscoveryConfig, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str]]]:
    """``script CONFIG --allow-loopback`` as a process; its listeners from the
    ``serving name=host:port ...`` line. Killed at the end if still running."""
    path = tmp_path / "discovery.json"
    path.write_text(json.dumps({"discovery": config.model_dump(mode="json")}))
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), "--allow-loopback"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        if not line.startswith("serving "):
            process.kill()
            raise AssertionError(f"no start line: {line!r}; {process.stderr.read()!r}")  # type: ignore[union-attr]
        yield process, dict(item.split("=") for item in line.split()[1:])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.parametrize("registry", ["etcd", "consul"])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_sigterm_deregisters_before_exit_and_the_in_flight_request_completes(
    example: str, registry: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    consul: ThreadedConsul | None = None
    if registry == "etcd":
        server: EtcdServer = request.getfixturevalue("etcd_server")
        prefix = unique_prefix()
        config = etcd_config(server.url, prefix)

        async def addresses() -> list[str]:
            return await etcd_addresses(server.url, prefix)

    else:
        consul = ThreadedConsul().__enter__()
        config = consul_config(consul.url, check_path=None)
        url = consul.url

        async def addresses() -> list[str]:
            return await consul_addresses(url)

    try:
        with running(EXAMPLES[example], config, tmp_path) as (process, bound):
            web = bound["web"]
            seen: dict[str, Any] = {}

            async def scenario() -> None:
                assert await addresses() == [web]
                async with (
                    httpx.AsyncClient(trust_env=False, timeout=10) as http,
                    http.stream("GET", f"http://{web}/slow/800") as answer,
                ):
                    chunks = answer.aiter_raw()
                    first = await chunks.__anext__()
                    assert first.startswith(b"started")  # inside the app now
                    process.send_signal(signal.SIGTERM)
                    with anyio.fail_after(10):
                        while await addresses():  # noqa: ASYNC110 - polling a registry
                            await anyio.sleep(0.02)
                    seen["alive_when_gone"] = process.poll() is None
                    rest = b"".join([chunk async for chunk in chunks])
                    seen["status"] = answer.status_code
                    seen["body"] = first + rest

            run_on("trio", scenario)
            code = process.wait(15)
            stderr = process.stderr.read().decode() if process.stderr else ""
    finally:
        if consul is not None:
            consul.__exit__(None, None, None)
    assert seen["alive_when_gone"], "the record must be gone before the process exits"
    assert seen["status"] == 200 and seen["body"] == b"started\nhello\n"
    assert code == 0, stderr
    assert "SIGTERM: shutting down" in stderr
    assert "host closed (SIGTERM)" in stderr and "web=deregistered" in stderr


def test_the_grpc_example_registers_with_the_grpc_metadata_and_drains_on_sigterm(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    # examples/grpc_hosted_trio.py as a process on real etcd: its record is
    # dialled by a discovery channel with no DiscoveryProtocol (so it carries
    # the gRPC metadata), answers through the generated stub, and is gone
    # before the process exits 0 on SIGTERM.
    import importlib.util

    from nadisc import open_discovery
    from nadisc._grpc_protocol import GRPC_TLS_KEY
    from nadisc.grpc import discovery_channel
    from tests.hosting.test_rolling_restart import caller_config

    spec = importlib.util.spec_from_file_location("grpc_hosted_trio", GRPC_EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    (tmp_path / "gen").mkdir()
    pb, pb_grpc = example.generate(tmp_path / "gen")
    prefix = unique_prefix()
    config = etcd_config(etcd_server.url, prefix, registration={"listener_ref": "grpc"})
    seen: dict[str, Any] = {}
    with running(GRPC_EXAMPLE, config, tmp_path) as (process, bound):

        async def scenario() -> None:
            assert await etcd_addresses(etcd_server.url, prefix) == [bound["grpc"]]
            async with (
                open_discovery(caller_config(config, {})) as caller,
                discovery_channel(caller, "primary", "self") as channel,
            ):
                observation = await caller.client("primary").observe("self")
                (instance,) = observation.snapshot().instances
                seen["metadata"] = dict(instance.metadata)
                reply = await pb_grpc.EchoStub(channel).Say(pb.EchoRequest(text="hi"), timeout=5)
                seen["reply"] = (reply.text, reply.server)
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                while await etcd_addresses(etcd_server.url, prefix):  # noqa: ASYNC110 - polling a registry
                    await anyio.sleep(0.02)
            seen["alive_when_gone"] = process.poll() is None

        run_on("trio", scenario)
        code = process.wait(15)
        stderr = process.stderr.read().decode() if process.stderr else ""
    assert seen["metadata"][GRPC_TLS_KEY] == "plaintext"
    assert seen["reply"] == ("hi", f"pid {process.pid}")
    assert seen["alive_when_gone"], "the record must be gone before the process exits"
    assert code == 0, stderr
    assert "host closed (SIGTERM)" in stderr and "web=deregistered" in stderr
    assert "gRPC listener stopped: 1 RPCs" in stderr
