"""Shared setup for the owner-level tests against a real etcd (not a test module).

Configs put one ``etcd`` connection named ``primary`` on a unique key prefix
with short timings (request timeout 500 ms, probes every 300 ms, retries
from 100 ms), so every fault shows within a second or two.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
from nadisc_etcd import EtcdProvider, EtcdSettings

from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryOwner,
    EvidenceUnavailable,
    Observation,
    ObservationSnapshot,
    RegistrationStatus,
)

#: The wire a test uses unless it is parametrized over both
#: (``NADISC_ETCD_TEST_WIRE=grpc`` runs every etcd test over gRPC).
DEFAULT_WIRE = os.environ.get("NADISC_ETCD_TEST_WIRE", "json")
#: The wire of the test running now (set by an autouse fixture of conftest).
WIRE = DEFAULT_WIRE

#: The address registrations in these tests advertise (nothing dials it).
WEB = ("10.0.0.5", 18080)


P = TypeVar("P", bound=EtcdProvider)


def injected_provider(
    cls: type[P], url: str, prefix: str, *, request_timeout: float = 0.5, **etcd: Any
) -> P:
    """A provider object for ``providers=`` (so a test can read its state)."""
    context = ConnectionContext(
        name="primary",
        request_timeout=request_timeout,
        max_instances_per_service=4096,
        max_response_bytes=4 * 1024 * 1024,
    )
    return cls(context, EtcdSettings.model_validate(etcd_block(url, prefix, **etcd)))


def unique_prefix() -> str:
    return f"o-{uuid.uuid4().hex[:10]}/services"


def etcd_block(url: str, prefix: str, **overrides: Any) -> dict[str, Any]:
    block: dict[str, Any] = {
        "endpoints": [url],
        "prefix": prefix,
        "probe_interval_ms": 300,
        "retry_initial_backoff_ms": 100,
        "retry_max_backoff_ms": 400,
        "connect_timeout_ms": 300,
        "ttl_seconds": 3,
        "services": {"orders": {"name": "orders"}, "self": {"name": "order-api"}},
        "wire": WIRE,
    }
    block.update(overrides)
    return block


def etcd_config(
    url: str,
    prefix: str,
    *,
    etcd: Mapping[str, Any] | None = None,
    registrations: Mapping[str, Mapping[str, Any]] | None = None,
    limits: Mapping[str, Any] | None = None,
    shutdown_timeout_ms: int = 4000,
    **connection: Any,
) -> DiscoveryConfig:
    """One ``primary`` etcd connection; ``connection`` overrides its policy fields."""
    policy: dict[str, Any] = {
        "provider": "etcd",
        "request_timeout_ms": 500,
        "poll_interval_ms": 1000,
        "snapshot": {"max_age_ms": 3000, "stale_if_error_ms": 1500},
        "retry": {"initial_backoff_ms": 100, "max_backoff_ms": 400},
        "monitor_interval_ms": 1000,
        "observation_grace_ms": 3000,
        "deregister_timeout_ms": 1000,
        "etcd": etcd_block(url, prefix, **(etcd or {})),
    }
    policy.update(connection)
    document: dict[str, Any] = {
        "enabled": True,
        "connections": {"primary": policy},
        "shutdown_timeout_ms": shutdown_timeout_ms,
    }
    if limits:
        document["limits"] = dict(limits)
    if registrations:
        document["registrations"] = {name: dict(spec) for name, spec in registrations.items()}
    return DiscoveryConfig.model_validate(document)


def web_registration(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "service_name": "self",
        "listener_ref": "web",
        "ip": WEB[0],
        "port": WEB[1],
    }
    spec.update(overrides)
    return spec


def soon(seconds: float = 3.0) -> float:
    return anyio.current_time() + seconds


Look = ObservationSnapshot | EvidenceUnavailable


def look(observation: Observation, *, strict: bool = False) -> Look:
    """The observation's answer now: a usable snapshot or the refusal."""
    try:
        return observation.snapshot(strict=strict)
    except EvidenceUnavailable as exc:
        return exc


def ids(answer: Look) -> set[str] | None:
    """Identities served, or None when the observation refuses."""
    if isinstance(answer, EvidenceUnavailable):
        return None
    return set(answer.identities())


def reason(answer: Look) -> str | None:
    return answer.reason if isinstance(answer, EvidenceUnavailable) else None


async def wait_for(
    observation: Observation, predicate: Callable[[Look], bool], within: float = 5.0
) -> Look:
    """Wait on ``changed()`` until the observation's answer satisfies ``predicate``."""
    deadline = anyio.current_time() + within
    while True:
        answer = look(observation)
        if predicate(answer):
            return answer
        await observation.changed(deadline)


async def wait_status(
    owner: DiscoveryOwner,
    name: str,
    predicate: Callable[[RegistrationStatus], bool],
    within: float = 5.0,
) -> RegistrationStatus:
    """Poll a registration's status (states also follow from time alone)."""
    with anyio.fail_after(within):
        while True:
            status = owner.registrations()[name]
            if predicate(status):
                return status
            await anyio.sleep(0.02)
