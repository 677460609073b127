"""Building owners over in-process Nacos fakes (shared by the owner tests)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from nadisc_nacos import NacosSettings, factory

from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    EvidenceUnavailable,
    Observation,
    Provider,
    open_discovery,
    validate_provider_block,
)
from tests.fakes.nacos import NacosFake


def connection(
    url: str, *, policy: Mapping[str, Any] | None = None, **block: Any
) -> dict[str, Any]:
    nacos: dict[str, Any] = {"server_addr": url, "services": {"orders": {"name": "order-worker"}}}
    nacos.update(block)
    out: dict[str, Any] = {"provider": "nacos", "nacos": nacos}
    out.update(policy or {})
    return out


#: Metadata of an ephemeral instance a test registers directly (no beats):
#: the server's heartbeat rules for it are an hour long. One service holds
#: one kind of instance, so such a neighbour of an ephemeral registration
#: must be ephemeral too.
LONG_LIVED = {"preserved.heart.beat.timeout": "3600000", "preserved.ip.delete.timeout": "3600000"}


def config(
    url: str,
    *,
    registration: Mapping[str, Any] | None = None,
    policy: Mapping[str, Any] | None = None,
    **block: Any,
) -> DiscoveryConfig:
    document: dict[str, Any] = {
        "enabled": True,
        "connections": {"primary": connection(url, policy=policy, **block)},
        "shutdown_timeout_ms": 5000,
    }
    if registration is not None:
        document["registrations"] = {
            "web": {"service_name": "orders", "ip": "10.0.0.7", "port": 18080, **registration}
        }
    return DiscoveryConfig.model_validate(document)


def providers_for(cfg: DiscoveryConfig, fakes: Mapping[str, NacosFake]) -> dict[str, Provider]:
    """What the ``nacos`` entry point builds from ``cfg``, wired to in-process fakes."""
    out: dict[str, Provider] = {}
    for name, fake in fakes.items():
        conn = cfg.connections[name]
        settings = validate_provider_block(name, conn, NacosSettings)
        context = ConnectionContext(
            name=name,
            request_timeout=conn.request_timeout_ms / 1000,
            max_instances_per_service=cfg.limits.max_instances_per_service,
            max_response_bytes=cfg.limits.max_snapshot_bytes,
        )
        out[name] = factory.create_with(context, settings, transport=fake.transport())
    return out


#: Where the registration ``web`` of :func:`config` listens.
WEB = {"web": ("10.0.0.7", 18080)}


def open_owner(
    cfg: DiscoveryConfig,
    fake: NacosFake,
    providers: Mapping[str, Provider] | None = None,
) -> AbstractAsyncContextManager[DiscoveryOwner]:
    """An owner of ``cfg`` over ``fake`` (the ``primary`` connection); with a
    registration, ``web`` listens at :data:`WEB` and is always eligible."""
    if providers is None:
        providers = providers_for(cfg, {"primary": fake})
    if not cfg.registrations:
        return open_discovery(cfg, providers=providers)
    return open_discovery(
        cfg, providers=providers, listeners=WEB, eligibility={"web": Eligibility.always()}
    )


def identities(observation: Observation) -> tuple[str, ...]:
    try:
        return observation.snapshot().identities()
    except EvidenceUnavailable:
        return ()


def refusal(observation: Observation, *, strict: bool = False) -> str | None:
    try:
        observation.snapshot(strict=strict)
    except EvidenceUnavailable as exc:
        return exc.reason
    return None


async def until(predicate: Callable[[], bool], *, limit: float = 600) -> None:
    """Wait for a condition spanning the owner and the fake."""
    with anyio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - no single event covers both sides
            await anyio.sleep(0.05)
