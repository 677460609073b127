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

``revision`` is the newest revision whose effects are all applied, so a
broken stream resumes from ``revision + 1`` with no event lost and none
applied twice (an event at or below ``revision`` is ignored).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nadisc import CapacityRejected, EvidenceKind, Instance, ProviderSnapshot

from ._layout import Layout, RecordError, decode_record
from ._wire import KeyValue, WatchResponse

__all__ = ["Backoff", "ProbeVerdict", "ServiceState"]


@dataclass(frozen=True, slots=True)
class _Entry:
    mod_revision: int
    instance: Instance | None
    problem: str | None


class ProbeVerdict(enum.Enum):
    #: The probe saw exactly our listing: the registry confirmed it now.
    CONFIRMED = "confirmed"
    #: The probe saw something newer; the stream should deliver it soon.
    LAGGING = "lagging"
    #: The stream did not deliver what a probe saw one interval earlier.
    STALLED = "stalled"


class ServiceState:
    """The records of one service under a layout, as of ``revision``."""

    def __init__(
        self, service: str, layout: Layout, *, max_record_bytes: int, max_instances: int
    ) -> None:
        self.service = service
        self.layout = layout
        self.revision = 0
        self._max_record_bytes = max_record_bytes
        self._max_instances = max_instances
        self._entries: dict[bytes, _Entry] = {}
        self._lagging_since: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def _decode(self, kv: KeyValue) -> _Entry:
        identity = self.layout.instance_id(self.service, kv.key)
        if identity is None:
            return _Entry(kv.mod_revision, None, "key has no UTF-8 instance id")
        try:
            instance = decode_record(identity, kv.value, max_record_bytes=self._max_record_bytes)
        except RecordError as exc:
            return _Entry(kv.mod_revision, None, str(exc))
        return _Entry(kv.mod_revision, instance, None)

    def reset(self, kvs: Iterable[KeyValue], revision: int) -> None:
        """Replace everything with a complete range taken at ``revision``."""
        self._entries = {kv.key: self._decode(kv) for kv in kvs}
        self.revision = revision
        self._lagging_since = None

    def apply(self, response: WatchResponse) -> bool:
        """Apply one watch response's events; True if the listing changed.

        Events at or below ``revision`` were applied already (a resumed stream
        may repeat them) and are ignored. Events of one response may share a
        revision (one transaction), so the guard uses the revision from
        before the response.
        """
        floor = self.revision
        newest = floor
        changed = False
        for event in response.events:
            kv = event.kv
            if kv.mod_revision and kv.mod_revision <= floor:
                continue
            newest = max(newest, kv.mod_revision)
            if event.type == "DELETE":
                changed |= self._entries.pop(kv.key, None) is not None
            else:
                self._entries[kv.key] = self._decode(kv)
                changed = True
        self.revision = newest
        return changed

    def progress(self, revision: int) -> None:
        """A progress notification: everything up to ``revision`` was delivered."""
        self.revision = max(self.revision, revision)

    def judge_probe(self, revision: int, kvs: Iterable[KeyValue]) -> ProbeVerdict:
        """Compare a keys-only range taken at ``revision`` with our listing.

        Equal (key, mod_revision) sets mean the same listing, so the registry
        confirmed ours. A difference is normal while events are in flight; it
        becomes a stall when a later probe still differs and we have not even
        reached the revision the earlier probe saw.
        """
        seen = {kv.key: kv.mod_revision for kv in kvs}
        ours = {key: entry.mod_revision for key, entry in self._entries.items()}
        if seen == ours:
            self._lagging_since = None
            return ProbeVerdict.CONFIRMED
        if self._lagging_since is not None and self.revision < self._lagging_since:
            return ProbeVerdict.STALLED
        # The revision we must reach to have applied what this probe saw: the
        # newest differing record, or (for a deletion, whose revision a range
        # cannot show) anything past where we stand now.
        target = max((rev for key, rev in seen.items() if ours.get(key) != rev), default=0)
        if any(key not in seen for key in ours):
            target = max(target, self.revision + 1)
        self._lagging_since = min(target, revision) if revision else target
        return ProbeVerdict.LAGGING

    def invalid(self) -> Mapping[str, str]:
        return {
            key.decode("utf-8", "replace"): entry.problem
            for key, entry in sorted(self._entries.items())
            if entry.problem is not None
        }

    def snapshot(self) -> ProviderSnapshot:
        """The complete listing now, valid instances in key order.

        ``CapacityRejected`` when more valid instances than
        ``max_instances_per_service`` are present. Invalid records never
        count against the limit and never appear among the instances.
        """
        instances = tuple(
            entry.instance
            for _, entry in sorted(self._entries.items())
            if entry.instance is not None
        )
        if len(instances) > self._max_instances:
            raise CapacityRejected(
                f"service {self.service!r}: {len(instances)} instances exceed "
                f"max_instances_per_service={self._max_instances}"
            )
        return ProviderSnapshot(
            service=self.service,
            instances=instances,
            evidence=EvidenceKind.LEASE,
            invalid=self.invalid(),
        )


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
