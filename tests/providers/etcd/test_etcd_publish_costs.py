"""What one watch batch costs to publish: proportional to the changes, not the listing.

Counted, not timed: the sorts, the identity checks and the byte measurements
one batch of ten events causes on a 2,000-record service, through the
owner's ledger exactly as an observation slot admits it.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable
from typing import Any

import nadisc_etcd._state as state_module
import pytest
from nadisc_etcd._layout import Layout
from nadisc_etcd._state import ServiceState
from nadisc_etcd._wire import Event, KeyValue, ResponseHeader, WatchResponse, b64

from nadisc import Instance, ProviderSnapshot
from nadisc._capacity import SnapshotLedger

RECORDS = 2000


def record(addr: str) -> str:
    document = {"Op": 0, "Addr": addr, "Metadata": {"zone": "a"}}
    return b64(json.dumps(document).encode())


def kv(n: int, mod: int, port: int = 80) -> KeyValue:
    return KeyValue(
        key=f"p/orders/i{n:05d}".encode(), mod_revision=mod, value=record(f"10.0.0.1:{port}")
    )


def batch(revision: int, changes: Iterable[tuple[str, KeyValue]]) -> WatchResponse:
    return WatchResponse(
        header=ResponseHeader(revision=revision),
        events=tuple(Event(type=kind, kv=item) for kind, item in changes),  # type: ignore[arg-type]
    )


class Counts:
    def __init__(self) -> None:
        self.sorted_items = 0
        self.measured = 0
        self.identity_checks = 0


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    seen = Counts()
    measure = Instance.approximate_bytes
    check = ProviderSnapshot.__post_init__

    def counting_sorted(items: Iterable[Any], **kwargs: Any) -> list[Any]:
        out = sorted(items, **kwargs)
        seen.sorted_items += len(out)
        return out

    def counting_measure(self: Instance) -> int:
        seen.measured += 1
        return measure(self)

    def counting_check(self: ProviderSnapshot) -> None:
        seen.identity_checks += len(self.instances)
        check(self)

    monkeypatch.setattr(state_module, "sorted", counting_sorted, raising=False)
    monkeypatch.setattr(Instance, "approximate_bytes", counting_measure)
    monkeypatch.setattr(ProviderSnapshot, "__post_init__", counting_check)
    return seen


def test_a_batch_of_ten_changes_costs_ten_not_the_whole_listing(counts: Counts) -> None:
    state = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    state.reset([kv(n, 10 + n) for n in range(RECORDS)], 10 + RECORDS)
    ledger = SnapshotLedger(
        max_instances_per_service=10_000, max_total_instances=100_000, max_snapshot_bytes=1 << 30
    )
    hold = ledger.admit(state.snapshot())
    revision = 10 + RECORDS
    for _ in range(5):
        counts.__init__()  # type: ignore[misc]
        revision += 1
        changes = [("PUT", kv(n, revision, port=81 + revision % 7)) for n in range(0, 50, 10)]
        changes += [("DELETE", kv(RECORDS - 1 - n, revision)) for n in range(5)]
        changes += [("PUT", kv(RECORDS + revision * 10 + n, revision)) for n in range(5)]
        assert state.apply(batch(revision, changes))
        snapshot = state.snapshot()
        hold = ledger.admit(snapshot, replacing=hold)
        assert (
            snapshot.approximate_bytes()
            == ProviderSnapshot("orders", snapshot.instances, snapshot.evidence).approximate_bytes()
        )
        # A full sort, a full identity check or a re-measure of every
        # instance would each count about 2,000 here.
        assert counts.sorted_items == 0
        assert counts.identity_checks <= len(snapshot.instances)  # only the check above
        assert counts.measured <= 3 * len(changes) + len(snapshot.instances)


def test_an_unchanged_state_is_published_as_the_same_snapshot() -> None:
    state = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    state.reset([kv(n, 10 + n) for n in range(100)], 200)
    first = state.snapshot()
    assert not state.apply(batch(201, [("DELETE", kv(5000, 201))]))  # absent key
    assert state.snapshot() is first
    keys = [i.identity for i in first.instances]
    assert keys == sorted(keys)


def test_a_range_reuses_the_records_a_live_state_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ServiceState, "RESET_STEP", 10)
    live = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    live.reset([kv(n, 10 + n) for n in range(100)], 200)
    fresh = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    kvs = [kv(n, 10 + n) for n in range(99)] + [kv(99, 300, port=99)]
    steps = sum(1 for _ in fresh.reset_steps(kvs, 300, reuse=live))
    assert steps == 10  # the caller gets a turn every RESET_STEP records
    old, new = live.snapshot().instances, fresh.snapshot().instances
    assert all(a is b for a, b in zip(old[:99], new[:99], strict=True))
    assert new[99].port == 99 and new[99] is not old[99]


def test_a_watched_listing_adds_nothing_for_the_cyclic_collector_to_walk() -> None:
    """Per record the state keeps an entry and an Instance; neither is
    tracked by the cyclic GC, so a 10,000-key listing does not lengthen
    every full collection of the process (they used to be three tracked
    objects per key: entry, instance, an empty metadata view)."""
    state = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    bare = ServiceState("orders", Layout("p"), max_record_bytes=4096, max_instances=10_000)
    plain = b64(b'{"Addr": "10.0.0.1:80"}')
    bare_kvs = [
        KeyValue(key=f"p/orders/i{n:05d}".encode(), mod_revision=10 + n, value=plain)
        for n in range(RECORDS)
    ]
    state.reset([kv(n, 10 + n) for n in range(RECORDS)], 10 + RECORDS)
    bare.reset(bare_kvs, 10 + RECORDS)
    for one in (state, bare):
        entries = list(one._entries.values())
        assert len(entries) == RECORDS
        assert not any(gc.is_tracked(e) or gc.is_tracked(e.instance) for e in entries)
    # Records without metadata share one empty view.
    views = {id(e.instance.metadata) for e in bare._entries.values() if e.instance is not None}
    assert len(views) == 1
