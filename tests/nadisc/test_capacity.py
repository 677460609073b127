"""Capacity limits: typed refusals, never truncated listings."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import (
    CapacityExceeded,
    EvidenceKind,
    EvidenceUnavailable,
    Instance,
    LimitsConfig,
    Observation,
    ProviderSnapshot,
)
from nadisc._capacity import SnapshotLedger, StreamTicket, TaskBudget, WatchStreams
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner, policy


def many(prefix: str, count: int) -> list[Instance]:
    return [Instance(f"{prefix}{n}", f"10.1.{n // 250}.{n % 250 + 1}", 80) for n in range(count)]


def listing(prefix: str, count: int) -> ProviderSnapshot:
    return ProviderSnapshot("svc", tuple(many(prefix, count)), EvidenceKind.REGISTRY_HEALTH)


def reason_of(observation: Observation) -> str:
    with pytest.raises(EvidenceUnavailable) as info:
        observation.snapshot()
    return info.value.reason


def test_ledger_counts_until_the_last_reference_goes() -> None:
    ledger = SnapshotLedger(
        max_instances_per_service=10, max_total_instances=12, max_snapshot_bytes=10**6
    )
    first = ledger.admit(listing("a", 8))
    assert ledger.instances == 8 and ledger.held == 1
    with pytest.raises(CapacityExceeded) as info:
        ledger.admit(listing("b", 5))
    assert info.value.limit == "max_total_instances"
    assert ledger.instances == 8  # nothing counted for a refusal
    with pytest.raises(CapacityExceeded) as info:
        ledger.admit(listing("c", 11))
    assert info.value.limit == "max_instances_per_service"
    del first
    gc.collect()
    assert ledger.instances == 0 and ledger.size == 0 and ledger.held == 0
    assert ledger.admit(listing("b", 5)).instances == 5


class _Record:
    """Stands for a snapshot record: unhashable, as a record's hash (its
    whole listing) must never be taken."""

    __hash__ = None  # type: ignore[assignment]


def test_holds_and_their_consumers_are_released_by_reference_counting() -> None:
    """No cycle anywhere: with the cyclic collector off, a record that goes
    stops counting at once, a hold that goes gives its share back at once,
    and a ledger that goes is freed with its holds still alive."""
    gc.disable()
    try:
        ledger = SnapshotLedger(
            max_instances_per_service=10, max_total_instances=100, max_snapshot_bytes=10**6
        )
        hold = ledger.admit(listing("a", 3))
        records = [_Record() for _ in range(3)]
        for record in records:
            hold.add_consumer(record)
        del record
        hold.add_consumer(records[0])  # counted once per reference taken
        assert hold.consumers == 4
        del records[1]
        assert hold.consumers == 3
        records.clear()
        assert hold.consumers == 0
        assert ledger.instances == 3 and ledger.held == 1
        del hold
        assert ledger.instances == 0 and ledger.size == 0 and ledger.held == 0
        kept = ledger.admit(listing("b", 2))
        gone = weakref.ref(ledger)
        del ledger
        assert gone() is None
        del kept  # its callback finds no ledger: nothing to give back to
    finally:
        gc.enable()


def test_ledger_byte_budget() -> None:
    snapshot = listing("a", 4)
    ledger = SnapshotLedger(
        max_instances_per_service=100,
        max_total_instances=100,
        max_snapshot_bytes=snapshot.approximate_bytes() + 10,
    )
    hold = ledger.admit(snapshot)
    with pytest.raises(CapacityExceeded) as info:
        ledger.admit(listing("b", 1))
    assert info.value.limit == "max_snapshot_bytes"
    assert hold.size == snapshot.approximate_bytes()


def test_watch_streams_are_granted_in_order_and_fit_first() -> None:
    streams = WatchStreams(3)
    a = streams.request(2)
    b = streams.request(2)  # does not fit: queued
    c = streams.request(1)  # fits: goes ahead of b instead of waiting behind it
    assert a.granted and not b.granted and c.granted
    assert b.passed_over == 1 and streams.queued == 1 and streams.in_use == 3
    streams.release(a)
    assert b.granted and streams.in_use == 3
    streams.release(c)
    streams.release(c)  # idempotent
    assert streams.in_use == 2
    streams.release(b)
    assert streams.in_use == 0 and streams.queued == 0


def test_a_request_larger_than_the_limit_is_never_queued_and_blocks_nobody() -> None:
    streams = WatchStreams(3)
    huge = streams.request(4)
    assert huge.oversized and not huge.granted
    assert streams.queued == 0 and streams.oversized == 1
    small = streams.request(1)
    assert small.granted  # not stuck behind a request that can never fit
    streams.release(small)
    assert not huge.granted
    streams.release(huge)
    streams.release(huge)  # idempotent
    assert streams.oversized == 0 and streams.in_use == 0


def test_a_waiting_request_is_overtaken_a_bounded_number_of_times() -> None:
    streams = WatchStreams(2)
    a = streams.request(1)
    big = streams.request(2)  # waits for both streams
    overtakers = []
    for _ in range(streams.max_passed_over):
        ticket = streams.request(1)
        assert ticket.granted  # fits in the free stream: goes ahead
        overtakers.append(ticket)
        streams.release(ticket)
    assert big.passed_over == streams.max_passed_over
    late = streams.request(1)
    assert not late.granted  # big has waited enough: nothing overtakes it now
    streams.release(a)
    assert big.granted and not late.granted
    streams.release(big)
    assert late.granted and streams.in_use == 1


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(0, 30)), max_size=40),
)
def test_watch_streams_never_exceed_the_limit_and_drain(
    limit: int, steps: list[tuple[bool, int, int]]
) -> None:
    streams = WatchStreams(limit)
    tickets: list[StreamTicket] = []
    for is_request, size, pick in steps:
        if is_request or not tickets:
            tickets.append(streams.request(size))
        else:
            streams.release(tickets.pop(pick % len(tickets)))
        granted = [t for t in tickets if t.granted]
        assert streams.in_use == sum(t.streams for t in granted) <= limit
        assert not any(t.oversized for t in granted)
        assert streams.oversized == sum(t.oversized for t in tickets)
        assert all(t.passed_over <= streams.max_passed_over for t in tickets)
        # Nothing that fits waits while nothing at all is in use.
        if streams.in_use == 0:
            assert streams.queued == 0
    for ticket in tickets:
        streams.release(ticket)
    assert streams.in_use == 0 and streams.queued == 0 and streams.oversized == 0


def test_task_budget() -> None:
    budget = TaskBudget(2)
    budget.acquire(2)
    with pytest.raises(CapacityExceeded) as info:
        budget.acquire()
    assert info.value.limit == "max_transport_tasks"
    budget.release(2)
    budget.acquire()


async def test_oversized_listing_is_refused_not_truncated(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "orders"})
    p.set("orders", many("i", 6))
    limits = LimitsConfig(max_instances_per_service=5)
    async with memory_owner({"primary": p}, limits=limits) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert reason_of(obs) == "capacity"
        metrics = owner.observer().snapshot().connection("primary")
        assert metrics.capacity_rejections == 1
        p.set("orders", many("i", 5))
        await anyio.sleep(5.5)
        assert len(obs.snapshot().instances) == 5


async def test_withheld_set_never_serves_removed_candidates(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "orders"})
    p.set("orders", [inst("a", 1), inst("b", 2), inst("c", 3)])
    limits = LimitsConfig(max_instances_per_service=3)
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 10000})
    async with memory_owner({"primary": p}, limits=limits, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        # the new complete set drops b and c but is over the limit
        p.set("orders", [inst("a", 1), inst("d", 4), inst("e", 5), inst("f", 6)])
        await anyio.sleep(5.5)
        snap = obs.snapshot()
        assert snap.identities() == ("a",)
        assert snap.degraded
        with pytest.raises(EvidenceUnavailable):
            obs.snapshot(strict=True)


async def test_total_counts_old_snapshots_held_by_consumers(autojump_clock: object) -> None:
    p = MemoryProvider(services={"one": "one", "two": "two"})
    p.set("one", many("a", 6))
    p.set("two", many("b", 3))
    limits = LimitsConfig(max_instances_per_service=10, max_total_instances=10)
    async with memory_owner({"primary": p}, limits=limits) as owner:
        handle = owner.client()
        one = await handle.observe("one", anyio.current_time() + 5)
        kept = one.snapshot()  # a consumer keeps the old listing
        p.set("one", many("c", 4))
        await anyio.sleep(5.5)
        assert {i.identity[0] for i in one.snapshot().instances} == {"c"}
        # the old listing of "one" still counts while the consumer holds it
        assert owner.observer().snapshot().capacity.instances == 10
        two = await handle.observe("two", anyio.current_time() + 5)
        assert reason_of(two) == "capacity"
        del kept
        gc.collect()
        assert owner.observer().snapshot().capacity.instances == 4
        await anyio.sleep(2)  # the retry after the refusal
        assert len(two.snapshot().instances) == 3
        assert owner.observer().snapshot().capacity.instances == 7


async def test_a_slot_may_replace_its_own_unshared_listing(autojump_clock: object) -> None:
    p = MemoryProvider(services={"one": "one"})
    p.set("one", many("a", 6))
    limits = LimitsConfig(max_instances_per_service=10, max_total_instances=10)
    async with memory_owner({"primary": p}, limits=limits) as owner:
        one = await owner.client().observe("one", anyio.current_time() + 5)
        assert len(one.snapshot().instances) == 6  # record dropped at once
        gc.collect()
        p.set("one", many("b", 7))
        await anyio.sleep(5.5)
        assert {i.identity[0] for i in one.snapshot().instances} == {"b"}
        gc.collect()
        assert owner.observer().snapshot().capacity.instances == 7


async def test_service_watch_slots_per_connection(autojump_clock: object) -> None:
    p = MemoryProvider(services={"a": "a", "b": "b", "c": "c"})
    for name in "abc":
        p.set(name, [inst(name)])
    limits = LimitsConfig(max_service_watches_per_connection=2)
    async with memory_owner({"primary": p}, limits=limits) as owner:
        handle = owner.client()
        kept = [await handle.observe(n, anyio.current_time() + 5) for n in "ab"]
        with pytest.raises(CapacityExceeded) as info:
            await handle.observe("c", anyio.current_time() + 5)
        assert info.value.limit == "max_service_watches_per_connection"
        assert p.query_counts["c"] == 0
        assert len(kept) == 2


async def test_transport_task_budget(autojump_clock: object) -> None:
    p = MemoryProvider(services={"a": "a", "b": "b"}, watch=True)
    for name in "ab":
        p.set(name, [inst(name)])
    limits = LimitsConfig(max_transport_tasks=3)
    async with memory_owner({"primary": p}, limits=limits) as owner:
        kept = await owner.client().observe("a", anyio.current_time() + 5)  # slot + watch
        with pytest.raises(CapacityExceeded) as info:
            await owner.client().observe("b", anyio.current_time() + 5)
        assert info.value.limit == "max_transport_tasks"
        assert owner.observer().snapshot().capacity.transport_tasks == 2
        assert kept.snapshot().identities() == ("a",)


async def test_parallel_operations_limiter(autojump_clock: object) -> None:
    limits = LimitsConfig(max_parallel_operations=2)
    providers = {}
    for n in range(4):
        p = MemoryProvider(services={"x": "x"})
        p.set_prepare_latency(1.0)
        providers[f"c{n}"] = p
    async with memory_owner(providers, limits=limits, prepare=False) as owner:
        assert owner.operations.total_tokens == 2
        start = anyio.current_time()
        await owner.prepare(anyio.current_time() + 10)
        # four one-second prepares, two at a time (queueing counts against
        # each connection's request_timeout_ms of 3 s)
        assert anyio.current_time() - start == pytest.approx(2.0)


async def test_snapshot_after_a_change_hashes_no_instance(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record handed out is tracked by identity: tracking it by its own
    hash hashed every instance of the listing (7 ms per ``snapshot()`` at
    10,000 instances, on every change)."""
    p = MemoryProvider(services={"svc": "svc"}, watch=True)
    p.set("svc", many("a", 500))
    async with memory_owner({"primary": p}) as owner:
        observation = await owner.client().observe("svc", anyio.current_time() + 5)
        hashed: list[Instance] = []
        original = Instance.__hash__

        def counting(self: Instance) -> int:
            hashed.append(self)
            return original(self)

        monkeypatch.setattr(Instance, "__hash__", counting)
        for round_ in range(3):
            p.set("svc", many(f"r{round_}-", 500))
            await observation.changed(anyio.current_time() + 5)
            record = observation.snapshot()
            assert record.instances[0].identity == f"r{round_}-0"
        assert hashed == []
