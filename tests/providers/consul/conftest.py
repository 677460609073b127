"""Shared helpers for the Consul provider tests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from nadisc_consul import ConsulProvider, ConsulSettings

from nadisc import ConnectionContext, ProviderFailure, ProviderSnapshot
from tests.fakes.consul import ConsulFake


@pytest.fixture(scope="session")
def self_signed_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A throw-away self-signed certificate for 127.0.0.1: (cert.pem, key.pem).

    Made with the ``openssl`` command line (a hard requirement of this test
    suite: its absence fails the test rather than skipping it)."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the openssl command is required for the TLS tests"
    folder = tmp_path_factory.mktemp("consul-tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    assert Path(cert).stat().st_size > 0 and Path(key).stat().st_size > 0
    return str(cert), str(key)


def context(**overrides: Any) -> ConnectionContext:
    values: dict[str, Any] = {
        "name": "primary",
        "request_timeout": 3.0,
        "max_instances_per_service": 4096,
        "max_response_bytes": 8 * 1024 * 1024,
    }
    values.update(overrides)
    return ConnectionContext(**values)


#: The fake fleets of these tests give every instance a catalog-unique ID,
#: and the tests name instances by it: they read identities in ``service``
#: scope. The default (``node``) is pinned by test_identity.py.
SERVICE_SCOPE = "service"


def in_process(
    fake: ConsulFake, *, ctx: ConnectionContext | None = None, **settings: Any
) -> ConsulProvider:
    """A provider talking to ``fake`` without sockets (MockClock friendly)."""
    settings.setdefault("identity_scope", SERVICE_SCOPE)
    return ConsulProvider(
        ctx or context(),
        ConsulSettings(url=fake.url, **settings),  # type: ignore[arg-type]
        transport=fake.transport(),
    )


def over_loopback(
    fake: ConsulFake, *, ctx: ConnectionContext | None = None, **settings: Any
) -> ConsulProvider:
    """A provider talking to a fake served on a real port."""
    settings.setdefault("identity_scope", SERVICE_SCOPE)
    return ConsulProvider(ctx or context(), ConsulSettings(url=fake.url, **settings))  # type: ignore[arg-type]


@dataclass
class RecordingSink:
    """An ObservationSink that keeps everything it was told."""

    published: list[ProviderSnapshot] = field(default_factory=list)
    failures: list[ProviderFailure] = field(default_factory=list)
    refreshes: int = 0
    events: list[str] = field(default_factory=list)
    _moved: anyio.Event = field(default_factory=anyio.Event)

    def _note(self, event: str) -> None:
        self.events.append(event)
        moved, self._moved = self._moved, anyio.Event()
        moved.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds (re-checked after every call)."""
        while not predicate():
            await self._moved.wait()

    def publish(self, snapshot: ProviderSnapshot) -> None:
        self.published.append(snapshot)
        self._note("publish")

    def fail(self, failure: ProviderFailure) -> None:
        self.failures.append(failure)
        self._note(f"fail:{type(failure).__name__}")

    def refresh(self) -> None:
        self.refreshes += 1
        self._note("refresh")
