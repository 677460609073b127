"""The example apps run as real processes and get SIGTERM.

For each example (Starlette on trio, plain ASGI on asyncio) and each
registry (real etcd, the Consul fake): start the process, find its record
in the registry, start a slow request and wait until its first line arrived
(it is inside the app), send SIGTERM, then check that

* the registry record is gone while the process is still running,
* the in-flight request then completes with 200 and its whole body,
* the process exits 0 after logging the close report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

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

    path = tmp_path / "discovery.json"
    path.write_text(json.dumps({"discovery": config.model_dump(mode="json")}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES[example]), str(path), "--allow-loopback"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        if not line.startswith("serving "):
            process.kill()
            raise AssertionError(f"no start line: {line!r}; {process.stderr.read()!r}")  # type: ignore[union-attr]
        bound = dict(item.split("=") for item in line.split()[1:])
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
        if process.poll() is None:
            process.kill()
            process.wait(5)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        if consul is not None:
            consul.__exit__(None, None, None)
    assert seen["alive_when_gone"], "the record must be gone before the process exits"
    assert seen["status"] == 200 and seen["body"] == b"started\nhello\n"
    assert code == 0, stderr
    assert "SIGTERM: shutting down" in stderr
    assert "host closed (SIGTERM)" in stderr and "web=deregistered" in stderr
