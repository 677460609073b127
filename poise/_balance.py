"""The balance: many endpoints, one policy-driven async service.

:class:`Balance` holds an ordered list of :class:`~poise.Endpoint` objects and
runs the readiness lifecycle of the dispatch contract over them::

    IDLE --poll_ready() -> True--> READY --selected by call()--> IDLE
      |  |                           |
      |  +-- "not yet" --> (parked) --its wake, or pending_recheck s--> IDLE
      +--poll_ready() raised--> FAILED --reset()--> IDLE

    Drained (``eligible = False``) and ejected endpoints are IDLE but in no
    scan list until they can be picked again.

Readiness (``await ready()``, or the synchronous ``ready_nowait()``)
    scans the IDLE endpoints that can be picked, calling
    ``service.poll_ready(wake)`` with that endpoint's own wake function
    (made once, when it joins). An endpoint that answers "not yet" is
    *parked*: later scans skip it until its wake fires (then the next scan
    polls it, and a waiting ``ready()`` wakes), or, for services that never
    call wake, until the first scan ``pending_recheck`` seconds after it was
    parked. ``wake()`` (the balance-wide wake) unparks everything. A READY
    endpoint keeps its reservation and is not polled again until a call
    selects it. A ``poll_ready`` that raises
    quarantines that endpoint only (FAILED); the error goes to the readiness
    observer; if some endpoint is still READY the balance stays ready. When
    a failure leaves no endpoint that is eligible and not FAILED, ``ready()``
    raises :class:`~poise.ReadinessError` (index and key of that endpoint,
    chained from the service's error). FAILED endpoints return only through
    :meth:`Balance.reset` / :meth:`Balance.reset_all`.

    Cost: O(endpoints consumed or woken, plus at most 64 due for a re-check
    while any endpoint is READY) per scan, flat in the number of drained,
    ejected and busy endpoints; no allocation
    when nothing fails or parks, no task; waiting costs one event per wait,
    shared by every waiter.

Outlier ejection (optional ``outlier_detector``)
    every completed call (success or failure) is reported to the
    :class:`~poise.OutlierDetector`; an endpoint it ejects leaves selection
    like a drained one (its in-flight guards are untouched) and returns at
    the first scan after its ejection ends. Ejections are lifted early when
    they would leave nothing to pick.

Dispatch (``await call(request)``, or ``await dispatch(request)`` = ready + call)
    asks the policy to pick among the READY endpoints (in endpoint order),
    starts the endpoint's load guard, moves the endpoint back to IDLE (its
    reservation is consumed by the call) and awaits its service. A response
    completes the guard; an exception completes it as failed and is raised as
    :class:`~poise.EndpointError` carrying the dispatch-time index and the
    key; cancellation (any ``BaseException``) cancels the guard and
    propagates. ``call()`` with no READY endpoint raises
    :class:`~poise.SelectionError` and never touches an unready service. A
    service that raises :class:`~poise.CallDeclined` (it sent nothing) has
    its guard cancelled, is not blamed, and the exception propagates as is.
    ``await dispatch_held(request)`` returns a :class:`Held`: the response
    with the guard still open, ended later by ``held.complete()`` or
    ``held.cancel()`` from any task, for responses that outlive the call
    (streamed bodies). ``async with balance.open(request) as response:`` is
    the same scoped to a block.

Membership
    ``push``, ``remove``, ``replace_endpoints`` (an atomic commit of a whole
    new list that keeps the state of retained endpoint objects, O(n)),
    ``splice`` (the same commit described by its changes: removals,
    replacements in place and appends, O(changes)), ``endpoint_mut``
    (invalidates a reservation) and ``reset``. A new endpoint always enters
    IDLE. An error's index describes the order at the time and may go stale
    after later edits; use keys for durable labels.

Concurrency: several tasks may share a balance. ``dispatch``,
``dispatch_held`` and ``open`` select without yielding after their readiness
scan, so a scan that found a ready endpoint is always followed by a
selection. The separate pair ``ready()`` then ``call()`` does yield in
between, so another task may take the reservation first; ``call()`` then
raises ``SelectionError``. All wake functions must be called from the event
loop thread.
"""

from __future__ import annotations

import logging
import math
import sys
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count, islice, repeat
from operator import attrgetter
from typing import Generic, Never, Protocol, TypeVar, cast, overload

import anyio
import anyio.lowlevel

from ._context import ContextProjection, UseRequest
from ._endpoint import FAILED, IDLE, READY, Endpoint
from ._errors import (
    CallDeclined,
    DuplicateIdentity,
    EndpointError,
    InvalidInput,
    ReadinessError,
    SelectionError,
)
from ._flat import (
    _INF,
    _MIN_ESTIMATE,
    Row,
    also_started,
    cancel_call,
    complete_call,
    one_ended,
    pick,
)
from ._hedge import CallPicks, Peek, current_attempt, hedge_pick
from ._outlier import OutlierDetector, OutlierEvent
from ._peak_ewma import PeakEwma
from ._policies import PowerOfTwoChoices
from ._protocols import LoadGuard, Policy
from ._service import release_reservation

__all__ = ["Balance", "BalanceStatistics", "Held", "ReadinessObserver"]

logger = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Ctx = TypeVar("Ctx")

ReadinessObserver = Callable[[int, Hashable, Exception], None]
"""Called as ``observer(index, key, error)`` for every readiness failure."""

_by_index = attrgetter("_index")

_T = TypeVar("_T")
# splice() renumbers with map(setattr, ...) drained by a zero-length deque:
# the loop runs in C.
_set_attr = setattr
_INDEX = repeat("_index")
_consume = deque[object](maxlen=0).extend
# Up to this many deletions edit a list in place; more copy it once.
_FEW = 16
# At most this many parked endpoints due for a re-check return per scan
# while something is READY (see Balance._recheck_parked).
_RECHECK_BATCH = 64
_checkpoint = anyio.lowlevel.checkpoint
_exp = math.exp


@dataclass(frozen=True, slots=True)
class BalanceStatistics:
    """A point-in-time view of a balance.

    ``idle``, ``ready`` and ``failed`` partition the endpoints by readiness
    state; ``ineligible`` counts endpoints with ``eligible = False`` whatever
    their state (never READY). ``in_flight`` counts calls dispatched by this
    balance that have not ended, including calls to endpoints removed since.
    ``pending`` counts IDLE endpoints parked until their wake fires, and
    ``ejected`` the endpoints the outlier detector keeps out.
    """

    endpoints: int
    idle: int
    ready: int
    failed: int
    ineligible: int
    in_flight: int
    pending: int = 0
    ejected: int = 0


class _Owner(Protocol):
    """What a :class:`Held` needs of its balance: the clock and the in-flight count."""

    _in_flight: int
    _clock: Callable[[], float]
    _detector: OutlierDetector | None

    def _outcome(self, key: Hashable, failed: bool, now: float) -> None: ...


class Held(Generic[Resp]):
    """A dispatched call whose load guard is still open: see :meth:`Balance.dispatch_held`.

    ``response`` is what the service returned; ``key`` and ``index`` name the
    endpoint that served it (the index as it was at dispatch time). End the
    call exactly once with :meth:`complete` (``failed=True`` if using the
    response failed) or :meth:`cancel` (the response was abandoned): the
    first end counts, later ends are no-ops. Both are synchronous and never
    wait, so they work from any task of the event loop, in a cancelled
    scope and in a ``finally`` block; they read the balance's clock.
    Made by :meth:`Balance.dispatch_held`; not meant to be constructed.
    """

    __slots__ = ("_balance", "_ended", "_guard", "_index", "_key", "_response", "_started")

    def __init__(
        self,
        balance: _Owner,
        guard: LoadGuard,
        response: Resp,
        key: Hashable,
        index: int,
        started: float,
    ) -> None:
        self._balance = balance
        self._guard = guard
        self._response = response
        self._key = key
        self._index = index
        #: When the guard was opened: where a clock gone wrong ends it instead.
        self._started = started
        self._ended = False

    @property
    def response(self) -> Resp:
        return self._response

    @property
    def key(self) -> Hashable:
        """The identity of the endpoint that served the call."""
        return self._key

    @property
    def index(self) -> int:
        """The endpoint's index at dispatch time (may be stale after edits)."""
        return self._index

    @property
    def ended(self) -> bool:
        """True once :meth:`complete` or :meth:`cancel` ran."""
        return self._ended

    def complete(self, *, failed: bool = False) -> None:
        """End the call; ``failed=True`` when the response turned out bad."""
        if self._ended:
            return
        self._ended = True
        balance = self._balance
        balance._in_flight -= 1
        now = balance._clock()
        _complete(self._guard, self._started, now, failed)
        if balance._detector is not None:
            balance._outcome(self._key, failed, now)

    def cancel(self) -> None:
        """End the call as cancelled: it counts as neither success nor failure."""
        if self._ended:
            return
        self._ended = True
        balance = self._balance
        balance._in_flight -= 1
        _cancel(self._guard, self._started, balance._clock())

    def __repr__(self) -> str:
        state = "ended" if self._ended else "open"
        return (
            f"<Held key={self._key!r} index={self._index} {state} "
            f"response={type(self._response).__name__}>"
        )


class Balance(Generic[Req, Resp]):
    """A policy-driven service over a changing set of endpoints.

    ``context`` chooses the affinity context the policy receives: ``None``
    (default, the policy gets ``None``), :class:`~poise.UseRequest` (the
    request itself) or a :class:`~poise.RequestContext` projection.
    ``readiness_observer(index, key, error)`` sees every readiness failure and
    must not raise. ``clock`` returns the event loop time passed to the policy
    and the load trackers. ``outlier_detector`` (default none) ejects
    endpoints whose calls keep failing. ``pending_recheck`` (seconds,
    default 1.0) bounds how long a parked endpoint waits for its wake before
    it is polled again.

    Raises :class:`~poise.DuplicateIdentity` if two endpoints share a key.
    """

    __slots__ = (
        "_by_key",
        "_checkpoint",
        "_clock",
        "_consumed",
        "_context",
        "_default_clock",
        "_detector",
        "_draw",
        "_edits",
        "_endpoints",
        "_event",
        "_found",
        "_idle",
        "_in_flight",
        "_last_scan",
        "_observer",
        "_park_seq",
        "_parked",
        "_parked_count",
        "_peek",
        "_policy",
        "_project",
        "_ready",
        "_recheck",
        "_rrows",
        "_scanning",
        "_unbound",
        "_wake_count",
    )

    @overload
    def __init__(
        self,
        policy: Policy[None],
        endpoints: Iterable[Endpoint[Req, Resp]] = (),
        *,
        context: None = None,
        readiness_observer: ReadinessObserver | None = None,
        clock: Callable[[], float] = anyio.current_time,
        outlier_detector: OutlierDetector | None = None,
        pending_recheck: float = 1.0,
    ) -> None: ...

    @overload
    def __init__(
        self,
        policy: Policy[Req],
        endpoints: Iterable[Endpoint[Req, Resp]] = (),
        *,
        context: UseRequest,
        readiness_observer: ReadinessObserver | None = None,
        clock: Callable[[], float] = anyio.current_time,
        outlier_detector: OutlierDetector | None = None,
        pending_recheck: float = 1.0,
    ) -> None: ...

    @overload
    def __init__(
        self,
        policy: Policy[Ctx],
        endpoints: Iterable[Endpoint[Req, Resp]] = (),
        *,
        context: ContextProjection[Req, Ctx],
        readiness_observer: ReadinessObserver | None = None,
        clock: Callable[[], float] = anyio.current_time,
        outlier_detector: OutlierDetector | None = None,
        pending_recheck: float = 1.0,
    ) -> None: ...

    def __init__(
        self,
        policy: Policy[Never],
        endpoints: Iterable[Endpoint[Req, Resp]] = (),
        *,
        context: ContextProjection[Req, object] | None = None,
        readiness_observer: ReadinessObserver | None = None,
        clock: Callable[[], float] = anyio.current_time,
        outlier_detector: OutlierDetector | None = None,
        pending_recheck: float = 1.0,
    ) -> None:
        if outlier_detector is not None and not isinstance(outlier_detector, OutlierDetector):
            raise InvalidInput(
                f"outlier_detector must be an OutlierDetector, got "
                f"{type(outlier_detector).__name__}"
            )
        if (
            isinstance(pending_recheck, bool)
            or not isinstance(pending_recheck, int | float)
            or not (0.0 < pending_recheck < float("inf"))
        ):
            raise InvalidInput(
                f"pending_recheck must be a finite number of seconds > 0, got {pending_recheck!r}"
            )
        if not callable(getattr(policy, "pick", None)):
            raise InvalidInput(f"policy must have a pick() method, got {type(policy).__name__}")
        if context is not None and not callable(getattr(context, "project", None)):
            raise InvalidInput(
                f"context must be None, UseRequest() or have a project() method, "
                f"got {type(context).__name__}"
            )
        if readiness_observer is not None and not callable(readiness_observer):
            raise InvalidInput("readiness_observer must be callable")
        if not callable(clock):
            raise InvalidInput(f"clock must be callable, got {type(clock).__name__}")
        self._policy = cast("Policy[object]", policy)
        # A turn-taking policy's pick without a turn, for a hedged call's extra
        # attempts (None: the policy has none, and a hedge picks as any call).
        peek = getattr(policy, "peek", None)
        self._peek: Peek | None = peek if callable(peek) else None
        self._context = context
        self._project: Callable[[Req], object] | None = None if context is None else context.project
        self._observer = readiness_observer
        self._clock = clock
        self._default_clock = clock is anyio.current_time
        # The checkpoint of dispatch: anyio's generic one until the first
        # dispatch finds out which loop runs it (see _first_checkpoint).
        self._checkpoint: Callable[[], Awaitable[None]] = self._first_checkpoint
        self._detector = outlier_detector
        self._recheck = float(pending_recheck)
        # IDLE endpoints whose poll_ready said "not yet", waiting for their
        # wake: (parked at, sequence, endpoint) in time order. An entry is
        # live while endpoint._parked == sequence; others are skipped.
        self._parked: deque[tuple[float, int, Endpoint[Req, Resp]]] = deque()
        self._parked_count = 0
        self._park_seq = 0
        self._last_scan = 0.0
        self._endpoints: list[Endpoint[Req, Resp]] = []
        self._by_key: dict[Hashable, Endpoint[Req, Resp]] = {}
        # READY endpoints in endpoint order (READY implies eligible). An
        # endpoint selected by a call stays listed, though IDLE, until the
        # next scan: usually that scan finds it ready again, and leaving it in
        # place saves a removal and an ordered re-insertion per call. A new
        # endpoint spliced in at a READY predecessor's position is listed in
        # its place the same way. Those endpoints are remembered in
        # _consumed; _flush() drops the ones that did not become READY, and
        # runs before every pick.
        self._ready: list[Endpoint[Req, Resp]] = []
        # The tracker row of every endpoint in _ready (None: a tracker
        # without one), in the same order: a power-of-two-choices pick reads
        # these (see poise._flat) without touching an endpoint or tracker
        # object. _unbound counts the endpoints without a row.
        self._rrows: list[Row | None] = []
        self._unbound = 0
        # The inlined pick of dispatch(): the policy's generator when it is a
        # PowerOfTwoChoices and no context is projected (it reads none).
        self._draw: Callable[[], float] | None = (
            policy._random if type(policy) is PowerOfTwoChoices and context is None else None
        )
        self._consumed: list[Endpoint[Req, Resp]] = []
        # IDLE endpoints in no particular order (swap-remove; ep._slot is the position).
        self._idle: list[Endpoint[Req, Resp]] = []
        self._event: anyio.Event | None = None
        self._wake_count = 0
        self._in_flight = 0
        self._scanning = False
        # The endpoints a scan found READY, listed in _ready as one merge
        # when it ends (empty between scans); see _scan and _list_found.
        self._found: list[Endpoint[Req, Resp]] = []
        # Bumped by every membership edit, so an owner that mirrors the
        # membership can tell whether anyone else edited it.
        self._edits = 0
        self.replace_endpoints(list(endpoints))

    # -- read-only views ----------------------------------------------------

    @property
    def policy(self) -> object:
        return self._policy

    @property
    def context(self) -> object:
        return self._context

    @property
    def endpoints(self) -> tuple[Endpoint[Req, Resp], ...]:
        """The endpoints in order (a snapshot; edit membership through the balance)."""
        return tuple(self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)

    def endpoint(self, index_or_key: Hashable) -> Endpoint[Req, Resp]:
        """Look up by key, or by index when the value is an int that is not a key.

        Raises :class:`~poise.InvalidInput` if there is no such endpoint.
        Reading an endpoint does not disturb its reservation.
        """
        return self._lookup(index_or_key)

    @property
    def wake_count(self) -> int:
        """How many times :meth:`wake` was called; see :meth:`wait_woken`."""
        return self._wake_count

    def statistics(self) -> BalanceStatistics:
        """Counts by readiness state, eligibility and ejection. O(n)."""
        ineligible = ready = failed = ejected = 0
        for ep in self._endpoints:
            if not ep._eligible:
                ineligible += 1
            if ep._ejected:
                ejected += 1
            state = ep._state
            if state is READY:
                ready += 1
            elif state is FAILED:
                failed += 1
        return BalanceStatistics(
            endpoints=len(self._endpoints),
            idle=len(self._endpoints) - ready - failed,
            ready=ready,
            failed=failed,
            ineligible=ineligible,
            in_flight=self._in_flight,
            pending=self._parked_count,
            ejected=ejected,
        )

    @property
    def outlier_detector(self) -> OutlierDetector | None:
        return self._detector

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Balance policy={type(self._policy).__name__} endpoints={s.endpoints} "
            f"ready={s.ready} idle={s.idle} failed={s.failed} ineligible={s.ineligible} "
            f"pending={s.pending} ejected={s.ejected} in_flight={s.in_flight}>"
        )

    # -- waking -------------------------------------------------------------

    def wake(self) -> None:
        """Wake every task waiting in :meth:`ready`; re-poll every pending endpoint.

        Each endpoint's ``poll_ready`` gets a wake function of its own, which
        brings back only that endpoint; this one is for other sources of
        change (a discovery update) and returns *every* parked endpoint to
        the next scan, so it costs O(pending endpoints). Call it from the
        event loop thread only.
        """
        parked = self._parked
        while parked:
            _, seq, ep = parked.popleft()
            if ep._parked == seq:
                self._unpark(ep)
        self._notify()

    def _notify(self) -> None:
        """Wake the waiting tasks (a membership or readiness change)."""
        self._wake_count += 1
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    async def wait_woken(self, since: int) -> None:
        """Wait until :attr:`wake_count` differs from ``since``. Always checkpoints.

        Read ``since = balance.wake_count`` *before* the scan whose result
        made you wait: a wake that arrives during the scan is then not lost.
        """
        if self._wake_count != since:
            await _checkpoint()
            return
        event = self._event
        if event is None:
            event = self._event = anyio.Event()
        await event.wait()

    def _endpoint_woken(self, ep: Endpoint[Req, Resp]) -> None:
        """The wake function of one endpoint fired: scan it again."""
        ep._wakes += 1
        if ep._parked >= 0 and ep._owner is self:
            self._unpark(ep)
        self._notify()

    def _park(self, ep: Endpoint[Req, Resp], now: float) -> None:
        seq = self._park_seq = self._park_seq + 1
        ep._parked = seq
        self._parked_count += 1
        self._parked.append((now, seq, ep))

    def _unpark(self, ep: Endpoint[Req, Resp]) -> None:
        ep._parked = -1
        self._parked_count -= 1
        if ep._state is IDLE and ep._eligible and not ep._ejected:
            ep._slot = len(self._idle)
            self._idle.append(ep)

    def _recheck_parked(self, now: float) -> None:
        """Return the endpoints parked for ``pending_recheck`` seconds to the scan.

        While some endpoint is READY, one scan returns at most
        ``_RECHECK_BATCH`` of them: endpoints parked together come due
        together, and re-polling thousands in one dispatch would be a
        latency spike (the rest follow in the next scans). With nothing
        READY every due endpoint returns at once, so a scan never reports
        "not yet" while a due endpoint was left unpolled.
        """
        parked = self._parked
        limit = now - self._recheck
        budget = _RECHECK_BATCH if self._ready else -1
        while parked and parked[0][0] <= limit and budget:
            budget -= 1
            _, seq, ep = parked.popleft()
            if ep._parked == seq:
                self._unpark(ep)
        if not self._parked_count and parked:
            parked.clear()

    async def _first_checkpoint(self) -> None:
        """Checkpoint, and choose the checkpoint of later dispatches.

        On trio, dispatch uses ``trio.lowlevel.checkpoint`` (and, when the
        clock is the default ``anyio.current_time``, ``trio.current_time``)
        directly, which saves anyio's per-call backend lookup; on any other
        loop it keeps anyio's. A balance later used on another loop falls
        back to anyio's at its first dispatch there (see _loop_changed).
        """
        trio = sys.modules.get("trio")
        if trio is not None:
            try:
                trio.lowlevel.current_task()
            except RuntimeError:
                pass
            else:
                self._checkpoint = trio.lowlevel.checkpoint
                if self._default_clock:
                    self._clock = trio.current_time
                await self._checkpoint()
                return
        self._checkpoint = _checkpoint
        await _checkpoint()

    async def _loop_changed(self) -> None:
        """The trio checkpoint failed (another loop): back to anyio's."""
        self._checkpoint = self._first_checkpoint
        if self._default_clock:
            self._clock = anyio.current_time
        await self._first_checkpoint()

    # -- readiness ----------------------------------------------------------

    def ready_nowait(self, now: float | None = None) -> bool:
        """One readiness scan without waiting: True if an endpoint is READY.

        False means some eligible endpoint is pending and will wake the
        balance. Raises like :meth:`ready` when no usable endpoint is left.
        O(idle endpoints); allocates nothing unless a service fails.
        ``now``: a reading of the balance's clock the caller took with
        nothing awaited since (the scan then reads none of its own).
        """
        return self._scan(now)

    def _scan(self, now: float | None) -> bool:
        """The scan of ready_nowait(); ``now`` is the clock if the caller read it."""
        found = self._found
        if found:
            # A scan from inside another's poll_ready: what the outer scan
            # found READY so far is listed first (the two share the list).
            self._list_found()
        if self._parked_count or self._detector is not None:
            if now is None:
                now = self._scan_time()
            self._due_checks(now)
        idle = self._idle
        if not idle:
            if self._consumed:
                # A consumed endpoint drained or ejected before this scan.
                self._flush()
            if self._ready:
                return True
            if self._parked_count:
                return False
            return self._exhausted(None)
        ready = self._ready
        pending = 0
        failures: list[tuple[Endpoint[Req, Resp], Exception]] | None = None
        # Newly READY endpoints are listed when the scan ends, all at once:
        # one by one, a first scan of n endpoints (which the swap-removal
        # visits out of order) moved O(n) list items per insertion.
        self._scanning = True
        try:
            i = 0
            while i < len(idle):
                ep = idle[i]
                wakes = ep._wakes
                try:
                    ok = ep._service.poll_ready(ep._wake)  # type: ignore[arg-type]
                except Exception as exc:
                    if ep._slot == i:
                        self._take_idle(ep)
                    elif not self._fail_moved(ep):
                        continue
                    ep._state = FAILED
                    ep._error = exc
                    if failures is None:
                        failures = []
                    failures.append((ep, exc))
                    continue
                if ep._slot != i:
                    # poll_ready changed this endpoint's place (it drained,
                    # removed or ejected something): settle it the slow way.
                    self._settled(ep, ok)
                    continue
                if ok:
                    # Swap-remove from the idle list (inlined _take_idle).
                    last = idle.pop()
                    if last is not ep:
                        idle[i] = last
                        last._slot = i
                    ep._slot = -1
                    ep._state = READY
                    if not ep._listed:
                        ep._listed = True
                        found.append(ep)
                elif ep._wakes != wakes:
                    # Woken while it answered "not yet": poll it again next scan.
                    pending += 1
                    i += 1
                else:
                    # Parked until its wake fires (or pending_recheck passes).
                    last = idle.pop()
                    if last is not ep:
                        idle[i] = last
                        last._slot = i
                    ep._slot = -1
                    if now is None:
                        now = self._scan_time()
                    self._park(ep, now)
                    pending += 1
        finally:
            if found:
                self._list_found()
            self._scanning = False
        consumed = self._consumed
        if consumed:
            if len(consumed) == 1 and consumed[0]._state is READY:
                consumed.clear()  # the usual case: the one consumed is ready again
            else:
                self._flush()
        if failures is not None:
            self._report(failures)  # the observer may edit membership
            ready = self._ready
        if ready:
            return True
        if pending or self._parked_count:
            return False
        return self._exhausted(failures)

    def _settled(self, ep: Endpoint[Req, Resp], ok: bool) -> None:
        """After a poll_ready that moved its own endpoint (rare)."""
        if ep._owner is not self or ep._state is not IDLE or not ep._eligible or ep._ejected:
            if ok:
                release_reservation(ep._service)
            return
        if ok:
            self._leave_scan(ep)
            ep._state = READY
            if not ep._listed:
                self._list_ready(ep)

    def _fail_moved(self, ep: Endpoint[Req, Resp]) -> bool:
        """Before quarantining an endpoint whose poll_ready moved it, then
        raised (a scan from inside that poll_ready settled it first): take
        it out of where it went. The raise is the newer answer, so one the
        inner scan found READY gives its reservation back. False when the
        inner scan quarantined it already (and reports that failure).
        (Membership cannot change during a scan: it is still this balance's.)"""
        if ep._state is FAILED:
            return False
        if ep._state is READY:
            self._unlist(ep)
            release_reservation(ep._service)
        else:
            self._leave_scan(ep)
        return True

    def _list_ready(self, ep: Endpoint[Req, Resp]) -> None:
        """Insert a READY endpoint in _ready (and its row in _rrows), in order."""
        ep._listed = True
        ready = self._ready
        at = bisect_right(ready, ep._index, key=_by_index)
        ready.insert(at, ep)
        self._rrows.insert(at, ep._row)

    def _list_found(self) -> None:
        """List the endpoints a scan found READY (marked listed already), in order."""
        found = self._found
        ready = self._ready
        rrows = self._rrows
        if len(found) <= _FEW:
            for ep in found:
                at = bisect_right(ready, ep._index, key=_by_index)
                ready.insert(at, ep)
                rrows.insert(at, ep._row)
        else:
            # One sort of two ordered runs, and the rows copied once.
            ready += found
            ready.sort(key=_by_index)
            rrows[:] = [ep._row for ep in ready]
        found.clear()

    def _scan_time(self) -> float:
        """The clock for the scan's own bookkeeping; works outside an event loop.

        ``ready_nowait()`` may be called with no loop running (the default
        clock then has no time to give): the last time seen stands in, which
        only makes a re-check come sooner.
        """
        try:
            now = self._clock()
        except RuntimeError:
            return self._last_scan
        self._last_scan = now
        return now

    def _due_checks(self, now: float) -> None:
        """Parked endpoints due for a re-check, and ejections that ended."""
        if self._parked_count:
            self._recheck_parked(now)
        detector = self._detector
        if detector is not None and detector.next_due() <= now:
            self._apply(detector.expire(now))

    async def ready(self) -> None:
        """Wait until at least one eligible endpoint is READY. Always checkpoints.

        Raises :class:`~poise.SelectionError` at once when the balance has no
        endpoint, or none that is eligible and not FAILED; raises
        :class:`~poise.ReadinessError` when a readiness failure in this scan
        exhausted the usable pool.
        """
        await _checkpoint()
        while True:
            since = self._wake_count
            if self.ready_nowait():
                return
            await self.wait_woken(since)

    def _exhausted(self, failures: list[tuple[Endpoint[Req, Resp], Exception]] | None) -> bool:
        if failures:
            ep, exc = failures[-1]
            others = len(failures) - 1
            more = f" ({others} other endpoint(s) failed in the same scan)" if others else ""
            raise ReadinessError(
                f"readiness of endpoint {ep._key!r} at index {ep._index} failed with "
                f"{type(exc).__name__} and no usable endpoint is left{more}",
                index=ep._index,
                key=ep._key,
            ) from exc
        # Pending endpoints would be in the idle list; nothing is usable.
        detector = self._detector
        if detector is not None and detector.ejected:
            # Ejections never leave nothing to pick: lift them all.
            self._apply(detector.release_all(self._clock()))
            if self._idle:
                return self.ready_nowait()
        if not self._endpoints:
            raise SelectionError("the balance has no endpoints")
        failed = sum(1 for ep in self._endpoints if ep._state is FAILED)
        ineligible = sum(1 for ep in self._endpoints if not ep._eligible and ep._state is IDLE)
        raise SelectionError(
            f"no usable endpoint: {failed} failed, {ineligible} ineligible "
            f"of {len(self._endpoints)}"
        )

    def _report(self, failures: list[tuple[Endpoint[Req, Resp], Exception]]) -> None:
        for ep, exc in failures:
            logger.debug(
                "endpoint %r quarantined: poll_ready raised %s", ep._key, type(exc).__name__
            )
        observer = self._observer
        if observer is not None:
            for ep, exc in failures:
                observer(ep._index, ep._key, exc)

    # -- dispatch -----------------------------------------------------------

    async def call(self, request: Req) -> Resp:
        """Call one READY endpoint chosen by the policy.

        Raises :class:`~poise.SelectionError` if no endpoint holds a
        reservation (await :meth:`ready` first), and
        :class:`~poise.EndpointError` if the service raised. Adds no
        checkpoint of its own beyond the service's.
        """
        now = self._clock()
        ep, guard = self._select(request, now)
        index = ep._index
        self._in_flight += 1
        try:
            response = await ep._service.call(request)
        except CallDeclined:
            self._in_flight -= 1
            guard.cancel(now)  # as of the dispatch: nothing was sent, no evidence
            raise
        except Exception as exc:
            self._in_flight -= 1
            end = self._clock()
            _complete(guard, now, end, True)
            if self._detector is not None:
                self._outcome(ep._key, True, end)
            raise _endpoint_error(ep._key, index, exc) from exc
        except BaseException:
            self._in_flight -= 1
            _cancel(guard, now, self._clock())
            raise
        self._in_flight -= 1
        end = self._clock()
        _complete(guard, now, end, False)
        if self._detector is not None:
            self._outcome(ep._key, False, end)
        return response

    async def dispatch(self, request: Req) -> Resp:
        """``await ready()`` then ``await call(request)``, with no yield in between."""
        checkpoint = self._checkpoint
        try:
            await checkpoint()
        except RuntimeError:
            if checkpoint is _checkpoint or checkpoint == self._first_checkpoint:
                raise
            await self._loop_changed()
        # A local: calling an instance attribute through `self` takes
        # CPython's unspecialized method lookup every time.
        clock = self._clock
        now = clock()
        if (
            self._idle
            or self._consumed
            or not self._ready
            or self._parked_count
            or self._detector is not None
        ):
            while True:
                since = self._wake_count
                if self._scan(now):
                    break
                await self.wait_woken(since)
                now = clock()
            if self._consumed:
                self._flush()
        # The selection of _select(), inlined: this is the hot path.
        ready = self._ready
        draw = self._draw
        guard: LoadGuard | None
        if draw is not None and not self._unbound and now - now == 0.0:
            # The flat path: the pick, the start and the end of the call read
            # and edit the picked endpoint's tracker row in place (see
            # poise._flat: pick, start_call and complete_call, written out),
            # with no guard. The row is the tracker's own, so the call ends
            # on the right state even if the endpoint leaves meanwhile.
            rows = cast("list[Row]", self._rrows)
            n = len(rows)
            if n > 1:
                first = int(draw() * n)
                second = int(draw() * (n - 1))
                if second >= first:
                    second += 1
                # The policy reads the second sample's load first. With no
                # call in flight the age floor and the factor (0 + 1) change
                # nothing (oldest is infinite), so they are skipped.
                row = rows[second]
                gap = row.updated - now
                if gap < 0.0:
                    cost = row.estimate * _exp(gap * row.rate)
                    if cost < _MIN_ESTIMATE:
                        cost = _MIN_ESTIMATE
                else:
                    if gap == _INF:
                        row.updated = now  # the first use
                    cost = row.estimate
                busy = row.in_flight
                if busy:
                    age = now - row.oldest
                    if age > cost:
                        cost = age
                    cost *= busy + 1
                cost_second = cost
                row = rows[first]
                gap = row.updated - now
                if gap < 0.0:
                    cost = row.estimate * _exp(gap * row.rate)
                    if cost < _MIN_ESTIMATE:
                        cost = _MIN_ESTIMATE
                else:
                    if gap == _INF:
                        row.updated = now  # the first use
                    cost = row.estimate
                busy = row.in_flight
                if busy:
                    age = now - row.oldest
                    if age > cost:
                        cost = age
                    cost *= busy + 1
                if cost_second < cost:
                    first = second
                    row = rows[second]
            else:
                first = 0
                row = rows[0]
                if row.updated == _INF:
                    row.updated = now  # the first use
            ep = ready[first]
            k = row.in_flight
            row.in_flight = k + 1
            if row.floor:
                if not k:
                    row.oldest = now
                else:
                    also_started(row, now)
            guard = None
        else:
            n = len(ready)
            project = self._project
            context = None if project is None else project(request)
            if self._peek is None or (attempt := current_attempt.get()) is None:
                i = self._policy.pick(ready, context, now)
            else:
                i = self._attempt_pick(attempt, ready, context, now)
            if type(i) is not int or not 0 <= i < n:
                raise _bad_pick(self._policy, i, n)
            ep = ready[i]
            guard = ep._tracker.start(now)
        call = ep._call
        if call is None:
            call = ep._service.call
            if not ep._steady:
                ep._state = IDLE
                self._consumed.append(ep)
                idle = self._idle
                ep._slot = len(idle)
                idle.append(ep)
        index = ep._index
        self._in_flight += 1
        try:
            response = await call(request)
        except CallDeclined:
            self._in_flight -= 1
            # As of the dispatch: nothing was sent, no evidence.
            if guard is None:
                self._end_flat(ep, row, now, now, None)
            else:
                guard.cancel(now)
            raise
        except Exception as exc:
            self._in_flight -= 1
            end = clock()
            if guard is None:
                self._end_flat(ep, row, now, end, True)
            else:
                _complete(guard, now, end, True)
            if self._detector is not None:
                self._outcome(ep._key, True, end)
            raise _endpoint_error(ep._key, index, exc) from exc
        except BaseException:
            self._in_flight -= 1
            if guard is None:
                self._end_flat(ep, row, now, clock(), None)
            else:
                _cancel(guard, now, clock())
            raise
        self._in_flight -= 1
        end = clock()
        if guard is not None:
            _complete(guard, now, end, False)
        elif 0.0 <= end - now < _INF:
            # complete_call(row, now, end, False, ...), written out.
            k = row.in_flight - 1
            row.in_flight = k
            if not k:
                row.oldest = _INF
            elif row.floor:
                one_ended(row, now)
            stored = row.estimate
            last = row.updated
            rtt = end - now
            elapsed = end - last
            weight = _exp(-elapsed * row.rate) if elapsed > 0.0 else 1.0
            stored *= weight
            if rtt > stored:
                stored = rtt
            else:
                stored = stored * weight + rtt * (1.0 - weight)
                if stored < _MIN_ESTIMATE:
                    stored = _MIN_ESTIMATE
            row.estimate = stored
            if end > last:
                row.updated = end
            row.observations += 1
        else:
            self._end_flat(ep, row, now, end, False)
        if self._detector is not None:
            self._outcome(ep._key, False, end)
        return response

    def _end_flat(
        self, ep: Endpoint[Req, Resp], row: Row, started: float, now: float, failed: bool | None
    ) -> None:
        """End a call of dispatch's flat path on its tracker's row; ``failed`` None: cancelled.

        A completion at a time that is not finite or before the start (a
        clock that went back) cancels the call as of its start, which is no
        evidence, and raises InvalidInput.
        """
        tracker = cast(PeakEwma, ep._tracker)
        if failed is None:
            if now - now != 0.0:  # not finite: no evidence, and no error (see _cancel)
                now = started
            cancel_call(row, started, now, tracker._cancel_evidence)
        elif 0.0 <= now - started < _INF:
            complete_call(row, started, now, failed, tracker._failure_penalty)
        else:
            cancel_call(row, started, started, False)
            raise _bad_end(started, now)

    async def dispatch_held(self, request: Req) -> Held[Resp]:
        """Like :meth:`dispatch`, but the load guard stays open in the result.

        Waits for readiness and calls the selected endpoint with no yield in
        between, exactly as :meth:`dispatch` does, and returns a
        :class:`Held` carrying the response, the endpoint's key and its
        dispatch-time index. The call counts as in flight, and its load guard
        stays open, until :meth:`Held.complete` or :meth:`Held.cancel` (from
        any task); use it when the response outlives the call, such as a
        streamed body that is read later. A :class:`Held` that is never ended
        keeps its endpoint looking busy.

        A failing service call completes the guard as failed and raises
        :class:`~poise.EndpointError`; :class:`~poise.CallDeclined` cancels
        the guard and propagates unchanged; cancellation cancels the guard.
        """
        checkpoint = self._checkpoint
        try:
            await checkpoint()
        except RuntimeError:
            if checkpoint is _checkpoint or checkpoint == self._first_checkpoint:
                raise
            await self._loop_changed()
        now = self._clock()
        # (An outlier detector has no length: it is true when present.)
        if self._idle or self._consumed or not self._ready or self._parked_count or self._detector:
            while True:
                since = self._wake_count
                if self._scan(now):
                    break
                await self.wait_woken(since)
                now = self._clock()
        ep, guard = self._select(request, now)
        index = ep._index
        self._in_flight += 1
        try:
            response = await ep._service.call(request)
        except CallDeclined:
            self._in_flight -= 1
            guard.cancel(now)  # as of the dispatch: nothing was sent, no evidence
            raise
        except Exception as exc:
            self._in_flight -= 1
            end = self._clock()
            _complete(guard, now, end, True)
            if self._detector is not None:
                self._outcome(ep._key, True, end)
            raise _endpoint_error(ep._key, index, exc) from exc
        except BaseException:
            self._in_flight -= 1
            _cancel(guard, now, self._clock())
            raise
        return Held(self, guard, response, ep._key, index, now)

    async def call_held(self, request: Req) -> Held[Resp]:
        """:meth:`call` with the load guard left open in the result, like :meth:`dispatch_held`.

        Needs a reservation (``ready_nowait()`` returned True, or
        :meth:`ready` returned, with no yield since): raises
        :class:`~poise.SelectionError` otherwise. Adds no checkpoint of its
        own beyond the service's, so a caller that found an endpoint ready
        without waiting hands the request over without a trip through the
        scheduler. Failures end the guard as in :meth:`dispatch_held`.
        """
        now = self._clock()
        ep, guard = self._select(request, now)
        index = ep._index
        self._in_flight += 1
        try:
            response = await ep._service.call(request)
        except CallDeclined:
            self._in_flight -= 1
            guard.cancel(now)  # as of the dispatch: nothing was sent, no evidence
            raise
        except Exception as exc:
            self._in_flight -= 1
            end = self._clock()
            _complete(guard, now, end, True)
            if self._detector is not None:
                self._outcome(ep._key, True, end)
            raise _endpoint_error(ep._key, index, exc) from exc
        except BaseException:
            self._in_flight -= 1
            _cancel(guard, now, self._clock())
            raise
        return Held(self, guard, response, ep._key, index, now)

    def pick_held(self, request: Req, now: float | None = None) -> Held[Endpoint[Req, Resp]]:
        """Pick an endpoint and open its load guard without calling its service.

        For a caller that sends the request itself: ``held.response`` is the
        picked endpoint. Needs a reservation like :meth:`call_held` (raises
        :class:`~poise.SelectionError` otherwise); synchronous, no
        checkpoint. The caller ends the guard once with :meth:`Held.complete`
        (``failed=True`` when the call failed: that is the outlier evidence)
        or :meth:`Held.cancel` (nothing was sent, or it was abandoned).
        ``now``: a reading of the balance's clock the caller took with
        nothing awaited since (the guard starts then; none is read here).
        """
        if now is None:
            now = self._clock()
        ep, guard = self._select(request, now)
        self._in_flight += 1
        return Held(self, guard, ep, ep._key, ep._index, now)

    def hold(self, index_or_key: Hashable) -> Held[None]:
        """Open a load guard on one named endpoint, outside the policy's pick.

        For a caller that chose the endpoint itself (a health probe's winner,
        say) and sends to it directly: the call counts in the endpoint's
        load, latency and outcomes exactly as a picked one does. No
        reservation is taken or needed, and nothing awaits. End it once with
        :meth:`Held.complete` or :meth:`Held.cancel`. Raises
        :class:`~poise.InvalidInput` when there is no such endpoint.
        """
        ep = self._lookup(index_or_key)
        now = self._clock()
        guard = ep._tracker.start(now)
        self._in_flight += 1
        return Held(self, guard, None, ep._key, ep._index, now)

    @asynccontextmanager
    async def open(self, request: Req) -> AsyncIterator[Resp]:
        """Dispatch and hold the load guard until the block exits (streamed bodies).

        ``async with balance.open(request) as response:`` is
        :meth:`dispatch_held` scoped to a block: it yields the response and
        ends the guard on exit. The guard completes when the block exits
        normally, completes as failed when it exits with an exception (which
        propagates unchanged), and is cancelled on cancellation. A failing
        service call raises :class:`~poise.EndpointError` like :meth:`call`;
        :class:`~poise.CallDeclined` propagates unchanged.
        """
        held = await self.dispatch_held(request)
        try:
            yield held._response
        except Exception:
            held.complete(failed=True)
            raise
        except BaseException:
            held.cancel()
            raise
        held.complete()

    def _select(self, request: Req, now: float) -> tuple[Endpoint[Req, Resp], LoadGuard]:
        if self._consumed:
            self._flush()
        ready = self._ready
        n = len(ready)
        if n == 0:
            raise SelectionError(
                "no endpoint holds a readiness reservation; await ready() before call()"
            )
        draw = self._draw
        if draw is not None and not self._unbound and now - now == 0.0:
            ep = ready[pick(cast("list[Row]", self._rrows), draw, now)]
        else:
            project = self._project
            context = None if project is None else project(request)
            if self._peek is None or (attempt := current_attempt.get()) is None:
                i = self._policy.pick(ready, context, now)
            else:
                i = self._attempt_pick(attempt, ready, context, now)
            if type(i) is not int or not 0 <= i < n:
                raise _bad_pick(self._policy, i, n)
            ep = ready[i]
        guard = ep._tracker.start(now)
        if not ep._steady:
            # The call consumes the reservation: back to IDLE, polled by the
            # next scan (it stays listed in _ready until then; see _flush). An
            # always-ready service that reserves nothing stays READY.
            ep._state = IDLE
            self._consumed.append(ep)
            idle = self._idle
            ep._slot = len(idle)
            idle.append(ep)
        return ep, guard

    def _attempt_pick(
        self,
        attempt: tuple[CallPicks, int],
        ready: Sequence[Endpoint[Req, Resp]],
        context: object,
        now: float,
    ) -> int:
        """A pick inside an attempt of a hedged call (see poise._hedge), recorded.

        The first pick of the call from this balance is the policy's; a
        later attempt's pick is :func:`~poise._hedge.hedge_pick`, which
        takes no turn. Synchronous: the record is shared by the call's
        attempts, each in its own task.
        """
        picks, number = attempt
        tried = picks.get(self)
        if tried is None:
            tried = picks[self] = []
        if number and tried:
            peek = self._peek
            assert peek is not None
            i = hedge_pick(peek, ready, context, now, tried)
        else:
            i = self._policy.pick(ready, context, now)
            if type(i) is not int or not 0 <= i < len(ready):
                raise _bad_pick(self._policy, i, len(ready))
        tried.append(ready[i]._key)
        return i

    # -- membership ----------------------------------------------------------

    def push(self, endpoint: Endpoint[Req, Resp]) -> int:
        """Append an endpoint (it enters IDLE); return its index.

        Raises :class:`~poise.DuplicateIdentity` if its key is taken and
        :class:`~poise.InvalidInput` if it belongs to another balance.
        """
        self._check_not_scanning()
        if not isinstance(endpoint, Endpoint):
            raise InvalidInput(f"push() needs an Endpoint, got {type(endpoint).__name__}")
        if endpoint._key in self._by_key:
            raise DuplicateIdentity(endpoint._key, "balance")
        if endpoint._owner is not None:
            raise InvalidInput(f"endpoint {endpoint._key!r} already belongs to a balance")
        index = len(self._endpoints)
        self._edits += 1
        self._attach(endpoint, index)
        self._endpoints.append(endpoint)
        self._by_key[endpoint._key] = endpoint
        if self._detector is not None:
            self._detector_sync([endpoint._key])
        self._notify()
        return index

    def remove(self, index_or_key: Hashable) -> Endpoint[Req, Resp]:
        """Detach one endpoint and return it; later indices shift down by one.

        Its reservation (if READY) is released; calls already dispatched to it
        keep their guards. The service is not closed: the caller owns it now.
        """
        self._check_not_scanning()
        ep = self._lookup(index_or_key)
        index = ep._index
        self._edits += 1
        self._detach(ep)
        del self._endpoints[index]
        del self._by_key[ep._key]
        for later in self._endpoints[index:]:
            later._index -= 1
        if self._detector is not None:
            self._detector_sync((), [ep._key])
        self._notify()
        return ep

    def replace_endpoints(self, endpoints: Sequence[Endpoint[Req, Resp]]) -> None:
        """Atomically make ``endpoints`` the whole ordered endpoint list.

        Endpoint *objects* already in this balance keep all their state: a
        READY reservation, a FAILED quarantine and their load tracker. New
        objects enter IDLE. Objects that are not in the new list are detached:
        their reservation is released; guards of calls already dispatched are
        untouched and their services are not closed. Everything is validated
        first (:class:`~poise.DuplicateIdentity`, :class:`~poise.InvalidInput`
        for a non-endpoint or one owned by another balance): on error nothing
        changed.
        """
        self._check_not_scanning()
        new = list(endpoints)
        keys: dict[Hashable, Endpoint[Req, Resp]] = {}
        for ep in new:
            if not isinstance(ep, Endpoint):
                raise InvalidInput(f"endpoints must be Endpoint objects, got {type(ep).__name__}")
            if ep._key in keys:
                raise DuplicateIdentity(ep._key, "the new endpoint list")
            if ep._owner is not None and ep._owner is not self:
                raise InvalidInput(f"endpoint {ep._key!r} already belongs to another balance")
            keys[ep._key] = ep
        self._edits += 1
        kept = {id(ep) for ep in new if ep._owner is self}
        for ep in self._endpoints:
            if id(ep) not in kept:
                self._detach(ep)
        ready: list[Endpoint[Req, Resp]] = []
        rrows: list[Row | None] = []
        idle: list[Endpoint[Req, Resp]] = []
        for index, ep in enumerate(new):
            if ep._owner is not self:
                self._attach_state(ep)
            ep._index = index
            ep._listed = ep._state is READY
            if ep._listed:
                ready.append(ep)
                rrows.append(ep._row)
            elif ep._state is IDLE and ep._eligible and not ep._ejected and ep._parked < 0:
                ep._slot = len(idle)
                idle.append(ep)
            else:
                ep._slot = -1  # FAILED, drained, ejected or parked (kept parked)
        self._endpoints = new
        self._by_key = keys
        self._ready = ready
        self._rrows = rrows
        self._idle = idle
        self._consumed.clear()
        if self._detector is not None:
            self._detector_sync()
        self._notify()

    def splice(
        self,
        removed: Iterable[Hashable] = (),
        replaced: Iterable[tuple[Hashable, Endpoint[Req, Resp]]] = (),
        appended: Iterable[Endpoint[Req, Resp]] = (),
    ) -> None:
        """Atomically edit the endpoint list in place: remove, replace, append.

        Every target is a key or an index (looked up like :meth:`remove`)
        naming an endpoint *before* the splice. ``removed`` endpoints leave;
        each ``(target, endpoint)`` of ``replaced`` puts a new endpoint at its
        target's position; ``appended`` endpoints go to the end, in order. The
        result is exactly what :meth:`replace_endpoints` would give for the
        list "current order minus removed, replacements in place, plus
        appended": endpoints that stay keep all their state and their
        relative order, new ones enter IDLE, the ones that leave are detached
        (a reservation is released; guards of calls already dispatched are
        untouched; services are not closed).

        Everything is validated first, and on error nothing changed:
        :class:`~poise.InvalidInput` for an unknown target, a target named
        twice, a non-endpoint, or an endpoint that already belongs to a
        balance (this one included: use :meth:`replace_endpoints` to reorder);
        :class:`~poise.DuplicateIdentity` when a new key is taken by an
        endpoint that stays or by another new endpoint. A
        ``release_reservation()`` hook that raises is logged; the splice stands.

        Cost: O(changes) in Python, no per-endpoint work for the endpoints
        that stay, except that a removal before the end renumbers the
        endpoints after it and copies the endpoint and ready lists once, in C.
        """
        self._check_not_scanning()
        if isinstance(removed, str | bytes):
            raise InvalidInput("removed must be a collection of keys or indices, not one string")
        by_key = self._by_key
        # -- validate: nothing below this block may raise before the commit --
        leaving: dict[int, Endpoint[Req, Resp]] = {}
        gone: list[Endpoint[Req, Resp]] = []
        for target in removed:
            ep = self._lookup(target)
            if id(ep) in leaving:
                raise InvalidInput(f"splice names endpoint {ep._key!r} twice")
            leaving[id(ep)] = ep
            gone.append(ep)
        swaps: list[tuple[Endpoint[Req, Resp], Endpoint[Req, Resp]]] = []
        for pair in replaced:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InvalidInput(
                    f"replaced must hold (key or index, endpoint) pairs, got {type(pair).__name__}"
                )
            target, new = pair
            ep = self._lookup(target)
            if id(ep) in leaving:
                raise InvalidInput(f"splice names endpoint {ep._key!r} twice")
            leaving[id(ep)] = ep
            swaps.append((ep, new))
        added = list(appended)
        incoming = [new for _, new in swaps]
        incoming += added
        arriving: set[Hashable] = set()
        for new in incoming:
            if not isinstance(new, Endpoint):
                raise InvalidInput(f"endpoints must be Endpoint objects, got {type(new).__name__}")
            key = new._key
            holder = by_key.get(key)
            if key in arriving or (holder is not None and id(holder) not in leaving):
                raise DuplicateIdentity(key, "balance")
            if new._owner is not None:
                where = "this balance" if new._owner is self else "another balance"
                raise InvalidInput(f"endpoint {key!r} already belongs to {where}")
            arriving.add(key)
        if not leaving and not added:
            return
        # -- commit ------------------------------------------------------------
        self._edits += 1
        endpoints = self._endpoints
        ready = self._ready
        consumed = self._consumed
        slack = len(endpoints) - len(ready)
        releases: list[Endpoint[Req, Resp]] = []
        unlisted: list[int] = []
        for ep in gone:
            if ep._listed:
                unlisted.append(self._ready_position(ep, slack))
                ep._listed = False
            self._vacate(ep, releases)
            del by_key[ep._key]
        for old, new in swaps:
            index = old._index
            self._vacate(old, releases)
            del by_key[old._key]
            endpoints[index] = new
            self._attach(new, index)
            if old._listed:
                # The new generation takes its predecessor's place in the
                # ready list, as a consumed endpoint keeps its own: when the
                # next scan finds it ready it is already in order, and if
                # not, _flush() drops it before any pick.
                at = self._ready_position(old, slack)
                ready[at] = new
                self._rrows[at] = new._row
                old._listed = False
                new._listed = True
                consumed.append(new)
        for _, new in swaps:
            by_key[new._key] = new
        if unlisted:
            self._ready = _without(ready, unlisted)
            self._rrows = _without(self._rrows, unlisted)
        if gone:
            positions = [ep._index for ep in gone]
            endpoints = self._endpoints = _without(endpoints, positions)
            first = min(positions)
            # Renumber the endpoints behind the first removal, in C.
            _consume(map(_set_attr, islice(endpoints, first, None), _INDEX, count(first)))
        for ep in leaving.values():
            ep._owner = None
            ep._index = -1
            ep._slot = -1
            if ep._row is None:
                self._unbound -= 1
        for new in added:
            self._attach(new, len(endpoints))
            endpoints.append(new)
            by_key[new._key] = new
        if self._detector is not None:
            self._detector_sync(
                [new._key for new in incoming], [ep._key for ep in leaving.values()]
            )
        if len(consumed) > 2 * len(endpoints) + 64:
            # Departed endpoints linger in _consumed until the next scan;
            # applications without scans in between must not pile them up.
            consumed[:] = [ep for ep in consumed if ep._listed and ep._owner is self]
        self._notify()
        for ep in releases:
            try:
                release_reservation(ep._service)
            except Exception:
                logger.exception("releasing the reservation of endpoint %r failed", ep._key)

    def _ready_position(self, ep: Endpoint[Req, Resp], slack: int) -> int:
        """Where a listed endpoint sits in _ready. O(log(slack)).

        _ready is an ordered subsequence of the endpoints, so an endpoint at
        index i sits at a position in [i - slack, i], where slack is the
        number of endpoints that are not listed.
        """
        ready = self._ready
        index = ep._index
        lo = index - slack if index > slack else 0
        hi = index + 1 if index < len(ready) else len(ready)
        at = bisect_left(ready, index, lo, hi, key=_by_index)
        if at < len(ready) and ready[at] is ep:
            return at
        return ready.index(ep)  # pragma: no cover - _ready is always in order

    def _vacate(self, ep: Endpoint[Req, Resp], releases: list[Endpoint[Req, Resp]]) -> None:
        """Take a departing endpoint out of the readiness lists (not _ready)."""
        state = ep._state
        if state is READY:
            ep._state = IDLE
            releases.append(ep)
        elif state is IDLE:
            self._leave_scan(ep)

    def endpoint_mut(self, index_or_key: Hashable) -> Endpoint[Req, Resp]:
        """The endpoint, for editing its service in place; drops its reservation.

        A READY endpoint becomes IDLE and its service's
        ``release_reservation()`` hook (if any) is called, so the next scan
        polls the edited service afresh. FAILED stays FAILED until reset.
        """
        ep = self._lookup(index_or_key)
        self._invalidate(ep)
        self._notify()
        return ep

    def reset(self, index_or_key: Hashable) -> None:
        """Bring a FAILED endpoint back to IDLE (no-op for other states)."""
        ep = self._lookup(index_or_key)
        if ep._state is FAILED:
            self._reset(ep)
            self._notify()

    def reset_all(self) -> int:
        """Bring every FAILED endpoint back to IDLE; return how many."""
        count = 0
        for ep in self._endpoints:
            if ep._state is FAILED:
                self._reset(ep)
                count += 1
        if count:
            self._notify()
        return count

    # -- internals -----------------------------------------------------------

    def _lookup(self, index_or_key: Hashable) -> Endpoint[Req, Resp]:
        try:
            ep = self._by_key.get(index_or_key)
        except TypeError:
            raise InvalidInput(
                f"endpoint keys are hashable; got {type(index_or_key).__name__}"
            ) from None
        if ep is not None:
            return ep
        if (
            isinstance(index_or_key, int)
            and not isinstance(index_or_key, bool)
            and 0 <= index_or_key < len(self._endpoints)
        ):
            return self._endpoints[index_or_key]
        raise InvalidInput(f"no endpoint with key or index {index_or_key!r}")

    def _check_not_scanning(self) -> None:
        if self._scanning:
            raise RuntimeError("endpoint membership cannot change during a readiness scan")

    def _attach(self, ep: Endpoint[Req, Resp], index: int) -> None:
        self._attach_state(ep)
        ep._index = index
        if ep._eligible and not ep._ejected:
            ep._slot = len(self._idle)
            self._idle.append(ep)
        else:
            ep._slot = -1

    def _attach_state(self, ep: Endpoint[Req, Resp]) -> None:
        ep._owner = self
        if ep._row is None:
            self._unbound += 1
        ep._state = IDLE
        ep._error = None
        ep._listed = False
        ep._parked = -1
        detector = self._detector
        ep._ejected = detector is not None and detector.is_ejected(ep._key)
        ep._wake = self._wake_for(ep)

    def _wake_for(self, ep: Endpoint[Req, Resp]) -> Callable[[], None]:
        """The wake function of one endpoint (made once, when it joins)."""
        woken = self._endpoint_woken

        def wake() -> None:
            woken(ep)

        return wake

    def _detector_sync(
        self, added: Iterable[Hashable] | None = None, removed: Iterable[Hashable] = ()
    ) -> None:
        """Tell the detector about a membership change (all of it when ``added`` is None)."""
        detector = self._detector
        assert detector is not None
        by_key = self._by_key
        if added is None:
            if any(key not in by_key for key in detector._states):
                self._apply(detector.sync(by_key, self._clock()))
            else:
                for key in by_key:
                    detector.add(key)
            return
        for key in added:
            detector.add(key)
        gone = [key for key in removed if key not in by_key]
        if gone:
            now = self._clock()
            events: list[OutlierEvent] = []
            for key in gone:
                events += detector.remove(key, now)
            self._apply(events)

    def _detach(self, ep: Endpoint[Req, Resp]) -> None:
        state = ep._state
        self._unlist(ep)
        if state is READY:
            ep._state = IDLE
        elif state is IDLE:
            self._leave_scan(ep)
        ep._owner = None
        ep._index = -1
        ep._slot = -1
        if ep._row is None:
            self._unbound -= 1
        if state is READY:
            release_reservation(ep._service)

    def _unlist(self, ep: Endpoint[Req, Resp]) -> None:
        if ep._listed:
            ep._listed = False
            self._drop_ready(ep)

    def _drop_ready(self, ep: Endpoint[Req, Resp]) -> None:
        """Take one endpoint (and its row) out of _ready and _rrows."""
        found = self._found
        if found:
            # Perhaps found READY by the scan under way, not in _ready yet.
            for at, other in enumerate(found):
                if other is ep:
                    del found[at]
                    return
        at = self._ready.index(ep)
        del self._ready[at]
        del self._rrows[at]

    def _flush(self) -> None:
        """Drop consumed endpoints that did not become READY again from _ready."""
        dropped: list[Endpoint[Req, Resp]] | None = None
        for ep in self._consumed:
            if ep._listed and ep._state is not READY and ep._owner is self:
                ep._listed = False
                if dropped is None:
                    dropped = []
                dropped.append(ep)
        self._consumed.clear()
        if dropped is not None:
            ready = self._ready
            if len(dropped) <= _FEW:
                for ep in dropped:
                    self._drop_ready(ep)
            else:
                # Many at once (replacements spliced in that did not become
                # ready): find them by bisection and copy the list once.
                slack = len(self._endpoints) - len(ready)
                at = [self._ready_position(ep, slack) for ep in dropped]
                self._ready = _without(ready, at)
                self._rrows = _without(self._rrows, at)

    def _leave_scan(self, ep: Endpoint[Req, Resp]) -> None:
        """Take an IDLE endpoint out of the scan (the idle list or the parking)."""
        if ep._slot >= 0:
            self._take_idle(ep)
        elif ep._parked >= 0:
            ep._parked = -1
            self._parked_count -= 1

    def _take_idle(self, ep: Endpoint[Req, Resp]) -> None:
        idle = self._idle
        slot = ep._slot
        last = idle.pop()
        if last is not ep:
            idle[slot] = last
            last._slot = slot
        ep._slot = -1

    def _invalidate(self, ep: Endpoint[Req, Resp]) -> None:
        if ep._state is READY:
            self._unlist(ep)
            ep._state = IDLE
            ep._slot = len(self._idle)
            self._idle.append(ep)
            release_reservation(ep._service)

    def _reset(self, ep: Endpoint[Req, Resp]) -> None:
        ep._state = IDLE
        ep._error = None
        self._rejoin(ep)

    def _rejoin(self, ep: Endpoint[Req, Resp]) -> None:
        """Put an IDLE endpoint that may be scanned back in the idle list."""
        if (
            ep._state is IDLE
            and ep._eligible
            and not ep._ejected
            and ep._slot < 0
            and ep._parked < 0
        ):
            ep._slot = len(self._idle)
            self._idle.append(ep)

    def _withdraw(self, ep: Endpoint[Req, Resp]) -> None:
        """Take an endpoint out of selection (drained or ejected): O(1)."""
        self._invalidate(ep)
        if ep._state is IDLE:
            self._leave_scan(ep)

    def _eligibility_changed(self, ep: Endpoint[Req, Resp]) -> None:
        if ep._eligible:
            self._rejoin(ep)
        else:
            self._withdraw(ep)
        self._notify()

    # -- outlier ejection ------------------------------------------------------

    def _outcome(self, key: Hashable, failed: bool, now: float) -> None:
        """A call of ``key`` completed: tell the detector, apply an ejection."""
        detector = self._detector
        assert detector is not None
        event = detector.record(key, failed, now)
        if event is not None:
            self._apply([event])

    def _apply(self, events: list[OutlierEvent]) -> None:
        by_key = self._by_key
        for event in events:
            ep = by_key.get(event.key)
            if ep is None:
                continue
            if event.ejected:
                if not ep._ejected:
                    ep._ejected = True
                    self._withdraw(ep)
            elif ep._ejected:
                ep._ejected = False
                self._rejoin(ep)
        if events:
            self._notify()


def _without(items: list[_T], positions: list[int]) -> list[_T]:
    """``items`` without the entries at ``positions`` (distinct, any order).

    A few deletions edit the list in place; more rebuild it from
    slices, one C-level copy instead of one memmove per deletion.
    """
    positions.sort()
    if len(positions) <= _FEW:
        for at in reversed(positions):
            del items[at]
        return items
    kept = items[:0]
    start = 0
    for at in positions:
        kept += items[start:at]
        start = at + 1
    kept += items[start:]
    return kept


def _complete(guard: LoadGuard, started: float, now: float, failed: bool) -> None:
    """``guard.complete``; if it refuses ``now`` (a clock that went back), cancel as of the start.

    So a call never stays counted in flight after its dispatch ended.
    """
    try:
        guard.complete(now, failed=failed)
    except InvalidInput:
        guard.cancel(started)
        raise


def _cancel(guard: LoadGuard, started: float, now: float) -> None:
    """``guard.cancel(now)``; if it refuses ``now`` (not finite: a clock gone
    wrong), cancel as of the start instead, without raising.

    The call still ends (nothing stays counted in flight) and proves nothing,
    and a cancellation on its way out is not replaced by an error about the
    clock.
    """
    try:
        guard.cancel(now)
    except InvalidInput:
        guard.cancel(started)


def _bad_end(started: float, now: float) -> InvalidInput:
    return InvalidInput(
        f"the balance's clock read {now!r} at the end of a call dispatched at "
        f"{started!r}: a completion must come at a finite time, not before the start"
    )


def _bad_pick(policy: object, index: object, n: int) -> SelectionError:
    if type(index) is not int:
        return SelectionError(
            f"policy {type(policy).__name__} returned a {type(index).__name__} "
            f"({index!r}) where an int index into {n} ready endpoints was expected"
        )
    return SelectionError(
        f"policy {type(policy).__name__} picked index {index!r} of {n} ready endpoints"
    )


def _endpoint_error(key: Hashable, index: int, exc: Exception) -> EndpointError:
    return EndpointError(
        f"call to endpoint {key!r} at index {index} failed with {type(exc).__name__}",
        index=index,
        key=key,
    )
