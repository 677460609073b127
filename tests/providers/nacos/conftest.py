"""Shared helpers for the Nacos provider tests."""

from __future__ import annotations

from typing import Any

from nadisc_nacos import NacosProvider, NacosSettings

from nadisc import ConnectionContext, RegistrationRecord
from tests.fakes.nacos import NacosFake


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
    fake: NacosFake, *, ctx: ConnectionContext | None = None, **settings: object
) -> NacosProvider:
    """A provider talking to ``fake`` without sockets (MockClock friendly)."""
    return NacosProvider(
        ctx or context(),
        NacosSettings.model_validate({"server_addr": fake.url, **settings}),
        transport=fake.transport(),
    )


def record(
    service: str = "orders", host: str = "10.0.0.7", port: int = 8080, **extra: Any
) -> RegistrationRecord:
    return RegistrationRecord(
        registration="web",
        service=service,
        instance_id=f"{host}:{port}",
        host=host,
        port=port,
        **extra,
    )
