"""Shared observations: one slot per (connection, service), one query stream.

::

    handle.observe("orders", deadline) ──► Slot(primary, orders) ◄── observe() again
                                            │  Evidence (sans-IO rules)
        owner's task group ─► Slot.run ─────┤  LatestCell[int] (generation)
          poll every poll_interval, or      │
          watch + confirmation queries      ▼
                                     Observation handles (no close rights)
                                       snapshot(strict) / changed(deadline)
                                       submit_if_current(fn)

*Single flight.* The first ``observe()`` of a service creates the slot and
starts its refresh task in the owner's task group; every later caller only
waits for the slot's first outcome. The task belongs to the owner, never to a
caller: a caller whose deadline passes stops waiting, and the query goes on
for everybody else.

*Holders.* A slot is held while any :class:`Observation` handle for it is
alive (handles are tracked weakly) or while it was accessed by ``observe()``
within ``idle_timeout_ms``. A slot without holders for ``idle_timeout_ms`` is
reclaimed by its own task: the moment it decides so it leaves the connection
and its evidence is closed (synchronously, before its watch is torn down, so
no ``observe()`` is ever handed a slot on its way out); its budgets are
released when the task ends; a later ``observe()`` starts a new one. The
task notices the last handle going away at its next check, at most
``min(poll_interval_ms, idle_timeout_ms)`` later.

*Refresh.* Providers without watch streams are queried every
``poll_interval_ms``; a failed query is retried after an exponential backoff
with jitter. Providers with watch streams get a watch (when the owner's
``max_watch_streams`` allow; queued requests keep polling) and a full
re-read only when the watch has not confirmed the listing (a change or a
``refresh``) within the confirmation window (see :func:`next_confirmation`),
or reported a failure. A provider declaring
``Capabilities.shared_watch`` rides every watch of the connection on the
same streams: its slots share one stream ticket, requested by the first
watching slot and given back by the last. A static listing is queried
once: it does not age.

*Provider-paced polling.* A provider may pace its own polls by offering a
synchronous ``refresh_delay(service, poll_interval) -> seconds`` (looked up
by name, e.g. the DNS provider, whose answers carry a TTL). After a complete
listing the slot waits what it answers, capped at ``poll_interval_ms`` so the
evidence rules keep their budget; an answer that is not a positive finite
number, or that raises, falls back to ``poll_interval_ms``. Failed queries
still back off as usual.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import types
import weakref
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import TaskStatus

from poise import CellReader, LatestCell

from ._capacity import Hold, StreamTicket
from ._errors import (
    CapacityExceeded,
    CapacityRejected,
    DeadlineExceeded,
    EvidenceUnavailable,
    IdentityRevoked,
    IncompleteSnapshot,
    InvalidSnapshot,
    ProviderFailure,
    relative_deadline_hint,
)
from ._evidence import Backoff, Evidence, EvidencePolicy, FailureKind, Reason, Usable
from ._instance import EvidenceKind, Instance, ProviderSnapshot, _identity_of

if TYPE_CHECKING:
    from ._connection import Connection

__all__ = [
    "Observation",
    "ObservationChanges",
    "ObservationSnapshot",
    "Slot",
    "check_deadline",
    "check_deadline_value",
    "confirmation_window",
    "loop_clock",
    "next_confirmation",
    "run_clock",
    "watch_current",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def loop_clock() -> tuple[Callable[[], float], Callable[[], float]]:
    """The running event loop's ``(current_time, current_effective_deadline)``.

    The same values anyio returns, without its per-call backend lookup: a
    transport resolves them once, on its first request (it serves one loop).
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.current_time, trio.current_effective_deadline
    return anyio.current_time, anyio.current_effective_deadline


def run_clock() -> Callable[[], float]:
    """The running loop's clock, read without anyio's per-call backend lookup
    and, on trio, without the run-context lookup of ``trio.current_time``.

    The same time as ``anyio.current_time``, bound to this run's clock (trio)
    or loop (asyncio): for an object that lives within one run, which it
    must not outlive (a new trio run has a clock of its own).
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_clock().current_time
    import asyncio

    return asyncio.get_running_loop().time


#: How a handle waits for a cell to move past a revision, until a time.
CellWait = Callable[[CellReader[int], int, float], Coroutine[Any, Any, None]]


def run_cell_wait() -> CellWait:
    """``wait(reader, revision, until)``, bound to the running loop: returns
    once the cell moved past ``revision`` (a publish or its close) or the
    loop's clock reached ``until`` (``inf``: no time limit), whichever comes
    first, and raises the caller's cancellation. The caller has seen the
    cell at ``revision`` with no await since, so a publish cannot slip in
    between (a cell already past it returns at once).

    On trio: trio's own cancel scope around the cell's wait. On asyncio: a
    bare future woken by a one-shot waker of the cell, and a loop timer at
    ``until``; what anyio's ``move_on_at`` and event wait would do, without
    their backend look-ups, cancel-scope bookkeeping and event objects
    (about half of what a woken ``changed()`` cost).
    """
    if sniffio.current_async_library() == "trio":
        import trio

        async def wait_trio(reader: CellReader[int], revision: int, until: float) -> None:
            with trio.move_on_at(until):
                await reader.wait_past(revision)

        return wait_trio
    import asyncio

    loop = asyncio.get_running_loop()

    async def wait_asyncio(reader: CellReader[int], revision: int, until: float) -> None:
        if reader.revision != revision or reader.closed:
            return
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not future.done():  # a cancelled wait cancelled the future
                future.set_result(None)

        reader.add_waker(wake)
        timer = loop.call_at(until, wake) if until != math.inf else None
        try:
            await future
        finally:
            reader.discard_waker(wake)
            if timer is not None:
                timer.cancel()

    return wait_asyncio


class OutcomeEvent(Protocol):
    """What a slot's first-outcome event offers (anyio's and trio's alike)."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...

    async def wait(self) -> None: ...


def loop_event_and_deadline() -> tuple[
    Callable[[], OutcomeEvent], Callable[[float], contextlib.AbstractContextManager[object]]
]:
    """The running loop's own event type and ``move_on_at``: on trio, trio's
    (a wake-up of thousands of waiters skips anyio's per-waiter layer; the
    semantics are the same), else anyio's."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.Event, trio.move_on_at
    return anyio.Event, anyio.move_on_at


def check_deadline_value(deadline: object) -> None:
    """Refuse a deadline that is not a number, or is NaN, with ``DeadlineExceeded``
    (whatever the time: such a value is never a deadline)."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise DeadlineExceeded(
            f"deadline must be a number on the event-loop clock, not {type(deadline).__name__}"
        )
    if math.isnan(deadline):
        raise DeadlineExceeded("deadline is NaN")


def check_deadline(deadline: float, now: float) -> None:
    """Refuse a NaN or already-passed deadline with ``DeadlineExceeded``.

    A deadline far in the past (more than a minute) was most likely meant
    as a duration: the message then says how to spell it.
    """
    check_deadline_value(deadline)
    if deadline <= now:
        raise DeadlineExceeded(
            f"deadline passed {now - deadline:.6f}s ago{relative_deadline_hint(deadline, now)}"
        )


def confirmation_window(poll: float, timeout: float, max_age: float) -> float:
    """How long a watched listing may go without a confirmation before the
    slot re-reads it: the poll interval plus a slack of a quarter of it,
    capped at half of what the evidence budget leaves over (the config
    ensures ``poll + timeout < max_age``). A watch confirming every poll
    interval (etcd's probe) is then not raced by a query that starts a
    round trip before the probe's answer, and a query started at the
    window's end still completes within ``max_age`` of the last
    confirmation."""
    return poll + max(0.0, min(poll / 4, (max_age - poll - timeout) / 2))


def watch_current(now: float, confirmed_at: float | None, window: float) -> bool:
    """True while a watch keeps its listing current: a healthy record
    (``confirmed_at`` is None when there is none, or it failed) last listed
    or confirmed less than ``window`` ago. No full re-read is needed then."""
    return confirmed_at is not None and now < confirmed_at + window


def next_confirmation(
    queried_at: float, confirmed_at: float | None, poll: float, window: float
) -> float:
    """When a watched slot looks again: one poll interval after its own last
    query, and no earlier than ``window`` after the watch's last
    confirmation (``confirmed_at``; None for no healthy record). Whatever the
    watch does, a re-read starts no later than ``window`` after the newest
    confirmation (or one poll after the previous query)."""
    wake_at = queried_at + poll
    if confirmed_at is not None:
        wake_at = max(wake_at, confirmed_at + window)
    return wake_at


@dataclass(frozen=True, slots=True, weakref_slot=True)
class ObservationSnapshot:
    """An immutable view of an observation that may be used now.

    Holding a snapshot keeps its listing counted against the owner's
    ``max_total_instances`` / ``max_snapshot_bytes``. The presence of an
    instance proves only what ``evidence`` says (a static fact proves nothing
    about liveness).
    """

    connection: str
    service: str
    instances: tuple[Instance, ...]
    evidence: EvidenceKind
    #: The observation's generation: grows whenever what it serves changes.
    revision: int
    #: Event-loop time of the last complete listing (or confirmation).
    confirmed_at: float
    #: True while served from the grace window after a failed refresh.
    degraded: bool
    _hold: object = field(default=None, repr=False, compare=False)

    def identities(self) -> tuple[str, ...]:
        """Provider instance identities, in listing order."""
        return tuple(map(_identity_of, self.instances))


_FAILURE_KINDS: tuple[tuple[type[ProviderFailure], FailureKind], ...] = (
    (IdentityRevoked, FailureKind.REVOKED),
    (InvalidSnapshot, FailureKind.INVALID),
    (CapacityRejected, FailureKind.CAPACITY),
    (IncompleteSnapshot, FailureKind.INCOMPLETE),
)


def failure_kind(failure: BaseException) -> FailureKind:
    """The evidence kind of a provider outcome; anything unknown is incomplete."""
    for cls, kind in _FAILURE_KINDS:
        if isinstance(failure, cls):
            return kind
    return FailureKind.INCOMPLETE


class Slot:
    """The shared state of one (connection, service) observation.

    Implements :class:`~nadisc.ObservationSink` for the provider's watch.
    """

    def __init__(self, connection: Connection, alias: str, remote: str) -> None:
        self.connection = connection
        #: Why the last refresh failed ("<kind>: <message>", redacted like a
        #: prepare failure); None once a complete listing was accepted.
        self.failure_reason: str | None = None
        self.alias = alias
        self.remote = remote
        policy = connection.policy
        self.evidence = Evidence(
            EvidencePolicy(
                max_age=policy.snapshot.max_age_ms / 1000.0,
                stale_if_error=policy.snapshot.stale_if_error_ms / 1000.0,
            )
        )
        self.cell: LatestCell[int] = LatestCell(0)
        self.first_outcome: OutcomeEvent = loop_event_and_deadline()[0]()
        #: This run's clock (anyio.current_time without its backend lookup,
        #: about 1 us a reading on asyncio): read per published listing and
        #: per snapshot() of a handle.
        self.clock = run_clock()
        #: This run's wait for the cell (see run_cell_wait): what a handle's
        #: changed() waits with.
        self.wait = run_cell_wait()
        self.handles: weakref.WeakSet[Observation] = weakref.WeakSet()
        self.last_access = -math.inf
        self.queries = 0
        #: Records the latest complete listing held but refused as invalid
        #: (registry key -> reason); never served, shown by the observer.
        self.invalid: Mapping[str, str] = {}
        #: True once the budgets were given back (the task ended).
        self.reclaimed = False
        #: True from the moment reclaim was decided: the slot has left its
        #: connection and ``observe()`` starts a new one, even while this
        #: slot's task still tears its watch down.
        self.reclaiming = False
        self._unheld_since: float | None = None
        self._record: ObservationSnapshot | None = None
        self._record_key: tuple[int, float | None, bool] | None = None
        #: (evidence, its version, usable until, record) of the last
        #: non-strict look: the same record, unchecked, while they hold.
        self._record_valid: tuple[Evidence, int, float, ObservationSnapshot] | None = None
        # The last state key and the times it holds for: (evidence,
        # generation, from, until, key). Every observer woken by one outcome
        # reads it, so it is worked out once per change, not once per waiter.
        self._key_memo: tuple[Evidence, int, float, float, tuple[int, Reason | None]] | None = None
        self._poll = policy.poll_interval_ms / 1000.0
        self._idle = policy.idle_timeout_ms / 1000.0
        self._timeout = policy.request_timeout_ms / 1000.0
        # A watched slot re-reads only when its watch has not confirmed the
        # listing for this long.
        self._confirm_window = confirmation_window(
            self._poll, self._timeout, policy.snapshot.max_age_ms / 1000.0
        )
        # Between half and all of a poll interval, fixed per service.
        spread = zlib.crc32(f"{connection.name}/{alias}".encode()) / 2**32
        self._failure_delay = self._poll * (0.5 + 0.5 * spread)
        #: Set when a failure is recorded while the watch is up.
        self._failed: anyio.Event | None = None
        #: While a session's query runs beside its watch opening: the
        #: watch's failures, applied once the query answered (a watch that
        #: fails at once must not be the first outcome ``observe()`` sees
        #: when the query is about to list the service).
        self._held: list[BaseException] | None = None
        #: Confirmation queries a live, current watch made unnecessary.
        self.skipped_queries = 0
        hook = getattr(connection.provider, "refresh_delay", None)
        self._refresh_hook: Callable[[str, float], object] | None = hook if callable(hook) else None
        #: Long watch streams one watch of this provider holds (0: poll only).
        self.watch_streams = connection.provider.capabilities.watch_streams
        #: Transport tasks this slot may run: itself, plus its watch.
        self.task_cost = 2 if self.watch_streams > 0 else 1

    # ------------------------------------------------------------------ holders

    def state_key(self, now: float) -> tuple[int, Reason | None]:
        """``evidence.state_key(now)``, shared by every reader until it can change.

        The key moves only with the generation or at ``evidence.expiry``
        (see :mod:`nadisc._evidence`), so one computed at ``t`` holds, for
        the same evidence and generation, from ``t`` until that expiry.
        """
        return self._memo_at(now)[4]

    def key_expiry(self, now: float) -> float:
        """``evidence.expiry(now)``, from the shared key's memo (no second
        evaluation after :meth:`state_key`). A confirmation since the memo
        was made may have moved the real expiry later, never earlier: a wait
        until this one then wakes once early, finds the key unchanged and
        waits again."""
        return self._memo_at(now)[3]

    def _memo_at(self, now: float) -> tuple[Evidence, int, float, float, tuple[int, Reason | None]]:
        """The key memo holding ``now`` (worked out when the last one does
        not: another evidence or generation, or ``now`` past its expiry)."""
        evidence = self.evidence
        memo = self._key_memo
        if (
            memo is None
            or memo[0] is not evidence
            or memo[1] != evidence.generation
            or not memo[2] <= now < memo[3]
        ):
            key, expiry = evidence.key_and_expiry(now)
            memo = self._key_memo = (evidence, evidence.generation, now, expiry, key)
        return memo

    def touch(self, now: float) -> None:
        self.last_access = max(self.last_access, now)

    def _reclaimable(self, now: float) -> bool:
        if len(self.handles):
            self._unheld_since = None
            return False
        if self._unheld_since is None:
            self._unheld_since = now
        idle_since = max(self.last_access, self._unheld_since)
        return now - idle_since >= self._idle

    def _begin_reclaim(self) -> None:
        """Leave the connection and close the evidence, synchronously, the
        moment reclaim is decided (before any teardown awaits), so no
        ``observe()`` can be handed this slot any more. Idempotent."""
        self.reclaiming = True
        connection = self.connection
        if connection.slots.get(self.alias) is self:
            del connection.slots[self.alias]
        self.close()

    def _next_idle_check(self, now: float) -> float:
        if not len(self.handles) and self._unheld_since is not None:
            return max(self.last_access, self._unheld_since) + self._idle
        return now + min(self._poll, self._idle)

    # ------------------------------------------------------------------ outcomes

    def _notify(self, changed: bool) -> None:
        if changed:
            self._drop_record()
            if not self.cell.closed:
                self.cell.publish(self.evidence.generation)
        if not self.first_outcome.is_set() and self.evidence.has_outcome:
            self.first_outcome.set()

    def publish(self, snapshot: ProviderSnapshot) -> None:
        """A complete listing was observed now (also the watch sink)."""
        self._accept(snapshot, self.clock())

    def fail(self, failure: ProviderFailure) -> None:
        """A refresh failed (also the watch sink)."""
        self._watch_failed(failure)

    def _watch_failed(self, failure: BaseException) -> None:
        if self._held is not None:
            self._held.append(failure)
        else:
            self._fail(failure, self.clock())

    def refresh(self) -> None:
        """The registry confirmed nothing changed (also the watch sink)."""
        self.evidence.on_refresh(self.clock())

    def _fail(self, failure: BaseException, now: float) -> None:
        kind = failure_kind(failure)
        if kind is not FailureKind.INCOMPLETE or not isinstance(failure, IncompleteSnapshot):
            logger.info(
                "connection %r service %r: refresh failed (%s)",
                self.connection.name,
                self.alias,
                kind.value,
            )
        self.connection.stats.record_failure(kind.value)
        self.failure_reason = self.connection.redacted(f"{type(failure).__name__}: {failure}")
        if self._failed is not None:
            self._failed.set()
        changed = self.evidence.on_failure(kind, now)
        self._notify(changed)
        if changed and kind is FailureKind.REVOKED:
            self.connection.stats.identity_revocations += 1
            self.connection.runtime.identity_revoked(self.connection.name)

    def _accept(self, snapshot: object, now: float) -> bool:
        if not isinstance(snapshot, ProviderSnapshot):
            self._fail(IncompleteSnapshot("the provider returned a malformed listing"), now)
            return False
        stats = self.connection.stats
        invalid = snapshot.invalid
        if invalid:
            # Each bad record once: a key the last listing did not already
            # refuse for the same reason (a refresh or an unrelated change
            # that lists it again is not another bad record).
            previous = self.invalid
            stats.invalid_records += sum(
                1 for key, why in invalid.items() if previous.get(key) != why
            )
        self.invalid = invalid
        evidence = self.evidence
        if evidence.matches(snapshot):
            changed = evidence.on_success(snapshot, now, evidence.hold, matched=True)
        elif not snapshot.instances:
            changed = evidence.on_success(snapshot, now, None, matched=False)
        else:
            try:
                # The cached record is ours, not a consumer's: drop it so
                # the ledger sees who else still holds the old listing.
                self._drop_record()
                current = evidence.hold
                hold = self.connection.runtime.ledger.admit(
                    snapshot, replacing=current if isinstance(current, Hold) else None
                )
            except CapacityExceeded as exc:
                stats.capacity_rejections += 1
                logger.warning(
                    "connection %r service %r: listing withheld (%s)",
                    self.connection.name,
                    self.alias,
                    exc.limit,
                )
                self.failure_reason = self.connection.redacted(f"CapacityExceeded: {exc}")
                self._notify(evidence.on_withheld(frozenset(snapshot.identities()), now))
                return False
            changed = evidence.on_success(snapshot, now, hold, matched=False)
        self.failure_reason = None
        self._notify(changed)
        return True

    # ------------------------------------------------------------------ records

    def _drop_record(self) -> None:
        self._record = None
        self._record_key = None
        self._record_valid = None

    def record(self, now: float, *, strict: bool) -> ObservationSnapshot:
        """The snapshot record that may be used at ``now`` (cached while the
        evidence is unchanged), or ``EvidenceUnavailable``."""
        evidence = self.evidence
        if not strict:
            # The record of the last look while nothing was recorded since
            # and time alone has not refused it yet (Evidence.usable_until).
            known = self._record_valid
            if (
                known is not None
                and known[0] is evidence
                and known[1] == evidence.version
                and now < known[2]
            ):
                return known[3]
        until = evidence.usable_until(now, strict=strict)
        if until is None:
            refusal = evidence.refusal(now, strict=strict)
            assert refusal is not None
            raise EvidenceUnavailable(
                f"connection {self.connection.name!r} service {self.alias!r}: {refusal.message}",
                reason=refusal.reason.value,
            )
        key = (evidence.generation, evidence.confirmed_at, evidence.failure is not None)
        if key == self._record_key and self._record is not None:
            if not strict:
                self._record_valid = (evidence, evidence.version, until, self._record)
            return self._record
        view = evidence.view(now)
        assert isinstance(view, Usable)
        record = ObservationSnapshot(
            connection=self.connection.name,
            service=self.alias,
            instances=view.instances,
            evidence=view.evidence,
            revision=view.generation,
            confirmed_at=view.confirmed_at,
            degraded=view.degraded,
            _hold=view.hold,
        )
        if isinstance(view.hold, Hold):
            view.hold.add_consumer(record)
        self._record = record
        self._record_key = key
        if not strict:
            self._record_valid = (evidence, evidence.version, until, record)
        return record

    def close(self) -> None:
        """Close the evidence: every handle sees reason ``closed``. Idempotent."""
        self._drop_record()
        self.evidence.close()
        if not self.cell.closed:
            self.cell.publish(self.evidence.generation)
            self.cell.close()
        if not self.first_outcome.is_set():
            self.first_outcome.set()

    # ------------------------------------------------------------------ refresh task

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The slot's refresh task, run in the owner's task group."""
        runtime = self.connection.runtime
        runtime.live_tasks += 1
        task_status.started()
        try:
            if self.watch_streams > 0:
                await self._run_watching()
            else:
                await self._poll_cycle(self._backoff(), None)
        except Exception:
            # A defect (ours or a provider's) ends this observation only; the
            # owner, its other observations and connections keep running.
            logger.exception(
                "connection %r service %r: the observation failed and is closed",
                self.connection.name,
                self.alias,
            )
        finally:
            runtime.live_tasks -= 1
            self._retire()

    def _backoff(self) -> Backoff:
        retry = self.connection.policy.retry
        return Backoff(retry.initial_backoff_ms / 1000.0, retry.max_backoff_ms / 1000.0)

    def _retire(self) -> None:
        connection = self.connection
        if connection.slots.get(self.alias) is self:
            del connection.slots[self.alias]
        if not self.reclaimed:
            self.reclaimed = True
            connection.runtime.tasks.release(self.task_cost)
        self.close()

    async def _query_once(self) -> bool:
        connection = self.connection
        start = anyio.current_time()
        deadline = start + self._timeout
        snapshot: object = None
        failure: BaseException | None = None
        with anyio.move_on_at(deadline) as scope:
            try:
                snapshot = await connection.provider.query(self.remote, deadline)
            except ProviderFailure as exc:
                failure = exc
            except Exception as exc:
                logger.warning(
                    "connection %r service %r: provider query raised %s",
                    connection.name,
                    self.alias,
                    type(exc).__name__,
                )
                failure = IncompleteSnapshot(f"the provider raised {type(exc).__name__}")
        now = anyio.current_time()
        self.queries += 1
        connection.stats.record_query(now - start)
        if scope.cancelled_caught:
            failure = IncompleteSnapshot(f"the query took longer than {self._timeout}s")
        if failure is not None:
            self._fail(failure, now)
            return False
        return self._accept(snapshot, now)

    def refresh_delay(self) -> float:
        """Seconds to wait after a complete listing before the next poll:
        the provider's ``refresh_delay`` answer capped at the poll interval,
        or the poll interval when it has none (or answers nonsense)."""
        hook = self._refresh_hook
        if hook is None:
            return self._poll
        try:
            delay = hook(self.remote, self._poll)
        except Exception as exc:
            logger.warning(
                "connection %r service %r: refresh_delay raised %s; polling every %ss",
                self.connection.name,
                self.alias,
                type(exc).__name__,
                self._poll,
            )
            return self._poll
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            return self._poll
        if not (math.isfinite(delay) and delay > 0):
            return self._poll
        return min(float(delay), self._poll)

    def _watch_current(self, now: float) -> bool:
        evidence = self.evidence
        return watch_current(
            now,
            None if evidence.failure is not None or evidence.closed else evidence.confirmed_at,
            self._confirm_window,
        )

    def _next_confirmation(self, queried_at: float) -> float:
        evidence = self.evidence
        return next_confirmation(
            queried_at,
            None if evidence.failure is not None else evidence.confirmed_at,
            self._poll,
            self._confirm_window,
        )

    def _settled_static(self) -> bool:
        view = self.evidence.view(anyio.current_time())
        return isinstance(view, Usable) and view.evidence is EvidenceKind.STATIC_FACT

    async def _sleep_until(
        self, wake_at: float, ticket: StreamTicket | None, failed: anyio.Event | None = None
    ) -> str | None:
        """Sleep until ``wake_at``; returns "reclaim", "granted" or "failed" early."""
        while True:
            now = anyio.current_time()
            if self._reclaimable(now):
                self._begin_reclaim()
                return "reclaim"
            if ticket is not None and ticket.granted:
                return "granted"
            if failed is not None and failed.is_set():
                return "failed"
            if now >= wake_at:
                return None
            until = min(wake_at, self._next_idle_check(now))
            if ticket is not None:
                with anyio.move_on_at(until):
                    await ticket.wait_granted()
            elif failed is not None:
                with anyio.move_on_at(until):
                    await failed.wait()
            else:
                await anyio.sleep_until(until)

    async def _poll_cycle(self, backoff: Backoff, ticket: StreamTicket | None) -> str:
        while True:
            ok = await self._query_once()
            if ok:
                backoff.reset()
                delay = math.inf if self._settled_static() else self.refresh_delay()
            else:
                delay = backoff.next_delay()
            outcome = await self._sleep_until(anyio.current_time() + delay, ticket)
            if outcome is not None:
                return outcome

    async def _run_watching(self) -> None:
        streams = self.connection.runtime.streams
        shared = self.connection.provider.capabilities.shared_watch
        ticket = self.connection.request_watch_streams(self.watch_streams, shared=shared)
        if ticket.oversized:
            logger.warning(
                "connection %r service %r: a watch needs %d streams, more than "
                "max_watch_streams (%d); the observation polls instead",
                self.connection.name,
                self.alias,
                self.watch_streams,
                streams.limit,
            )
        backoff = self._backoff()
        try:
            while True:
                if not ticket.granted and await self._poll_cycle(backoff, ticket) == "reclaim":
                    return
                if await self._watch_once(backoff) == "reclaim":
                    return
                delay = backoff.next_delay()
                if await self._sleep_until(anyio.current_time() + delay, None) == "reclaim":
                    return
        finally:
            self.connection.release_watch_streams(ticket)

    async def _watch_once(self, backoff: Backoff) -> str | None:
        """One watch session: a query, the watch, confirmation queries.

        For a provider whose watch takes the query's listing
        (``Capabilities.watch_takes_query``) the query runs while the watch
        opens, in a task of its own: the watch session's end (a failed
        watch cancels it) does not cut the query short, and the session
        waits for it before it ends."""
        if not self.connection.provider.capabilities.watch_takes_query:
            await self._session_query(backoff)
            return await self._watch_session(backoff)
        async with anyio.create_task_group() as queries:

            async def query() -> None:
                try:
                    await self._session_query(backoff)
                finally:
                    held, self._held = self._held, None
                    for failure in held or ():
                        self._fail(failure, anyio.current_time())

            self._held = []
            queries.start_soon(query)
            outcome = await self._watch_session(backoff)
        return outcome

    async def _session_query(self, backoff: Backoff) -> None:
        """A watch session's query; one that answered resets the session backoff."""
        if await self._query_once():
            backoff.reset()

    async def _watch_session(self, backoff: Backoff) -> str | None:
        """The watch and its confirmation queries (see :meth:`_watch_once`)."""
        outcome: str | None = None
        try:
            async with anyio.create_task_group() as tg:
                with anyio.move_on_after(self._timeout) as start_scope:
                    await tg.start(self._watch_task, tg.cancel_scope)
                if start_scope.cancelled_caught:
                    tg.cancel_scope.cancel()
                    self._watch_failed(IncompleteSnapshot("the watch did not start in time"))
                    return None
                queried_at = anyio.current_time()
                failed_at: float | None = None
                while True:
                    # A failure the watch reports wakes the slot: it then
                    # re-reads one poll interval after its last query, and
                    # not before its own share of half a poll interval after
                    # the failure (slots whose shared stream broke together
                    # re-read spread out, not all at once).
                    self._failed = failed = anyio.Event()
                    wake_at = self._next_confirmation(queried_at)
                    if failed_at is not None:
                        wake_at = max(wake_at, failed_at + self._failure_delay)
                    woke = await self._sleep_until(wake_at, None, failed)
                    if woke == "reclaim":
                        outcome = "reclaim"
                        tg.cancel_scope.cancel()
                        break
                    if woke == "failed":
                        failed_at = anyio.current_time()
                        continue
                    if self._watch_current(anyio.current_time()):
                        # The watch confirmed the listing since: no re-read.
                        self.skipped_queries += 1
                        continue
                    queried_at = anyio.current_time()
                    failed_at = None
                    await self._session_query(backoff)
        except Exception as exc:
            self._watch_failed(
                exc
                if isinstance(exc, ProviderFailure)
                else IncompleteSnapshot(f"the watch could not start ({type(exc).__name__})")
            )
        finally:
            self._failed = None
        return outcome

    async def _watch_task(
        self, session: anyio.CancelScope, *, task_status: TaskStatus[None]
    ) -> None:
        runtime = self.connection.runtime
        runtime.live_tasks += 1
        try:
            await self.connection.provider.watch(self.remote, self, task_status=task_status)
            failure: ProviderFailure = IncompleteSnapshot("the watch ended")
        except ProviderFailure as exc:
            failure = exc
        except Exception as exc:
            logger.warning(
                "connection %r service %r: watch raised %s",
                self.connection.name,
                self.alias,
                type(exc).__name__,
            )
            failure = IncompleteSnapshot(f"the watch raised {type(exc).__name__}")
        finally:
            runtime.live_tasks -= 1
        self._watch_failed(failure)
        # End the session; the slot backs off and starts a new one.
        session.cancel()

    def __repr__(self) -> str:
        return (
            f"<Slot {self.connection.name}/{self.alias} handles={len(self.handles)} "
            f"queries={self.queries} {self.evidence!r}>"
        )


_PLAIN_CALLABLES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
)


def _is_async_callable(submit: object) -> bool:
    if inspect.iscoroutinefunction(submit):
        return True
    if isinstance(submit, _PLAIN_CALLABLES):
        return False
    # An object whose class (or a base) defines ``async def __call__``.
    for klass in type(submit).__mro__:
        call = vars(klass).get("__call__")
        if call is not None:
            return inspect.iscoroutinefunction(call)
    return False


def _check_submit(submit: object) -> None:
    if not callable(submit):
        raise TypeError(f"submit must be a synchronous callable, not {type(submit).__name__}")
    if _is_async_callable(submit):
        raise TypeError(
            "submit must be a short synchronous closure: an async function would "
            "run after the evidence check, when the evidence may have changed"
        )


def _submitted(result: T) -> T:
    if inspect.iscoroutine(result):
        result.close()
        raise TypeError(
            "submit returned a coroutine: its work would start after the evidence "
            "check; submit synchronously inside the closure instead"
        )
    return result


class Observation:
    """A handle on a shared observation. Has no close rights.

    Many handles share one slot; each keeps its own cursor for
    :meth:`changed`. Dropping every handle lets the slot be reclaimed after
    ``idle_timeout_ms``.
    """

    __slots__ = ("__weakref__", "_seen", "_slot")

    def __init__(self, slot: Slot) -> None:
        self._slot = slot
        # Set by observe() right before it returns the handle (_look).
        self._seen: tuple[int, Reason | None] = (-1, None)
        slot.handles.add(self)

    def _look(self, now: float) -> None:
        self._seen = self._slot.state_key(now)

    @property
    def connection(self) -> str:
        return self._slot.connection.name

    @property
    def service(self) -> str:
        return self._slot.alias

    def _usable(self, strict: bool) -> ObservationSnapshot:
        return self._slot.record(self._slot.clock(), strict=strict)

    def _usable_at(self, now: float, strict: bool) -> ObservationSnapshot:
        return self._slot.record(now, strict=strict)

    def snapshot(self, *, strict: bool = False) -> ObservationSnapshot:
        """The listing that may be used now, for diagnosis and selection.

        ``strict=True`` refuses evidence once a refresh failed (no grace).
        Raises :class:`~nadisc.EvidenceUnavailable` with ``reason`` otherwise.
        """
        return self._usable(strict)

    def submit_if_current(self, submit: Callable[[ObservationSnapshot], T]) -> T:
        """Re-check the evidence and run ``submit(snapshot)`` at once.

        ``submit`` is a short synchronous closure (choose an instance, hand
        the request to a transport): nothing can change between the check
        and the call. It must not wait or re-enter the owner. Permission to
        send is not network fencing: a submitted request may still arrive.

        An ``async`` closure (``async def``, an object with ``async def
        __call__``, a ``functools.partial`` of either) is refused with
        ``TypeError`` before the check: its body would run later, after the
        evidence may have changed. So is a closure that *returns* an awaitable
        coroutine (it is closed unrun): the work it stands for would start
        only when awaited. Hand the request over inside the closure, or
        return the chosen instance and send right after, with no await in
        between.
        """
        _check_submit(submit)
        return _submitted(submit(self._usable(False)))

    def submit_if_current_strict(self, submit: Callable[[ObservationSnapshot], T]) -> T:
        """As :meth:`submit_if_current`, refusing any evidence after a failure."""
        _check_submit(submit)
        return _submitted(submit(self._usable(True)))

    def changes(self, deadline: float | None = None) -> ObservationChanges:
        """``async for state in observation.changes(deadline)``: the state now, then each change.

        Each item is the :class:`ObservationSnapshot` that may be used at
        that moment, or the :class:`~nadisc.EvidenceUnavailable` saying why
        none may (stale, revoked, closed...). Latest-only: a consumer that
        is slow to ask again gets the newest state, never a backlog of the
        ones in between. The iteration ends after the close was yielded.
        ``deadline`` (absolute event-loop time) bounds the whole iteration:
        ``DeadlineExceeded`` when it passes; ``None`` (the default) means no
        deadline beyond the caller's cancel scope. It shares this handle's
        cursor with :meth:`changed`: iterate one at a time per handle.
        """
        return ObservationChanges(self, deadline)

    def _state(self) -> ObservationSnapshot | EvidenceUnavailable:
        try:
            return self._usable(False)
        except EvidenceUnavailable as exc:
            return exc

    async def changed(self, deadline: float | None = None) -> None:
        """Wait for a real change or a real expiry of the evidence.

        Returns when the observation's generation moved (new listing, failure,
        revocation, close) or an age/grace threshold of the evidence passed
        since this handle last looked. Raises ``DeadlineExceeded`` only when
        ``deadline`` passes (or was NaN/past on entry), and
        ``EvidenceUnavailable(reason="closed")`` once the close was seen.
        Static evidence never expires, however long one waits. ``deadline``
        ``None`` (the default) waits with no deadline beyond the caller's
        cancel scope.

        The cursor belongs to the handle, not to the waiting task: two tasks
        waiting on one handle share it, so a change wakes whichever looks
        first and the other goes on waiting for the next one. Give each
        waiting task a handle of its own (another ``observe()`` of the same
        service shares the observation and costs no query).
        """
        slot = self._slot
        if deadline is None:
            deadline = math.inf
        check_deadline(deadline, slot.clock())
        # A call that waited returns as soon as it sees the change: the wait
        # was its checkpoint (no further pass of the loop before returning).
        waited = False
        while True:
            now = slot.clock()
            key = slot.state_key(now)
            if key != self._seen:
                self._seen = key
                if not waited:
                    await anyio.lowlevel.checkpoint()
                return
            if slot.evidence.closed:
                if not waited:
                    await anyio.lowlevel.checkpoint()
                raise EvidenceUnavailable(
                    f"connection {slot.connection.name!r} service {slot.alias!r}: "
                    "the observation is closed",
                    reason="closed",
                )
            if now >= deadline:
                raise DeadlineExceeded("the deadline passed before the observation changed")
            until = min(deadline, slot.key_expiry(now))
            reader = slot.cell.reader()
            await slot.wait(reader, reader.revision, until)
            waited = True

    def __repr__(self) -> str:
        return f"<Observation {self.connection}/{self.service}>"


class ObservationChanges:
    """The async iterator of :meth:`Observation.changes` (not constructed directly).

    A class rather than an async generator: abandoning it half-way leaves
    nothing for the garbage collector to finalise.
    """

    __slots__ = ("_deadline", "_done", "_first", "_observation")

    def __init__(self, observation: Observation, deadline: float | None) -> None:
        if deadline is not None:
            check_deadline_value(deadline)
        self._observation = observation
        self._deadline = math.inf if deadline is None else deadline
        self._first = True
        self._done = False

    def __aiter__(self) -> AsyncIterator[ObservationSnapshot | EvidenceUnavailable]:
        return self

    async def __anext__(self) -> ObservationSnapshot | EvidenceUnavailable:
        if self._done:
            raise StopAsyncIteration
        observation = self._observation
        if self._first:
            self._first = False
            check_deadline(self._deadline, observation._slot.clock())
            observation._look(observation._slot.clock())
            await anyio.lowlevel.checkpoint()
        else:
            try:
                await observation.changed(self._deadline)
            except EvidenceUnavailable:
                # The close was already seen (and yielded) through this handle.
                self._done = True
                raise StopAsyncIteration from None
        state = observation._state()
        if isinstance(state, EvidenceUnavailable) and state.reason == "closed":
            self._done = True
        return state

    def __repr__(self) -> str:
        return f"<ObservationChanges {self._observation!r} done={self._done}>"
