"""Transactional reconciliation of discovery snapshots into a live balance.

:class:`DiscoveryBalance` owns a :class:`~poise.Balance` whose endpoints
mirror the members of the latest applied :class:`~poise.Snapshot`. Applying a
newer snapshot is one transaction::

    1 validate   not closed; membership not edited outside the reconciler
                 (ReconcileError, O(1)); lineage (ForeignSnapshot), revision
                 (StaleRevision; equal = no-op), identities (DuplicateIdentity)
    2 classify   retained  same key, same allocation: the whole Endpoint object
                           is kept (service, reservation, quarantine, load)
                 added     new key
                 rebuilt   known key, new allocation (an upsert, even of an
                           equal value): a new service generation
                 removed   key gone from the snapshot
    3 stage      the EndpointFactory builds every added and rebuilt generation
    4 commit     re-check step 1's first two points (an async stage awaited:
                 close() or an outside edit may have happened meanwhile), then
                 balance.splice(departed, rebuilt in place, appended) when the
                 new order is the old one minus departures plus a tail (always,
                 for a directory's snapshots), else balance.replace_endpoints(...)
                 in snapshot order; then the applied revision advances

Steps 1-3 change nothing that anyone can observe. If any of them (or the
re-check of step 4) fails, the live endpoints, their order, readiness,
quarantine and load, and the applied revision are exactly as before, every
staged service is closed, and the error is a :class:`~poise.ReconcileError`
(a factory failure or a wrong-shaped factory result is a
:class:`~poise.FactoryError` chaining the cause).
External effects a factory performed before failing cannot be undone, so a
factory should not publish its service anywhere before returning it.

Draining members keep their endpoint with ``eligible = False`` (new traffic
stops at once; calls already dispatched continue). Retired generations
(removed, or replaced by a rebuild) are detached at commit; their services
are closed when the last call dispatched to them ends, so in-flight calls
complete normally. To know when that is, every generation's tracker is
wrapped in a thin counter that forwards ``load`` and ``start`` to the tracker
the factory returned (available as ``endpoint.tracker.inner``).

The classification is a sans-IO function, :func:`plan_reconcile`, over plain
data. Cost of one application: O(changes) when the directory's change log
reaches back to the applied revision, else one C-level pass of dictionary
lookups over the snapshot (no per-member allocation for retained members);
then one factory call per added or rebuilt member, O(changes) bookkeeping,
and the balance's commit: a splice, O(changes) in Python plus C-level list
copies (and a C-level renumbering behind the first removal), or O(n) when
the whole list must be replaced. An equal revision is O(1).
"""

from __future__ import annotations

import inspect
import logging
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, filterfalse, islice
from operator import is_not
from typing import Generic, TypeVar, cast, overload

import anyio
import anyio.lowlevel

from ._balance import Balance, ReadinessObserver
from ._context import ContextProjection
from ._directory import Backend, Lineage, Member, Snapshot, SnapshotReader
from ._endpoint import Endpoint
from ._errors import FactoryError, ForeignSnapshot, ReconcileError, StaleRevision
from ._load import InFlight
from ._outlier import OutlierDetector
from ._protocols import LoadGuard, LoadTracker, Policy, Service
from ._service import close_service

__all__ = [
    "AppliedState",
    "AsyncEndpointFactory",
    "DiscoveryBalance",
    "EndpointFactory",
    "GenerationTracker",
    "ReconcilePlan",
    "ReconcileReport",
    "SyncEndpointFactory",
    "in_flight_factory",
    "plan_reconcile",
]

logger = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
E = TypeVar("E")

SyncEndpointFactory = Callable[[Hashable, Backend], tuple[Service[Req, Resp], LoadTracker]]
"""``factory(key, backend) -> (service, tracker)``."""
AsyncEndpointFactory = Callable[
    [Hashable, Backend], Awaitable[tuple[Service[Req, Resp], LoadTracker]]
]
"""``async factory(key, backend) -> (service, tracker)``; needs ``apply_snapshot_async``."""
EndpointFactory = SyncEndpointFactory[Req, Resp] | AsyncEndpointFactory[Req, Resp]


# -- the report -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What one application did, for control-plane observability.

    ``retained + added + rebuilt`` is the new endpoint count; ``removed`` the
    endpoints that left; ``draining`` how many live endpoints are draining
    (ineligible) after it. ``applied`` is False for an equal revision (a no-op
    that reports the current pool as retained).
    """

    revision: int
    retained: int
    added: int
    rebuilt: int
    removed: int
    draining: int
    applied: bool = True


# -- the sans-IO planner -----------------------------------------------------------


@dataclass(slots=True)
class AppliedState(Generic[E]):
    """What a reconciler has applied: revision, lineage, members and their endpoints.

    ``members`` is the applied snapshot's key-to-member mapping (shared, never
    mutated); ``endpoints`` maps the same keys to the live endpoint values and
    ``order`` lists those values in member order. ``revision`` is -1 before
    the first application. ``position_of(endpoint)`` may tell an endpoint's
    index in ``order`` in O(1) (it is checked; ``None`` or a wrong answer
    falls back to a search). ``directory_order`` says that ``order`` is the
    directory's own member order at ``revision`` (the snapshot applied last
    was taken from the directory, not built by hand); only then may a later
    snapshot's change log stand in for comparing every member.
    """

    revision: int = -1
    lineage: Lineage | None = None
    members: Mapping[Hashable, Member] = field(default_factory=dict)
    endpoints: dict[Hashable, E] = field(default_factory=dict)
    order: list[E] = field(default_factory=list)
    draining: int = 0
    position_of: Callable[[E], int | None] | None = None
    directory_order: bool = True


@dataclass(slots=True)
class ReconcilePlan(Generic[E]):
    """The classification of one snapshot against an :class:`AppliedState`.

    ``order`` is the new endpoint list in snapshot order with ``None`` at the
    positions ``build`` lists (``(position, member)`` of every added or
    rebuilt member, in snapshot order). ``replaced`` are the old generations
    of rebuilt members, ``removed`` the ``(key, endpoint)`` pairs that leave,
    ``flips`` the retained endpoints whose draining state changes.

    ``departed`` and ``in_place`` describe the same change incrementally,
    when it has that shape: the new order is the applied order without the
    endpoints of the ``departed`` keys (removed, or rebuilt and moved to the
    end), with the first ``in_place`` entries of ``build`` rebuilt at the
    place of the endpoint with the same key, and the other ``build`` entries
    appended. ``departed`` is ``None`` when the order changed in another way
    (a hand-built snapshot that reorders members or inserts one in the
    middle); the commit then replaces the whole list.
    """

    snapshot: Snapshot
    order: list[E | None]
    build: list[tuple[int, Member]]
    replaced: list[E]
    removed: list[tuple[Hashable, E]]
    flips: list[tuple[E, Member]]
    added: int
    draining: int
    departed: list[Hashable] | None = None
    in_place: int = 0

    @property
    def rebuilt(self) -> int:
        return len(self.replaced)

    @property
    def retained(self) -> int:
        return len(self.order) - len(self.build)

    def report(self) -> ReconcileReport:
        return ReconcileReport(
            revision=self.snapshot.revision,
            retained=self.retained,
            added=self.added,
            rebuilt=self.rebuilt,
            removed=len(self.removed),
            draining=self.draining,
        )


# Above these, comparing every member is cheaper than following the change log
# (the second bound only when departures must be found by linear search).
_DELTA_MAX_FRACTION = 4
_DELTA_MAX_MOVES = 256


def plan_reconcile(state: AppliedState[E], snapshot: Snapshot) -> ReconcilePlan[E] | None:
    """Validate ``snapshot`` against ``state`` and classify its members.

    Returns ``None`` for an equal revision (nothing to do, O(1)). Raises
    :class:`~poise.ForeignSnapshot`, :class:`~poise.StaleRevision` or
    :class:`~poise.ReconcileError`; never mutates ``state``. Pure and
    synchronous.

    Cost: when ``snapshot`` comes from the directory whose earlier snapshot
    ``state`` holds and few members changed, the directory's change log
    names them and classification is O(changes) plus C-level list copies;
    otherwise one O(n) pass of dictionary lookups (in C) finds the changed
    members and only those are examined in Python.
    """
    if not isinstance(snapshot, Snapshot):
        raise ReconcileError(f"expected a Snapshot, got {type(snapshot).__name__}")
    lineage = state.lineage
    if lineage is not None and snapshot.lineage is not lineage:
        raise ForeignSnapshot(
            f"snapshot of {snapshot.lineage!r} cannot be applied after snapshots of {lineage!r}"
        )
    revision = snapshot.revision
    if revision == state.revision:
        return None
    if revision < state.revision:
        raise StaleRevision(revision, state.revision)
    live = state.endpoints
    if not (len(state.members) == len(live) == len(state.order)):
        raise ReconcileError(
            f"live identities are inconsistent: {len(live)} endpoints and "
            f"{len(state.order)} ordered for {len(state.members)} applied members"
        )
    if state.lineage is not None and state.directory_order:
        entries = snapshot._changes_since(state.revision)
        if entries is not None and len(entries) <= len(live) // _DELTA_MAX_FRACTION + 16:
            plan = _plan_from_log(state, snapshot, entries)
            if plan is not None:
                return plan
    return _plan_full(state, snapshot)


def _plan_full(state: AppliedState[E], snapshot: Snapshot) -> ReconcilePlan[E]:
    old_members = state.members
    new_members = snapshot._by_key
    live = state.endpoints
    # Member objects are shared between snapshots for untouched keys, so one
    # lookup and one identity test classify a retained member. The passes
    # below run in C (map/compress); only changed positions reach Python.
    olds = list(map(old_members.get, new_members))
    order: list[E | None] = list(map(live.get, new_members))
    changed = compress(count(), map(is_not, olds, new_members.values()))
    members = tuple(new_members.values()) if olds else ()
    build: list[tuple[int, Member]] = []
    replaced: list[E] = []
    flips: list[tuple[E, Member]] = []
    added = 0
    draining = state.draining
    for position in changed:
        member = members[position]
        old = olds[position]
        if old is None:
            added += 1
            build.append((position, member))
            if member.draining:
                draining += 1
            continue
        draining += member.draining - old.draining
        if old.allocation is member.allocation:
            if old.draining != member.draining:
                flips.append((cast("E", order[position]), member))
        else:
            replaced.append(cast("E", order[position]))
            order[position] = None
            build.append((position, member))
    removed: list[tuple[Hashable, E]] = []
    if len(order) - added != len(old_members):
        for key in filterfalse(new_members.__contains__, old_members):  # C-level filter
            removed.append((key, live[key]))
            if old_members[key].draining:
                draining -= 1
    shape = _splice_shape(state, order, build, removed)
    return ReconcilePlan(
        snapshot=snapshot,
        order=order,
        build=build,
        replaced=replaced,
        removed=removed,
        flips=flips,
        added=added,
        draining=draining,
        departed=None if shape is None else shape[0],
        in_place=0 if shape is None else shape[1],
    )


def _splice_shape(
    state: AppliedState[E],
    order: list[E | None],
    build: list[tuple[int, Member]],
    removed: list[tuple[Hashable, E]],
) -> tuple[list[Hashable], int] | None:
    """``(departed keys, in-place count)`` if ``order`` is a splice of the applied order.

    The trailing build positions are the appended tail (a rebuilt member
    there departs from its old place); every other build position must hold
    a rebuilt member at its old place, and the retained endpoints must be
    the applied order minus the departures. Checked with one C-level copy
    and comparison; ``None`` when the shape differs.
    """
    live = state.endpoints
    k = len(build)
    tail = len(order)
    while k and build[k - 1][0] == tail - 1:
        k -= 1
        tail -= 1
    departed = [key for key, _ in removed]
    departed += [m.key for _, m in islice(build, k, None) if m.key in live]
    if len(departed) > _DELTA_MAX_MOVES and state.position_of is None:
        return None  # finding them would be a linear search each
    position = _positioner(state)
    gone = [position(live[key]) for key in departed]
    expected = _drop(state.order, gone)
    if len(expected) != tail:
        return None
    for at, member in islice(build, k):
        if expected[at] is not live.get(member.key):
            return None
        expected[at] = None
    if expected != order[:tail]:
        return None
    return departed, k


def _positioner(state: AppliedState[E]) -> Callable[[E], int]:
    """Where an endpoint stands in ``state.order``: O(1) with a right ``position_of``."""
    old_order = state.order
    position_of = state.position_of

    def position(endpoint: E) -> int:
        if position_of is not None:
            guess = position_of(endpoint)
            if guess is not None and 0 <= guess < len(old_order) and old_order[guess] is endpoint:
                return guess
        return old_order.index(endpoint)

    return position


def _drop(items: list[E], positions: list[int]) -> list[E | None]:
    """A new list: ``items`` without the entries at ``positions`` (C-level slices)."""
    kept: list[E | None] = []
    start = 0
    for at in sorted(positions):
        kept += items[start:at]
        start = at + 1
    kept += items[start:]
    return kept


def _plan_from_log(
    state: AppliedState[E], snapshot: Snapshot, entries: list[tuple[Hashable, bool]]
) -> ReconcilePlan[E] | None:
    """Classify only the keys the directory's log names; ``None``: use the full pass.

    Directory order is dict insertion order: a member that existed at the
    applied revision and was never deleted since keeps its relative place,
    and every member inserted since (new, or deleted and inserted again) is
    at the end, in insertion order. So the new order is the old one minus
    the departed positions, plus a tail read backwards from the snapshot.
    """
    old_members = state.members
    new_members = snapshot._by_key
    live = state.endpoints
    old_order = state.order
    deleted = {key for key, was_deleted in entries if was_deleted}
    if len(deleted) > _DELTA_MAX_MOVES and state.position_of is None:
        # Without position hints every departure is a linear search.
        return None
    position = _positioner(state)
    departed: list[int] = []
    departed_keys: list[Hashable] = []
    in_place: list[tuple[int, Member]] = []
    replaced: list[E] = []
    removed: list[tuple[Hashable, E]] = []
    flips: list[tuple[E, Member]] = []
    added = 0
    tail = 0
    draining = state.draining
    for key in dict.fromkeys(key for key, _ in entries):
        old = old_members.get(key)
        member = new_members.get(key)
        if old is member:
            continue  # absent before and after (added, then removed)
        if old is None:
            assert member is not None
            added += 1
            tail += 1
            draining += member.draining
            continue
        endpoint = live[key]
        if member is None:
            removed.append((key, endpoint))
            departed.append(position(endpoint))
            departed_keys.append(key)
            draining -= old.draining
            continue
        draining += member.draining - old.draining
        if key in deleted:
            # Deleted and inserted again: a new generation at the end.
            replaced.append(endpoint)
            departed.append(position(endpoint))
            departed_keys.append(key)
            tail += 1
        elif old.allocation is member.allocation:
            if old.draining != member.draining:
                flips.append((endpoint, member))
        else:
            replaced.append(endpoint)
            in_place.append((position(endpoint), member))
    order: list[E | None]
    if departed:
        departed.sort()
        order = []
        start = 0
        for gone in departed:
            order += old_order[start:gone]
            start = gone + 1
        order += old_order[start:]
    else:
        order = list(old_order)
    build: list[tuple[int, Member]] = []
    for old_position, member in in_place:
        new_position = old_position - bisect_left(departed, old_position)
        order[new_position] = None
        build.append((new_position, member))
    build.sort(key=_first)
    if tail:
        start = len(order)
        arrivals = list(islice(reversed(new_members.values()), tail))
        arrivals.reverse()
        for offset, member in enumerate(arrivals):
            old = old_members.get(member.key)
            if old is not None and member.key not in deleted:
                return None  # not the shape the log promised: compare everything
            order.append(None)
            build.append((start + offset, member))
    if len(order) != len(new_members):
        return None
    return ReconcilePlan(
        snapshot=snapshot,
        order=order,
        build=build,
        replaced=replaced,
        removed=removed,
        flips=flips,
        added=added,
        draining=draining,
        departed=departed_keys,
        in_place=len(in_place),
    )


def _first(item: tuple[int, Member]) -> int:
    return item[0]


# -- per-generation load accounting ------------------------------------------------------


class GenerationTracker:
    """Wraps one generation's tracker to count its open guards.

    ``load`` and ``start`` forward to :attr:`inner` (the tracker the factory
    returned). When the generation is retired, its service is closed as soon
    as no guard is open, so calls dispatched before retirement complete
    normally.
    """

    __slots__ = ("_closed", "_inner", "_open", "_retired", "_service")

    def __init__(self, inner: LoadTracker, service: object) -> None:
        self._inner = inner
        self._service = service
        self._open = 0
        self._retired = False
        self._closed = False

    @property
    def inner(self) -> LoadTracker:
        return self._inner

    @property
    def open_guards(self) -> int:
        return self._open

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def service_closed(self) -> bool:
        return self._closed

    def load(self, now: float) -> float:
        return self._inner.load(now)

    def start(self, now: float) -> LoadGuard:
        guard = self._inner.start(now)
        self._open += 1
        return _GenerationGuard(self, guard)

    def retire(self) -> None:
        """Close the service now if no call is open, else when the last one ends."""
        self._retired = True
        if self._open == 0:
            self._close()

    def _ended(self) -> None:
        self._open -= 1
        if self._retired and self._open == 0:
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            _close_quietly(self._service)

    def __repr__(self) -> str:
        state = " retired" if self._retired else ""
        return f"<GenerationTracker open={self._open}{state} inner={self._inner!r}>"


class _GenerationGuard:
    __slots__ = ("_generation", "_inner")

    def __init__(self, generation: GenerationTracker, inner: LoadGuard) -> None:
        self._generation: GenerationTracker | None = generation
        self._inner = inner

    def complete(self, now: float, *, failed: bool = False) -> None:
        generation = self._generation
        if generation is not None:
            self._generation = None
            try:
                self._inner.complete(now, failed=failed)
            finally:
                generation._ended()

    def cancel(self, now: float) -> None:
        generation = self._generation
        if generation is not None:
            self._generation = None
            try:
                self._inner.cancel(now)
            finally:
                generation._ended()


def _close_quietly(service: object) -> None:
    # Cleanup runs after the outcome is decided (rollback, retirement): a
    # failing close is logged, never allowed to mask that outcome.
    try:
        close_service(service)
    except Exception:
        logger.exception("closing service %s failed", type(service).__name__)


# -- factories ------------------------------------------------------------------------------


def _is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


@overload
def in_flight_factory(
    fn: Callable[[Hashable, Backend], Awaitable[Service[Req, Resp]]],
) -> AsyncEndpointFactory[Req, Resp]: ...


@overload
def in_flight_factory(
    fn: Callable[[Hashable, Backend], Service[Req, Resp]],
) -> SyncEndpointFactory[Req, Resp]: ...


def in_flight_factory(
    fn: Callable[[Hashable, Backend], Service[Req, Resp]]
    | Callable[[Hashable, Backend], Awaitable[Service[Req, Resp]]],
) -> EndpointFactory[Req, Resp]:
    """Turn ``fn(key, backend) -> service`` into an :data:`EndpointFactory`.

    Every service generation gets a fresh, unbounded :class:`~poise.InFlight`
    tracker. An ``async def`` ``fn`` gives an async factory.
    """
    if not callable(fn):
        raise TypeError(f"in_flight_factory needs a callable, got {type(fn).__name__}")
    if _is_async_callable(fn):
        async_fn = cast("Callable[[Hashable, Backend], Awaitable[Service[Req, Resp]]]", fn)

        async def async_factory(
            key: Hashable, backend: Backend
        ) -> tuple[Service[Req, Resp], LoadTracker]:
            return await async_fn(key, backend), InFlight()

        return async_factory
    sync_fn = cast("Callable[[Hashable, Backend], Service[Req, Resp]]", fn)

    def factory(key: Hashable, backend: Backend) -> tuple[Service[Req, Resp], LoadTracker]:
        return sync_fn(key, backend), InFlight()

    return factory


def _service_like(value: object) -> bool:
    return callable(getattr(value, "poll_ready", None)) and callable(getattr(value, "call", None))


def _checked_result(key: Hashable, result: object) -> tuple[Service[object, object], LoadTracker]:
    """The factory result as (service, tracker), or FactoryError (closing what it can)."""
    if isinstance(result, tuple) and len(result) == 2:
        service, tracker = result
        service_ok = _service_like(service)
        tracker_ok = callable(getattr(tracker, "load", None)) and callable(
            getattr(tracker, "start", None)
        )
        if service_ok and tracker_ok:
            return cast("tuple[Service[object, object], LoadTracker]", result)
        _close_services_in(result)
        what = "service (poll_ready, call)" if not service_ok else "load tracker (load, start)"
        got = type(service if not service_ok else tracker).__name__
        raise FactoryError(
            f"factory for {key!r} returned a {got} where a {what} was expected",
            key=key,
        )
    _close_services_in(result)
    raise FactoryError(
        f"factory for {key!r} must return a (service, tracker) tuple, got {type(result).__name__};"
        " wrap a service-only factory with in_flight_factory()",
        key=key,
    )


def _close_services_in(result: object) -> None:
    # A wrong-shaped result is discarded: close every service in it, so a
    # factory bug never leaks a connection.
    items = result if isinstance(result, tuple | list) else (result,)
    for item in items:
        if _service_like(item):
            _close_quietly(item)


# -- the reconciling balance ------------------------------------------------------------------


class DiscoveryBalance(Generic[Req, Resp]):
    """A :class:`~poise.Balance` kept in step with discovery snapshots.

    ``DiscoveryBalance(policy, factory, context=..., readiness_observer=...,
    clock=..., outlier_detector=...)``: the keyword arguments go to the inner
    balance (the detector keys endpoints by their snapshot key, so an
    ejection outlives a new generation of the same key). The factory
    is called as ``factory(key, backend)`` for every new service generation
    and returns ``(service, tracker)`` (see :func:`in_flight_factory`); it may
    be ``async``, in which case use :meth:`apply_snapshot_async`.

    Membership is edited only through snapshots: do not push, remove,
    replace or splice endpoints on :attr:`balance` directly. Such an edit is
    detected in O(1) through the balance's edit count, and every later
    application raises :class:`~poise.ReconcileError` instead of silently
    overwriting it. Readiness, reset and statistics are available there.
    """

    __slots__ = (
        "_async_factory",
        "_balance",
        "_busy",
        "_closed",
        "_commits",
        "_done",
        "_edits",
        "_factory",
        "_state",
    )

    def __init__(
        self,
        policy: Policy[object] | Policy[None] | Policy[Req],
        factory: EndpointFactory[Req, Resp],
        *,
        context: ContextProjection[Req, object] | None = None,
        readiness_observer: ReadinessObserver | None = None,
        clock: Callable[[], float] = anyio.current_time,
        outlier_detector: OutlierDetector | None = None,
    ) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {type(factory).__name__}")
        self._factory = factory
        self._async_factory = _is_async_callable(factory)
        self._balance: Balance[Req, Resp] = Balance(
            cast("Policy[None]", policy),
            context=cast("None", context),
            readiness_observer=readiness_observer,
            clock=clock,
            outlier_detector=outlier_detector,
        )
        self._state: AppliedState[Endpoint[Req, Resp]] = AppliedState(position_of=_index_of)
        self._commits = 0
        # The balance's edit count after our last commit: if it moved, someone
        # edited membership directly and only a whole-list commit restores it.
        self._edits = self._balance._edits
        self._busy = False
        self._done: anyio.Event | None = None
        self._closed = False

    # -- views ------------------------------------------------------------------

    @property
    def balance(self) -> Balance[Req, Resp]:
        """The live balance (readiness, statistics, reset)."""
        return self._balance

    @property
    def revision(self) -> int:
        """The applied snapshot revision; -1 before the first application."""
        return self._state.revision

    @property
    def lineage(self) -> Lineage | None:
        return self._state.lineage

    @property
    def endpoints(self) -> tuple[Endpoint[Req, Resp], ...]:
        return self._balance.endpoints

    def endpoint(self, key: Hashable) -> Endpoint[Req, Resp]:
        return self._balance.endpoint(key)

    @property
    def draining(self) -> int:
        return self._state.draining

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._balance)

    def __repr__(self) -> str:
        return (
            f"<DiscoveryBalance revision={self._state.revision} endpoints={len(self._balance)} "
            f"draining={self._state.draining}>"
        )

    # -- applying snapshots -----------------------------------------------------------

    def apply_snapshot(self, snapshot: Snapshot) -> ReconcileReport:
        """Apply ``snapshot`` as one transaction (see the module docstring).

        Needs a synchronous factory: an ``async`` factory is refused with
        :class:`~poise.FactoryError` before anything happens.
        """
        plan = self._plan(snapshot)
        if plan is None:
            return self._noop_report()
        if plan.build and self._async_factory:
            raise FactoryError(
                "the endpoint factory is async; use `await apply_snapshot_async(snapshot)`",
                key=plan.build[0][1].key,
            )
        self._busy = True
        staged: list[Endpoint[Req, Resp]] = []
        try:
            for _position, member in plan.build:
                staged.append(self._stage(member, self._call_sync(member)))
        except BaseException as exc:
            self._staging_failed(staged, member, exc)
            raise
        finally:
            self._busy = False
        return self._commit(plan, staged)

    def _staging_failed(
        self, staged: list[Endpoint[Req, Resp]], member: Member, exc: BaseException
    ) -> None:
        """Roll a failed staging back: close what was staged, and turn a
        factory's own exception into :class:`FactoryError` (the caller
        re-raises anything else, cancellation included, unchanged)."""
        self._discard(staged)
        if isinstance(exc, Exception) and not isinstance(exc, FactoryError):
            raise FactoryError(
                f"factory for {member.key!r} raised {type(exc).__name__}: {exc}",
                key=member.key,
            ) from exc

    async def apply_snapshot_async(self, snapshot: Snapshot) -> ReconcileReport:
        """Like :meth:`apply_snapshot`, awaiting async factories while staging.

        All or nothing: if a factory fails, or this call is cancelled while
        staging, every staged service is closed and nothing is committed. The
        commit itself is synchronous. Concurrent calls are applied one after
        the other. Always checkpoints.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        while self._busy:
            # Another application is staging; it will commit or roll back.
            done = self._done
            if done is None:
                done = self._done = anyio.Event()
            await done.wait()
        plan = self._plan(snapshot)
        if plan is None or not plan.build:
            report = self._noop_report() if plan is None else self._commit(plan, [])
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return report
        self._busy = True
        staged: list[Endpoint[Req, Resp]] = []
        try:
            for _position, member in plan.build:
                result: object = self._factory(member.key, member.backend)
                if inspect.isawaitable(result):
                    result = await result
                staged.append(self._stage(member, result))
                if self._closed:
                    break  # the commit refuses and closes what was staged
        except BaseException as exc:
            self._staging_failed(staged, member, exc)
            raise
        finally:
            self._busy = False
            done, self._done = self._done, None
            if done is not None:
                done.set()
        report = self._commit(plan, staged)
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return report

    def sync(self, reader: SnapshotReader) -> ReconcileReport:
        """One atomic ``reader.load()`` and :meth:`apply_snapshot`. No polling, no task."""
        return self.apply_snapshot(reader.load())

    def close(self) -> None:
        """Detach every endpoint and close its service (when its calls end). Idempotent.

        An :meth:`apply_snapshot_async` that is staging at the time stops
        after its current factory call, closes what it staged and raises
        :class:`~poise.ReconcileError`; nothing it staged is ever committed.
        """
        if self._closed:
            return
        self._closed = True
        state = self._state
        live = list(state.endpoints.values())
        self._balance.replace_endpoints([])
        self._edits = self._balance._edits
        state.endpoints = {}
        state.order = []
        state.members = {}
        state.draining = 0
        for endpoint in live:
            _retire(endpoint)

    # -- internals ----------------------------------------------------------------------------

    def _plan(self, snapshot: Snapshot) -> ReconcilePlan[Endpoint[Req, Resp]] | None:
        if self._closed:
            raise ReconcileError("the discovery balance is closed")
        if self._busy:
            raise ReconcileError(
                "another application is staging; apply snapshots from one task at a time"
            )
        self._check_membership()
        return plan_reconcile(self._state, snapshot)

    def _check_membership(self) -> None:
        """ReconcileError if the balance's membership was edited by anyone else. O(1)."""
        balance = self._balance
        if balance._edits != self._edits:
            raise ReconcileError(
                f"the membership of the balance was edited outside this reconciler "
                f"({len(balance)} endpoints now, {len(self._state.endpoints)} applied): "
                "edit membership through snapshots only"
            )

    def _noop_report(self) -> ReconcileReport:
        state = self._state
        return ReconcileReport(
            revision=state.revision,
            retained=len(state.endpoints),
            added=0,
            rebuilt=0,
            removed=0,
            draining=state.draining,
            applied=False,
        )

    def _call_sync(self, member: Member) -> object:
        result: object = self._factory(member.key, member.backend)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise FactoryError(
                f"factory for {member.key!r} returned an awaitable; declare an async "
                "factory with `async def` and use `await apply_snapshot_async(snapshot)`",
                key=member.key,
            )
        return result

    def _stage(self, member: Member, result: object) -> Endpoint[Req, Resp]:
        service, tracker = _checked_result(member.key, result)
        backend = member.backend
        try:
            return Endpoint(
                member.key,
                cast("Service[Req, Resp]", service),
                weight=backend.weight,
                eligible=not member.draining,
                metadata=backend,
                tracker=GenerationTracker(tracker, service),
            )
        except BaseException:
            _close_quietly(service)
            raise

    @staticmethod
    def _discard(staged: Sequence[Endpoint[Req, Resp]]) -> None:
        for endpoint in staged:
            _retire(endpoint)

    def _commit(
        self,
        plan: ReconcilePlan[Endpoint[Req, Resp]],
        staged: Sequence[Endpoint[Req, Resp]],
    ) -> ReconcileReport:
        try:
            # An async application staged with awaits: the reconciler may have
            # been closed, or the membership edited, in the meantime.
            if self._closed:
                raise ReconcileError("the discovery balance was closed while staging")
            self._check_membership()
        except ReconcileError:
            self._discard(staged)
            raise
        order = plan.order
        for (position, _member), endpoint in zip(plan.build, staged, strict=True):
            order[position] = endpoint
        balance = self._balance
        departed = plan.departed
        try:
            if departed is not None:
                k = plan.in_place
                rebuilt = zip(islice(plan.build, k), staged[:k], strict=True)
                balance.splice(
                    departed,
                    [(member.key, endpoint) for (_, member), endpoint in rebuilt],
                    staged[k:],
                )
            else:
                balance.replace_endpoints(cast("list[Endpoint[Req, Resp]]", order))
        except BaseException as exc:
            self._discard(staged)
            if isinstance(exc, Exception):
                raise ReconcileError(
                    f"the balance refused the new endpoint list: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        # Committed: from here on nothing may fail half-way.
        self._edits = balance._edits
        state = self._state
        state.order = cast("list[Endpoint[Req, Resp]]", order)
        live = state.endpoints
        for key, _endpoint in plan.removed:
            del live[key]
        for (_position, member), endpoint in zip(plan.build, staged, strict=True):
            live[member.key] = endpoint
        snapshot = plan.snapshot
        state.members = snapshot._by_key
        state.revision = snapshot.revision
        state.lineage = snapshot.lineage
        state.directory_order = snapshot._log is not None
        state.draining = plan.draining
        self._commits += 1
        for endpoint, member in plan.flips:
            try:
                endpoint.eligible = not member.draining
            except Exception:
                logger.exception("changing eligibility of %r failed", member.key)
        for _key, endpoint in plan.removed:
            _retire(endpoint)
        for endpoint in plan.replaced:
            _retire(endpoint)
        return plan.report()


def _index_of(endpoint: Endpoint[Req, Resp]) -> int | None:
    return endpoint.index


def _retire(endpoint: Endpoint[Req, Resp]) -> None:
    tracker = endpoint.tracker
    if isinstance(tracker, GenerationTracker):
        tracker.retire()
    else:
        _close_quietly(endpoint.service)
