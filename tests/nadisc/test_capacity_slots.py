"""Capacity budgets as observation slots use them: held listings, task budget,
watch streams."""

from __future__ import annotations

import dataclasses
import gc

import anyio
import pytest

from nadisc import Capabilities, EvidenceUnavailable, Instance, LimitsConfig
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner, policy


def many(prefix: str, count: int) -> list[Instance]:
    return [inst(f"{prefix}{n}", n + 1) for n in range(count)]


async def test_replacement_counts_a_consumer_held_old_listing(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"one": "one"})
    provider.set("one", many("a", 6))
    limits = LimitsConfig(max_instances_per_service=10, max_total_instances=10)
    async with memory_owner({"primary": provider}, limits=limits) as owner:
        one = await owner.client().observe("one", anyio.current_time() + 5)
        kept = one.snapshot()
        provider.set("one", many("b", 6))
        await anyio.sleep(5.5)
        # 6 held by a consumer + 6 new > 10: the new listing is withheld, and
        # the old candidates it removed are not served either.
        with pytest.raises(EvidenceUnavailable) as info:
            one.snapshot()
        assert info.value.reason == "capacity"
        assert owner.observer().snapshot().connection("primary").capacity_rejections >= 1
        assert {i.identity[0] for i in kept.instances} == {"a"}
        del kept
        gc.collect()
        await anyio.sleep(5)
        assert {i.identity[0] for i in one.snapshot().instances} == {"b"}


async def test_a_reclaimed_slot_returns_its_task_budget(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"a": "a", "b": "b"})
    provider.set("a", [inst("a")])
    provider.set("b", [inst("b")])
    limits = LimitsConfig(max_transport_tasks=1)
    policies = {"primary": policy(idle_timeout_ms=10_000)}
    async with memory_owner({"primary": provider}, limits=limits, policies=policies) as owner:
        await owner.client().observe("a", anyio.current_time() + 5)
        gc.collect()
        await anyio.sleep(20)  # "a" is reclaimed
        assert owner.observer().snapshot().capacity.transport_tasks == 0
        b = await owner.client().observe("b", anyio.current_time() + 5)
        assert b.snapshot().identities() == ("b",)


async def test_a_caller_cancelled_while_starting_the_slot_leaves_it_running(
    autojump_clock: object,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    provider.set_latency(1.0)
    async with memory_owner({"primary": provider}) as owner:
        handle = owner.client()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await handle.observe("orders", anyio.current_time() + 5)
        observation = await handle.observe("orders", anyio.current_time() + 5)
        assert observation.snapshot().identities() == ("a",)
        assert provider.query_counts["orders"] == 1


async def test_a_watch_holds_the_streams_its_provider_declares(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"one": "one", "two": "two"}, watch=True, watch_streams=2)
    provider.set("one", [inst("a")])
    provider.set("two", [inst("b")])
    async with memory_owner(
        {"primary": provider}, limits=LimitsConfig(max_watch_streams=3)
    ) as owner:
        one = await owner.client().observe("one", anyio.current_time() + 5)
        two = await owner.client().observe("two", anyio.current_time() + 5)
        await anyio.sleep(0.1)
        capacity = owner.observer().snapshot().capacity
        assert capacity.watch_streams == 2 and capacity.watch_streams_queued == 1
        assert provider.watch_counts["one"] == 1 and provider.watch_counts["two"] == 0
        # The queued one keeps refreshing by polling.
        assert one.snapshot().identities() == ("a",)
        assert two.snapshot().identities() == ("b",)


async def test_a_watch_larger_than_the_limit_polls_and_blocks_no_other(
    autojump_clock: object,
) -> None:
    wide = MemoryProvider(services={"orders": "orders"}, watch=True, watch_streams=2)
    wide.set("orders", [inst("a")])
    narrow = MemoryProvider(services={"users": "users"}, watch=True, watch_streams=1)
    narrow.set("users", [inst("u")])
    limits = LimitsConfig(max_watch_streams=1)
    async with memory_owner({"primary": wide, "other": narrow}, limits=limits) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 5)
        users = await owner.client("other").observe("users", anyio.current_time() + 5)
        await anyio.sleep(0.1)
        capacity = owner.observer().snapshot().capacity
        assert capacity.watch_streams_oversized == 1
        assert capacity.watch_streams_queued == 0 and capacity.watch_streams == 1
        assert wide.watch_counts["orders"] == 0 and narrow.watch_counts["users"] == 1
        # The oversized one keeps its evidence fresh by polling.
        wide.set("orders", [inst("b")])
        await anyio.sleep(5.5)
        assert orders.snapshot(strict=True).identities() == ("b",)
        assert users.snapshot(strict=True).identities() == ("u",)
    assert owner.close_report is not None and owner.close_report.tasks_left == 0


class SharedWatchProvider(MemoryProvider):
    """Declares that all its watches ride on the same stream (as etcd's
    prefix watch does)."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, shared_watch=True)


async def test_shared_watches_hold_their_streams_once_per_connection(
    autojump_clock: object,
) -> None:
    names = ("one", "two", "three")
    provider = SharedWatchProvider(services={n: n for n in names}, watch=True)
    for n in names:
        provider.set(n, [inst(n)])
    policies = {"primary": policy(idle_timeout_ms=1000)}
    async with memory_owner(
        {"primary": provider}, policies=policies, limits=LimitsConfig(max_watch_streams=1)
    ) as owner:
        observations = [await owner.client().observe(n, anyio.current_time() + 5) for n in names]
        await anyio.sleep(0.1)
        capacity = owner.observer().snapshot().capacity
        # Three watches, one stream counted, none queued behind the limit of 1.
        assert (capacity.watch_streams, capacity.watch_streams_queued) == (1, 0)
        assert [provider.watch_counts[n] for n in names] == [1, 1, 1]
        # The first watcher leaving keeps the stream for the others...
        del observations[0]
        gc.collect()
        await anyio.sleep(3)
        assert provider.active_watches("one") == 0
        assert owner.observer().snapshot().capacity.watch_streams == 1
        # ...the last one gives it back.
        observations.clear()
        gc.collect()
        await anyio.sleep(3)
        assert owner.observer().snapshot().capacity.watch_streams == 0
