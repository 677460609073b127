"""Shared helpers of the dns provider tests."""

from __future__ import annotations

import anyio

from nadisc import ConnectionContext, DnsConfig
from nadisc.providers._dns import DnsProvider

from .conftest import DOMAIN

WEB = f"web.{DOMAIN}"


def context(*, max_instances: int = 4096, timeout: float = 3.0) -> ConnectionContext:
    return ConnectionContext(
        name="edge",
        request_timeout=timeout,
        max_instances_per_service=max_instances,
        max_response_bytes=65_536,
    )


def provider_for(nameserver: str, services: dict[str, object], **kw: object) -> DnsProvider:
    settings = DnsConfig.model_validate({"services": services, "nameservers": [nameserver], **kw})
    return DnsProvider(context(), settings)


def soon(seconds: float = 3.0) -> float:
    return anyio.current_time() + seconds
