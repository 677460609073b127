"""Real etcd servers for the provider tests.

``etcd_server`` is one throw-away etcd per test session; ``own_etcd`` starts
a private one for a test that stops, restarts, compacts or locks down its
server. Both listen on free loopback ports with a temporary data dir and are
stopped at teardown. Under ``CI=true`` a missing ``etcd`` binary fails the
test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from nadisc_etcd import EtcdProvider, EtcdSettings

from nadisc import ConnectionContext, ProviderFailure, ProviderSnapshot

from . import owner_helpers

IN_CI = os.environ.get("CI", "").lower() == "true"
#: Runs a test once per wire (its ``wire`` argument overrides the fixture).
both_wires = pytest.mark.parametrize("wire", ["json", "grpc"])
ETCD = shutil.which("etcd")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PortTaken(RuntimeError):
    """Another process holds a port this etcd was to listen on."""


class EtcdServer:
    """One etcd process on loopback, restartable on the same data dir and ports."""

    def __init__(self, binary: str, root: Path, *, progress_notify: str = "1s") -> None:
        self.binary = binary
        self.root = root
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.progress_notify = progress_notify
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", "default",
            "--data-dir", str(self.root / "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--heartbeat-interval", "20",
            "--election-timeout", "200",
            "--experimental-watch-progress-notify-interval", self.progress_notify,
            "--logger", "zap",
            "--log-outputs", str(self.root / "etcd.log"),
            "--log-level", "warn",
        ]  # fmt: skip

    def start(self, timeout: float = 15.0) -> None:
        env = dict(os.environ)
        if platform.machine() in ("aarch64", "arm64"):
            env["ETCD_UNSUPPORTED_ARCH"] = "arm64"
        self.process = subprocess.Popen(
            self._command(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.starts += 1
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if self.process.poll() is not None:
                log = (self.root / "etcd.log").read_text(errors="replace")[-2000:]
                error = PortTaken if "address already in use" in log else RuntimeError
                raise error(f"etcd exited with {self.process.returncode}: {log}")
            try:
                answer = httpx.post(f"{self.url}/v3/maintenance/status", content=b"{}", timeout=1)
                if answer.status_code == 200 and json.loads(answer.content).get("leader"):
                    # A leader is elected, but a linearizable read waits until
                    # it committed an entry of its own term (a WAL fsync that a
                    # busy disk can hold up). Ready means that read answers.
                    answer = httpx.post(
                        f"{self.url}/v3/kv/range", content=b'{"key": "AA=="}', timeout=5
                    )
                    if answer.status_code == 200 and self._answers_as_ours():
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become ready within {timeout} s")

    def _answers_as_ours(self) -> bool:
        """Whether the etcd answering on our client port is the one we started.

        A free port is picked by binding to port 0 and closing, so another
        worker's etcd can take the same port before ours binds it. Ours then
        exits on the bind error, perhaps only after the other one answered
        the readiness probe, and a test would pause or kill a server that
        is not the one it talks to. Each server's member list names its own
        peer port, which settles whose it is.
        """
        answer = httpx.post(f"{self.url}/v3/cluster/member/list", content=b"{}", timeout=5)
        peers = [url for m in answer.json().get("members", []) for url in m.get("peerURLs", [])]
        if f"http://127.0.0.1:{self.peer_port}" not in peers:
            raise PortTaken(f"another etcd answers on {self.url} (peers {peers})")
        return self.process is not None and self.process.poll() is None

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, returning once every thread of etcd has stopped.

        ``kill`` only queues the signal: a thread running on another CPU
        can still answer a request sent right after it returns. A test that
        pauses the server and then sends must not race that window, so this
        waits until ``/proc`` shows each thread in the stopped state.
        """
        assert self.process is not None and self.process.poll() is None, "etcd is not running"
        self.process.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        until = time.monotonic() + timeout
        while not _all_stopped(tasks):
            if time.monotonic() > until:
                raise RuntimeError(f"etcd did not stop within {timeout} s of SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no goodbye to clients (the data dir survives)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None


def _all_stopped(tasks: Path) -> bool:
    """Whether every thread under ``/proc/<pid>/task`` is stopped (``T``)."""
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread exited meanwhile
            continue
        # The state follows the command name, which is in parentheses and
        # may itself hold spaces or parentheses: read after the last ')'.
        if stat[stat.rindex(")") + 2] not in "tT":
            return False
    return True


def _require_etcd() -> str:
    if ETCD is None:
        message = "the etcd binary is not installed (apt-get install etcd-server)"
        if IN_CI:
            pytest.fail(f"{message}; CI=true requires the real server", pytrace=False)
        pytest.skip(message)  # outside CI only; under CI=true the test fails above
    return ETCD


def _started(binary: str, root: Path) -> EtcdServer:
    """An etcd started on fresh ports, picked again while another process takes them."""
    for attempt in range(3):
        data = root / f"try-{attempt}"
        data.mkdir()
        server = EtcdServer(binary, data)
        try:
            server.start()
        except PortTaken:
            server.stop()
            continue
        return server
    raise RuntimeError("three pairs of free ports were each taken before etcd could bind them")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """The session's shared etcd (tests isolate themselves by key prefix)."""
    binary = _require_etcd()
    with tempfile.TemporaryDirectory(prefix="nadisc-etcd-") as root:
        server = _started(binary, Path(root))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """A private etcd for tests that stop, restart or lock down their server."""
    binary = _require_etcd()
    with tempfile.TemporaryDirectory(prefix="nadisc-etcd-own-") as root:
        server = _started(binary, Path(root))
        try:
            yield server
        finally:
            server.stop()


class RawEtcd:
    """Test-side writes through the plain gateway (independent of the provider)."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http
        self.token: str | None = None

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": self.token} if self.token else {}
        answer = await self.http.post(f"{self.url}{path}", json=body, headers=headers)
        payload: dict[str, Any] = answer.json()
        if answer.status_code != 200:
            raise AssertionError(f"{path} -> {answer.status_code}: {payload}")
        return payload

    @staticmethod
    def b64(text: str | bytes) -> str:
        data = text.encode() if isinstance(text, str) else text
        return base64.b64encode(data).decode()

    async def put(self, key: str, value: str | bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": self.b64(key), "value": self.b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def put_record(self, key: str, addr: str, metadata: object = None) -> int:
        document: dict[str, object] = {"Op": 0, "Addr": addr}
        if metadata is not None:
            document["Metadata"] = metadata
        return await self.put(key, json.dumps(document))

    async def delete(self, key: str) -> int:
        answer = await self.call("/v3/kv/deleterange", {"key": self.b64(key)})
        return int(answer["header"]["revision"])

    async def get(self, key: str) -> list[dict[str, Any]]:
        answer = await self.call("/v3/kv/range", {"key": self.b64(key)})
        kvs: list[dict[str, Any]] = answer.get("kvs", [])
        return kvs

    async def revision(self) -> int:
        answer = await self.call("/v3/kv/range", {"key": self.b64("\x00"), "count_only": True})
        return int(answer["header"]["revision"])

    async def compact(self, revision: int) -> None:
        """Compact the history up to ``revision``; done when it already is.

        The gateway forwards the call over its own gRPC connection, which a
        server just resumed from SIGSTOP may have to re-establish: the
        compaction can then be applied and answered as "already compacted".
        Either way the history is compacted up to ``revision``."""
        headers = {"Authorization": self.token} if self.token else {}
        body = {"revision": str(revision), "physical": True}
        answer = await self.http.post(f"{self.url}/v3/kv/compaction", json=body, headers=headers)
        payload: dict[str, Any] = answer.json()
        if answer.status_code == 200:
            return
        if "required revision has been compacted" in str(payload.get("message")):
            return  # etcd says so only for a revision at or below its compacted one
        raise AssertionError(f"/v3/kv/compaction -> {answer.status_code}: {payload}")

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def authenticate(self, name: str, password: str) -> None:
        answer = await self.call("/v3/auth/authenticate", {"name": name, "password": password})
        self.token = str(answer["token"])


@pytest.fixture
async def raw_factory() -> AsyncIterator[Callable[[EtcdServer], RawEtcd]]:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        yield lambda server: RawEtcd(server.url, http)


@pytest.fixture
def raw(etcd_server: EtcdServer, raw_factory: Callable[[EtcdServer], RawEtcd]) -> RawEtcd:
    return raw_factory(etcd_server)


class RecordingSink:
    """An ObservationSink that remembers everything and lets a test wait for it."""

    def __init__(self) -> None:
        self.events: list[ProviderSnapshot | ProviderFailure | str] = []
        self.publishes: list[ProviderSnapshot] = []
        self.failures: list[ProviderFailure] = []
        self.refreshes = 0
        self._changed = anyio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def publish(self, snapshot: ProviderSnapshot) -> None:
        self.events.append(snapshot)
        self.publishes.append(snapshot)
        self._wake()

    def fail(self, failure: ProviderFailure) -> None:
        self.events.append(failure)
        self.failures.append(failure)
        self._wake()

    def refresh(self) -> None:
        self.events.append("refresh")
        self.refreshes += 1
        self._wake()

    @property
    def latest(self) -> ProviderSnapshot:
        return self.publishes[-1]

    def ids(self) -> set[str]:
        """The newest snapshot's instance ids (empty before the first one)."""
        return set(self.latest.identities()) if self.publishes else set()

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        with anyio.fail_after(within):
            while not predicate():
                await self._changed.wait()


def make_context(**overrides: Any) -> ConnectionContext:
    values: dict[str, Any] = {
        "name": "test",
        "request_timeout": 1.0,
        "max_instances_per_service": 4096,
        "max_response_bytes": 4 * 1024 * 1024,
    }
    values.update(overrides)
    return ConnectionContext(**values)


ProviderMaker = Callable[..., EtcdProvider]


@pytest.fixture
def wire() -> str:
    """The provider's ``wire`` (``both_wires`` parametrizes it)."""
    return owner_helpers.DEFAULT_WIRE


@pytest.fixture(autouse=True)
def _helpers_use_the_wire(wire: str) -> Iterator[None]:
    """The owner-level helpers' configs and providers use the test's wire."""
    owner_helpers.WIRE = wire
    yield
    owner_helpers.WIRE = owner_helpers.DEFAULT_WIRE


@pytest.fixture
async def make_provider(wire: str) -> AsyncIterator[ProviderMaker]:
    """Build providers against a server with a unique prefix; closes them at teardown.

    ``make_provider(server_or_url, context=..., **settings)``, on the test's ``wire``.
    """
    made: list[EtcdProvider] = []

    def build(
        server: EtcdServer | str, *, context: ConnectionContext | None = None, **settings: Any
    ) -> EtcdProvider:
        url = server if isinstance(server, str) else server.url
        values: dict[str, Any] = {
            "endpoints": [url],
            "prefix": f"t-{uuid.uuid4().hex[:10]}/services",
            "probe_interval_ms": 300,
            "retry_initial_backoff_ms": 100,
            "retry_max_backoff_ms": 400,
            "connect_timeout_ms": 500,
            "wire": wire,
        }
        values.update(settings)
        provider = EtcdProvider(context or make_context(), EtcdSettings(**values))
        made.append(provider)
        return provider

    yield build
    for provider in made:
        await provider.aclose()
