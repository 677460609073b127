"""How long does applying a discovery snapshot take, against a set-building floor?

For each size, a directory of ``n`` members is applied once; then each round
re-upserts 1% of the members (rebuilt generations, so the factory runs for
them) and times ``DiscoveryBalance.apply_snapshot`` on the new snapshot. The
floor is the time to build a ``set`` of the same ``n`` keys in the same run:
any reconciler must at least look at every key once. The target is an apply
within 10x the floor at 65,536 members. An equal revision must be O(1); its
time is printed too.

Run: ``python -m benchmarks.reconcile_scale [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from poise import Backend, Balance, Directory, DiscoveryBalance, RoundRobin, in_flight_factory

SIZES = (1_000, 10_000, 65_536)
SMOKE_SIZES = (100, 1_000)
TARGET_RATIO = 10.0


class _NullService:
    """The cheapest possible service: always ready, echoes the request."""

    __slots__ = ("address",)

    def __init__(self, address: str) -> None:
        self.address = address

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True

    async def call(self, request: object) -> object:
        return request


def _make_service(key: Hashable, backend: Backend) -> _NullService:
    return _NullService(backend.id)


@dataclass(frozen=True)
class Row:
    members: int
    rebuilt: int
    apply_ms: float
    commit_ms: float
    splices: int
    replacements: int
    floor_ms: float
    equal_us: float
    gc_apply_ms: float

    @property
    def reconcile_ms(self) -> float:
        """The apply without the balance's own commit (splice or replace_endpoints)."""
        return self.apply_ms - self.commit_ms

    @property
    def ratio(self) -> float:
        return self.apply_ms / self.floor_ms if self.floor_ms else float("inf")

    @property
    def reconcile_ratio(self) -> float:
        return self.reconcile_ms / self.floor_ms if self.floor_ms else float("inf")


class _CommitClock:
    """Times the balance's share of an apply: ``Balance.splice`` and ``replace_endpoints``.

    A directory's snapshots commit through ``splice``; ``replace_endpoints``
    is the fallback for snapshots that reorder members. Both are wrapped for
    the duration of the ``with`` block and their time is summed in ``spent``.
    """

    def __init__(self) -> None:
        self.spent = 0.0
        self.calls: dict[str, int] = {"splice": 0, "replace_endpoints": 0}
        self._originals: dict[str, Callable[..., None]] = {
            "splice": Balance.splice,
            "replace_endpoints": Balance.replace_endpoints,
        }

    def _wrap(self, name: str) -> Callable[..., None]:
        original = self._originals[name]
        clock = self

        def timed(balance: Balance[object, object], *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                original(balance, *args, **kwargs)
            finally:
                clock.spent += time.perf_counter() - start
                clock.calls[name] += 1

        return timed

    def __enter__(self) -> _CommitClock:
        for name in self._originals:
            setattr(Balance, name, self._wrap(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(Balance, name, original)


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rebuild_one_percent(directory: Directory, keys: Sequence[str], round_number: int) -> None:
    for i in range(round_number % 100, len(keys), 100):
        directory.upsert(keys[i], Backend(f"http://{keys[i]}"))


def measure(n: int, rounds: int) -> Row:
    directory = Directory()
    keys = [f"member-{i:06d}" for i in range(n)]
    for key in keys:
        directory.upsert(key, Backend(f"http://{key}"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(), in_flight_factory(_make_service)
    )
    balance.apply_snapshot(directory.snapshot())
    rebuilt = len(range(0, n, 100))
    applies: list[float] = []
    commits: list[float] = []
    splices = replacements = 0
    floors: list[float] = []
    gc_applies: list[float] = []
    for r in range(rounds + 3):
        _rebuild_one_percent(directory, keys, r)
        snapshot = directory.snapshot()
        snapshot_keys = list(snapshot.by_key)
        if r >= rounds:
            # The same apply with the collector running, as an application sees it.
            gc_applies.append(_time(lambda: balance.apply_snapshot(snapshot)))  # noqa: B023
            continue
        # Like timeit, pause the cyclic garbage collector while timing, so a
        # collection triggered by earlier allocations is not billed here.
        gc.collect()
        gc.disable()
        try:
            floors.append(_time(lambda: set(snapshot_keys)))  # noqa: B023 - timed at once
            with _CommitClock() as commit:
                applies.append(_time(lambda: balance.apply_snapshot(snapshot)))  # noqa: B023
            commits.append(commit.spent)
            splices += commit.calls["splice"]
            replacements += commit.calls["replace_endpoints"]
        finally:
            gc.enable()
        assert balance.revision == snapshot.revision
    snapshot = directory.snapshot()
    repeat = 10_000
    start = time.perf_counter()
    for _ in range(repeat):
        balance.apply_snapshot(snapshot)
    equal = (time.perf_counter() - start) / repeat
    return Row(
        members=n,
        rebuilt=rebuilt,
        apply_ms=statistics.median(applies) * 1e3,
        commit_ms=statistics.median(commits) * 1e3,
        splices=splices,
        replacements=replacements,
        floor_ms=statistics.median(floors) * 1e3,
        equal_us=equal * 1e6,
        gc_apply_ms=statistics.median(gc_applies) * 1e3,
    )


def render(rows: Sequence[Row]) -> str:
    header = (
        f"{'members':>8} {'rebuilt':>8} {'set floor ms':>13} {'apply ms':>9} {'ratio':>7} "
        f"{'balance commit ms':>18} {'reconcile ms':>13} {'ratio':>7} {'equal-rev us':>13} "
        f"{'apply ms, gc on':>16}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.members:>8} {row.rebuilt:>8} {row.floor_ms:>13.3f} {row.apply_ms:>9.3f} "
            f"{row.ratio:>6.1f}x {row.commit_ms:>18.3f} {row.reconcile_ms:>13.3f} "
            f"{row.reconcile_ratio:>6.1f}x {row.equal_us:>13.3f} {row.gc_apply_ms:>16.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small sizes, a few seconds")
    args = parser.parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    rounds = 3 if args.smoke else 9
    rows = [measure(n, rounds) for n in sizes]
    print(render(rows))
    largest = rows[-1]
    verdict = "met" if largest.ratio <= TARGET_RATIO else "MISSED"
    print(
        f"target: {largest.members} members applied within {TARGET_RATIO:g}x the set floor: "
        f"{verdict} ({largest.ratio:.1f}x overall, {largest.reconcile_ratio:.1f}x for the "
        "reconciler without the balance commit); equal revision is O(1)"
    )
    splices = sum(row.splices for row in rows)
    replacements = sum(row.replacements for row in rows)
    print(
        f"timed commits: {splices} through Balance.splice, {replacements} through "
        "Balance.replace_endpoints"
    )
    print(
        "apply = plan + factory calls + balance commit; 'balance commit' is the time in "
        "Balance.splice (a directory's snapshots) or Balance.replace_endpoints (reordered "
        "snapshots); timings with the garbage collector paused, as timeit does, except the "
        "last column"
    )
    return rows


if __name__ == "__main__":
    main()
