"""The runtime observer: an immutable, label-safe view of the owner."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from nadisc import IncompleteSnapshot, Instance, ObserverSnapshot, Phase
from nadisc.testing import MemoryProvider

from .owner_support import memory_owner


async def test_observer_reports_phase_queries_and_evidence_age(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "order-worker"})
    p.set(
        "order-worker",
        [Instance("a", "10.9.9.9", 80, metadata={"password": "hunter2"})],
        invalid={"bad-record": "no port"},
    )
    p.set_latency(0.2)
    async with memory_owner({"primary": p}, prepare=False) as owner:
        observer = owner.observer()
        first = observer.snapshot()
        assert first.phase is Phase.BUILT and not first.prepared
        await owner.prepare(anyio.current_time() + 5)
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        await anyio.sleep(3)
        view = observer.snapshot()
        assert isinstance(view, ObserverSnapshot)
        assert view.phase is Phase.PREPARED and view.prepared
        conn = view.connection("primary")
        assert conn.prepared is True
        assert conn.queries == 1 and conn.failures == 0
        assert conn.latency_last == pytest.approx(0.2)
        assert conn.latency_avg == pytest.approx(0.2)
        assert sum(count for _, count in conn.latency_histogram) == 1
        assert conn.invalid_records == 1
        (service,) = conn.services
        assert service.service == "orders"
        assert service.evidence_age == pytest.approx(3.0)
        assert service.unavailable_reason is None
        assert service.instances == 1 and service.holders == 1
        assert view.capacity.instances == 1
        assert view.capacity.transport_tasks == 1
        assert view.live_tasks == 1
        # immutable, and no addresses or secrets anywhere in it
        with pytest.raises(dataclasses.FrozenInstanceError):
            view.prepared = False  # type: ignore[misc]
        text = repr(view)
        assert "10.9.9.9" not in text and "hunter2" not in text
        p.fail("order-worker", IncompleteSnapshot("down"))
        await anyio.sleep(20)
        later = observer.snapshot().connection("primary")
        assert later.failures >= 1
        assert later.services[0].unavailable_reason == "stale"
        assert later.services[0].evidence_age == pytest.approx(23.0)
        del obs
    assert observer.snapshot().phase is Phase.CLOSED
