"""Shared setup for the owner and observation tests (not a test module)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sniffio

from nadisc import (
    ConnectionConfig,
    ConnectionSpec,
    DiscoveryOwner,
    Instance,
    LimitsConfig,
    OwnerBuilder,
)
from nadisc.testing import MemoryProvider


def policy(**fields: Any) -> ConnectionConfig:
    """A connection policy for an injected provider (defaults as the seed's table)."""
    return ConnectionConfig(provider="memory", **fields)


def inst(identity: str, last_octet: int = 1, port: int = 8080) -> Instance:
    return Instance(identity, f"10.0.0.{last_octet}", port)


@asynccontextmanager
async def memory_owner(
    providers: Mapping[str, MemoryProvider],
    *,
    policies: Mapping[str, ConnectionConfig] | None = None,
    limits: LimitsConfig | None = None,
    default: str | None = None,
    prepare: bool = True,
) -> AsyncIterator[DiscoveryOwner]:
    builder = OwnerBuilder(limits=limits)
    for name, provider in providers.items():
        builder.connection(ConnectionSpec(name, provider, (policies or {}).get(name, policy())))
    if default is not None:
        builder.default_connection(default)
    async with builder.open() as owner:
        if prepare:
            await owner.prepare(anyio.current_time() + 5)
        yield owner


def all_tasks() -> set[object]:
    """Every task of this run (trio: walked from the root task; asyncio: the
    loop's live tasks), to compare before and after a block."""
    if sniffio.current_async_library() == "asyncio":
        import asyncio

        return {task for task in asyncio.all_tasks() if not task.done()}
    import trio.lowlevel

    found: set[object] = set()
    stack: list[trio.lowlevel.Task | None] = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is None or task in found:
            continue
        found.add(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found
