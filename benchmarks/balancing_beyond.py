"""Balancing past the peers: hedged requests, retry budgets, zones and subsets.

Four experiments, each on the real poise parts.

1. Hedging on Linkerd's experiment
    11 backends answering in about 167 ms (uniform in [150, 184] ms), an
    open loop of 1000 requests/s (Poisson arrivals, each request its own
    task) for 60 s, one backend answering in 2 s from t = 15 s to 45 s.
    Every attempt goes through one :class:`poise.Balance` (P2C on
    :class:`poise.PeakEwma`), on trio's virtual clock. Hedged rows send a
    second attempt when the first has been out longer than the route's
    rolling p95 of completed attempts (:class:`poise.Hedging`, at most one
    hedge, charged to a 20% + 10/s :class:`poise.RetryBudget`), keep the
    first answer and cancel the loser (:func:`poise.hedged_call`). A hedge
    goes to another backend than the first attempt (the backend declines it,
    nothing sent, and the balance picks again). The last
    row cancels the same way but with ``PeakEwma(cancel_evidence=False)``:
    a cancelled loser then says nothing about its backend, which looks as
    fast as its last completed answer and keeps attracting attempts (the
    "slow attempts" column: attempts the slow backend received while slow).

2. Retry budget
    11 backends (latency as above), 1 or all 11 failing every call after
    1 ms, ``max_attempts`` 4, 1000 requests/s: attempts per request with and
    without a 20% + 10/s budget (a retry goes back through the balance).

3. Zones (:func:`poise.zone_plan`, Envoy's rule)
    3 zones, callers equal in each. Expected load per instance is computed
    exactly from the plans (callers in zone ``c`` send ``1/3`` of the
    traffic, ``plan(c).shares[z] / n[z]`` of it to each instance of ``z``)
    and checked by routing 300,000 simulated requests with
    ``ZonePlan.pick`` then a uniform pick in the zone.

4. Deterministic subsetting (:func:`poise.subset`)
    300 clients x 1,000 backends, subset 20, beside the SRE book's
    deterministic subsetting (shuffled rounds) and Finagle's deterministic
    aperture (a ring of clients over a ring of backends, partly overlapped
    backends weighted by their overlap), all on the same backends in the
    same ring order. Connection counts per backend, expected load per
    backend (each client spreads one unit of load over its subset by the
    algorithm's weights) and the churn when one backend leaves, one joins
    and one client joins: connections opened and closed by the clients that
    were already there (the departed backend's own connections are not
    counted as closed: no algorithm can keep them).

Run: ``python -m benchmarks.balancing_beyond [--smoke] [--seed S]``
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
import trio.testing

from benchmarks._sim import load_average, nearest_rank, open_loop, run_virtual
from poise import (
    Balance,
    CallDeclined,
    Endpoint,
    Hedging,
    LatencyWindow,
    PeakEwma,
    PowerOfTwoChoices,
    RetryBudget,
    hedged_call,
    ring_order,
    service_fn,
    subset,
    zone_plan,
)

BACKENDS = 11
LATENCY = (0.150, 0.184)
RATE = 1000.0
DURATION = 60.0
SLOW = (15.0, 45.0, 2.0)  # from, to, latency (seconds)
HEDGE_PERCENTILE = 0.95
BUDGET_PERCENT = 0.2
BUDGET_MIN_PER_SECOND = 10.0
MAX_ATTEMPTS = 4
FAIL_LATENCY = 0.001
QUANTILES = (0.50, 0.99, 0.999, 0.9999)
TARGET_P9999_MS = 400.0
TARGET_EXTRA = 0.05
TARGET_ATTEMPTS = 1.21


def _align(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return out


# -- 1. hedging -------------------------------------------------------------------------


@dataclass
class HedgeResult:
    name: str
    quantiles: dict[float, float]  # ms
    requests: int
    attempts: int
    slow_attempts: int  # attempts the slow backend received in its slow window
    hedge_wins: int
    refused: int
    wall_seconds: float

    @property
    def extra_share(self) -> float:
        return (self.attempts - self.requests) / self.requests


def run_hedge(
    name: str,
    *,
    hedge: bool,
    cancel_evidence: bool,
    rate: float,
    duration: float,
    seed: int,
) -> HedgeResult:
    rng = random.Random(seed)
    scale = duration / DURATION
    slow_from, slow_to, slow_latency = SLOW[0] * scale, SLOW[1] * scale, SLOW[2]
    slow_attempts = 0
    attempts = 0

    # Backends the attempts of each request went to: a hedge declines them
    # (nothing sent, no evidence) and the balance picks again, as nadisc's
    # transport skips the instances a call already tried.
    used: dict[int, set[int]] = {}

    def endpoint(index: int) -> Endpoint[tuple[int, int], int]:
        async def serve(request: tuple[int, int]) -> int:
            nonlocal slow_attempts, attempts
            n, k = request
            taken = used.setdefault(n, set())
            if k and index in taken and len(taken) < BACKENDS:
                raise CallDeclined("a hedge goes to another backend")
            taken.add(index)
            attempts += 1
            now = trio.current_time()
            if index == 0 and slow_from <= now < slow_to:
                slow_attempts += 1
                await trio.sleep(slow_latency)
            else:
                await trio.sleep(rng.uniform(*LATENCY))
            return index

        tracker = PeakEwma(cancel_evidence=cancel_evidence)
        return Endpoint(index, service_fn(serve), tracker=tracker)

    hedging = (
        Hedging(percentile=HEDGE_PERCENTILE, max_extra=1, window=LatencyWindow(1000, 10.0))
        if hedge
        else None
    )
    budget = RetryBudget(BUDGET_PERCENT, BUDGET_MIN_PER_SECOND)
    latencies: list[float] = []

    async def main() -> None:
        balance: Balance[tuple[int, int], int] = Balance(
            PowerOfTwoChoices(random.Random(seed + 1)), [endpoint(i) for i in range(BACKENDS)]
        )

        async def one(n: int) -> None:
            sent = trio.current_time()
            budget.deposit(sent)

            async def attempt(k: int) -> int:
                while True:
                    try:
                        return await balance.dispatch((n, k))
                    except CallDeclined:
                        continue

            await hedged_call(attempt, hedging, idempotent=True, budget=budget)
            latencies.append(trio.current_time() - sent)
            del used[n]

        await open_loop(rng, rate, duration, one)

    wall = run_virtual(main)
    latencies.sort()
    return HedgeResult(
        name=name,
        quantiles={q: nearest_rank(latencies, q) * 1e3 for q in QUANTILES},
        requests=len(latencies),
        attempts=attempts,
        slow_attempts=slow_attempts,
        hedge_wins=0 if hedging is None else hedging.wins,
        refused=0 if hedging is None else hedging.refused,
        wall_seconds=wall,
    )


def run_hedge_all(rate: float, duration: float, seed: int) -> list[HedgeResult]:
    return [
        run_hedge(
            "P2C peak-EWMA, no hedge",
            hedge=False,
            cancel_evidence=True,
            rate=rate,
            duration=duration,
            seed=seed,
        ),
        run_hedge(
            "hedge at p95, loser's time is evidence",
            hedge=True,
            cancel_evidence=True,
            rate=rate,
            duration=duration,
            seed=seed,
        ),
        run_hedge(
            "hedge at p95, cancel is no evidence",
            hedge=True,
            cancel_evidence=False,
            rate=rate,
            duration=duration,
            seed=seed,
        ),
    ]


def format_hedge(results: list[HedgeResult], rate: float, duration: float) -> str:
    rows: list[tuple[str, ...]] = [
        (
            "policy",
            *(f"p{q * 100:g}" for q in QUANTILES),
            "extra attempts",
            "hedge wins",
            "slow attempts",
            "wall s",
        )
    ]
    for r in results:
        rows.append(
            (
                r.name,
                *(f"{r.quantiles[q]:.1f}" for q in QUANTILES),
                f"{r.extra_share * 100:.2f}%",
                f"{r.hedge_wins}",
                f"{r.slow_attempts}",
                f"{r.wall_seconds:.1f}",
            )
        )
    scale = duration / DURATION
    note = (
        f"latencies in ms; {BACKENDS} backends in {LATENCY[0] * 1e3:g}-{LATENCY[1] * 1e3:g} ms, "
        f"{rate:g} req/s for {duration:g} s, one at {SLOW[2]:g} s from t={SLOW[0] * scale:g} s "
        f"to t={SLOW[1] * scale:g} s; hedge budget {BUDGET_PERCENT:.0%} + "
        f"{BUDGET_MIN_PER_SECOND:g}/s; target p99.99 <= {TARGET_P9999_MS:g} ms with <= "
        f"{TARGET_EXTRA:.0%} extra attempts (virtual clock; wall s under {load_average()})"
    )
    return "\n".join([*_align(rows), note])


# -- 2. retry budget ----------------------------------------------------------------------


@dataclass
class BudgetResult:
    name: str
    failing: int
    budgeted: bool
    requests: int
    attempts: int
    failed_requests: int
    refused: int

    @property
    def per_request(self) -> float:
        return self.attempts / self.requests


class _Failed(Exception):
    pass


def run_budget(
    *, failing: int, budgeted: bool, rate: float, duration: float, seed: int
) -> BudgetResult:
    rng = random.Random(seed)
    attempts = 0
    failed_requests = 0

    def endpoint(index: int) -> Endpoint[int, int]:
        async def serve(request: int) -> int:
            nonlocal attempts
            attempts += 1
            if index < failing:
                await trio.sleep(FAIL_LATENCY)
                raise _Failed(index)
            await trio.sleep(rng.uniform(*LATENCY))
            return index

        return Endpoint(index, service_fn(serve), tracker=PeakEwma())

    budget = RetryBudget(BUDGET_PERCENT, BUDGET_MIN_PER_SECOND)
    requests = 0

    async def main() -> None:
        nonlocal requests
        balance: Balance[int, int] = Balance(
            PowerOfTwoChoices(random.Random(seed + 1)), [endpoint(i) for i in range(BACKENDS)]
        )

        async def one(n: int) -> None:
            nonlocal failed_requests
            budget.deposit(trio.current_time())
            for tried in range(1, MAX_ATTEMPTS + 1):
                try:
                    await balance.dispatch(n)
                    return
                except Exception:
                    if tried == MAX_ATTEMPTS:
                        break
                    if budgeted and not budget.try_withdraw(trio.current_time()):
                        break
            failed_requests += 1

        requests = await open_loop(rng, rate, duration, one)

    run_virtual(main)
    name = f"{failing} of {BACKENDS} failing, " + ("budget" if budgeted else "no budget")
    return BudgetResult(
        name, failing, budgeted, requests, attempts, failed_requests, budget.refusals
    )


def run_budget_all(rate: float, duration: float, seed: int) -> list[BudgetResult]:
    return [
        run_budget(failing=failing, budgeted=budgeted, rate=rate, duration=duration, seed=seed)
        for failing in (1, BACKENDS)
        for budgeted in (False, True)
    ]


def format_budget(results: list[BudgetResult], rate: float, duration: float) -> str:
    rows: list[tuple[str, ...]] = [
        ("case", "requests", "attempts/request", "failed requests", "refused retries")
    ]
    for r in results:
        rows.append(
            (
                r.name,
                f"{r.requests}",
                f"{r.per_request:.4f}",
                f"{r.failed_requests / r.requests:.1%}",
                f"{r.refused}",
            )
        )
    note = (
        f"max_attempts {MAX_ATTEMPTS}, budget {BUDGET_PERCENT:.0%} + {BUDGET_MIN_PER_SECOND:g}/s, "
        f"failing backends answer an error in {FAIL_LATENCY * 1e3:g} ms; {rate:g} req/s for "
        f"{duration:g} s (virtual clock); target <= {TARGET_ATTEMPTS} attempts/request; "
        f"the budget's bound is 1 + {BUDGET_PERCENT:g} + {BUDGET_MIN_PER_SECOND:g} x seconds / "
        "requests (1.21 at exactly 1000 req/s)"
    )
    return "\n".join([*_align(rows), note])


# -- 3. zones -----------------------------------------------------------------------------


@dataclass
class ZoneResult:
    name: str
    counts: dict[str, int]
    in_zone: float  # share of the first zone's callers' requests that stay in it
    busiest: float  # busiest instance / mean, zone-aware (exact)
    stay_local: float  # busiest / mean if every caller stayed in its zone
    simulated: float  # busiest / mean from simulated requests
    fleet_in_zone: float  # share of all requests that stay in their caller's zone


ZONES = ("a", "b", "c")


def run_zone_case(name: str, counts: dict[str, int], requests: int, seed: int) -> ZoneResult:
    plans = {zone: zone_plan(zone, counts) for zone in ZONES}
    instances = sum(counts.values())
    mean = 1.0 / instances
    caller = 1.0 / len(ZONES)
    per_instance = {
        z: sum(caller * plans[c].weight(z, counts[z]) for c in ZONES) for z in ZONES if counts[z]
    }
    busiest = max(per_instance.values()) / mean
    local_only = max(caller / counts[z] for z in ZONES if counts[z]) / mean
    rng = random.Random(seed)
    hits: dict[tuple[str, int], int] = {}
    stayed = 0
    for _ in range(requests):
        home = ZONES[rng.randrange(len(ZONES))]
        zone = plans[home].pick(rng.random())
        stayed += zone == home
        key = (zone, rng.randrange(counts[zone]))
        hits[key] = hits.get(key, 0) + 1
    simulated = max(hits.values()) / (requests / instances)
    return ZoneResult(
        name,
        dict(counts),
        plans["a"].local_share,
        busiest,
        local_only,
        simulated,
        stayed / requests,
    )


def run_zones(requests: int, seed: int) -> tuple[list[ZoneResult], list[ZoneResult]]:
    cases = [
        run_zone_case("equal capacity (3/3/3)", {"a": 3, "b": 3, "c": 3}, requests, seed),
        run_zone_case("zone a loses 2 of 3 (1/3/3)", {"a": 1, "b": 3, "c": 3}, requests, seed),
    ]
    curve = [
        run_zone_case(f"a={a}", {"a": a, "b": 29, "c": 29}, requests, seed)
        for a in (29, 20, 14, 10, 7, 5, 3, 2)
    ]
    return cases, curve


def format_zones(cases: list[ZoneResult], curve: list[ZoneResult], requests: int) -> str:
    head = (
        "case",
        "a share",
        "in-zone (a callers)",
        "in-zone (fleet)",
        "busiest/mean",
        "simulated",
        "stay-local busiest/mean",
    )
    rows: list[tuple[str, ...]] = [head]
    for r in [*cases, *curve]:
        share = r.counts["a"] / sum(r.counts.values())
        rows.append(
            (
                r.name,
                f"1/{1 / share:.1f}",
                f"{r.in_zone:.1%}",
                f"{r.fleet_in_zone:.1%}",
                f"{r.busiest:.3f}",
                f"{r.simulated:.3f}",
                f"{r.stay_local:.2f}",
            )
        )
    lines = _align(rows)
    lines.insert(1 + len(cases), "curve: b = c = 29 instances, zone a shrinking")
    note = (
        f"callers equal in each zone; busiest/mean exact from the plans, 'simulated' from "
        f"{requests:,} routed requests; target: >= 99% in-zone at equal capacity, "
        "busiest <= 1.1x mean and about 43% in-zone when zone a loses 2 of 3"
    )
    return "\n".join([*lines, note])


# -- 4. subsetting ------------------------------------------------------------------------

Assignment = dict[int, dict[str, float]]  # client -> backend -> load weight


def poise_subsets(backends: Sequence[str], clients: int, size: int) -> Assignment:
    out: Assignment = {}
    for client in range(clients):
        chosen = subset(backends, client, size)
        out[client] = dict.fromkeys(chosen, 1.0 / len(chosen))
    return out


def sre_subsets(backends: Sequence[str], clients: int, size: int) -> Assignment:
    """The SRE book's rule: rounds of ``M // size`` clients, each round a seeded shuffle."""
    ordered = ring_order(backends)
    count = max(1, len(ordered) // size)
    out: Assignment = {}
    shuffled: dict[int, list[str]] = {}
    for client in range(clients):
        round_ = client // count
        if round_ not in shuffled:
            order = list(ordered)
            random.Random(round_).shuffle(order)
            shuffled[round_] = order
        start = (client % count) * size
        chosen = shuffled[round_][start : start + size]
        out[client] = dict.fromkeys(chosen, 1.0 / len(chosen))
    return out


def aperture_subsets(backends: Sequence[str], clients: int, size: int) -> Assignment:
    """Finagle's deterministic aperture: client ``i`` covers ``[i/N, i/N + w)`` of the ring.

    Backend ``j`` owns ``[j/M, (j+1)/M)``; ``w = max(size/M, 1/N)``; a client
    connects to every backend its range overlaps and loads it by the overlap.
    """
    ordered = ring_order(backends)
    members = len(ordered)
    width = max(size / members, 1.0 / clients)
    out: Assignment = {}
    for client in range(clients):
        low = client / clients
        high = low + width
        weights: dict[str, float] = {}
        first = math.floor(low * members)
        last = math.ceil(high * members)
        for j in range(first, last):
            overlap = min(high, (j + 1) / members) - max(low, j / members)
            if overlap > 1e-12:
                key = ordered[j % members]
                weights[key] = weights.get(key, 0.0) + overlap / width
        out[client] = weights
    return out


@dataclass
class SubsetResult:
    name: str
    connections: int
    min_conn: int
    max_conn: int
    mean_conn: float
    load_low: float  # min load / mean load
    load_high: float
    churn: dict[str, tuple[float, float]]  # event -> mean (opened, closed) by existing clients


def _spread(assignment: Assignment, backends: Sequence[str]) -> tuple[list[int], list[float]]:
    conns = dict.fromkeys(backends, 0)
    load = dict.fromkeys(backends, 0.0)
    for weights in assignment.values():
        for key, weight in weights.items():
            conns[key] += 1
            load[key] += weight
    return list(conns.values()), list(load.values())


def _churn(before: Assignment, after: Assignment, gone: str | None) -> tuple[int, int]:
    opened = closed = 0
    for client, old in before.items():
        new = set(after[client])
        kept = set(old) - ({gone} if gone else set())
        opened += len(new - kept)
        closed += len(kept - new)
    return opened, closed


def run_subsets(
    clients: int, members: int, size: int, seed: int, events: int = 32
) -> tuple[list[SubsetResult], dict[str, float]]:
    """Churn is the mean over ``events`` random leaves and joins (one each time)."""
    rng = random.Random(seed)
    backends = [f"10.{i // 250}.{i % 250}.{rng.randrange(1, 250)}:8080" for i in range(members)]
    leaving = [backends[i] for i in rng.sample(range(members), events)]
    joining = [f"10.99.{n}.{rng.randrange(1, 250)}:8080" for n in range(events)]
    algorithms: list[tuple[str, Callable[[Sequence[str], int, int], Assignment]]] = [
        ("poise.subset", poise_subsets),
        ("SRE deterministic subsetting", sre_subsets),
        ("Finagle deterministic aperture", aperture_subsets),
    ]

    def mean(pairs: list[tuple[int, int]]) -> tuple[float, float]:
        return (
            sum(p[0] for p in pairs) / len(pairs),
            sum(p[1] for p in pairs) / len(pairs),
        )

    results = []
    for name, algorithm in algorithms:
        base = algorithm(backends, clients, size)
        conns, load = _spread(base, backends)
        mean_load = sum(load) / len(load)
        leaves = [
            _churn(base, algorithm([b for b in backends if b != gone], clients, size), gone)
            for gone in leaving
        ]
        joins = [_churn(base, algorithm([*backends, new], clients, size), None) for new in joining]
        churn = {
            "backend leaves": mean(leaves),
            "backend joins": mean(joins),
            "client joins": mean([_churn(base, algorithm(backends, clients + 1, size), None)]),
        }
        results.append(
            SubsetResult(
                name,
                sum(conns),
                min(conns),
                max(conns),
                sum(conns) / len(conns),
                min(load) / mean_load,
                max(load) / mean_load,
                churn,
            )
        )
    minimum = {
        # The departed backend's clients must each open one; a newcomer must get
        # its mean share; a joining client's own connections are not counted.
        "backend leaves": clients * size / members,
        "backend joins": clients * size / (members + 1),
        "client joins": 0.0,
    }
    return results, minimum


def format_subsets(
    results: list[SubsetResult], minimum: dict[str, float], clients: int, members: int, size: int
) -> str:
    events = list(minimum)
    rows: list[tuple[str, ...]] = [
        (
            "algorithm",
            "connections",
            "per backend min/mean/max",
            "load min..max / mean",
            *(f"{e} (open+close)" for e in events),
        )
    ]
    for r in results:
        rows.append(
            (
                r.name,
                f"{r.connections}",
                f"{r.min_conn}/{r.mean_conn:.2f}/{r.max_conn}",
                f"{r.load_low:.3f}..{r.load_high:.3f}",
                *(f"{r.churn[e][0]:.1f}+{r.churn[e][1]:.1f}" for e in events),
            )
        )
    rows.append(("least possible", "", "", "", *(f"~{minimum[e]:.0f} opened" for e in events)))
    note = (
        f"{clients} clients x {members} backends, subset {size} (full mesh: "
        f"{clients * members:,} connections); churn counts the connections opened and closed "
        "by the clients already there, mean of 32 random leaves and 32 random joins; target: "
        "every backend within +-1 of the mean, load within +-5%, churn no worse than the aperture"
    )
    return "\n".join([*_align(rows), note])


# -- main ---------------------------------------------------------------------------------


@dataclass
class AllResults:
    hedge: list[HedgeResult]
    budget: list[BudgetResult]
    zones: list[ZoneResult]
    curve: list[ZoneResult]
    subsets: list[SubsetResult]
    subset_minimum: dict[str, float]


def main(argv: list[str] | None = None) -> AllResults:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="a short run of every table")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    seed = args.seed
    rate, duration = (200.0, 6.0) if args.smoke else (RATE, DURATION)
    print(load_average())
    hedge = run_hedge_all(rate, duration, seed)
    print("Hedged requests on Linkerd's experiment")
    print(format_hedge(hedge, rate, duration))
    b_rate, b_duration = (200.0, 3.0) if args.smoke else (RATE, DURATION)
    budget = run_budget_all(b_rate, b_duration, seed)
    print()
    print("Retry budget")
    print(format_budget(budget, b_rate, b_duration))
    z_requests = 20_000 if args.smoke else 300_000
    zones, curve = run_zones(z_requests, seed)
    print()
    print("Zone-aware routing (3 zones)")
    print(format_zones(zones, curve, z_requests))
    clients, members, size = (60, 200, 20) if args.smoke else (300, 1000, 20)
    subsets, minimum = run_subsets(clients, members, size, seed)
    print()
    print("Deterministic subsetting")
    print(format_subsets(subsets, minimum, clients, members, size))
    print(load_average())
    return AllResults(hedge, budget, zones, curve, subsets, minimum)


if __name__ == "__main__":
    main()
