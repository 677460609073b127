"""Sans-IO state of one watched service: the key -> record map and its revision.

The watch shell feeds this module what the server said (a range, watch
responses, progress notifications, probe results); the module decides what
the listing is and whether the stream can be trusted. No I/O, no clock.

::

    range(R) ──reset──► state@R ──watch from R+1──► apply(batch) ──► snapshot()
                           ▲                            │
                           │ compacted (canceled +      │ progress(R') / probe match
                           │ compact_revision)          ▼
                           └──────── re-range ◄──── confirmed: nothing changed

(The shell takes a first range inside a stream opened from now, so the
stream starts at or before ``R + 1``; events at or below ``R`` are ignored.)

``revision`` is the newest revision whose effects are all applied, so a
broken stream resumes from ``revision + 1`` with no event lost and none
applied twice (an event at or below ``revision`` is ignored).

Costs: the valid records live in an :class:`~nadisc.IncrementalListing`
(key order, identity count and byte total kept per change), so a watch batch
of k events costs O(k log n) plus the decoding of those k records, and
:meth:`ServiceState.snapshot` copies one tuple of references and sorts only
the invalid records (cached while they do not change). A complete range
(:meth:`~ServiceState.reset`) is O(n); records whose key and
``mod_revision`` a live state already decoded are taken over undecoded
(in etcd a key's ``mod_revision`` names one value), the others are decoded
column-wise a chunk of :attr:`~ServiceState.RESET_STEP` at a time
(:func:`~._layout.decode_records`; a chunk holding an invalid record is
decoded record by record, so each bad one is named with its reason), the
listing is built in bulk from the range's key order, and
:meth:`~ServiceState.reset_steps` yields every few hundred records so the
caller can give the event loop back in between. A range read in pages is
decoded a page at a time as each arrives (:meth:`~ServiceState.resetting`,
:class:`Reset`), with the same result.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from itertools import islice, repeat
from operator import attrgetter
from types import MappingProxyType

import msgspec

from nadisc import CapacityRejected, EvidenceKind, IncrementalListing, Instance, ProviderSnapshot

from ._layout import (
    Layout,
    RecordError,
    decode_record,
    decode_record_bytes,
    decode_records,
    decode_records_b64,
    instance_id_after,
    instance_ids_after,
)
from ._wire import Event, KeyValue, WatchResponse

__all__ = ["Backoff", "ProbeVerdict", "Reset", "ServiceState"]


class _Entry(msgspec.Struct, frozen=True, gc=False):
    """One key's record as of ``mod_revision``. Untracked by the cyclic
    collector (it refers to an ``Instance``, itself untracked, or to text):
    a watch of 10,000 keys adds no objects for every full collection to walk."""

    mod_revision: int
    instance: Instance | None
    problem: str | None


_key_of = attrgetter("key")
_raw_of = attrgetter("raw")
_text_of = attrgetter("value")
_mod_revision_of = attrgetter("mod_revision")


def _reused(known: Mapping[bytes, _Entry], kv: KeyValue) -> _Entry | None:
    """The entry a live state holds for ``kv``'s key at its ``mod_revision``
    (in etcd a key's ``mod_revision`` names one value), or None."""
    entry = known.get(kv.key)
    if entry is None or not kv.mod_revision or entry.mod_revision != kv.mod_revision:
        return None
    return entry


class ProbeVerdict(enum.Enum):
    #: The probe saw exactly our listing: the registry confirmed it now.
    CONFIRMED = "confirmed"
    #: The probe saw something newer; the stream should deliver it soon.
    LAGGING = "lagging"
    #: The stream did not deliver what a probe saw one interval earlier.
    STALLED = "stalled"


class ServiceState:
    """The records of one service under a layout, as of ``revision``."""

    #: Records a cooperative reset decodes between two yields.
    RESET_STEP = 256
    #: Keys a cooperative probe comparison looks at between two yields.
    PROBE_STEP = 1024

    def __init__(
        self, service: str, layout: Layout, *, max_record_bytes: int, max_instances: int
    ) -> None:
        self.service = service
        self.layout = layout
        #: The service's key prefix, built once (every decoded key starts with it).
        self._head = layout.service_prefix(service)
        self.revision = 0
        self._max_record_bytes = max_record_bytes
        self._max_instances = max_instances
        self._entries: dict[bytes, _Entry] = {}
        self._listing: IncrementalListing[bytes] = IncrementalListing()
        self._invalid: dict[bytes, str] = {}
        self._invalid_view: Mapping[str, str] | None = None
        self._lagging_since: int | None = None
        #: Counts changes of the listing (a cooperative probe checks it).
        self._version = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _decode(self, kv: KeyValue) -> _Entry:
        identity = instance_id_after(self._head, kv.key)
        if identity is None:
            return _Entry(kv.mod_revision, None, "key has no UTF-8 instance id")
        try:
            instance = (
                decode_record_bytes(identity, kv.raw, max_record_bytes=self._max_record_bytes)
                if kv.raw
                else decode_record(identity, kv.value, max_record_bytes=self._max_record_bytes)
            )
        except RecordError as exc:
            return _Entry(kv.mod_revision, None, str(exc))
        return _Entry(kv.mod_revision, instance, None)

    def _decode_all(
        self, kvs: Sequence[KeyValue], keys: list[bytes]
    ) -> tuple[list[_Entry], list[Instance]] | None:
        """The entries of ``kvs`` (whose keys are ``keys``), each what
        :meth:`_decode` makes of it, decoded column-wise
        (:func:`~._layout.decode_records`), and their instances; None when
        any of them is not valid (each is then decoded by itself)."""
        if not kvs:
            return [], []
        identities = instance_ids_after(self._head, keys)
        if identities is None:
            return None
        raws = list(map(_raw_of, kvs))
        limit = self._max_record_bytes
        if all(raws):
            decoded = decode_records(identities, raws, max_record_bytes=limit)
        else:  # the JSON wire's base64 text (or an empty value: None below)
            texts = list(map(_text_of, kvs))
            decoded = (
                decode_records_b64(identities, texts, max_record_bytes=limit)
                if all(texts)
                else None
            )
        if decoded is None:
            return None
        return list(map(_Entry, map(_mod_revision_of, kvs), decoded, repeat(None))), decoded

    def reset(
        self,
        kvs: Iterable[KeyValue],
        revision: int,
        *,
        reuse: ServiceState | None = None,
        refused: Mapping[bytes, str] | None = None,
    ) -> None:
        """Replace everything with a complete range taken at ``revision``."""
        for _ in self.reset_steps(kvs, revision, reuse=reuse, refused=refused):
            pass

    def reset_steps(
        self,
        kvs: Iterable[KeyValue],
        revision: int,
        *,
        reuse: ServiceState | None = None,
        refused: Mapping[bytes, str] | None = None,
    ) -> Iterator[None]:
        """:meth:`reset`, yielding after every :attr:`RESET_STEP` records; the
        state changes only once the iterator is exhausted. ``reuse`` (another
        state of the same service, a live watch's) lends records it already
        decoded at the same ``mod_revision``. ``refused`` maps the keys of
        records the range could not read (their values too large for a
        response; ``kvs`` holds them keys-only) to the reason: each is kept
        invalid at its ``mod_revision``, which a probe compares."""
        building = self.resetting(refused)
        yield from building.page_steps(kvs, reuse)
        building.finish(revision)

    def resetting(self, refused: Mapping[bytes, str] | None = None) -> Reset:
        """A :meth:`reset_steps` fed a page at a time (:meth:`Reset.page_steps`,
        each page decoded as it arrives) and applied by :meth:`Reset.finish`;
        the state is left as it was until then. ``refused`` is read as each
        page is decoded: a key added to it before its page is fed counts."""
        return Reset(self, refused)

    def adopt(self, other: ServiceState) -> None:
        """Take over ``other``'s complete listing and revision (a state of
        the same service nobody uses afterwards), as :meth:`reset` from the
        same range would."""
        self._entries = other._entries
        self._listing = other._listing
        self._invalid = other._invalid
        self._invalid_view = None
        self._version += 1
        self.revision = other.revision
        self._lagging_since = None

    def _store(self, key: bytes, entry: _Entry) -> None:
        self._version += 1
        self._entries[key] = entry
        if entry.instance is not None:
            self._listing.put(key, entry.instance)
            if self._invalid.pop(key, None) is not None:
                self._invalid_view = None
        else:
            self._listing.discard(key)
            self._invalid[key] = entry.problem or "invalid record"
            self._invalid_view = None

    def _remove(self, key: bytes) -> bool:
        if self._entries.pop(key, None) is None:
            return False
        self._version += 1
        self._listing.discard(key)
        if self._invalid.pop(key, None) is not None:
            self._invalid_view = None
        return True

    def apply(self, response: WatchResponse) -> bool:
        """Apply one watch response's events; True if the listing changed.

        Events at or below ``revision`` were applied already (a resumed stream
        may repeat them) and are ignored. Events of one response may share a
        revision (one transaction), so the guard uses the revision from
        before the response. O(events x log n).
        """
        return self.apply_events(response.events)

    def apply_events(self, events: Iterable[Event]) -> bool:
        """:meth:`apply` for events of one or several responses, in order."""
        floor = self.revision
        newest = floor
        changed = False
        for event in events:
            kv = event.kv
            if kv.mod_revision and kv.mod_revision <= floor:
                continue
            newest = max(newest, kv.mod_revision)
            if event.type == "DELETE":
                changed |= self._remove(kv.key)
            else:
                self._store(kv.key, self._decode(kv))
                changed = True
        self.revision = newest
        return changed

    def progress(self, revision: int) -> None:
        """A progress notification: everything up to ``revision`` was delivered."""
        self.revision = max(self.revision, revision)

    def judge_probe(self, revision: int, kvs: Sequence[KeyValue]) -> ProbeVerdict:
        """Compare a keys-only range taken at ``revision`` with our listing.

        Equal (key, mod_revision) sets mean the same listing, so the registry
        confirmed ours. A difference is normal while events are in flight; it
        becomes a stall when a later probe still differs and we have not even
        reached the revision the earlier probe saw.
        """
        steps = self.judge_probe_steps(revision, kvs)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                verdict: ProbeVerdict = done.value
                return verdict

    def judge_probe_steps(
        self, revision: int, kvs: Sequence[KeyValue]
    ) -> Generator[None, None, ProbeVerdict]:
        """:meth:`judge_probe`, yielding after every :attr:`PROBE_STEP` keys so
        the caller can give the event loop back (O(n) in all, no copy of
        either side). A listing that changes in between is judged LAGGING
        (the comparison saw two different listings) without a stall mark."""
        version = self._version
        present = 0
        target = 0
        differs = False
        for count, kv in enumerate(kvs, 1):
            entry = self._entries.get(kv.key)
            if entry is not None:
                present += 1
            if entry is None or entry.mod_revision != kv.mod_revision:
                differs = True
                target = max(target, kv.mod_revision)
            if count % self.PROBE_STEP == 0:
                yield
        if self._version != version:
            return ProbeVerdict.LAGGING
        missing = len(self._entries) > present
        if not differs and not missing:
            self._lagging_since = None
            return ProbeVerdict.CONFIRMED
        if self._lagging_since is not None and self.revision < self._lagging_since:
            return ProbeVerdict.STALLED
        # The revision we must reach to have applied what this probe saw: the
        # newest differing record, or (for a deletion, whose revision a range
        # cannot show) anything past where we stand now.
        if missing:
            target = max(target, self.revision + 1)
        self._lagging_since = min(target, revision) if revision else target
        return ProbeVerdict.LAGGING

    def invalid(self) -> Mapping[str, str]:
        """Invalid records (key -> reason) in key order; cached while unchanged."""
        if self._invalid_view is None:
            self._invalid_view = MappingProxyType(
                {
                    key.decode("utf-8", "replace"): problem
                    for key, problem in sorted(self._invalid.items())
                }
            )
        return self._invalid_view

    def snapshot(self) -> ProviderSnapshot:
        """The complete listing now, valid instances in key order.

        ``CapacityRejected`` when more valid instances than
        ``max_instances_per_service`` are present. Invalid records never
        count against the limit and never appear among the instances.
        The same object is returned while nothing changed.
        """
        count = len(self._listing)
        if count > self._max_instances:
            raise CapacityRejected(
                f"service {self.service!r}: {count} instances exceed "
                f"max_instances_per_service={self._max_instances}"
            )
        return self._listing.snapshot(self.service, EvidenceKind.LEASE, self.invalid())


class Reset:
    """A complete range decoded into a :class:`ServiceState` a page at a time
    (see :meth:`ServiceState.resetting`): every page in key order, the pages
    in key order, then :meth:`finish`. The result is the one
    :meth:`ServiceState.reset_steps` gives for all the pages' records at once
    (each record is decoded by itself or in a chunk of its page; a chunk's
    bounds never change what a record decodes to)."""

    __slots__ = ("_entries", "_instances", "_invalid", "_keys", "_state", "_unread")

    def __init__(self, state: ServiceState, refused: Mapping[bytes, str] | None) -> None:
        self._state = state
        #: Read as each page is decoded (the caller may add to it meanwhile).
        self._unread: Mapping[bytes, str] = refused if refused is not None else {}
        self._entries: dict[bytes, _Entry] = {}
        # A range comes in key order: the listing is built in bulk at the end.
        self._keys: list[bytes] = []
        self._instances: list[Instance] = []
        self._invalid: dict[bytes, str] = {}

    def page_steps(
        self, kvs: Iterable[KeyValue], reuse: ServiceState | None = None
    ) -> Iterator[None]:
        """Decode the next page's records, yielding after every
        :attr:`ServiceState.RESET_STEP` of them. ``reuse``: as in
        :meth:`ServiceState.reset_steps` (read at this page)."""
        state = self._state
        known = reuse._entries if reuse is not None else {}
        unread = self._unread
        entries = self._entries
        keys = self._keys
        instances = self._instances
        invalid = self._invalid
        step = state.RESET_STEP
        records = iter(kvs)
        while chunk := list(islice(records, step)):
            # What the live state decoded at the same mod_revision is taken
            # over; the rest is decoded in bulk.
            if known or unread:
                fresh = [kv for kv in chunk if kv.key not in unread and _reused(known, kv) is None]
            else:
                fresh = chunk
            fresh_keys = list(map(_key_of, fresh))
            decoded = state._decode_all(fresh, fresh_keys)
            if decoded is not None and len(fresh) == len(chunk):
                # Every record of the chunk new and valid (the common case).
                entries.update(zip(fresh_keys, decoded[0], strict=True))
                keys += fresh_keys
                instances += decoded[1]
            else:
                # Record by record: reused, decoded in bulk above, or (a
                # chunk holding an invalid record) decoded by itself.
                done = {} if decoded is None else dict(zip(fresh_keys, decoded[0], strict=True))
                for kv in chunk:
                    key = kv.key
                    problem = unread.get(key)
                    entry = (
                        _Entry(kv.mod_revision, None, problem)
                        if problem is not None
                        else done.get(key) or _reused(known, kv) or state._decode(kv)
                    )
                    entries[key] = entry
                    if entry.instance is not None:
                        keys.append(key)
                        instances.append(entry.instance)
                    else:
                        invalid[key] = entry.problem or "invalid record"
            if len(chunk) == step:
                yield

    def finish(self, revision: int) -> None:
        """Replace the state's listing with the pages fed, taken at ``revision``."""
        state = self._state
        state._entries = self._entries
        state._version += 1
        state._listing = IncrementalListing.from_sorted(self._keys, self._instances)
        state._invalid = self._invalid
        state._invalid_view = None
        state.revision = revision
        state._lagging_since = None


class Backoff:
    """Exponential backoff with jitter between half the current cap and the cap."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self._initial = initial
        self._maximum = maximum
        self._rng = rng or random.Random()
        self._attempts = 0

    def reset(self) -> None:
        self._attempts = 0

    def next_delay(self) -> float:
        cap = min(self._maximum, self._initial * (2 ** min(self._attempts, 62)))
        self._attempts += 1
        return self._rng.uniform(cap / 2, cap)
