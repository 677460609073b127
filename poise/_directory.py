"""Discovery membership: backends, allocations, a directory and its snapshots.

Two identities describe a discovered member, and they mean different things:

* the **key** (any hashable, usually a string) names the logical member
  across revisions;
* the **allocation** names one configuration *generation* of that member.
  Every :meth:`Directory.upsert` creates a new :class:`Allocation`, even when
  the new :class:`Backend` compares equal to the old one: an upsert is an
  intentional generation change. :meth:`Directory.drain` only changes
  membership state and keeps the allocation, so a reconciler can keep the
  live endpoint (service, reservation, quarantine, load) across a drain.

A :class:`Directory` is the writer. Each mutation produces a new revision and
publishes it to a latest-only cell; :meth:`Directory.snapshot` and the
:class:`SnapshotReader` return immutable :class:`Snapshot` values::

    upsert(k, b) ──► member k active, new allocation   (new key: appended;
                                                        known key: keeps its
                                                        position)
    drain(k)     ──► member k draining, same allocation
    finish_drain(k) / remove(k) ──► member k gone (a later upsert appends it)

    member:   absent ──upsert──► active ──drain──► draining ──finish_drain──► absent
                                   ▲  │                │
                                   │  └────remove──────┴──────remove────────► absent
                                   └──────upsert (new allocation, active)──┘

Member order is insertion order; upserting a known key keeps its position,
so a reconciled balance keeps a stable endpoint order.

Cost: a snapshot shares the directory's member table (copy-on-write), so a
mutation is O(1) unless a snapshot of the current revision has been taken
since the last mutation, in which case the first mutation after it copies the
table once (O(n)). Publishing is lazy: the cell carries the revision, and the
snapshot is built only when someone reads it, so a burst of mutations costs
O(1) each and readers see only the newest state. The directory also keeps a
bounded change log (which key each revision touched), so a reconciler that
applied revision r can classify revision r' in O(r' - r) instead of O(n).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import anyio
import anyio.lowlevel

from ._cell import LatestCell, Subscription
from ._errors import DuplicateIdentity, InvalidInput, StreamClosed

__all__ = [
    "Allocation",
    "Backend",
    "Directory",
    "Lineage",
    "Member",
    "Snapshot",
    "SnapshotReader",
    "SnapshotStream",
    "UnknownMember",
]

_EMPTY_METADATA: Mapping[str, str] = MappingProxyType({})
_generations = itertools.count(1)
_lineages = itertools.count(1)
_LOG_MIN = 1024


class UnknownMember(InvalidInput, LookupError):
    """A directory operation named a key that is not a member."""

    def __init__(self, key: Hashable, operation: str) -> None:
        super().__init__(f"{operation}({key!r}): no such member")
        self.key = key


class Backend:
    """Candidate metadata of one backend: identity, weight and metadata. Frozen.

    ``id`` is usually the address a factory connects to (``"http://west"``);
    ``weight`` is a finite number > 0 that weighted policies read; ``metadata``
    is a string-to-string mapping copied at construction and read-only.
    Two backends with equal fields compare equal and hash alike.
    """

    __slots__ = ("_id", "_metadata", "_weight")

    _id: str
    _weight: float
    _metadata: Mapping[str, str]

    def __init__(
        self, id: str, *, weight: float = 1.0, metadata: Mapping[str, str] | None = None
    ) -> None:
        if not isinstance(id, str) or not id:
            raise InvalidInput(f"Backend id must be a non-empty string, got {id!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise InvalidInput(
                f"Backend {id!r}: weight must be a finite number > 0, got {weight!r}"
            )
        if metadata is None or not metadata:
            frozen = _EMPTY_METADATA
        else:
            if not isinstance(metadata, Mapping):
                raise InvalidInput(
                    f"Backend {id!r}: metadata must be a mapping, got {type(metadata).__name__}"
                )
            copied = dict(metadata)
            for name, value in copied.items():
                if not isinstance(name, str) or not isinstance(value, str):
                    raise InvalidInput(
                        f"Backend {id!r}: metadata must map str to str, got {name!r}: {value!r}"
                    )
            frozen = MappingProxyType(copied)
        object.__setattr__(self, "_id", id)
        object.__setattr__(self, "_weight", float(weight))
        object.__setattr__(self, "_metadata", frozen)

    @property
    def id(self) -> str:
        """The backend's identity, usually its address."""
        return self._id

    @property
    def address(self) -> str:
        """Alias of :attr:`id`."""
        return self._id

    @property
    def weight(self) -> float:
        return self._weight

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Backend is frozen; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Backend is frozen; cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Backend):
            return NotImplemented
        return (
            self._id == other._id
            and self._weight == other._weight
            and self._metadata == other._metadata
        )

    def __hash__(self) -> int:
        return hash((self._id, self._weight, frozenset(self._metadata.items())))

    def __repr__(self) -> str:
        extra = f", metadata={dict(self._metadata)!r}" if self._metadata else ""
        return f"Backend({self._id!r}, weight={self._weight!r}{extra})"


class Allocation:
    """One configuration generation of a member. Compared by identity.

    Created by every :meth:`Directory.upsert`; two allocations of equal
    backends are still different generations. ``generation`` is a process-wide
    increasing number, for logs and tests.
    """

    __slots__ = ("_backend", "_generation")

    def __init__(self, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            raise InvalidInput(f"an allocation needs a Backend, got {type(backend).__name__}")
        self._backend = backend
        self._generation = next(_generations)

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def generation(self) -> int:
        return self._generation

    def __repr__(self) -> str:
        return f"<Allocation #{self._generation} {self._backend!r}>"


class Lineage:
    """The identity of one directory; snapshots of different lineages never mix."""

    __slots__ = ("_number",)

    def __init__(self) -> None:
        self._number = next(_lineages)

    def __repr__(self) -> str:
        return f"<Lineage {self._number}>"


@dataclass(frozen=True, slots=True)
class Member:
    """A member of a snapshot: key, allocation, and whether it is draining.

    Equal members have equal keys, the *same* allocation and the same
    draining state.
    """

    key: Hashable
    allocation: Allocation
    draining: bool = False

    @property
    def backend(self) -> Backend:
        return self.allocation.backend


class Snapshot:
    """An immutable membership view at one revision of one lineage.

    Iterating yields :class:`Member` values in member order. Lookups by key
    are O(1). ``Snapshot(members, revision=..., lineage=...)`` builds one
    outside a :class:`Directory` (for adapters and tests) and rejects a key
    that appears twice with :class:`~poise.DuplicateIdentity`.
    """

    __slots__ = ("_by_key", "_lineage", "_log", "_log_base", "_members", "_revision")

    _by_key: dict[Hashable, Member]
    _members: tuple[Member, ...] | None
    _log: list[tuple[Hashable, bool]] | None
    _log_base: int

    def __init__(self, members: Iterable[Member], *, revision: int, lineage: Lineage) -> None:
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            raise InvalidInput(f"snapshot revision must be an integer >= 0, got {revision!r}")
        if not isinstance(lineage, Lineage):
            raise InvalidInput(f"snapshot lineage must be a Lineage, got {type(lineage).__name__}")
        by_key: dict[Hashable, Member] = {}
        for member in members:
            if not isinstance(member, Member):
                raise InvalidInput(f"snapshot members must be Member, got {type(member).__name__}")
            if member.key in by_key:
                raise DuplicateIdentity(member.key, f"snapshot revision {revision}")
            by_key[member.key] = member
        self._by_key = by_key
        self._members = None
        self._revision = revision
        self._lineage = lineage
        self._log = None
        self._log_base = 0

    @classmethod
    def _wrap(
        cls,
        by_key: dict[Hashable, Member],
        revision: int,
        lineage: Lineage,
        log: list[tuple[Hashable, bool]],
        log_base: int,
    ) -> Snapshot:
        # The caller promises never to mutate ``by_key`` again (copy-on-write)
        # and only to append to ``log``.
        snapshot = cls.__new__(cls)
        snapshot._by_key = by_key
        snapshot._members = None
        snapshot._revision = revision
        snapshot._lineage = lineage
        snapshot._log = log
        snapshot._log_base = log_base
        return snapshot

    def _changes_since(self, revision: int) -> list[tuple[Hashable, bool]] | None:
        """The ``(key, deleted)`` mutations from ``revision`` to this one, if known.

        ``None`` when this snapshot was not built by a directory or the
        directory's change log no longer reaches back to ``revision``.
        """
        log = self._log
        base = self._log_base
        if log is None or revision < base or revision > self._revision:
            return None
        return log[revision - base : self._revision - base]

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def lineage(self) -> Lineage:
        return self._lineage

    @property
    def members(self) -> tuple[Member, ...]:
        """All members in order (built once, on first use)."""
        if self._members is None:
            self._members = tuple(self._by_key.values())
        return self._members

    @property
    def by_key(self) -> Mapping[Hashable, Member]:
        """A read-only key-to-member mapping in member order. O(1), no copy."""
        return MappingProxyType(self._by_key)

    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._by_key)

    def get(self, key: Hashable) -> Member | None:
        return self._by_key.get(key)

    @property
    def draining(self) -> int:
        """How many members are draining. O(n)."""
        return sum(1 for member in self._by_key.values() if member.draining)

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Member]:
        return iter(self._by_key.values())

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __repr__(self) -> str:
        return f"<Snapshot revision={self._revision} members={len(self._by_key)} {self._lineage!r}>"


class Directory:
    """The writer side of discovery membership. Synchronous, single-threaded.

    Every effective mutation advances :attr:`revision` by one and publishes
    it; a no-op (draining a member that is already draining) publishes
    nothing. After :meth:`close`, mutations raise :class:`~poise.StreamClosed`
    and readers' streams end after the final revision.
    """

    __slots__ = (
        "_cell",
        "_closed",
        "_lineage",
        "_log",
        "_log_base",
        "_members",
        "_revision",
        "_shared",
        "_snapshot",
    )

    def __init__(self) -> None:
        self._lineage = Lineage()
        self._members: dict[Hashable, Member] = {}
        self._shared = False
        self._revision = 0
        self._snapshot: Snapshot | None = None
        self._closed = False
        # The keys each revision touched, (key, deleted), so a reconciler that
        # applied revision r can find what changed up to r' in O(r' - r)
        # instead of comparing every member. Bounded: restarted (new list,
        # new base) when it outgrows the membership.
        self._log: list[tuple[Hashable, bool]] = []
        self._log_base = 0
        # The cell carries the directory revision; snapshots are built lazily.
        self._cell: LatestCell[int] = LatestCell(0)

    @property
    def lineage(self) -> Lineage:
        return self._lineage

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: object) -> bool:
        return key in self._members

    def upsert(self, key: Hashable, backend: Backend) -> int:
        """Add or replace member ``key`` with a new allocation of ``backend``.

        A new key is appended; a known key keeps its position and becomes
        active (not draining) with the new allocation. Returns the revision.
        """
        if not isinstance(backend, Backend):
            raise InvalidInput(f"upsert({key!r}): expected a Backend, got {type(backend).__name__}")
        try:
            hash(key)
        except TypeError:
            raise InvalidInput(f"upsert: key must be hashable, got {type(key).__name__}") from None
        members = self._writable("upsert", key)
        members[key] = Member(key, Allocation(backend))
        return self._publish(key, False)

    def drain(self, key: Hashable) -> int:
        """Mark ``key`` draining: no new traffic, same allocation and endpoint.

        Draining a member that is already draining changes nothing and
        publishes nothing.
        """
        member = self._member("drain", key)
        if member.draining:
            return self._revision
        members = self._writable("drain", key)
        members[key] = Member(key, member.allocation, draining=True)
        return self._publish(key, False)

    def finish_drain(self, key: Hashable) -> int:
        """Remove a draining member once the application saw its work finish.

        Raises :class:`~poise.InvalidInput` if ``key`` is not draining.
        """
        member = self._member("finish_drain", key)
        if not member.draining:
            raise InvalidInput(f"finish_drain({key!r}): member is not draining; drain it first")
        del self._writable("finish_drain", key)[key]
        return self._publish(key, True)

    def remove(self, key: Hashable) -> int:
        """Remove ``key`` at once, draining or not."""
        self._member("remove", key)
        del self._writable("remove", key)[key]
        return self._publish(key, True)

    def snapshot(self) -> Snapshot:
        """The current membership. O(1); repeated calls return the same object."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = Snapshot._wrap(
                self._members, self._revision, self._lineage, self._log, self._log_base
            )
            self._snapshot = snapshot
            self._shared = True
        return snapshot

    def reader(self) -> SnapshotReader:
        """A read-only handle for consumers (load, subscribe, changes)."""
        return SnapshotReader(self)

    def close(self) -> None:
        """Make the current revision final. Idempotent."""
        if not self._closed:
            self._closed = True
            self._cell.close()

    def _member(self, operation: str, key: Hashable) -> Member:
        if self._closed:
            raise StreamClosed(f"{operation}({key!r}): the directory is closed")
        try:
            return self._members[key]
        except (KeyError, TypeError):
            raise UnknownMember(key, operation) from None

    def _writable(self, operation: str, key: Hashable) -> dict[Hashable, Member]:
        if self._closed:
            raise StreamClosed(f"{operation}({key!r}): the directory is closed")
        if self._shared:
            # A snapshot holds the current table: copy once before writing.
            self._members = dict(self._members)
            self._shared = False
        return self._members

    def _publish(self, key: Hashable, deleted: bool) -> int:
        log = self._log
        if len(log) >= _LOG_MIN + 2 * len(self._members):
            # Snapshots taken so far keep the old list; start a fresh one.
            log = self._log = []
            self._log_base = self._revision
        log.append((key, deleted))
        self._revision += 1
        self._snapshot = None
        self._cell.publish(self._revision)
        return self._revision

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Directory revision={self._revision} members={len(self._members)} "
            f"{state} {self._lineage!r}>"
        )


class SnapshotReader:
    """Read-only access to a :class:`Directory`'s snapshots."""

    __slots__ = ("_directory",)

    def __init__(self, directory: Directory) -> None:
        self._directory = directory

    @property
    def lineage(self) -> Lineage:
        return self._directory.lineage

    @property
    def revision(self) -> int:
        return self._directory.revision

    @property
    def closed(self) -> bool:
        return self._directory.closed

    def load(self) -> Snapshot:
        """One atomic read of the current snapshot. O(1)."""
        return self._directory.snapshot()

    def subscribe(self) -> SnapshotStream:
        """A stream whose first item is the current snapshot."""
        return SnapshotStream(self._directory, self._directory._cell.reader().subscribe())

    def changes(self) -> SnapshotStream:
        """A stream that starts after the current revision."""
        return SnapshotStream(self._directory, self._directory._cell.reader().changes())

    def __repr__(self) -> str:
        return f"<SnapshotReader of {self._directory!r}>"


class SnapshotStream:
    """One subscriber's cursor over a directory: newest snapshot only.

    Async-iterable. If several revisions are published between two receives,
    only the newest is returned. After the directory is closed and its final
    revision returned, the stream ends (:class:`anyio.EndOfStream` from
    :meth:`receive`, ``StopAsyncIteration`` when iterating). Each stream has
    its own cursor and wakers; cancelling one waiting receiver affects no
    other.
    """

    __slots__ = ("_directory", "_subscription")

    def __init__(self, directory: Directory, subscription: Subscription[int]) -> None:
        self._directory = directory
        self._subscription = subscription

    @property
    def lineage(self) -> Lineage:
        return self._directory.lineage

    @property
    def pending(self) -> bool:
        """True if a snapshot newer than the last one returned is available."""
        return self._subscription.pending

    @property
    def ended(self) -> bool:
        """True once the directory is closed and its final snapshot was returned."""
        return self._subscription.ended

    def receive_nowait(self) -> Snapshot:
        """The newest unseen snapshot, or ``anyio.WouldBlock`` / ``anyio.EndOfStream``."""
        self._subscription.receive_nowait()
        # The cell always holds the newest revision, which is the directory's
        # current state, so building the snapshot now is exact.
        return self._directory.snapshot()

    async def receive(self) -> Snapshot:
        """Wait for a snapshot newer than the last one returned. Always checkpoints."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                snapshot = self.receive_nowait()
            except anyio.WouldBlock:
                await self._subscription.wait()
                continue
            except anyio.EndOfStream:
                await anyio.lowlevel.cancel_shielded_checkpoint()
                raise
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return snapshot

    async def wait(self) -> None:
        """Wait until a snapshot is pending or the stream ended; consumes nothing."""
        await self._subscription.wait()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once at the directory's next publish or close."""
        self._subscription.add_waker(wake)

    def discard_waker(self, wake: Callable[[], None]) -> None:
        self._subscription.discard_waker(wake)

    def __aiter__(self) -> SnapshotStream:
        return self

    async def __anext__(self) -> Snapshot:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def __repr__(self) -> str:
        return f"<SnapshotStream pending={self.pending} ended={self.ended}>"
