"""Hedged (backup) requests: a second attempt when the first is slower than usual.

One slow backend sets a fleet's tail: with P2C on peak EWMA the requests it
answers before the balancer has learned to avoid it wait its full latency.
A hedge sends the same idempotent request to another endpoint once the
first attempt has been out longer than the route usually takes, keeps the
first answer and cancels the other attempts (Finagle's backup requests,
gRPC's hedging policy).

Decision part (pure, time as an argument)
    :class:`LatencyWindow` keeps the latencies of the route's completed
    attempts over a rolling window (at most ``size`` samples, none older
    than ``horizon`` seconds) and answers nearest-rank percentiles.
    :class:`Hedging` holds one route's rule: the hedge delay is either fixed
    (``delay``) or the window's ``percentile`` (e.g. 0.95), and no hedge is
    sent before ``min_samples`` completions were seen; at most
    ``max_extra`` hedges per request, the next one ``delay`` after the
    previous. Only requests marked idempotent are hedged. Every hedge is
    charged to a :class:`~poise.RetryBudget` when one is given (the route's,
    shared with retries), and to the rule's own cap on extra load,
    ``max_extra_load`` when given (a share of the requests; it starts empty
    and keeps at most a thousand requests' worth): an exhausted budget or
    cap means no hedge (counted in ``refused``). A cap equal to ``1 -
    percentile`` (Finagle ties the two) refuses hedges whenever the window's
    estimate runs a little low, and a refused hedge of a request stuck on a
    slow backend is exactly the tail hedging is for: it is off by default.

Running part
    :func:`hedged_call` runs the attempts of one request in a task group it
    owns: the first success wins and the task group is cancelled, which
    cancels the losing attempts. A cancelled attempt ends its load guard
    with ``cancel(now)``: for :class:`~poise.PeakEwma` that is evidence of
    the time the attempt had taken (never of a fast answer), so a slow
    backend that keeps losing races looks slow, not fast. The latency
    window gets one sample per request, the first attempt's: its latency
    when it answered, or, when a hedge won, the time it had been out when
    the race ended. That is only a lower bound, but one above the hedge
    delay, so it ranks where it belongs for the percentile (above it); the
    hedges' own latencies are not samples (they would pull the percentile
    down and make hedges more frequent).

    No result is dropped: each answer is returned or handed to ``discard``
    exactly once, a loser's that came in the same instant as the winner's
    (or while it was being cancelled), and the winner's own when the call
    ends with an exception instead (its caller's cancel scope ended just as
    it answered): a response is always closed and its load guard ends.

Picks: a hedge is a copy of an attempt that already had its turn, so
    it must not take a turn of the balance's policy. Each attempt of a race
    runs with a marker (a context variable: the attempt's number and the
    call's record of the endpoints its attempts picked, per balance). A
    :class:`~poise.Balance` whose policy can ``peek`` (the turn-taking
    ones: :class:`~poise.RoundRobin`, :class:`~poise.WeightedRoundRobin`,
    :class:`~poise.LeastLoaded`; and :class:`~poise.WeightedRendezvous`,
    whose hedge goes to the context's next-ranked ready endpoint) records
    every pick of the call's attempts,
    and answers a pick of a later attempt, once the call has picked from
    that balance, with :func:`hedge_pick`: the policy's next turn among the
    ready endpoints the call has not tried, taken without using it up. So
    with hedging on, the first attempts of successive calls rotate exactly
    as they would without it, and a hedge goes to another endpoint than the
    attempts before it whenever one is ready. Other policies pick for a
    hedge as for any call (power of two choices on the in-flight attempt's
    load already steers away from it). The first pick of a hedge in a
    balance the call had not used is an ordinary pick.

Failures: an attempt that fails while another is out does not end the
request; when every attempt started has failed and no hedge is due, the
last failure propagates (the caller's retry rule decides what follows).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Container, Hashable, Sequence
from contextvars import ContextVar
from typing import TypeVar, cast

import anyio

from ._budget import RetryBudget
from ._errors import InvalidInput, SelectionError
from ._protocols import Weighted

__all__ = ["Hedging", "LatencyWindow", "hedged_call"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_DISCARD_SECONDS = 5.0

#: A turn-taking policy's ``peek(ready, context, now, avoid)``.
Peek = Callable[[Sequence[Weighted], object, float, Container[Hashable]], int]

#: The endpoint keys one hedged call's attempts picked, in pick order, per balance.
CallPicks = dict[object, list[Hashable]]

#: Set in each attempt of a race (its own task): the call's picks and the
#: attempt's number (0: the first). None outside a race.
current_attempt: ContextVar[tuple[CallPicks, int] | None] = ContextVar(
    "poise_hedged_attempt", default=None
)


def hedge_pick(
    peek: Peek,
    ready: Sequence[Weighted],
    context: object,
    now: float,
    tried: Sequence[Hashable],
) -> int:
    """The index in ``ready`` of a hedge's pick; changes no policy state.

    ``tried`` holds the keys the call's attempts picked so far (oldest
    first). The hedge goes to the policy's next turn among the ready
    endpoints not tried; when the call has tried every ready endpoint, among
    those but the one it tried last; with one ready endpoint, to it.
    Raises :class:`~poise.SelectionError` when ``peek`` answers an index out
    of range (or ``ready`` is empty).
    """
    n = len(ready)
    avoid: Container[Hashable] = ()
    if tried and n > 1:
        avoid = set(tried)
        for index in range(n):
            if ready[index].key not in avoid:
                break
        else:
            avoid = (tried[-1],)
    i = peek(ready, context, now, avoid)
    if type(i) is not int or not 0 <= i < n:
        raise SelectionError(f"{peek!r} returned {i!r} for {n} ready endpoint(s)")
    return i


class LatencyWindow:
    """Rolling latencies (seconds) of completed attempts; percentiles by rank.

    Holds at most ``size`` samples, and none recorded more than ``horizon``
    seconds before the latest ``now`` given. O(size) per record (a sorted
    list), O(1) per percentile.

    The ``q`` percentile of ``n`` samples is the sample of rank
    ``ceil(q x (n + 1))`` (at most ``n``): a new sample from the same
    distribution exceeds the sample of rank ``k`` with probability
    ``(n + 1 - k) / (n + 1)``, so this rank keeps that probability at or
    below ``1 - q``. (The nearest rank, ``ceil(q x n)``, is exceeded a
    little more often: 5.09% for p95 over 1,000 samples, and a hedge at
    "p95" would then cost more than 5% extra attempts.)
    """

    __slots__ = ("_horizon", "_order", "_size", "_sorted")

    def __init__(self, size: int = 1000, horizon: float = 10.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidInput(f"LatencyWindow: size must be an integer >= 1, got {size!r}")
        if not (isinstance(horizon, (int, float)) and 0.0 < horizon < math.inf):
            raise InvalidInput(f"LatencyWindow: horizon must be > 0 and finite, got {horizon!r}")
        self._size = size
        self._horizon = float(horizon)
        self._order: deque[tuple[float, float]] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def _evict(self, now: float) -> None:
        order, ranked = self._order, self._sorted
        oldest = now - self._horizon
        while order and (len(order) > self._size or order[0][0] < oldest):
            _, value = order.popleft()
            del ranked[bisect.bisect_left(ranked, value)]

    def record(self, now: float, seconds: float) -> None:
        """Add one completed attempt that took ``seconds``, finished at ``now``."""
        if not (math.isfinite(now) and math.isfinite(seconds) and seconds >= 0.0):
            raise InvalidInput(
                f"LatencyWindow: a sample needs a finite time and a latency >= 0, "
                f"got now={now!r} seconds={seconds!r}"
            )
        self._order.append((now, seconds))
        bisect.insort(self._sorted, seconds)
        self._evict(now)

    def percentile(self, now: float, q: float) -> float | None:
        """The ``q`` quantile of the samples still in the window (None: empty)."""
        if not 0.0 < q <= 1.0:
            raise InvalidInput(f"LatencyWindow: a percentile must be in (0, 1], got {q!r}")
        self._evict(now)
        ranked = self._sorted
        if not ranked:
            return None
        count = len(ranked)
        return ranked[min(count, max(1, math.ceil(q * (count + 1)))) - 1]


class Hedging:
    """One route's hedging rule and counters (see the module docstring).

    Exactly one of ``delay`` (seconds, fixed) and ``percentile`` (in (0, 1))
    is given. ``max_extra`` hedges at most per request (1-8).
    """

    __slots__ = (
        "_cap",
        "_delay",
        "_max_extra",
        "_min_samples",
        "_percentile",
        "hedges",
        "refused",
        "window",
        "wins",
    )

    def __init__(
        self,
        *,
        delay: float | None = None,
        percentile: float | None = None,
        max_extra: int = 1,
        min_samples: int = 20,
        max_extra_load: float | None = None,
        window: LatencyWindow | None = None,
    ) -> None:
        if (delay is None) == (percentile is None):
            raise InvalidInput("Hedging: give exactly one of delay and percentile")
        if delay is not None and (
            isinstance(delay, bool)
            or not isinstance(delay, (int, float))
            or not 0.0 <= delay < math.inf
        ):
            raise InvalidInput(f"Hedging: delay must be >= 0 seconds and finite, got {delay!r}")
        if percentile is not None and not (
            isinstance(percentile, (int, float)) and 0.0 < percentile < 1.0
        ):
            raise InvalidInput(f"Hedging: percentile must be in (0, 1), got {percentile!r}")
        if isinstance(max_extra, bool) or not isinstance(max_extra, int) or not 1 <= max_extra <= 8:
            raise InvalidInput(f"Hedging: max_extra must be an integer 1-8, got {max_extra!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 0:
            raise InvalidInput(f"Hedging: min_samples must be an integer >= 0, got {min_samples!r}")
        if max_extra_load is not None and (
            isinstance(max_extra_load, bool)
            or not isinstance(max_extra_load, (int, float))
            or not 0.0 < max_extra_load <= 8.0
        ):
            raise InvalidInput(f"Hedging: max_extra_load must be in (0, 8], got {max_extra_load!r}")
        self._cap = (
            None
            if max_extra_load is None
            else RetryBudget(max_extra_load, 0.0, capacity=max(10.0, 1000.0 * max_extra_load))
        )
        self._delay = None if delay is None else float(delay)
        self._percentile = None if percentile is None else float(percentile)
        self._max_extra = max_extra
        self._min_samples = min_samples
        self.window = LatencyWindow() if window is None else window
        #: Hedges sent, hedges whose answer won, hedges the budget refused.
        self.hedges = 0
        self.wins = 0
        self.refused = 0

    @property
    def max_extra(self) -> int:
        return self._max_extra

    def admit(self, now: float) -> None:
        """Count one request that may be hedged (feeds the extra-load cap)."""
        if self._cap is not None:
            self._cap.deposit(now)

    def delay(self, now: float) -> float | None:
        """The hedge delay at ``now``; None when no hedge may be sent (too few samples)."""
        if self._delay is not None:
            return self._delay
        if len(self.window) < self._min_samples:
            return None
        assert self._percentile is not None
        return self.window.percentile(now, self._percentile)

    def may_hedge(self, now: float, sent: int, budget: RetryBudget | None) -> bool:
        """Whether hedge number ``sent + 1`` may go out at ``now`` (charges the budget)."""
        if sent >= self._max_extra:
            return False
        cap = self._cap
        if (cap is not None and cap.balance(now) < 1.0) or (
            budget is not None and not budget.try_withdraw(now)
        ):
            self.refused += 1
            return False
        if cap is not None:
            cap.try_withdraw(now)
        self.hedges += 1
        return True

    def __repr__(self) -> str:
        rule = f"delay={self._delay:g}s" if self._delay is not None else f"p{self._percentile:g}"
        return f"<Hedging {rule} max_extra={self._max_extra} hedges={self.hedges}>"


class _Race:
    __slots__ = ("errors", "result", "running", "wake", "won")

    def __init__(self) -> None:
        self.running = 0
        self.won = False
        self.result: object = None
        self.errors: list[Exception] = []
        self.wake = anyio.Event()


async def _discard(discard: Callable[[T], Awaitable[object]] | None, value: T) -> None:
    """Hand ``value`` to ``discard``, shielded and bounded; its failure is not the call's."""
    if discard is None:
        return
    with anyio.CancelScope(shield=True), anyio.move_on_after(_DISCARD_SECONDS):
        try:
            await discard(value)
        except Exception as error:
            # Closing an unwanted answer failed: the caller has its own answer (or
            # its own exception, a cancellation above all), which this must not mask.
            logger.debug("discarding a hedged attempt's result raised %r", error)


async def hedged_call(
    attempt: Callable[[int], Awaitable[T]],
    hedging: Hedging | None,
    *,
    idempotent: bool,
    budget: RetryBudget | None = None,
    clock: Callable[[], float] = anyio.current_time,
    discard: Callable[[T], Awaitable[object]] | None = None,
) -> T:
    """Run ``attempt(0)``, hedged by ``attempt(1)``... per ``hedging``; the first success wins.

    ``attempt(n)`` makes attempt ``n`` (0 = the first). Without ``hedging``,
    for a request not ``idempotent``, or before the window has enough
    samples, this is ``await attempt(0)``. The losers are cancelled when the
    winner answers; the task group is this call's own, so nothing outlives it.

    Every result an attempt produces is either returned or handed to
    ``discard`` (e.g. closing a response, which ends its load guard), exactly
    once, shielded and bounded to 5 s: a loser that answered anyway (in the
    same instant, or while it was being cancelled), and the winner itself
    when this call ends with an exception instead of returning it (the
    caller's cancel scope ended just as it answered). An exception ``discard``
    raises is logged (debug) and does not replace the call's outcome.

    Each attempt runs in its own task with a marker a
    :class:`~poise.Balance` reads: a later attempt's pick from a balance
    the call already picked from takes no turn of a turn-taking policy
    and avoids the endpoints the call tried (see the module docstring).
    """
    started = clock()
    if hedging is not None and idempotent:
        hedging.admit(started)
    delay = None if hedging is None or not idempotent else hedging.delay(started)
    if hedging is None or delay is None:
        value = await attempt(0)
        if hedging is not None:
            now = clock()
            hedging.window.record(now, now - started)
        return value
    race = _Race()
    picks: CallPicks = {}

    async def one(n: int) -> None:
        # This task's own context: the marker is seen by this attempt's picks only.
        current_attempt.set((picks, n))
        try:
            value = await attempt(n)
        except Exception as error:
            race.errors.append(error)
        else:
            # No await from here to the claim: a result is never between owners.
            if race.won:
                await _discard(discard, value)
            else:
                race.won = True
                race.result = value
                now = clock()
                # The first attempt's latency; a hedge that wins cut it off at now.
                hedging.window.record(now, now - started)
                if n:
                    hedging.wins += 1
        finally:
            race.running -= 1
            race.wake.set()

    sent = 0
    try:
        async with anyio.create_task_group() as group:
            race.running += 1
            group.start_soon(one, 0)
            hedge = True
            while not race.won and race.running:
                race.wake = wake = anyio.Event()
                if hedge:
                    with anyio.move_on_after(delay):
                        await wake.wait()
                    if wake.is_set():
                        continue
                    if hedging.may_hedge(clock(), sent, budget):
                        sent += 1
                        race.running += 1
                        group.start_soon(one, sent)
                    else:
                        hedge = False
                else:
                    await wake.wait()
            group.cancel_scope.cancel()
    except BaseException:
        # The group has ended (every attempt with it), so the race is decided: a
        # winner that is not returned (the caller was cancelled as it answered, or
        # another attempt raised what ends the call) is discarded, not dropped.
        if race.won:
            await _discard(discard, cast(T, race.result))
        raise
    # No await between the group's end and the return: the caller gets the winner.
    if race.won:
        return cast(T, race.result)
    raise race.errors[-1]
