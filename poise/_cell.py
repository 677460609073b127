"""The latest-only cell: a value with a revision, and readers that see the newest.

Snapshot streams, observations and catalogs all describe *current state*, not
an event log, so their channel is not a queue. A :class:`LatestCell` holds one
value and a revision that grows by one on every :meth:`~LatestCell.publish`.
Each :class:`Subscription` remembers the revision it last returned; when the
cell moved past it, ``receive()`` returns the current value at once, otherwise
it waits. Several publishes between two receives therefore yield only the
newest value, and a slow reader never builds a backlog.

After :meth:`LatestCell.close`, a subscription first returns the final value
(if it has not seen it) and then ends with :class:`anyio.EndOfStream`.

Task-free consumers use the synchronous side: ``pending``, ``ended``,
``receive_nowait()`` and ``add_waker(wake)`` (one-shot, called at the next
publish or close, or at once if a value is already pending); ``await
wait()`` waits without consuming.

Cost: ``publish`` is O(number of registered wakers) and allocates nothing when
no one waits; a waiting reader costs one shared event per cell, not one per
reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["CellReader", "LatestCell", "Subscription"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNSET: object = object()


class LatestCell(Generic[T]):
    """A versioned value; the publisher side. Publishing is synchronous."""

    __slots__ = ("_closed", "_event", "_revision", "_value", "_wakers")

    def __init__(self, *args: T) -> None:
        """``LatestCell()`` starts empty (revision 0); ``LatestCell(v)`` at revision 1."""
        if len(args) > 1:
            raise TypeError("LatestCell takes at most one initial value")
        self._value: object = args[0] if args else _UNSET
        self._revision = 1 if args else 0
        self._closed = False
        # Created lazily: a cell may be built and published to outside any
        # event loop (a Directory built in plain sync code).
        self._event: anyio.Event | None = None
        self._wakers: dict[Callable[[], None], None] = {}

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def has_value(self) -> bool:
        return self._value is not _UNSET

    def get(self) -> T:
        """The current value; ``LookupError`` if nothing was published yet."""
        if self._value is _UNSET:
            raise LookupError("nothing has been published yet")
        return self._value  # type: ignore[return-value]

    def publish(self, value: T) -> int:
        """Make ``value`` current, wake every reader, return the new revision."""
        if self._closed:
            raise anyio.ClosedResourceError("cannot publish to a closed cell")
        self._value = value
        self._revision += 1
        self._wake_all()
        return self._revision

    def close(self) -> None:
        """Mark the current revision final. Idempotent."""
        if not self._closed:
            self._closed = True
            self._wake_all()

    def reader(self) -> CellReader[T]:
        """A read-only view: readers cannot publish or close."""
        return CellReader(self)

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once at the next publish or close.

        Registering an equal callable twice keeps one registration, so a
        component can pass the same bound method on every poll. A closed
        cell never calls it (nothing will change any more). A waker that
        raises is logged; it never fails the publish or the other wakers.
        """
        if not self._closed:
            self._wakers[wake] = None

    def discard_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.pop(wake, None)

    async def _wait_past(self, revision: int) -> None:
        """Wait until the revision moves past ``revision`` or the cell closes."""
        while self._revision == revision and not self._closed:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    def _wake_all(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()
        if self._wakers:
            wakers, self._wakers = self._wakers, {}
            for wake in wakers:
                try:
                    wake()
                except Exception:
                    # The value is already published; a subscriber's broken
                    # callback must not fail the publisher or starve others.
                    logger.exception("a LatestCell waker raised; continuing")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LatestCell revision={self._revision} {state}>"


class CellReader(Generic[T]):
    """Read-only access to a :class:`LatestCell`."""

    __slots__ = ("_cell",)

    def __init__(self, cell: LatestCell[T]) -> None:
        self._cell = cell

    @property
    def revision(self) -> int:
        return self._cell.revision

    @property
    def closed(self) -> bool:
        return self._cell.closed

    def load(self) -> T:
        """One atomic read of the current value (``LookupError`` if none yet)."""
        return self._cell.get()

    def subscribe(self) -> Subscription[T]:
        """A subscription whose first item is the current value (if any)."""
        return Subscription(self._cell, seen=0)

    def changes(self) -> Subscription[T]:
        """A subscription that starts after the current revision."""
        return Subscription(self._cell, seen=self._cell.revision)

    def add_waker(self, wake: Callable[[], None]) -> None:
        self._cell.add_waker(wake)

    def discard_waker(self, wake: Callable[[], None]) -> None:
        self._cell.discard_waker(wake)

    async def wait_past(self, revision: int) -> None:
        """Wait until the revision moves past ``revision`` or the cell closes.

        Returns at once, without a checkpoint, when that already happened:
        for a caller that waits only after seeing ``revision`` (and takes
        its own checkpoint otherwise). Consumes nothing.
        """
        await self._cell._wait_past(revision)


class Subscription(Generic[T]):
    """One reader's cursor over a cell. Async-iterable; newest value only."""

    __slots__ = ("_cell", "_seen")

    def __init__(self, cell: LatestCell[T], *, seen: int) -> None:
        self._cell = cell
        self._seen = seen

    @property
    def seen(self) -> int:
        """The revision this subscription last returned (0: none)."""
        return self._seen

    @property
    def pending(self) -> bool:
        """True if a newer value than the last one returned is available."""
        return self._cell.revision != self._seen and self._cell.has_value

    @property
    def ended(self) -> bool:
        """True once the cell is closed and its final revision was returned."""
        return self._cell.closed and not self.pending

    def receive_nowait(self) -> T:
        """The newest unseen value, or ``anyio.WouldBlock`` / ``anyio.EndOfStream``."""
        if self.pending:
            self._seen = self._cell.revision
            return self._cell.get()
        if self._cell.closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> T:
        """Wait for a value newer than the last one returned. Always checkpoints.

        Cancelling a waiting ``receive`` leaves the cursor where it was. A
        receive that waited returns as soon as it is woken: the wait was its
        checkpoint (a schedule point and a cancel point), so it does not
        yield to the loop once more before returning.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                value = self.receive_nowait()
            except anyio.WouldBlock:
                await self._cell._wait_past(self._cell.revision)
                waited = True
                continue
            except anyio.EndOfStream:
                if not waited:
                    await anyio.lowlevel.cancel_shielded_checkpoint()
                raise
            if not waited:
                await anyio.lowlevel.cancel_shielded_checkpoint()
            return value

    async def wait(self) -> None:
        """Wait until a value is pending or the stream ended; consumes nothing.

        Returns at once (after a checkpoint) if that is already the case.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        while not self.pending and not self._cell.closed:
            await self._cell._wait_past(self._cell.revision)
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once when this subscription may have something new.

        If a value is already pending, ``wake()`` is called at once; after
        the cell closed it is never called. Otherwise it is called at the
        cell's next publish or close (a cell-wide, one-shot registration).
        """
        if self.pending:
            wake()
        else:
            self._cell.add_waker(wake)

    def discard_waker(self, wake: Callable[[], None]) -> None:
        self._cell.discard_waker(wake)

    def __aiter__(self) -> Subscription[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def __repr__(self) -> str:
        return f"<Subscription seen={self._seen} cell_revision={self._cell.revision}>"
