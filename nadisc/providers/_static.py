"""The ``static`` provider: configured, complete instance lists.

``connections.<name>.static.services.<alias>`` is the complete list of that
alias. Its evidence is :attr:`~nadisc.EvidenceKind.STATIC_FACT`: a configured
address proves nothing about liveness, and the listing never ages (an
observation of it never goes stale and never expires because a wait timed
out). The provider cannot register.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio.lowlevel
from pydantic import BaseModel

from .._config import StaticConfig
from .._errors import ConfigError, InvalidSnapshot, LifecycleError
from .._instance import EvidenceKind, Instance, ProviderSnapshot
from .._provider import (
    Capabilities,
    ConnectionContext,
    DiscoveryOnlyProvider,
)

__all__ = ["StaticProvider", "factory"]

_CAPABILITIES = Capabilities(evidence=EvidenceKind.STATIC_FACT)


class StaticProvider(DiscoveryOnlyProvider):
    """Answers every query from fixed, complete listings."""

    provider_name = "static"

    def __init__(self, services: Mapping[str, Sequence[Instance]]) -> None:
        snapshots: dict[str, ProviderSnapshot] = {}
        for alias, instances in services.items():
            if not isinstance(alias, str) or not alias:
                raise ConfigError("static.services", f"invalid service alias {alias!r}")
            try:
                snapshots[alias] = ProviderSnapshot(
                    service=alias, instances=tuple(instances), evidence=EvidenceKind.STATIC_FACT
                )
            except ValueError as exc:
                raise ConfigError(f"static.services.{alias}", str(exc)) from None
        self._snapshots = snapshots
        self._closed = False

    @classmethod
    def static_services(cls, services: Mapping[str, Sequence[Instance]]) -> StaticProvider:
        """A provider for a standalone host: alias -> complete instance list."""
        return cls(services)

    @classmethod
    def from_config(cls, config: StaticConfig) -> StaticProvider:
        return cls({alias: config.instances(alias) for alias in config.services})

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def bindings(self) -> Mapping[str, str]:
        """Every configured alias is bound to itself."""
        return {alias: alias for alias in self._snapshots}

    async def prepare(self, deadline: float) -> None:
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise LifecycleError("the static provider is closed")

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        await anyio.lowlevel.checkpoint()
        try:
            return self._snapshots[service]
        except KeyError:
            raise InvalidSnapshot(f"service {service!r} is not configured") from None

    async def aclose(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"<StaticProvider services={len(self._snapshots)}>"


class _StaticFactory:
    """The ``static`` entry point."""

    @property
    def name(self) -> str:
        return "static"

    @property
    def settings_model(self) -> type[BaseModel]:
        return StaticConfig

    def create(self, context: ConnectionContext, settings: BaseModel) -> StaticProvider:
        if not isinstance(settings, StaticConfig):
            raise ConfigError(
                f"discovery.connections.{context.name}.static", "expected a static block"
            )
        return StaticProvider.from_config(settings)


factory = _StaticFactory()
