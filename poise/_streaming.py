"""A discovery balance driven by a snapshot stream, without a driver task.

:class:`StreamingDiscoveryBalance` joins a :class:`~poise.SnapshotStream`
(latest-only, one cursor) and a :class:`~poise.DiscoveryBalance`. Every
``await ready()`` does, in this order::

    1 reconcile  apply what discovery published since the last call
                 (newest only; at most ``max_applications_per_ready`` per
                 round, then yield to the scheduler and continue)
    2 end check  stream ended and FAIL_CLOSED -> StreamClosed
    3 readiness  one scan of the endpoints (balance.ready_nowait())
    4 wait       register the balance's wake with the stream and wait for
                 that single wake-up: a discovery publish and an endpoint
                 becoming ready wake the same waiter; then go to 1

No task is spawned and nothing polls: the wake function the endpoints get is
the one the stream calls. With a synchronous factory an application does not
yield at all, so the budget alone bounds how many snapshots one task applies
back to back before the scheduler runs someone else; with an ``async``
factory every application also yields while it stages. While the stream is open, an empty or fully
ineligible pool waits for discovery instead of raising.

Errors::

    reconcile failed  -> StreamingError (cause: the ReconcileError); the
                         previous pool is intact and the failed snapshot is
                         consumed, so the next ready() serves the last good
                         pool or applies a newer publication
    publisher closed  -> SERVE_LAST_GOOD (default): keep serving the pool
                         FAIL_CLOSED: ready() raises StreamClosed once the
                         final snapshot was observed

A snapshot taken from the stream whose application was *cancelled* is kept
and applied first by the next ``ready()``, so cancellation never loses state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

import anyio
import anyio.lowlevel

from ._balance import Balance
from ._cell import CellReader, Subscription
from ._directory import Snapshot, SnapshotReader, SnapshotStream
from ._errors import InvalidInput, ReconcileError, SelectionError, StreamClosed, StreamingError
from ._reconcile import DiscoveryBalance, ReconcileReport

__all__ = ["StreamEndPolicy", "StreamingConfig", "StreamingDiscoveryBalance"]

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _Source(Protocol):
    """What the wrapper needs of a latest-only snapshot stream."""

    @property
    def pending(self) -> bool: ...

    @property
    def ended(self) -> bool: ...

    def receive_nowait(self) -> Snapshot: ...

    def add_waker(self, wake: Callable[[], None]) -> None: ...


class StreamEndPolicy(enum.Enum):
    """What readiness does after the publisher closed and its final snapshot was seen."""

    SERVE_LAST_GOOD = "serve_last_good"
    """Keep serving the last successfully applied pool (the default)."""
    FAIL_CLOSED = "fail_closed"
    """Refuse readiness with :class:`~poise.StreamClosed`."""


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    """Settings of a :class:`StreamingDiscoveryBalance`.

    ``max_applications_per_ready``: how many snapshots one round of
    ``ready()`` applies before yielding to the scheduler (an integer >= 1).
    Only the newest publication is ever applied, so one application per
    round is the usual case; more happen when discovery publishes while an
    async factory is staging.
    """

    max_applications_per_ready: int = 4

    def __post_init__(self) -> None:
        value = self.max_applications_per_ready
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInput(
                f"StreamingConfig.max_applications_per_ready must be an integer >= 1, got {value!r}"
            )


class StreamingDiscoveryBalance(Generic[Req, Resp]):
    """A :class:`~poise.DiscoveryBalance` that reconciles on every ``ready()``.

    ``source`` is a :class:`~poise.SnapshotStream` (used as is: its cursor
    decides what is new) or a :class:`~poise.SnapshotReader` (subscribed, so
    the current snapshot is applied by the first ``ready()``). A
    :class:`~poise.Subscription` or :class:`~poise.CellReader` of a
    :class:`~poise.LatestCell` that carries snapshots works the same way.
    """

    __slots__ = (
        "_applications",
        "_config",
        "_discovery",
        "_end_policy",
        "_failures",
        "_last_error",
        "_last_report",
        "_stream",
        "_unapplied",
        "_wake",
    )

    def __init__(
        self,
        source: SnapshotStream | SnapshotReader | Subscription[Snapshot] | CellReader[Snapshot],
        discovery: DiscoveryBalance[Req, Resp],
        config: StreamingConfig | None = None,
        end_policy: StreamEndPolicy = StreamEndPolicy.SERVE_LAST_GOOD,
    ) -> None:
        stream: _Source
        if isinstance(source, SnapshotReader | CellReader):
            stream = source.subscribe()
        elif isinstance(source, SnapshotStream | Subscription):
            stream = source
        else:
            raise InvalidInput(
                "source must be a SnapshotStream, SnapshotReader, Subscription or CellReader, "
                f"got {type(source).__name__}"
            )
        if not isinstance(discovery, DiscoveryBalance):
            raise InvalidInput(
                f"discovery must be a DiscoveryBalance, got {type(discovery).__name__}"
            )
        if config is None:
            config = StreamingConfig()
        elif not isinstance(config, StreamingConfig):
            raise InvalidInput(f"config must be a StreamingConfig, got {type(config).__name__}")
        if not isinstance(end_policy, StreamEndPolicy):
            raise InvalidInput(f"end_policy must be a StreamEndPolicy, got {end_policy!r}")
        self._stream: _Source = stream
        self._discovery = discovery
        self._config = config
        self._end_policy = end_policy
        # One bound method, registered again on every wait (the cell dedups).
        self._wake: Callable[[], None] = discovery.balance.wake
        self._unapplied: Snapshot | None = None
        self._applications = 0
        self._failures = 0
        self._last_error: ReconcileError | None = None
        self._last_report: ReconcileReport | None = None

    # -- views --------------------------------------------------------------------------

    @property
    def discovery(self) -> DiscoveryBalance[Req, Resp]:
        return self._discovery

    @property
    def balance(self) -> Balance[Req, Resp]:
        return self._discovery.balance

    @property
    def stream(self) -> SnapshotStream | Subscription[Snapshot]:
        """The subscription whose cursor decides what is new."""
        return cast("SnapshotStream | Subscription[Snapshot]", self._stream)

    @property
    def config(self) -> StreamingConfig:
        return self._config

    @property
    def end_policy(self) -> StreamEndPolicy:
        return self._end_policy

    @property
    def ended(self) -> bool:
        """True once the publisher closed and its final snapshot was taken."""
        return self._stream.ended and self._unapplied is None

    @property
    def applications(self) -> int:
        """Snapshots applied successfully (no-ops included)."""
        return self._applications

    @property
    def failures(self) -> int:
        """Snapshots whose application failed."""
        return self._failures

    @property
    def last_error(self) -> ReconcileError | None:
        return self._last_error

    @property
    def last_report(self) -> ReconcileReport | None:
        return self._last_report

    def __repr__(self) -> str:
        return (
            f"<StreamingDiscoveryBalance revision={self._discovery.revision} "
            f"applications={self._applications} failures={self._failures} "
            f"ended={self.ended} endpoints={len(self._discovery)}>"
        )

    # -- readiness and dispatch ------------------------------------------------------------

    async def ready(self) -> None:
        """Reconcile what discovery published, then wait until an endpoint is READY.

        Always checkpoints. Raises :class:`~poise.StreamingError` if a
        published snapshot could not be applied (the previous pool serves
        on), :class:`~poise.StreamClosed` under ``FAIL_CLOSED`` after the
        stream ended, and the balance's :class:`~poise.ReadinessError`. An
        empty or unusable pool raises :class:`~poise.SelectionError` only
        once the stream has ended; before that, it waits for discovery.
        """
        await anyio.lowlevel.checkpoint()
        balance = self._discovery.balance
        stream = self._stream
        budget_per_round = self._config.max_applications_per_ready
        while True:
            budget = budget_per_round
            while budget and (stream.pending or self._unapplied is not None):
                budget -= 1
                await self._apply_next()
            if stream.pending:
                # Budget spent while discovery keeps publishing: let others run.
                await anyio.lowlevel.checkpoint()
                continue
            if stream.ended and self._end_policy is StreamEndPolicy.FAIL_CLOSED:
                raise StreamClosed(
                    f"discovery stream ended at revision {self._discovery.revision} "
                    "and the end policy is FAIL_CLOSED"
                )
            since = balance.wake_count
            try:
                if balance.ready_nowait():
                    return
            except SelectionError:
                if stream.ended:
                    raise
            stream.add_waker(self._wake)
            await balance.wait_woken(since)

    async def _apply_next(self) -> None:
        stream = self._stream
        if stream.pending:
            # A newer publication supersedes one whose application was cancelled.
            self._unapplied = stream.receive_nowait()
        snapshot = self._unapplied
        assert snapshot is not None
        discovery = self._discovery
        try:
            if discovery._async_factory:
                report = await discovery.apply_snapshot_async(snapshot)
            else:
                # Nothing to await: apply without yielding. The budget in
                # ready() decides when this task lets others run.
                report = discovery.apply_snapshot(snapshot)
        except ReconcileError as exc:
            # The snapshot was observed: do not retry it, serve the last good pool.
            self._unapplied = None
            self._failures += 1
            self._last_error = exc
            what = getattr(snapshot, "revision", None)
            raise StreamingError(
                f"could not apply discovery snapshot revision {what} "
                f"({type(exc).__name__}: {exc}); still serving revision "
                f"{self._discovery.revision}"
            ) from exc
        self._unapplied = None
        self._applications += 1
        self._last_report = report

    async def call(self, request: Req) -> Resp:
        """The balance's ``call``: needs a reservation from :meth:`ready`."""
        return await self._discovery.balance.call(request)

    async def dispatch(self, request: Req) -> Resp:
        """``await ready()`` then ``call(request)``, with no yield in between."""
        await self.ready()
        return await self._discovery.balance.call(request)

    def ready_nowait(self) -> bool:
        """One readiness scan of the current pool, without reconciling or waiting."""
        return self._discovery.balance.ready_nowait()
