"""A throw-away dnsmasq on a loopback port for the dns provider tests.

The server answers authoritatively for ``example.test`` (unknown names there
are NXDOMAIN; names elsewhere are REFUSED because it has no upstream). Tests
rewrite its hosts file (``set_hosts`` + SIGHUP re-read) or its SRV records
and TTL (``configure`` restarts the process, as dnsmasq only reads those at
start). Under CI=true a missing dnsmasq binary fails the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import IN_CI

DOMAIN = "example.test"


def _dnsmasq_binary() -> str | None:
    found = shutil.which("dnsmasq")
    if found:
        return found
    for candidate in ("/usr/sbin/dnsmasq", "/usr/local/sbin/dnsmasq"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    # dnsmasq binds UDP and TCP on the port: find one free for both.
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free loopback port for dnsmasq")


@dataclass
class DnsServer:
    """One dnsmasq process; ``nameserver`` is its ``ip:port``."""

    binary: str
    workdir: Path
    port: int = field(default_factory=_free_port)
    ttl: int = 30
    srv: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def hosts_file(self) -> Path:
        return self.workdir / "hosts"

    @property
    def log_file(self) -> Path:
        return self.workdir / "dnsmasq.log"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def set_hosts(self, entries: Sequence[tuple[str, str]]) -> None:
        """Replace the A/AAAA data (address, name) and make dnsmasq re-read it."""
        self.hosts_file.write_text("".join(f"{addr} {name}\n" for addr, name in entries))
        if self.process is not None:
            reads = self._hosts_reads()
            self.process.send_signal(signal.SIGHUP)
            self._wait_for(lambda: self._hosts_reads() > reads, "re-reading the hosts file")

    def configure(self, *, srv: Sequence[str] | None = None, ttl: int | None = None) -> None:
        """Change SRV records (``srv-host`` values) or the TTL: restarts dnsmasq."""
        if srv is not None:
            self.srv = tuple(srv)
        if ttl is not None:
            self.ttl = ttl
        self.stop()
        self.start()

    def start(self) -> None:
        conf = self.workdir / "dnsmasq.conf"
        lines = [f"local=/{DOMAIN}/", f"local-ttl={self.ttl}", "log-queries"]
        lines += [f"srv-host={record}" for record in self.srv]
        conf.write_text("\n".join(lines) + "\n")
        if not self.hosts_file.exists():
            self.hosts_file.write_text("")
        args = [
            self.binary,
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--keep-in-foreground",
            f"--conf-file={conf}",
            "--pid-file=",
            f"--addn-hosts={self.hosts_file}",
            f"--log-facility={self.log_file}",
        ]
        if os.geteuid() == 0:
            args.append("--user=root")
        self.log_file.write_text("")
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self._wait_for(lambda: self._hosts_reads() > 0, "dnsmasq to start")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def _hosts_reads(self) -> int:
        try:
            return self.log().count(f"read {self.hosts_file}")
        except FileNotFoundError:
            return 0

    def _wait_for(self, condition: object, what: str) -> None:
        assert callable(condition)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if condition():
                return
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"dnsmasq exited ({self.process.returncode}): {err}")
            time.sleep(0.01)
        raise RuntimeError(f"timed out waiting for {what}")


@pytest.fixture
def dns_server(tmp_path: Path) -> Iterator[DnsServer]:
    binary = _dnsmasq_binary()
    if binary is None:
        message = "dnsmasq is not installed (Debian package dnsmasq-base)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)  # outside CI only; under CI=true the test fails above
    server = DnsServer(binary=binary, workdir=tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def closed_port() -> int:
    """A loopback UDP port with nobody listening."""
    return _free_port()
