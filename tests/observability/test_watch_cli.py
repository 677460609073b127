"""``nadisc watch`` as a real process on a pseudo-terminal, against the Consul fake.

The table is drawn, then redrawn in place (ANSI home + clear) when an
instance is registered in the fake: revision, evidence, age and the
instance count move.
"""

# Polling here waits on other processes or on a server's side effects,
# which no single event covers.
# ruff: noqa: ASYNC109, ASYNC110, ASYNC220

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import yaml

from tests.fakes.consul import run_consul_fake
from tests.observability.support import orders_instance

pytestmark = [pytest.mark.trio_only, pytest.mark.real_server]

CLEAR = "\x1b[H\x1b[2J"


def write_config(path: Path, url: str) -> Path:
    document = {
        "discovery": {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "consul",
                    "consul": {
                        "url": url,
                        "token": "${CONSUL_TOKEN}",
                        "watch_rate": 100,
                        "watch_burst": 20,
                        "services": {"orders": {"name": "orders"}},
                    },
                }
            },
        }
    }
    path.write_text(yaml.safe_dump(document))
    return path


async def read_until(fd: int, seen: list[str], predicate: object, timeout: float = 20) -> str:
    with trio.fail_after(timeout):
        while True:
            text = "".join(seen)
            if predicate(text):  # type: ignore[operator]
                return text
            await trio.lowlevel.wait_readable(fd)
            try:
                seen.append(os.read(fd, 65536).decode(errors="replace"))
            except OSError:
                return "".join(seen)


async def test_watch_redraws_the_table_on_a_pseudo_terminal(tmp_path: Path) -> None:
    async with run_consul_fake() as fake:
        config = write_config(tmp_path / "app.yaml", fake.url)
        main, child = pty.openpty()
        env = dict(os.environ, CONSUL_TOKEN="tok-not-shown-4711", COLUMNS="120")
        process = subprocess.Popen(
            [sys.executable, "-m", "nadisc._cli", "watch", str(config), "orders", "--updates", "2"],
            stdin=child,
            stdout=child,
            stderr=child,
            env=env,
            close_fds=True,
        )
        os.close(child)
        seen: list[str] = []
        try:
            first = await read_until(main, seen, lambda t: CLEAR in t and "orders" in t)
            assert "CONNECTION" in first and "INSTANCES" in first
            assert "unavailable: empty" in first
            fake.register(orders_instance(1), now=trio.current_time())
            text = await read_until(
                main, seen, lambda t: t.count(CLEAR) >= 2 and "registry_health" in t
            )
            last = text.rsplit(CLEAR, 1)[1]
            lines = last.strip().splitlines()
            assert lines[0].split() == [
                "CONNECTION",
                "SERVICE",
                "REV",
                "EVIDENCE",
                "AGE",
                "INSTANCES",
                "LAST",
                "ERROR",
            ]
            cells = lines[1].split()
            assert cells[:2] == ["primary", "orders"]
            assert cells[3] == "registry_health" and cells[5] == "1" and cells[6] == "-"
            assert cells[4].endswith("/15s")
            assert "tok-not-shown-4711" not in text
            with trio.fail_after(20):
                while process.poll() is None:
                    await trio.sleep(0.05)
            assert process.returncode == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            os.close(main)
