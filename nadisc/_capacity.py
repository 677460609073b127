"""Capacity accounting for one owner: instances, bytes, watch streams, tasks.

Every limit refuses work with a typed answer — :class:`~nadisc.CapacityExceeded`
naming the config key, or an observation whose evidence reason is
``capacity`` — and never by truncating a listing.

* :class:`SnapshotLedger` admits complete listings against
  ``max_instances_per_service``, ``max_total_instances`` and
  ``max_snapshot_bytes``. An admitted listing is represented by a
  :class:`Hold`; its instances and bytes stay counted for as long as anything
  references the hold — the observation slot *and* every
  :class:`~nadisc.ObservationSnapshot` a consumer still keeps. Old snapshots
  held by consumers therefore keep counting, as the seed requires. Release
  happens through a weak reference's callback, so it is exact under
  CPython's reference counting and eventual under other collectors.
* :class:`WatchStreams` hands out ``max_watch_streams`` long watch streams by
  arrival order. A watch that declares two streams (Kubernetes: Service and
  EndpointSlice) takes two. A request larger than the whole limit is never
  queued; a waiting request that does not fit does not block later ones that
  do, but may be overtaken only a bounded number of times (see the class).
  While a request waits (or for good, when oversized) its observation keeps
  refreshing by periodic queries.
* :class:`TaskBudget` counts the tasks the owner runs for observations
  (``max_transport_tasks``).

``max_parallel_operations`` is a plain :class:`anyio.CapacityLimiter` on the
owner (``owner.operations``), used for one-shot control operations:
preparation and every registry call of the registrations (FIFO; see
:mod:`nadisc._registration`).

Costs: admitting a listing is O(1) — the byte size of a
:class:`~nadisc.ProviderSnapshot` is measured once (or known from the
:class:`~nadisc.IncrementalListing` that built it) and the totals move by
the difference between the new listing and the one it replaces. Stream
requests and releases are O(waiting requests).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from ._errors import CapacityExceeded
from ._instance import ProviderSnapshot

__all__ = ["CapacityUse", "Hold", "SnapshotLedger", "StreamTicket", "TaskBudget", "WatchStreams"]


@dataclass(frozen=True, slots=True)
class CapacityUse:
    """A point-in-time view of the snapshot and task budgets."""

    instances: int
    max_total_instances: int
    snapshot_bytes: int
    max_snapshot_bytes: int
    snapshots_held: int
    watch_streams: int
    max_watch_streams: int
    watch_streams_queued: int
    transport_tasks: int
    max_transport_tasks: int
    #: Watches that want more streams than ``max_watch_streams`` altogether:
    #: never granted, their observations poll.
    watch_streams_oversized: int = 0


_O = TypeVar("_O")
_R = TypeVar("_R")


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that hashes and compares by its own identity, never
    by its referent's (a snapshot record's hash would hash its listing)."""

    __slots__ = ()
    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _weakly(owner: _O, act: Callable[[_O, _R], None]) -> Callable[[_R], None]:
    """A weak-reference callback that calls ``act(owner, reference)`` while
    ``owner`` is alive, holding ``owner`` only weakly (no cycle through the
    callback)."""
    holder = weakref.ref(owner)

    def callback(ref: _R) -> None:
        found = holder()
        if found is not None:
            act(found, ref)

    return callback


class Hold:
    """One admitted listing's share of the budgets. Released when unreferenced.

    :meth:`add_consumer` weakly tracks the snapshot records handed out for
    it, so a slot replacing its own listing knows whether anyone else still
    holds it (:attr:`consumers`: how many are alive). Each is a weak
    reference, hashed by its own identity (a record's hash would hash its
    whole listing, 7 ms for 10,000 instances), that drops itself when its
    record dies.
    """

    __slots__ = ("__weakref__", "_discard", "_refs", "instances", "size")

    def __init__(self, instances: int, size: int) -> None:
        self.instances = instances
        self.size = size
        self._refs: set[_Ref] = set()
        self._discard = _weakly(self._refs, set.discard)

    @property
    def consumers(self) -> int:
        """How many snapshot records handed out for this listing are alive."""
        return len(self._refs)

    def add_consumer(self, record: object) -> None:
        """Count ``record`` for as long as it is alive."""
        self._refs.add(_Ref(record, self._discard))

    def __repr__(self) -> str:
        return f"<Hold instances={self.instances} bytes={self.size}>"


class SnapshotLedger:
    """Admits listings against the instance and byte budgets."""

    def __init__(
        self, *, max_instances_per_service: int, max_total_instances: int, max_snapshot_bytes: int
    ) -> None:
        self.max_instances_per_service = max_instances_per_service
        self.max_total_instances = max_total_instances
        self.max_snapshot_bytes = max_snapshot_bytes
        self.instances = 0
        self.size = 0
        self.held = 0
        #: A weak reference to each admitted hold -> what it counts. The
        #: reference's callback releases that share when the hold dies (it
        #: holds the ledger weakly: no cycle through the callbacks).
        self._holds: dict[weakref.ref[Hold], tuple[int, int]] = {}
        self._release = _weakly(self, SnapshotLedger._released)

    def admit(self, snapshot: ProviderSnapshot, *, replacing: Hold | None = None) -> Hold:
        """Count ``snapshot`` and return its hold, or raise ``CapacityExceeded``.

        ``replacing`` is the listing the new one replaces in the same slot:
        if no consumer holds it any more it is about to be released and does
        not count against the new one; if a consumer still holds it, it
        counts. Nothing is counted when the listing is refused.
        """
        count = len(snapshot.instances)
        base_instances, base_size = self.instances, self.size
        if replacing is not None and not replacing.consumers:
            base_instances -= replacing.instances
            base_size -= replacing.size
        if count > self.max_instances_per_service:
            raise CapacityExceeded(
                "max_instances_per_service",
                f"service {snapshot.service!r} lists {count} instances "
                f"(limit {self.max_instances_per_service})",
            )
        if base_instances + count > self.max_total_instances:
            raise CapacityExceeded(
                "max_total_instances",
                f"admitting {count} instances would hold {base_instances + count} "
                f"(limit {self.max_total_instances}, old snapshots still held count)",
            )
        size = snapshot.approximate_bytes()
        if base_size + size > self.max_snapshot_bytes:
            raise CapacityExceeded(
                "max_snapshot_bytes",
                f"admitting {size} bytes would hold {base_size + size} "
                f"(limit {self.max_snapshot_bytes})",
            )
        hold = Hold(count, size)
        self.instances += count
        self.size += size
        self.held += 1
        self._holds[weakref.ref(hold, self._release)] = (count, size)
        return hold

    def _released(self, gone: weakref.ref[Hold]) -> None:
        count, size = self._holds.pop(gone)
        self.instances -= count
        self.size -= size
        self.held -= 1


class StreamTicket:
    """One observation's request for watch streams."""

    __slots__ = ("_event", "granted", "oversized", "passed_over", "streams")

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.granted = False
        #: True when the request is larger than the whole limit: never queued,
        #: never granted (the observation keeps polling).
        self.oversized = False
        #: How often a later request was granted ahead of this one.
        self.passed_over = 0
        self._event: anyio.Event | None = None

    def _grant(self) -> None:
        self.granted = True
        if self._event is not None:
            self._event.set()

    async def wait_granted(self) -> None:
        """Wait until the streams are granted (returns at once if they are)."""
        if self.granted:
            await anyio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class WatchStreams:
    """``max_watch_streams`` long watch streams, shared by arrival order.

    The rule, applied whenever streams are requested or given back:

    * A request for more streams than the whole limit is never queued and
      never granted (it could never fit and would only stand in the way); it
      is counted in :attr:`oversized` and its observation keeps polling.
    * Waiting requests are looked at oldest first; each one that fits in the
      free streams is granted. One that does not fit is skipped, so a later,
      smaller request is not blocked behind it (no head-of-line blocking).
    * A request skipped :attr:`max_passed_over` times (``limit`` times) stops
      being skipped: nothing behind it is granted until it fits. Large
      requests therefore wait a bounded number of overtakes, never for good.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        #: Requests larger than the whole limit (not queued, never granted).
        self.oversized = 0
        self._queue: collections.deque[StreamTicket] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def max_passed_over(self) -> int:
        return max(1, self.limit)

    def request(self, streams: int) -> StreamTicket:
        """A ticket: granted at once when the rule above allows, else queued
        (or, larger than the whole limit, marked ``oversized`` and left out)."""
        if streams < 1:
            raise ValueError("a watch holds at least one stream")
        ticket = StreamTicket(streams)
        if streams > self.limit:
            ticket.oversized = True
            self.oversized += 1
            return ticket
        self._queue.append(ticket)
        self._grant_waiting()
        return ticket

    def release(self, ticket: StreamTicket) -> None:
        """Give the ticket's streams back (or leave the queue). Idempotent."""
        if ticket.oversized:
            ticket.oversized = False
            self.oversized -= 1
            return
        if ticket.granted:
            ticket.granted = False
            self.in_use -= ticket.streams
        else:
            with contextlib.suppress(ValueError):
                self._queue.remove(ticket)
        self._grant_waiting()

    def _grant_waiting(self) -> None:
        limit = self.max_passed_over
        waiting: collections.deque[StreamTicket] = collections.deque()
        blocked = False
        while self._queue:
            ticket = self._queue.popleft()
            if blocked:
                waiting.append(ticket)
            elif self.in_use + ticket.streams <= self.limit:
                self.in_use += ticket.streams
                ticket._grant()
                # Everything waiting so far was skipped by this grant.
                for earlier in waiting:
                    earlier.passed_over += 1
                    blocked = blocked or earlier.passed_over >= limit
            else:
                waiting.append(ticket)
                # Waited long enough: nothing overtakes it any more.
                blocked = ticket.passed_over >= limit
        self._queue = waiting


class TaskBudget:
    """Counts owner-run transport tasks against ``max_transport_tasks``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def acquire(self, count: int = 1) -> None:
        if self.in_use + count > self.limit:
            raise CapacityExceeded(
                "max_transport_tasks",
                f"{self.in_use} transport tasks running, {count} more would exceed "
                f"the limit of {self.limit}",
            )
        self.in_use += count

    def release(self, count: int = 1) -> None:
        self.in_use -= count
