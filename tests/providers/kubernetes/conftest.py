"""Shared helpers for the Kubernetes provider tests: fake objects, kubeconfigs, sinks."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access

from nadisc import ConnectionContext, ProviderFailure, ProviderSnapshot
from tests.fakes.kubernetes import KubernetesFake, slice_object

IN_CI = os.environ.get("CI", "").lower() == "true"
TOKEN = "token-of-alice"


def endpoint(
    n: int,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zone: str = "zone-a",
    **extra: Any,
) -> dict[str, Any]:
    """An endpoint of Pod ``orders-<n>`` at 10.0.0.<n>."""
    conditions: dict[str, Any] = {}
    for key, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if value is not None:
            conditions[key] = value
    return {
        "addresses": [f"10.0.0.{n}"],
        "conditions": conditions,
        "nodeName": f"node-{n % 3}",
        "zone": zone,
        "targetRef": {
            "kind": "Pod",
            "namespace": "default",
            "name": f"orders-{n}",
            "uid": f"pod-{n}",
        },
        **extra,
    }


def owned_slice(
    fake: KubernetesFake, name: str, *pods: int, service: str = "orders", **kw: Any
) -> dict[str, Any]:
    """A slice of ``service`` owned by its current UID, with ready endpoints for ``pods``."""
    endpoints = kw.pop("endpoints", None) or [endpoint(n) for n in pods]
    return fake.put_slice(
        slice_object(name, service, endpoints, owner_uid=fake.service_uid(service), **kw)
    )


def write_kubeconfig(
    path: Path,
    server: str,
    *,
    token: str | None = TOKEN,
    token_file: str | None = None,
    ca_file: str | None = None,
    user: dict[str, Any] | None = None,
    namespace: str = "default",
) -> Path:
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority"] = ca_file
    body = dict(user or {})
    if token is not None and "token" not in body and token_file is None:
        body["token"] = token
    if token_file is not None:
        body["tokenFile"] = token_file
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": cluster}],
                "users": [{"name": "alice", "user": body}],
                "contexts": [
                    {
                        "name": "fake",
                        "context": {"cluster": "fake", "user": "alice", "namespace": namespace},
                    }
                ],
                "current-context": "fake",
            }
        )
    )
    return path


def context(**overrides: Any) -> ConnectionContext:
    values: dict[str, Any] = {
        "name": "primary",
        "request_timeout": 3.0,
        "max_instances_per_service": 4096,
        "max_response_bytes": 8 * 1024 * 1024,
    }
    values.update(overrides)
    return ConnectionContext(**values)


def in_process(
    fake: KubernetesFake,
    tmp_path: Path,
    *,
    ctx: ConnectionContext | None = None,
    token: str | None = TOKEN,
    **settings: Any,
) -> KubernetesProvider:
    """A provider talking to ``fake`` without sockets (MockClock friendly)."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url, token=token)
    settings.setdefault("services", {"orders": {"name": "orders", "port": "http"}})
    parsed = KubernetesSettings.model_validate(
        {"credentials": "kubeconfig", "kubeconfig": str(kubeconfig), **settings}
    )
    return KubernetesProvider(
        ctx or context(), parsed, access=resolve_access(parsed, {}), transport=fake.transport()
    )


@dataclass
class RecordingSink:
    """An ObservationSink that keeps everything it was told."""

    published: list[ProviderSnapshot] = field(default_factory=list)
    failures: list[ProviderFailure] = field(default_factory=list)
    refreshes: int = 0
    _moved: anyio.Event = field(default_factory=anyio.Event)

    def _note(self) -> None:
        moved, self._moved = self._moved, anyio.Event()
        moved.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._moved.wait()

    def publish(self, snapshot: ProviderSnapshot) -> None:
        self.published.append(snapshot)
        self._note()

    def fail(self, failure: ProviderFailure) -> None:
        self.failures.append(failure)
        self._note()

    def refresh(self) -> None:
        self.refreshes += 1
        self._note()

    @property
    def identities(self) -> tuple[str, ...]:
        return self.published[-1].identities() if self.published else ()


@pytest.fixture(scope="session")
def self_signed_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A throw-away self-signed certificate for 127.0.0.1 (the openssl command is required)."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the openssl command is required for the TLS tests"
    folder = tmp_path_factory.mktemp("kubernetes-tls")
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
    return str(cert), str(key)


@asynccontextmanager
async def watching(
    fake: KubernetesFake, tmp_path: Path, *, pods: tuple[int, ...] = (1,), **settings: Any
) -> AsyncIterator[tuple[KubernetesProvider, RecordingSink]]:
    """A watch of ``orders`` (created with an owned slice of ``pods``) running
    until the block ends: the scaffolding every watch row repeats."""
    fake.create_service("orders")
    owned_slice(fake, "orders-a", *pods)
    provider = in_process(fake, tmp_path, **settings)
    sink = RecordingSink()
    async with anyio.create_task_group() as group:
        await group.start(provider.watch, "orders", sink)
        yield provider, sink
        group.cancel_scope.cancel()
