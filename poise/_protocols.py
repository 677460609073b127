"""The three seams of the balancing core: services, load trackers and policies.

These are structural protocols: anything with the right methods fits, and
nothing here imports an event loop. Implementations live in their own modules
(``_service.py``, ``_load.py``, ``_peak_ewma.py``, ``_policies.py``).

Readiness is a *synchronous* check (Tower's ``poll_ready`` with a waker)::

    poll_ready(wake) -> True    ready; a reservation is now held until call()
                     -> False   pending; the service calls wake() once when
                                readiness may have changed
                     raise      failed; the balance quarantines the endpoint

Time is always passed in (``now``, seconds on the event loop clock), so load
tracking and selection are deterministic and testable without an event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["LoadGuard", "LoadTracker", "Policy", "Service", "Weighted"]

Req_contra = TypeVar("Req_contra", contravariant=True)
Resp_co = TypeVar("Resp_co", covariant=True)
Ctx_contra = TypeVar("Ctx_contra", contravariant=True)


@runtime_checkable
class Service(Protocol[Req_contra, Resp_co]):
    """An async service with a non-blocking, possibly reserving, readiness check.

    A service may also have a synchronous ``close()``; the balance and the
    reconciler call it when they discard a service they own (a staged service
    of a failed transaction, a retired generation).
    """

    def poll_ready(self, wake: Callable[[], None]) -> bool: ...

    async def call(self, request: Req_contra) -> Resp_co: ...


class LoadGuard(Protocol):
    """Accounts for one dispatched call. Exactly one of the two ends counts.

    ``complete`` ends the call (``failed=True`` when the service raised);
    ``cancel`` ends it as cancelled. Any later call of either is a no-op.
    """

    def complete(self, now: float, *, failed: bool = False) -> None: ...

    def cancel(self, now: float) -> None: ...


class LoadTracker(Protocol):
    """The per-endpoint load a load-aware policy compares.

    ``load(now)`` is a cost where lower is better (in-flight count for
    ``InFlight``; RTT estimate x (in-flight + 1) for ``PeakEwma``).
    ``start(now)`` is called when a call is dispatched and returns its guard.
    """

    def load(self, now: float) -> float: ...

    def start(self, now: float) -> LoadGuard: ...


class Weighted(Protocol):
    """What a policy may read of an endpoint: identity, weight and load."""

    @property
    def key(self) -> Hashable: ...

    @property
    def weight(self) -> float: ...

    def load(self, now: float) -> float: ...


class Policy(Protocol[Ctx_contra]):
    """Chooses one of the *ready* endpoints.

    ``pick`` returns an index into ``ready`` (never empty: the balance raises
    ``SelectionError`` itself before asking). ``context`` is the affinity
    context (``None`` for request-independent policies). A policy may keep
    state keyed by endpoint key; it must not hold on to the endpoints.

    A policy that keeps turns may also have ``peek(ready, context, now,
    avoid)``: the index ``pick`` would return if the endpoints keyed in
    ``avoid`` were not ready, changing no state (raising
    ``SelectionError`` when every one is avoided). The balance then picks
    a hedge with it, so that a hedge takes no turn (see
    :func:`~poise.hedged_call`). It is optional and not part of this
    protocol's required methods.
    """

    def pick(self, ready: Sequence[Weighted], context: Ctx_contra, now: float) -> int: ...


# A service factory result, used by the reconciler: (service, tracker).
ServiceFactoryResult = tuple[Service[object, object], LoadTracker]
WakeFn = Callable[[], None]
