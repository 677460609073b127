"""Reclaiming an idle observation never hands a dying slot to a new caller."""

from __future__ import annotations

import gc

import anyio
from anyio.abc import TaskStatus

from nadisc import ObservationSink
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner, policy


class SlowWatchTeardown(MemoryProvider):
    """A watch that needs a second to close (an HTTP stream closed politely)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.tearing_down = False

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        try:
            await super().watch(service, sink, task_status=task_status)
        finally:
            self.tearing_down = True
            with anyio.CancelScope(shield=True):
                await anyio.sleep(1.0)
            self.tearing_down = False


async def test_observe_while_a_watch_is_torn_down_gets_a_live_observation(
    autojump_clock: object,
) -> None:
    provider = SlowWatchTeardown(services={"orders": "orders"}, watch=True)
    provider.set("orders", [inst("a")])
    policies = {"primary": policy(idle_timeout_ms=10_000)}
    async with memory_owner({"primary": provider}, policies=policies) as owner:
        first = await owner.client().observe("orders", anyio.current_time() + 5)
        assert first.snapshot().identities() == ("a",)
        del first
        gc.collect()
        for _ in range(400):
            await anyio.sleep(0.05)
            if provider.tearing_down:
                break
        assert provider.tearing_down, "the idle slot was never reclaimed"
        # Reclaim was decided and the old watch is still closing: a new caller
        # must get a new, live observation, not the one on its way out.
        queries = provider.query_counts["orders"]
        again = await owner.client().observe("orders", anyio.current_time() + 5)
        assert provider.query_counts["orders"] == queries + 1  # a new slot's first query
        await anyio.sleep(2)
        assert again.snapshot().identities() == ("a",)
        assert again.snapshot(strict=True).identities() == ("a",)
        # The old slot gave its budget back once its task ended.
        assert owner.observer().snapshot().capacity.transport_tasks == 2
    assert owner.close_report is not None and owner.close_report.tasks_left == 0


async def test_a_poll_slot_reclaimed_and_observed_again_works(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    policies = {"primary": policy(idle_timeout_ms=10_000)}
    async with memory_owner({"primary": provider}, policies=policies) as owner:
        first = await owner.client().observe("orders", anyio.current_time() + 5)
        del first
        gc.collect()
        await anyio.sleep(30)
        assert owner.observer().snapshot().capacity.transport_tasks == 0
        again = await owner.client().observe("orders", anyio.current_time() + 5)
        assert again.snapshot().identities() == ("a",)
