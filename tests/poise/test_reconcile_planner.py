"""The sans-IO planner: the change-log path agrees with the full comparison.

The planner has two ways to classify a snapshot: follow the directory's
change log (O(changes)) or compare every member (O(n)). Whatever the edits,
both must produce the same plan, and the plan must describe the snapshot.
"""

from __future__ import annotations

from collections.abc import Hashable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import poise._directory
from poise import Backend, Directory, Snapshot
from poise._reconcile import (
    AppliedState,
    ReconcilePlan,
    _plan_from_log,
    _plan_full,
    plan_reconcile,
)

KEYS = [f"k{i}" for i in range(8)]

edits = st.lists(
    st.tuples(st.sampled_from(["upsert", "drain", "finish", "remove"]), st.sampled_from(KEYS)),
    max_size=30,
)


def apply_edits(directory: Directory, ops: list[tuple[str, str]]) -> None:
    for op, key in ops:
        member = directory.snapshot().get(key) if key in directory else None
        if op == "upsert":
            directory.upsert(key, Backend(f"http://{key}"))
        elif member is None:
            continue
        elif op == "drain":
            directory.drain(key)
        elif op == "remove":
            directory.remove(key)
        elif member.draining:
            directory.finish_drain(key)


def state_from(snapshot: Snapshot) -> AppliedState[str]:
    """A state as if ``snapshot`` had been applied, with string endpoints."""
    order = [f"{key}@{m.allocation.generation}" for key, m in snapshot.by_key.items()]
    return AppliedState(
        revision=snapshot.revision,
        lineage=snapshot.lineage,
        members=snapshot.by_key,
        endpoints=dict(zip(snapshot.by_key, order, strict=True)),
        order=order,
        draining=snapshot.draining,
    )


def summary(plan: ReconcilePlan[str]) -> tuple[object, ...]:
    return (
        plan.order,
        [(position, member.key, member.allocation) for position, member in plan.build],
        sorted(plan.replaced),
        sorted(plan.removed),
        sorted((endpoint, member.draining) for endpoint, member in plan.flips),
        plan.added,
        plan.draining,
        plan.retained,
    )


def check_describes(plan: ReconcilePlan[str], old: Snapshot, new: Snapshot) -> None:
    filled = list(plan.order)
    for position, member in plan.build:
        assert filled[position] is None
        filled[position] = f"{member.key}@{member.allocation.generation}"
    assert filled == [f"{k}@{m.allocation.generation}" for k, m in new.by_key.items()]
    kept = {k for k, m in new.by_key.items() if (o := old.get(k)) and o.allocation is m.allocation}
    assert plan.retained == len(kept)
    assert plan.draining == new.draining
    assert len(plan.removed) == len(set(old.by_key) - set(new.by_key))
    assert plan.added == len(set(new.by_key) - set(old.by_key))


@settings(max_examples=150, deadline=None)
@given(before=edits, after=edits)
def test_log_path_and_full_path_agree(
    before: list[tuple[str, str]], after: list[tuple[str, str]]
) -> None:
    directory = Directory()
    apply_edits(directory, before)
    old = directory.snapshot()
    apply_edits(directory, after)
    new = directory.snapshot()
    state = state_from(old)
    planned = plan_reconcile(state, new)
    if new.revision == old.revision:
        assert planned is None
        return
    assert planned is not None
    full = _plan_full(state, new)
    assert summary(planned) == summary(full)
    check_describes(full, old, new)
    entries = new._changes_since(old.revision)
    assert entries is not None
    logged = _plan_from_log(state, new, entries)
    assert logged is not None  # the log always suffices for directory snapshots
    assert summary(logged) == summary(full)


def test_the_log_path_is_taken_for_small_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    directory = Directory()
    for key in KEYS:
        directory.upsert(key, Backend(key))
    state = state_from(directory.snapshot())
    directory.upsert("k3", Backend("k3"))
    directory.remove("k5")
    directory.upsert("k5", Backend("k5"))
    new = directory.snapshot()
    entries = new._changes_since(state.revision)
    assert entries == [("k3", False), ("k5", True), ("k5", False)]

    def forbidden(*args: object) -> object:
        raise AssertionError("the full comparison ran")

    monkeypatch.setattr("poise._reconcile._plan_full", forbidden)
    plan = plan_reconcile(state, new)
    assert plan is not None
    assert [m.key for _, m in plan.build] == ["k3", "k5"]
    assert [p for p, _ in plan.build] == [3, 7]  # k5 moved to the end
    assert plan.rebuilt == 2 and plan.added == 0 and not plan.removed


def test_a_truncated_log_falls_back_to_the_full_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(poise._directory, "_LOG_MIN", 2)
    directory = Directory()
    directory.upsert("a", Backend("a"))
    old = directory.snapshot()
    for _ in range(10):
        directory.upsert("b", Backend("b"))
    new = directory.snapshot()
    assert new._changes_since(old.revision) is None  # the log was restarted
    plan = plan_reconcile(state_from(old), new)
    assert plan is not None and plan.added == 1 and plan.retained == 1
    # Snapshots taken before the restart still answer for their own range.
    assert old._changes_since(0) == [("a", False)]


def test_hand_built_snapshots_have_no_log() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    built = Snapshot(directory.snapshot(), revision=5, lineage=directory.lineage)
    assert built._changes_since(1) is None
    state = state_from(directory.snapshot())
    plan = plan_reconcile(state, built)
    assert plan is not None and plan.retained == 1


def test_position_hints_are_checked() -> None:
    directory = Directory()
    for key in KEYS:
        directory.upsert(key, Backend(key))
    state = state_from(directory.snapshot())
    wrong: dict[Hashable, int] = {}
    state.position_of = lambda endpoint: wrong.get(endpoint, 0)  # always wrong
    directory.remove("k4")
    directory.upsert("k6", Backend("k6"))
    plan = plan_reconcile(state, directory.snapshot())
    assert plan is not None
    assert [p for p, _ in plan.build] == [5]  # k6, after k4 left
    assert [key for key, _ in plan.removed] == ["k4"]
