"""subset: even coverage (hypothesis over fleet shapes) and bounded movement."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from poise import InvalidInput, ring_order, subset


def coverage(members: int, clients: int, size: int) -> dict[str, int]:
    keys = [f"b{i}" for i in range(members)]
    counts = dict.fromkeys(keys, 0)
    per_round = max(1, (2 * members + size) // (2 * size))
    for client in range(clients):
        chosen = subset(keys, client, size)
        assert len(chosen) == len(set(chosen))
        if size < members:
            assert members // per_round <= len(chosen) <= -(-members // per_round)
        for key in chosen:
            counts[key] += 1
    return counts


@settings(deadline=None)  # a few ms a case; the shared machine stalls
@given(st.integers(1, 120), st.integers(1, 60), st.integers(1, 30))
def test_every_backend_is_within_one_of_the_mean(members: int, clients: int, size: int) -> None:
    counts = coverage(members, clients, size)
    mean = sum(counts.values()) / members
    assert all(abs(c - mean) < 1.0 + 1e-9 for c in counts.values())


@settings(deadline=None)
@given(st.integers(2, 120), st.integers(1, 5), st.integers(1, 30))
def test_complete_rounds_cover_every_backend_equally(members: int, rounds: int, size: int) -> None:
    per_round = 1 if size >= members else max(1, (2 * members + size) // (2 * size))
    counts = coverage(members, rounds * per_round, size)
    assert set(counts.values()) == {rounds}


def test_the_fleet_of_the_issue_is_exact() -> None:
    assert set(coverage(1000, 300, 20).values()) == {6}


@settings(deadline=None, max_examples=50)
@given(st.integers(21, 200), st.integers(1, 40), st.data())
def test_a_leaving_backend_moves_each_client_by_at_most_two(
    members: int, clients: int, data: st.DataObject
) -> None:
    # The rounds keep their width unless M / 20 crosses a half (then all move).
    assume((2 * members + 20) // 40 == (2 * members - 2 + 20) // 40)
    keys = [f"10.0.{i}.1" for i in range(members)]
    gone = keys[data.draw(st.integers(0, members - 1))]
    rest = [k for k in keys if k != gone]
    for client in range(clients):
        before = set(subset(keys, client, 20)) - {gone}
        after = set(subset(rest, client, 20))
        assert len(after - before) <= 2


def test_a_leave_moves_the_windows_between_it_and_the_rounds_middle_only() -> None:
    # One round of 20 windows of 10: the window edges are rounded, so a leave
    # at window q shifts the windows between q and the middle (about |q - 10|),
    # a quarter of the round on average (floored edges moved half of it).
    keys = [f"10.1.{i}.7" for i in range(200)]
    moved_per_leave = []
    for gone in keys:
        rest = [k for k in keys if k != gone]
        moved = sum(
            1
            for client in range(20)
            if set(subset(rest, client, 10)) - set(subset(keys, client, 10))
        )
        moved_per_leave.append(moved)
    assert max(moved_per_leave) <= 20 // 2 + 1
    assert sum(moved_per_leave) / len(moved_per_leave) <= 20 / 4 + 1


def test_a_client_joining_moves_nobody() -> None:
    keys = [f"k{i}" for i in range(300)]
    assert [subset(keys, i, 10) for i in range(40)] == [subset(keys, i, 10) for i in range(40)]


def test_order_is_by_stable_hash_not_by_input_order() -> None:
    keys = [f"k{i}" for i in range(50)]
    assert ring_order(keys) == ring_order(list(reversed(keys)))
    assert subset(keys, 3, 5) == subset(list(reversed(keys)), 3, 5)


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidInput, match="client_index"):
        subset(["a"], -1, 1)
    with pytest.raises(InvalidInput, match="size"):
        subset(["a"], 0, 0)
    with pytest.raises(InvalidInput, match="not unique"):
        subset(["a", "a"], 0, 1)
