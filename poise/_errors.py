"""Exceptions raised by poise.

Every exception poise raises on purpose derives from :class:`PoiseError`::

    PoiseError
    ├── InvalidInput            bad weight, NaN/inf parameter, duplicate identity...
    ├── SelectionError          nothing to pick from, or call() without a reservation
    ├── ReadinessError          a readiness failure exhausted the usable pool
    ├── EndpointError           a dispatched call failed (carries dispatch-time index)
    ├── CallDeclined            a service declined a selected call before sending anything
    ├── ReconcileError          a snapshot could not be applied (nothing changed)
    │   ├── StaleRevision       the snapshot is older than the applied one
    │   ├── DuplicateIdentity   two members share one key
    │   ├── ForeignSnapshot     the snapshot comes from another directory lineage
    │   └── FactoryError        the endpoint factory failed or returned a wrong shape
    ├── StreamingError          a streaming balance could not reconcile (wraps ReconcileError)
    └── StreamClosed            a fail-closed stream ended, or a reader of a closed cell

Errors raised by user services and factories are chained as ``__cause__``,
never swallowed.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = [
    "CallDeclined",
    "DuplicateIdentity",
    "EndpointError",
    "FactoryError",
    "ForeignSnapshot",
    "InvalidInput",
    "PoiseError",
    "ReadinessError",
    "ReconcileError",
    "SelectionError",
    "StaleRevision",
    "StreamClosed",
    "StreamingError",
]


class PoiseError(Exception):
    """Root of every exception poise raises on purpose."""


class InvalidInput(PoiseError, ValueError):
    """A value was rejected where it entered (weight, parameter, identity)."""


class SelectionError(PoiseError):
    """No endpoint could be selected, or ``call()`` had no reservation."""


class _IndexedError(PoiseError):
    """An error tied to one endpoint, by its index at the time and its key.

    The index describes the endpoint order when the error happened and may be
    stale after later membership edits; use ``key`` for durable labels.
    """

    def __init__(self, message: str, *, index: int, key: Hashable) -> None:
        super().__init__(message)
        self.index = index
        self.key = key


class ReadinessError(_IndexedError):
    """A readiness failure left no usable endpoint; ``__cause__`` is the service's error."""


class EndpointError(_IndexedError):
    """A dispatched call failed; ``__cause__`` is the service's error."""


class CallDeclined(PoiseError):
    """Raised by a service's ``call()`` to decline a request it did not send.

    A service may find, after the balance selected it, that it cannot take
    this request after all (for example, the instance behind it was
    withdrawn a moment ago) and that nothing reached the wire. The balance
    then *cancels* the load guard (no round-trip time is recorded and the
    endpoint is not blamed) and re-raises this exception unchanged, not
    wrapped in :class:`EndpointError`, from ``call``, ``dispatch``,
    ``dispatch_held`` and ``open``. The caller may simply try again; chain
    the underlying reason as ``__cause__`` if there is one.
    """


class ReconcileError(PoiseError):
    """A snapshot was not applied; the live pool is exactly as it was."""


class StaleRevision(ReconcileError):
    """The snapshot's revision is older than the applied revision."""

    def __init__(self, revision: int, applied: int) -> None:
        super().__init__(f"snapshot revision {revision} is older than applied revision {applied}")
        self.revision = revision
        self.applied = applied


class DuplicateIdentity(ReconcileError, InvalidInput):
    """Two members share one identity key."""

    def __init__(self, key: Hashable, where: str) -> None:
        super().__init__(f"duplicate identity {key!r} in {where}")
        self.key = key


class ForeignSnapshot(ReconcileError):
    """The snapshot belongs to another directory lineage than the applied ones."""


class FactoryError(ReconcileError):
    """The endpoint factory raised or returned something other than (service, tracker)."""

    def __init__(self, message: str, *, key: Hashable) -> None:
        super().__init__(message)
        self.key = key


class StreamingError(PoiseError):
    """A streaming balance could not apply a published snapshot.

    ``__cause__`` is the :class:`ReconcileError`; the previous pool is intact.
    """


class StreamClosed(PoiseError):
    """The stream ended (publisher closed) where the caller required it open."""
