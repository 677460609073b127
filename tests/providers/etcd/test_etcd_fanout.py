"""The sans-IO fan-out of one prefix watch to many services (no server).

Unit cases pin each rule; a hypothesis state machine drives random writes,
joins, leaves, ranges racing the stream, stream breaks, host hand-overs and
compactions, and checks that once the stream has delivered everything every
live member lists exactly its own service's keys.
"""

from __future__ import annotations

import base64
import json

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from nadisc_etcd._fanout import Fanout, Member
from nadisc_etcd._layout import Layout
from nadisc_etcd._state import ProbeVerdict, ServiceState
from nadisc_etcd._wire import Event, KeyValue, ResponseHeader, WatchResponse

LAYOUT = Layout("p")


def kv(key: str, mod: int) -> KeyValue:
    value = base64.b64encode(json.dumps({"Op": 0, "Addr": "10.0.0.1:80"}).encode()).decode()
    return KeyValue(key=key.encode(), mod_revision=mod, value=value)


def response(*items: tuple[str, KeyValue]) -> WatchResponse:
    return WatchResponse(
        header=ResponseHeader(revision=max(item.mod_revision for _, item in items)),
        events=tuple(Event(type=kind, kv=item) for kind, item in items),  # type: ignore[arg-type]
    )


def state(service: str) -> ServiceState:
    return ServiceState(service, LAYOUT, max_record_bytes=1024, max_instances=1000)


def ids(member: Member[str]) -> set[str]:
    return set(member.state.snapshot().identities())


def live_member(fanout: Fanout[str], service: str, revision: int, *keys: KeyValue) -> Member[str]:
    member = fanout.join(state(service), service)
    fanout.begin_range(member)
    member.state.reset(list(keys), revision)
    assert fanout.accept(member, revision)
    return member


def test_events_reach_only_the_service_they_belong_to() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 5)
    ab = live_member(fanout, "a/b", 5)  # a name with a slash
    other = live_member(fanout, "ab", 5)  # shares a's leading character
    fanout.take_host(a)
    changed = fanout.dispatch(
        response(
            ("PUT", kv("p/a/x", 6)),
            ("PUT", kv("p/a/b/y", 6)),
            ("PUT", kv("p/zz/unobserved", 6)),
            ("PUT", kv("q/a/outside", 6)),
        )
    )
    # "p/a/b/y" is instance "b/y" of "a" and instance "y" of "a/b", as two
    # separate prefix watches would see it.
    assert {m.run for m in changed} == {"a", "a/b"}
    assert ids(a) == {"x", "b/y"} and ids(ab) == {"y"} and ids(other) == set()
    assert fanout.revision == 6


def test_a_transaction_s_events_all_apply_to_a_member() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 5, kv("p/a/1", 3), kv("p/a/2", 4))
    fanout.take_host(a)
    # One deleterange: both deletions at revision 6, in one response.
    assert fanout.dispatch(response(("DELETE", kv("p/a/1", 6)), ("DELETE", kv("p/a/2", 6))))
    assert ids(a) == set()


def test_events_during_a_range_are_buffered_and_applied_after_it() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    host = live_member(fanout, "h", 5)
    fanout.take_host(host)
    late = fanout.join(state("a"), "a")
    fanout.begin_range(late)
    # The stream delivers 6 (inside the range) and 8 (after it) while the
    # range, answered at 7, is still on its way.
    assert fanout.dispatch(response(("PUT", kv("p/a/six", 6)))) == []
    assert fanout.dispatch(response(("PUT", kv("p/a/eight", 8)))) == []
    late.state.reset([kv("p/a/six", 6), kv("p/a/seven", 7)], 7)
    assert fanout.accept(late, 7)
    assert ids(late) == {"six", "seven", "eight"}
    assert late.buffer == []


def test_a_range_older_than_the_open_stream_is_taken_again() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    host = live_member(fanout, "h", 10)
    assert fanout.take_host(host) == 11
    member = fanout.join(state("a"), "a")
    fanout.begin_range(member)
    assert not fanout.accept(member, 9)  # events 10 may never reach it
    assert not member.live
    assert fanout.accept(member, 12)
    assert member.live


def test_without_a_stream_the_oldest_accepted_range_sets_the_start() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 20)
    live_member(fanout, "b", 15)
    assert fanout.take_host(a) == 16


def test_a_break_keeps_continuity_and_a_compaction_ranges_everybody_again() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 5)
    b = live_member(fanout, "b", 5)
    woken: list[str] = []
    b.waker = lambda: woken.append("b")
    fanout.take_host(a)
    fanout.dispatch(response(("PUT", kv("p/b/x", 7))))
    failure = RuntimeError("gone")
    fanout.broke(failure)
    assert (a.failure, b.failure, woken) == (failure, failure, ["b"])
    assert fanout.host is None and a.live and b.live
    assert fanout.take_host(b) == 8  # resumed after the last delivered revision
    fanout.compacted()
    assert fanout.revision is None and fanout.host is None
    assert all(m.compacted and not m.live for m in (a, b))


def test_the_host_leaving_wakes_the_others_and_leaves_continuity() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 5)
    b = live_member(fanout, "b", 5)
    fanout.take_host(a)
    fanout.dispatch(response(("PUT", kv("p/a/x", 9))))
    fanout.leave(a)
    assert len(fanout) == 1 and fanout.host is None and b.woken
    assert b.failure is None  # a hand-over, not a failure
    assert fanout.take_host(b) == 10


def test_an_idle_fanout_opens_from_now_and_ranges_after_the_stream_is_created() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    first = fanout.join(state("a"), "a")
    fanout.begin_range(first)
    assert fanout.idle()
    fanout.open_fresh(first)
    assert fanout.opening and not fanout.idle()
    # A member whose range was answered while the stream was being opened
    # cannot know whether the stream covers what followed its range.
    other = fanout.join(state("b"), "b")
    fanout.begin_range(other)
    woken: list[str] = []
    other.waker = lambda: woken.append("b")
    assert not fanout.accept(other, 6)
    assert not other.live and woken == []
    fanout.opened(7)  # the stream delivers every event after 7
    assert woken == ["b"] and not fanout.opening
    assert (fanout.opened_from, fanout.revision) == (8, 7)
    # Ranges sent after the stream was created (at 7 or later) are complete
    # with it; the stream's events they already hold are ignored.
    first.state.reset([kv("p/a/x", 7)], 9)
    assert fanout.accept(first, 9)
    other.state.reset([], 8)
    assert fanout.accept(other, 8)
    assert fanout.dispatch(response(("PUT", kv("p/b/y", 9)))) == [other]
    assert fanout.dispatch(response(("PUT", kv("p/a/z", 10)))) == [first]
    assert ids(first) == {"x", "z"} and ids(other) == {"y"}
    # Live members hold continuity: the next stream resumes, not from now.
    fanout.broke(RuntimeError("gone"))
    assert not fanout.idle()


def test_a_failed_open_from_now_wakes_the_members_waiting_for_it() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    first = fanout.join(state("a"), "a")
    other = fanout.join(state("b"), "b")
    fanout.begin_range(other)
    fanout.open_fresh(first)
    assert not fanout.accept(other, 3)
    fanout.broke(RuntimeError("refused"))
    assert other.woken and not fanout.opening and fanout.idle()
    assert fanout.accept(other, 4)  # no stream: the next one resumes from 5
    assert fanout.take_host(other) == 5


def test_progress_confirms_live_members_and_the_probe_judges_the_stream() -> None:
    fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
    a = live_member(fanout, "a", 5)
    ranging = fanout.join(state("b"), "b")
    fanout.begin_range(ranging)
    fanout.take_host(a)
    assert fanout.progress(30) == [a]
    assert fanout.revision == 30 and a.state.revision == 30
    assert fanout.judge_probe(25) is ProbeVerdict.CONFIRMED
    assert fanout.judge_probe(31) is ProbeVerdict.LAGGING
    fanout.dispatch(response(("PUT", kv("p/c/x", 31))))
    assert fanout.judge_probe(33) is ProbeVerdict.LAGGING
    # Not even 33 (seen one probe ago) was delivered: stalled.
    assert fanout.judge_probe(33) is ProbeVerdict.STALLED
    assert fanout.delivered(a.state) == 31 and fanout.delivered(ranging.state) == -1


def test_a_stepped_probe_comparison_yields_and_sees_a_change_in_between() -> None:
    service = state("a")
    keys = [kv(f"p/a/{n:05d}", n + 1) for n in range(3000)]
    service.reset(keys, 3000)
    steps = service.judge_probe_steps(3000, keys)
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value is ProbeVerdict.CONFIRMED
            break
        yields += 1
    assert yields == 3000 // ServiceState.PROBE_STEP
    # A change applied between two steps: the comparison saw two listings.
    steps = service.judge_probe_steps(3000, keys)
    next(steps)
    service.apply_events(response(("DELETE", kv("p/a/00000", 3001))).events)
    verdicts = []
    try:
        while True:
            next(steps)
    except StopIteration as done:
        verdicts.append(done.value)
    assert verdicts == [ProbeVerdict.LAGGING]


# ------------------------------------------------------------------ state machine

SERVICES = ("a", "b", "a/b", "c")
INSTANCES = ("1", "2", "3")


class SharedWatch(RuleBasedStateMachine):
    """A model registry (revisioned history) against the fan-out."""

    def __init__(self) -> None:
        super().__init__()
        self.fanout: Fanout[str] = Fanout(LAYOUT.watch_prefix())
        self.revision = 1
        self.store: dict[str, int] = {}  # key -> mod revision
        self.history: list[tuple[int, str, str]] = []  # (revision, type, key)
        self.compacted_to = 0
        self.members: list[Member[str]] = []
        #: member -> the revision its in-flight range will be answered at.
        self.ranging: dict[int, int] = {}
        #: member -> the revision of its accepted range.
        self.ranged_at: dict[int, int] = {}
        self.cursor: int | None = None  # next revision the open stream delivers
        #: Newest revision any stream delivered (events or progress).
        self.delivered = 0

    # -- the registry

    @rule(service=st.sampled_from(SERVICES), instance=st.sampled_from(INSTANCES))
    def put(self, service: str, instance: str) -> None:
        self.revision += 1
        key = f"p/{service}/{instance}"
        self.store[key] = self.revision
        self.history.append((self.revision, "PUT", key))

    @rule(service=st.sampled_from(SERVICES), instance=st.sampled_from(INSTANCES))
    def delete(self, service: str, instance: str) -> None:
        key = f"p/{service}/{instance}"
        if key in self.store:
            self.revision += 1
            del self.store[key]
            self.history.append((self.revision, "DELETE", key))

    @rule()
    def compact(self) -> None:
        self.compacted_to = self.revision

    # -- members

    @rule(service=st.sampled_from(SERVICES))
    def join(self, service: str) -> None:
        member = self.fanout.join(state(service), service)
        self.fanout.begin_range(member)
        self.ranging[id(member)] = self.revision  # the range reads now...
        self.members.append(member)

    @precondition(lambda self: self.ranging)
    @rule(data=st.data())
    def range_answered(self, data: st.DataObject) -> None:
        # ...and its answer arrives later, after whatever the stream did.
        waiting = [m for m in self.members if id(m) in self.ranging]
        member = data.draw(st.sampled_from(waiting))
        at = self.ranging.pop(id(member))
        member.state.reset(self._listing(member.state.service, at), at)
        if self.fanout.accept(member, at):
            self.ranged_at[id(member)] = at
        else:
            self.fanout.begin_range(member)
            self.ranging[id(member)] = self.revision

    @precondition(lambda self: self.members)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(self.members))
        self.fanout.leave(member)
        self.members.remove(member)
        self.ranging.pop(id(member), None)
        if self.fanout.host is None:
            self.cursor = None

    # -- the stream

    @precondition(lambda self: self.fanout.host is None)
    @rule(data=st.data())
    def open_stream(self, data: st.DataObject) -> None:
        live = [m for m in self.fanout.members() if m.live]
        if not live:
            return
        start = self.fanout.take_host(data.draw(st.sampled_from(live)))
        if start <= self.compacted_to:
            self.fanout.compacted()
            self._range_everybody_again()
            return
        self.cursor = start

    @precondition(lambda self: self.fanout.idle() and self.ranging)
    @rule(data=st.data())
    def open_stream_from_now(self, data: st.DataObject) -> None:
        # The provider's first member (or the first after a compaction)
        # opens the stream before its range and ranges once it is created.
        waiting = [m for m in self.members if id(m) in self.ranging]
        member = data.draw(st.sampled_from(waiting))
        self.ranging.pop(id(member))
        self.fanout.open_fresh(member)

    @precondition(lambda self: self.fanout.opening)
    @rule()
    def created_from_now(self) -> None:
        host = self.fanout.host
        assert host is not None
        self.fanout.opened(self.revision)
        self.cursor = self.revision + 1
        self.ranging[id(host)] = self.revision  # its range is sent now

    @precondition(lambda self: self.cursor is not None)
    @rule(count=st.integers(1, 4))
    def deliver(self, count: int) -> None:
        assert self.cursor is not None
        for _ in range(count):
            pending = [h for h in self.history if h[0] >= self.cursor]
            if not pending:
                return
            revision = pending[0][0]
            items = [(kind, kv(key, rev)) for rev, kind, key in pending if rev == revision]
            self.fanout.dispatch(response(*items))
            self.cursor = revision + 1
            self.delivered = max(self.delivered, revision)

    @precondition(lambda self: self.cursor is not None)
    @rule()
    def progress(self) -> None:
        assert self.cursor is not None
        if not [h for h in self.history if h[0] >= self.cursor]:
            self.fanout.progress(self.revision)
            self.delivered = self.revision

    @precondition(lambda self: self.fanout.host is not None)
    @rule()
    def break_stream(self) -> None:
        host = self.fanout.host
        if self.fanout.opening and host is not None:
            self.ranging[id(host)] = self.revision  # it ranges again
        self.fanout.broke(RuntimeError("broken"))
        self.cursor = None
        for member in self.fanout.members():
            member.failure = None

    # -- helpers and checks

    @rule()
    def catch_up(self) -> None:
        """Deliver what the open stream has, answer every range (after the
        stream moved on: the race the buffer covers), open the stream if
        needed, deliver everything."""
        if self.fanout.opening:
            self.created_from_now()
        if self.cursor is not None:
            self.deliver(len(self.history) + 1)
        for member in list(self.members):
            if id(member) in self.ranging:
                at = self.ranging.pop(id(member))
                member.state.reset(self._listing(member.state.service, at), at)
                if self.fanout.accept(member, at):
                    self.ranged_at[id(member)] = at
                else:
                    self.fanout.begin_range(member)
                    self.ranging[id(member)] = self.revision
        if self.fanout.host is None:
            live = [m for m in self.fanout.members() if m.live]
            if not live:
                return
            start = self.fanout.take_host(live[0])
            if start <= self.compacted_to:
                self.fanout.compacted()
                self._range_everybody_again()
                return
            self.cursor = start
        self.deliver(len(self.history) + 1)

    def _range_everybody_again(self) -> None:
        for member in self.fanout.members():
            member.compacted = False
            self.fanout.begin_range(member)
            self.ranging[id(member)] = self.revision

    def _listing(self, service: str, revision: int) -> list[KeyValue]:
        live: dict[str, int] = {}
        for rev, kind, key in self.history:
            if rev > revision:
                break
            if kind == "PUT":
                live[key] = rev
            else:
                live.pop(key, None)
        head = f"p/{service}/"
        return [kv(key, rev) for key, rev in sorted(live.items()) if key.startswith(head)]

    @invariant()
    def counts_agree(self) -> None:
        assert len(self.fanout) == len(self.members)

    @invariant()
    def live_members_list_exactly_their_keys(self) -> None:
        # A live member lists its service as of its own range or of what the
        # stream delivered since, whichever is newer: nothing lost, nothing
        # of another service, nothing stale.
        for member in self.fanout.members():
            if member.live:
                at = max(self.ranged_at[id(member)], self.delivered)
                expected = {
                    kv.key.decode()[len(member.head) :]
                    for kv in self._listing(member.state.service, at)
                }
                assert ids(member) == expected, (member.state.service, at, expected)


TestSharedWatch = SharedWatch.TestCase
TestSharedWatch.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
