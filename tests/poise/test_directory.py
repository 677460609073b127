"""Directory, backends, allocations, snapshots and latest-only snapshot streams."""

from __future__ import annotations

import math

import anyio
import pytest

from poise import (
    Allocation,
    Backend,
    Directory,
    DuplicateIdentity,
    InvalidInput,
    Lineage,
    Member,
    Snapshot,
    StreamClosed,
    UnknownMember,
)

# -- Backend ------------------------------------------------------------------------


def test_backend_is_a_frozen_validated_value() -> None:
    backend = Backend("http://west", weight=2, metadata={"zone": "a"})
    assert backend.id == backend.address == "http://west"
    assert backend.weight == 2.0 and isinstance(backend.weight, float)
    assert dict(backend.metadata) == {"zone": "a"}
    assert backend == Backend("http://west", weight=2.0, metadata={"zone": "a"})
    assert hash(backend) == hash(Backend("http://west", weight=2.0, metadata={"zone": "a"}))
    assert backend != Backend("http://west", weight=3)
    assert backend != Backend("http://west", weight=2, metadata={"zone": "b"})
    assert backend != "http://west"
    with pytest.raises(AttributeError):
        backend.weight = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        backend.metadata["zone"] = "b"  # type: ignore[index]
    assert "http://west" in repr(backend) and "zone" in repr(backend)


def test_backend_copies_its_metadata() -> None:
    source = {"zone": "a"}
    backend = Backend("b", metadata=source)
    source["zone"] = "changed"
    assert backend.metadata["zone"] == "a"


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan, True, "1", None])
def test_backend_rejects_bad_weights(weight: object) -> None:
    with pytest.raises(InvalidInput, match="weight"):
        Backend("b", weight=weight)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", 3, None])
def test_backend_rejects_bad_ids(bad: object) -> None:
    with pytest.raises(InvalidInput, match="id"):
        Backend(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("metadata", [{"k": 1}, {1: "v"}, [("k", "v")]])
def test_backend_rejects_bad_metadata(metadata: object) -> None:
    with pytest.raises(InvalidInput, match="metadata"):
        Backend("b", metadata=metadata)  # type: ignore[arg-type]


# -- Directory mutations ------------------------------------------------------------------


def test_every_upsert_is_a_new_allocation_even_for_an_equal_value() -> None:
    directory = Directory()
    directory.upsert("west", Backend("http://west"))
    first = directory.snapshot().get("west")
    directory.upsert("west", Backend("http://west"))
    second = directory.snapshot().get("west")
    assert first is not None and second is not None
    assert first.backend == second.backend
    assert first.allocation is not second.allocation
    assert second.allocation.generation > first.allocation.generation
    assert first != second


def test_drain_is_membership_only_and_keeps_the_allocation() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    before = directory.snapshot().get("a")
    revision = directory.drain("a")
    after = directory.snapshot().get("a")
    assert before is not None and after is not None
    assert after.draining and not before.draining
    assert after.allocation is before.allocation
    assert directory.snapshot().draining == 1
    # Draining again changes nothing and publishes nothing.
    assert directory.drain("a") == revision == directory.revision


def test_upsert_keeps_position_and_reactivates_a_draining_member() -> None:
    directory = Directory()
    for key in ("a", "b", "c"):
        directory.upsert(key, Backend(key))
    directory.drain("b")
    directory.upsert("b", Backend("b", weight=3))
    snapshot = directory.snapshot()
    assert snapshot.keys() == ("a", "b", "c")
    member = snapshot.get("b")
    assert member is not None and not member.draining and member.backend.weight == 3
    # Removal then upsert appends at the end.
    directory.remove("a")
    directory.upsert("a", Backend("a"))
    assert directory.snapshot().keys() == ("b", "c", "a")


def test_finish_drain_removes_only_a_draining_member() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    with pytest.raises(InvalidInput, match="not draining"):
        directory.finish_drain("a")
    directory.drain("a")
    directory.finish_drain("a")
    assert "a" not in directory and len(directory) == 0


@pytest.mark.parametrize("operation", ["drain", "finish_drain", "remove"])
def test_unknown_keys_are_typed_errors(operation: str) -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    revision = directory.revision
    with pytest.raises(UnknownMember, match="'missing'") as info:
        getattr(directory, operation)("missing")
    assert isinstance(info.value, InvalidInput) and isinstance(info.value, LookupError)
    assert info.value.key == "missing"
    assert directory.revision == revision


def test_upsert_rejects_bad_input_without_publishing() -> None:
    directory = Directory()
    with pytest.raises(InvalidInput, match="Backend"):
        directory.upsert("a", "http://a")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="hashable"):
        directory.upsert(["a"], Backend("a"))  # type: ignore[arg-type]
    assert directory.revision == 0 and len(directory) == 0


def test_each_mutation_advances_the_revision_by_one() -> None:
    directory = Directory()
    assert directory.revision == 0 and directory.snapshot().revision == 0
    assert directory.upsert("a", Backend("a")) == 1
    assert directory.upsert("b", Backend("b")) == 2
    assert directory.drain("a") == 3
    assert directory.finish_drain("a") == 4
    assert directory.remove("b") == 5
    assert directory.snapshot().revision == 5


# -- Snapshots ------------------------------------------------------------------------------


def test_snapshots_are_immutable_and_unaffected_by_later_mutations() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    old = directory.snapshot()
    assert directory.snapshot() is old  # same revision, same object
    directory.upsert("b", Backend("b"))
    directory.drain("a")
    directory.remove("b")
    assert old.keys() == ("a",) and old.revision == 1
    member = old.get("a")
    assert member is not None and not member.draining
    new = directory.snapshot()
    assert new.revision == 4 and new.keys() == ("a",)
    with pytest.raises(TypeError):
        new.by_key["x"] = member  # type: ignore[index]
    # Untouched members are shared between snapshots (cheap classification).
    directory.upsert("c", Backend("c"))
    assert directory.snapshot().get("a") is new.get("a")


def test_snapshot_views() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    directory.upsert("b", Backend("b"))
    snapshot = directory.snapshot()
    assert len(snapshot) == 2 and "a" in snapshot and "z" not in snapshot
    assert [m.key for m in snapshot] == ["a", "b"]
    assert snapshot.members == tuple(snapshot) and snapshot.members is snapshot.members
    assert list(snapshot.by_key) == ["a", "b"]
    assert snapshot.get("z") is None
    assert snapshot.lineage is directory.lineage
    assert "revision=2" in repr(snapshot) and "members=2" in repr(directory)


def test_each_directory_is_its_own_lineage() -> None:
    first, second = Directory(), Directory()
    assert first.lineage is not second.lineage
    assert first.snapshot().lineage is first.lineage
    assert repr(first.lineage) != repr(second.lineage)


def test_a_hand_built_snapshot_rejects_duplicate_keys_and_bad_fields() -> None:
    allocation = Allocation(Backend("a"))
    lineage = Lineage()
    snapshot = Snapshot([Member("a", allocation)], revision=3, lineage=lineage)
    assert snapshot.revision == 3 and snapshot.keys() == ("a",)
    with pytest.raises(DuplicateIdentity, match="'a'"):
        Snapshot(
            [Member("a", allocation), Member("a", Allocation(Backend("b")))],
            revision=4,
            lineage=lineage,
        )
    with pytest.raises(InvalidInput, match="revision"):
        Snapshot([], revision=-1, lineage=lineage)
    with pytest.raises(InvalidInput, match="lineage"):
        Snapshot([], revision=1, lineage="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="Member"):
        Snapshot(["a"], revision=1, lineage=lineage)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="Backend"):
        Allocation("a")  # type: ignore[arg-type]


# -- readers and streams ----------------------------------------------------------------------


def test_reader_load_is_one_atomic_read_of_the_current_snapshot() -> None:
    directory = Directory()
    reader = directory.reader()
    directory.upsert("a", Backend("a"))
    snapshot = reader.load()
    assert snapshot is directory.snapshot() and snapshot.revision == 1
    assert reader.revision == 1 and reader.lineage is directory.lineage
    assert not reader.closed
    assert not hasattr(reader, "upsert")


async def test_subscribe_starts_with_the_current_snapshot_changes_after_it() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    reader = directory.reader()
    subscription = reader.subscribe()
    changes = reader.changes()
    assert (await subscription.receive()).revision == 1
    assert not changes.pending
    directory.upsert("b", Backend("b"))
    assert (await changes.receive()).keys() == ("a", "b")


async def test_a_burst_of_revisions_yields_only_the_newest_snapshot() -> None:
    directory = Directory()
    stream = directory.reader().changes()
    for i in range(100):
        directory.upsert(f"m{i}", Backend(f"m{i}"))
    snapshot = await stream.receive()
    assert snapshot.revision == 100 and len(snapshot) == 100
    assert not stream.pending
    with pytest.raises(anyio.WouldBlock):
        stream.receive_nowait()


async def test_two_subscribers_have_independent_cursors() -> None:
    directory = Directory()
    reader = directory.reader()
    first, second = reader.changes(), reader.changes()
    directory.upsert("a", Backend("a"))
    assert (await first.receive()).revision == 1
    directory.upsert("b", Backend("b"))
    assert (await first.receive()).revision == 2
    assert (await second.receive()).revision == 2
    assert not first.pending and not second.pending


async def test_a_waiting_subscriber_is_woken_by_a_publish() -> None:
    directory = Directory()
    stream = directory.reader().changes()
    seen: list[int] = []

    async def consume() -> None:
        async for snapshot in stream:
            seen.append(snapshot.revision)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        directory.upsert("a", Backend("a"))
        await anyio.wait_all_tasks_blocked()
        directory.upsert("b", Backend("b"))
        directory.drain("a")  # both before the consumer runs: only the newest
        await anyio.wait_all_tasks_blocked()
        directory.close()
    assert seen == [1, 3]


async def test_streams_end_after_the_final_revision() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    stream = directory.reader().subscribe()
    directory.upsert("b", Backend("b"))
    directory.close()
    directory.close()  # idempotent
    assert directory.closed and directory.reader().closed
    assert not stream.ended
    final = await stream.receive()
    assert final.revision == 2 and stream.ended
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()
    with pytest.raises(anyio.EndOfStream):
        stream.receive_nowait()
    assert [s.revision async for s in directory.reader().subscribe()] == [2]
    assert [s.revision async for s in directory.reader().changes()] == []
    # The final snapshot stays readable; mutations are refused.
    assert directory.snapshot().revision == 2
    with pytest.raises(StreamClosed):
        directory.upsert("c", Backend("c"))
    with pytest.raises(StreamClosed):
        directory.remove("a")


async def test_cancelling_a_waiting_subscriber_leaves_others_intact() -> None:
    directory = Directory()
    reader = directory.reader()
    doomed, survivor = reader.changes(), reader.changes()
    got: list[int] = []
    scope = anyio.CancelScope()

    async def doomed_wait() -> None:
        with scope:
            await doomed.receive()

    async def survive() -> None:
        got.append((await survivor.receive()).revision)

    async with anyio.create_task_group() as tg:
        tg.start_soon(doomed_wait)
        tg.start_soon(survive)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        directory.upsert("a", Backend("a"))
    assert scope.cancelled_caught and got == [1]
    assert doomed.pending and doomed.receive_nowait().revision == 1


async def test_stream_wakers_fire_on_publish_and_close() -> None:
    directory = Directory()
    stream = directory.reader().changes()
    calls: list[str] = []

    def wake() -> None:
        calls.append("wake")

    stream.add_waker(wake)
    stream.add_waker(wake)
    directory.upsert("a", Backend("a"))
    assert calls == ["wake"]
    stream.add_waker(wake)  # pending already: called at once
    assert calls == ["wake", "wake"]
    stream.receive_nowait()
    stream.add_waker(wake)
    stream.discard_waker(wake)
    directory.upsert("b", Backend("b"))
    assert calls == ["wake", "wake"]
    stream.receive_nowait()
    stream.add_waker(wake)
    directory.close()
    assert calls == ["wake", "wake", "wake"]


async def test_stream_wait_consumes_nothing() -> None:
    directory = Directory()
    stream = directory.reader().changes()

    async def later() -> None:
        await anyio.wait_all_tasks_blocked()
        directory.upsert("a", Backend("a"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await stream.wait()
    assert stream.pending
    assert stream.receive_nowait().revision == 1
    assert "pending=False" in repr(stream)


def test_mutations_without_readers_do_not_copy_the_member_table() -> None:
    directory = Directory()
    for i in range(10):
        directory.upsert(i, Backend(f"b{i}"))
    table = directory._members
    for i in range(10):
        directory.drain(i)
    assert directory._members is table  # no snapshot taken: edited in place
    snapshot = directory.snapshot()
    directory.remove(0)
    assert directory._members is not table  # copy-on-write after a snapshot
    assert len(snapshot) == 10 and len(directory) == 9
