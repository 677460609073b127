"""Shared helpers for the Consul provider tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from nadisc_consul import ConsulProvider, ConsulSettings

from nadisc import ConnectionContext, ProviderFailure, ProviderSnapshot
from tests.fakes.consul import ConsulFake


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
    fake: ConsulFake, *, ctx: ConnectionContext | None = None, **settings: Any
) -> ConsulProvider:
    """A provider talking to ``fake`` without sockets (MockClock friendly)."""
    return ConsulProvider(
        ctx or context(),
        ConsulSettings(url=fake.url, **settings),  # type: ignore[arg-type]
        transport=fake.transport(),
    )


def over_loopback(
    fake: ConsulFake, *, ctx: ConnectionContext | None = None, **settings: Any
) -> ConsulProvider:
    """A provider talking to a fake served on a real port."""
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
