"""Sans-IO fan-out of one etcd watch over the common prefix to many services.

Contract: one stream watches every key under ``<prefix>/``; each watched
service is a *member* holding its own :class:`~._state.ServiceState`. A
member receives only the events of keys under its own ``<prefix>/<service>/``
(a key under several observed services, possible when names contain ``/``,
reaches each of them, as separate watches would). No I/O, no clock: the
provider's shell opens the stream, feeds what it reads to :meth:`Fanout.dispatch`
and publishes the members it returns.

Member life::

    join ──► ranging (events buffered) ──accept(R)──► live (events applied)
                ▲           │ R older than the open stream: range again
                │           ▼
                └──── compacted (the stream's start revision was compacted,
                      or it refused a message over the response limit:
                      every member ranges again, the stream starts afresh)

Stream continuity: :attr:`Fanout.revision` is the newest revision whose
events under the prefix were all delivered (event revisions and progress
notifications). A stream that breaks or whose host leaves is reopened from
``revision + 1``, so no member loses or repeats an event (members ignore
events at or below their own revision). A member is joined *before* its
range is sent, so every event newer than its range either is in its buffer
or is still to come; :meth:`Fanout.accept` checks that the range is not
older than what an already open stream started from.

Opening from now: when no stream is open and no member is live (the first
watched service, or after a compaction) there is no continuity to keep, so
the host opens the stream *before* its range, from the current revision
(:meth:`Fanout.open_fresh`, :meth:`Fanout.opened`), and ranges once it is
created. etcd serves a watch from now with every change as it commits; a
watch from a past revision waits for the server's resync loop (every
100 ms), which is what a stream opened after the range would be whenever a
change landed in between.

Hosting: the stream is read inside one member's task (the *host*); the
provider starts no task of its own. When the host leaves, the stream is
closed with it and the next member to notice opens it again (a resume, not
a re-range).

Costs: routing one event is one dictionary look-up per ``/`` in its key
after the prefix; applying it is the member's O(log n). Events of services
nobody observes cost the routing only. A progress notification touches every
live member (O(members)); joins and leaves are O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ._state import ProbeVerdict, ServiceState
from ._wire import Event, WatchResponse

__all__ = ["Fanout", "Member"]

_R = TypeVar("_R")


class Member(Generic[_R]):
    """One watched service on the shared stream (``run``: the shell's bookkeeping)."""

    __slots__ = (
        "buffer",
        "compacted",
        "failure",
        "head",
        "live",
        "oversized",
        "run",
        "state",
        "waker",
        "woken",
    )

    def __init__(self, state: ServiceState, run: _R) -> None:
        self.state = state
        self.run = run
        self.head = state.layout.service_prefix(state.service)
        #: Ranged and accepted: events are applied to ``state`` as they come.
        self.live = False
        #: Events that arrived while the member was ranging.
        self.buffer: list[Event] = []
        #: The stream's start revision was compacted: range again.
        self.compacted = False
        #: With ``compacted``: the stream refused a message over the response
        #: limit instead (a resume would meet it again): range again too.
        self.oversized = False
        #: Why the stream this member followed broke (reported once).
        self.failure: Exception | None = None
        #: Something happened the member's task must look at (set by the fan-out).
        self.woken = False
        #: Called (by the shell's choice) whenever ``woken`` is set.
        self.waker: Callable[[], None] | None = None

    def wake(self) -> None:
        self.woken = True
        if self.waker is not None:
            self.waker()


class Fanout(Generic[_R]):
    """The members of one shared watch and the stream's continuity."""

    def __init__(self, head: bytes) -> None:
        #: ``<prefix>/``: the shared watch covers every key starting with it.
        self.head = head
        self._members: dict[bytes, list[Member[_R]]] = {}
        self._count = 0
        #: Newest revision fully delivered under ``head`` (None: no stream
        #: continuity, e.g. after a compaction; the next accepted range sets it).
        self.revision: int | None = None
        #: The start revision of the open stream (None: no stream open).
        self.opened_from: int | None = None
        #: The member whose task reads the stream right now.
        self.host: Member[_R] | None = None
        #: The newest change a probe saw that the stream had not delivered yet.
        self._lagging_since: int | None = None

    def __len__(self) -> int:
        return self._count

    def members(self) -> Iterable[Member[_R]]:
        for group in self._members.values():
            yield from group

    # ----------------------------------------------------------- membership

    def join(self, state: ServiceState, run: _R) -> Member[_R]:
        """A new member, buffering events until :meth:`accept`."""
        member = Member(state, run)
        self._members.setdefault(member.head, []).append(member)
        self._count += 1
        return member

    def leave(self, member: Member[_R]) -> None:
        group = self._members.get(member.head)
        if group is None or member not in group:
            return
        group.remove(member)
        if not group:
            del self._members[member.head]
        self._count -= 1
        member.live = False
        member.buffer = []
        if self.host is member:
            self.release_host(member)

    def begin_range(self, member: Member[_R]) -> None:
        """The member is about to range: buffer its events from now on."""
        member.live = False
        member.buffer = []
        member.compacted = False
        member.oversized = False

    def accept(self, member: Member[_R], revision: int) -> bool:
        """The member's state was just reset from a range at ``revision``.

        True: the member is live (its buffered events were applied). False:
        the range is older than the open stream's start, so events in between
        may never reach it; the caller ranges again (still buffering). Also
        False while a stream is being opened from now (:meth:`open_fresh`):
        its start is not known yet; the caller waits to be woken by
        :meth:`opened`, then ranges again.
        """
        if self.opening:
            member.buffer = []
            return False
        if self.opened_from is not None:
            if revision < self.opened_from - 1:
                member.buffer = []
                return False
        elif self.revision is None or revision < self.revision:
            self.revision = revision
        member.state.apply_events(member.buffer)
        member.buffer = []
        member.live = True
        return True

    # --------------------------------------------------------------- stream

    @property
    def opening(self) -> bool:
        """A stream from now is being opened (:meth:`open_fresh`): its start
        revision is not known yet."""
        return self.host is not None and self.opened_from is None

    def idle(self) -> bool:
        """No stream is open and no member is live: there is no continuity to
        keep, so the next stream may start from now (:meth:`open_fresh`)."""
        return self.host is None and not any(member.live for member in self.members())

    def open_fresh(self, member: Member[_R]) -> None:
        """``member`` opens the stream from now (no start revision) and then
        ranges, its events buffered (the fan-out is :meth:`idle`). etcd
        delivers a watch from now as soon as each change is committed; a
        watch from a past revision is first caught up by the server's
        periodic resync (every 100 ms), which would delay the first changes
        after a range by up to that much. Until :meth:`opened`, a range
        cannot be accepted."""
        assert self.host is None and not member.live
        self.host = member
        self.opened_from = None
        self.revision = None
        self._lagging_since = None

    def opened(self, revision: int) -> None:
        """The stream from now was created at server ``revision``: it delivers
        every event newer than that, so a range at ``revision`` or later is
        complete together with it. Wakes the members waiting to range again."""
        assert self.opening
        self.opened_from = revision + 1
        self.revision = revision
        for member in self.members():
            if not member.live:
                member.wake()

    def take_host(self, member: Member[_R]) -> int:
        """``member`` reads the stream from now on; the start revision to open it at."""
        assert self.host is None and member.live
        assert self.revision is not None  # set by the member's own accept
        self.host = member
        self.opened_from = self.revision + 1
        self._lagging_since = None
        return self.opened_from

    def judge_probe(self, newest: int) -> ProbeVerdict:
        """Judge a probe that saw ``newest``, the newest ``mod_revision``
        under the prefix (0: no key): CONFIRMED when the stream delivered it,
        LAGGING when not yet, STALLED when the stream has not even reached
        what the previous probe saw. (A deletion leaves no revision behind
        for a range to show; the owner's confirmation queries cover it.)"""
        delivered = self.revision or 0
        if newest <= delivered:
            self._lagging_since = None
            return ProbeVerdict.CONFIRMED
        if self._lagging_since is not None and delivered < self._lagging_since:
            return ProbeVerdict.STALLED
        self._lagging_since = newest
        return ProbeVerdict.LAGGING

    def delivered(self, state: ServiceState) -> int:
        """The revision up to which every event of ``state``'s service was
        applied to it (-1 when ``state`` is not a live member's)."""
        for member in self._members.get(state.layout.service_prefix(state.service), ()):
            if member.state is state and member.live:
                return max(state.revision, self.revision or 0)
        return -1

    def live(self) -> list[Member[_R]]:
        """The members whose listing the stream keeps current."""
        return [member for member in self.members() if member.live]

    def release_host(self, member: Member[_R]) -> None:
        """The host stopped reading (left, or its stream ended): wake the
        others so one of them opens the stream again from ``revision + 1``."""
        if self.host is not member:
            return
        self.host = None
        self.opened_from = None
        for other in self.members():
            other.wake()

    def dispatch(self, response: WatchResponse) -> list[Member[_R]]:
        """Route one response's events; the live members whose listing changed.

        A member gets all its events of the response in one
        :meth:`~._state.ServiceState.apply_events` (events of one response may
        share a revision, one transaction).
        """
        routed: dict[int, tuple[Member[_R], list[Event]]] = {}
        newest = self.revision or 0
        head_len = len(self.head)
        members = self._members
        for event in response.events:
            key = event.kv.key
            newest = max(newest, event.kv.mod_revision)
            if not members or not key.startswith(self.head):
                continue
            slash = key.find(b"/", head_len)
            while slash >= 0:
                group = members.get(key[: slash + 1])
                if group is not None:
                    for member in group:
                        entry = routed.get(id(member))
                        if entry is None:
                            routed[id(member)] = entry = (member, [])
                        entry[1].append(event)
                slash = key.find(b"/", slash + 1)
        self.revision = newest
        changed: list[Member[_R]] = []
        for member, events in routed.values():
            if not member.live:
                member.buffer.extend(events)
            elif member.state.apply_events(events):
                changed.append(member)
        return changed

    def progress(self, revision: int) -> list[Member[_R]]:
        """A progress notification at ``revision``: the live members, now confirmed."""
        self.revision = max(self.revision or 0, revision)
        confirmed = []
        for member in self.members():
            if member.live:
                member.state.progress(revision)
                confirmed.append(member)
        return confirmed

    def broke(self, failure: Exception) -> None:
        """The stream broke: every member reports ``failure``; continuity stays."""
        self.host = None
        self.opened_from = None
        for member in self.members():
            member.failure = failure
            member.wake()

    def compacted(self, *, oversized: bool = False) -> None:
        """The stream's start revision was compacted, or (``oversized``) the
        stream refused a message over the response limit, which a resumed
        stream would send again: every member ranges again, and the stream
        starts afresh from now."""
        self.host = None
        self.opened_from = None
        self.revision = None
        for member in self.members():
            member.live = False
            member.buffer = []
            member.compacted = True
            member.oversized = oversized
            member.wake()
