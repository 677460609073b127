"""Every comparison of real elapsed time in tests/, reviewed.

The machines the suite runs on are shared and their speed drifts by 2x or
more, so a test on the real clock may compare elapsed time only where the
comparison cannot fail for that reason:

* ``upper``: a bound at least 10x what the test measures here (the measured
  value is recorded beside it);
* ``lower``: a bound that the code's own timers or sleeps guarantee (a timer
  cannot fire before its deadline on the clock that reads it, and slowness
  only lengthens what is measured);
* ``order``: two readings of the same clock whose order follows from cause
  and effect, or a rate that grows with the time it is measured over.

Tests on trio's virtual clock (the ``autojump_clock``/``mock_clock``
fixtures, or ``trio.run(..., clock=MockClock(...))``) are not listed: their
time moves only when every task waits.

:data:`REVIEWED` is that list. :func:`test_every_real_clock_comparison_is_reviewed`
finds the comparisons in tests/ by reading the source (a name assigned from a
clock reading, or a clock read inside the comparison) and fails on one that
is not listed, on a listed one that is gone, and on an upper bound closer
than 10x to what it measured. The benchmark smoke runs' ratio bounds are
listed too (they compare measured results, which the scan cannot see).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_CLOCK = re.compile(
    r"current_time\(|monotonic\(|perf_counter\(|time\.time\(|\.elapsed\b|_seconds\b|loop\.time\("
)
#: Names that hold a duration by this suite's convention, wherever they come from.
_DURATION_NAMES = re.compile(r"^(elapsed|took|waited|latency|seen_after)$")
_DURATION_WORDS = re.compile(r"\b(elapsed|took|waited|latency|seen_after)\b")
_VIRTUAL_FIXTURES = {"autojump_clock", "mock_clock"}


@dataclass(frozen=True)
class Bound:
    kind: str  # "upper", "lower" or "order"
    measured: float | None  # seconds (or the ratio, for benchmark rows)
    bound: float | None
    why: str


#: (file under tests/, test function, the assertion's text with its white
#: space folded) -> what was measured and why the bound holds.
REVIEWED: dict[tuple[str, str, str], Bound] = {
    (
        "fakes/test_consul_fake.py",
        "test_served_on_loopback_with_transport_faults",
        "assert anyio.current_time() - start >= 0.1",
    ): Bound(
        "lower", 0.16, 0.1, "at least 7 of the fake's 8 sleeps of 20 ms precede the last byte"
    ),
    (
        "hosting/test_host_registries.py",
        "test_shutdown_deregisters_first_then_drains_in_flight_requests",
        'assert results["gone"] < results["slow"][1]',
    ): Bound(
        "order", 0.05, 1.5, "the record goes at shutdown, the answer after the handler's 1.5 s"
    ),
    (
        "hosting/test_host_registries.py",
        "test_shutdown_deregisters_first_then_drains_in_flight_requests",
        "assert report.deregistered_at + report.drain_seconds >= arrived + 1.5",
    ): Bound("lower", None, 1.5, "the drain waits out the handler's own 1.5 s sleep"),
    (
        "hosting/test_units.py",
        "test_a_drain_past_its_budget_is_cut_and_warned",
        "assert report.drain_seconds < 3.0",
    ): Bound("upper", 0.25, 3.0, "cut at the 0.2 s budget; the stuck request would take 5 s"),
    (
        "nadisc/dns/test_dns_owner.py",
        "test_the_record_ttl_paces_the_refresh_not_the_poll_interval",
        "assert anyio.current_time() - start < 12.0",
    ): Bound("upper", 1.1, 12.0, "the 1 s TTL paces it; the poll interval is 30 s"),
    (
        "nadisc/dns/test_dns_unit.py",
        "test_unreachable_nameserver_is_incomplete_within_the_deadline",
        "assert anyio.current_time() - start < 1.5",
    ): Bound("upper", 0.10, 1.5, "the 0.1 s deadline; the request timeout would be 3 s"),
    (
        "nadisc/test_calling_budget.py",
        "test_httpx_pool_carries_the_budget_in_its_timeouts",
        "assert 0.3 <= elapsed < 4.0",
    ): Bound("upper", 0.30, 4.0, "the 0.3 s httpx timeout (a lower bound it guarantees); 30 s"),
    (
        "nadisc/test_calling_budget.py",
        "test_rest_client_budget_covers_the_body_over_httpx_pool",
        'assert error.limit == "httpx timeout" and 0.3 <= elapsed < 4.0',
    ): Bound("upper", 0.30, 4.0, "the 0.3 s budget; the whole body takes 9 s"),
    (
        "nadisc/test_rest.py",
        "test_the_budget_covers_reading_the_body",
        "assert anyio.current_time() - started < 5.0",
    ): Bound("upper", 0.41, 5.0, "the 0.4 s budget; the whole body takes 15 s"),
    (
        "nadisc/test_rest_verbs.py",
        "test_a_direct_call_looks_like_an_httpx_one",
        "assert response.elapsed.total_seconds() >= 0",
    ): Bound("order", None, 0.0, "a duration is never negative"),
    (
        "nadisc/test_transport.py",
        "test_retries_share_one_budget",
        "assert 0.6 <= elapsed < 7.0",
    ): Bound("upper", 0.65, 7.0, "the shared 0.6 s budget; 16 attempts would take 9.6 s"),
    (
        "nadisc/test_transport.py",
        "test_retries_on_a_single_dead_instance_stop_at_max_attempts",
        "assert anyio.current_time() - started < 1.5",
    ): Bound("upper", 0.06, 1.5, "three refused connects; the request timeout is 3 s"),
    (
        "nadisc/test_transport.py",
        "test_retryable_status_from_the_only_instance_is_returned_after_max_attempts",
        "assert anyio.current_time() - started < 1.0",
    ): Bound("upper", 0.05, 1.0, "two quick 503s; the budget is 2 s"),
    (
        "observability/test_console_browser.py",
        "test_the_page_shows_a_registered_instance_within_a_second",
        "assert latency < 1.0",
    ): Bound("upper", 0.073, 1.0, "registry write to the page over the console's WebSocket"),
    (
        "providers/consul/test_catalog.py",
        "test_peer_recovery_is_seen_within_one_round_trip_without_topology_change",
        "assert elapsed < 1.0",
    ): Bound("upper", 0.009, 1.0, "one blocking round trip; a missed wake-up waits 30 s"),
    (
        "providers/consul/test_catalog_owner.py",
        "test_catalog_of_an_entry_point_provider_over_loopback_sees_recovery_quickly",
        "assert anyio.current_time() - start < 1.0",
    ): Bound("upper", 0.028, 1.0, "one blocking round trip; a missed wake-up waits 30 s"),
    (
        "providers/etcd/test_etcd_provider.py",
        "test_a_stopped_server_is_incomplete_then_recovers",
        "assert anyio.current_time() - began < 6.0",
    ): Bound("upper", 0.50, 6.0, "the 0.5 s request timeout; the deadline is 10 s"),
    (
        "providers/etcd/test_owner_discovery.py",
        "test_open_discovery_loads_etcd_by_name_and_sees_each_change_at_once",
        "assert latency < 1.0, latency",
    ): Bound("upper", 0.015, 1.0, "one watch event over loopback"),
    (
        "providers/etcd/test_owner_faults.py",
        "test_a_stopped_server_degrades_within_the_grace_then_goes_stale_then_recovers",
        "assert noticed - confirmed < grace",
    ): Bound("upper", 0.50, 6.0, "the 500 ms probe timeout notices the silence"),
    (
        "providers/etcd/test_owner_faults.py",
        "test_a_stopped_server_degrades_within_the_grace_then_goes_stale_then_recovers",
        "assert before_look < confirmed + grace",
    ): Bound("order", None, None, "a degraded answer is only given before the grace ends"),
    (
        "providers/etcd/test_owner_faults.py",
        "test_a_stopped_server_degrades_within_the_grace_then_goes_stale_then_recovers",
        "assert confirmed + grace <= expired < confirmed + grace + 0.25",
    ): Bound("upper", 0.002, 0.25, "changed() wakes at the window's end (lower bound: its timer)"),
    (
        "providers/etcd/test_owner_scale.py",
        "test_a_400_key_burst_is_seen_in_full_soon_after_the_last_write",
        "assert seen_after < 5.0, seen_after",
    ): Bound("upper", 0.001, 5.0, "the last write's watch event"),
    (
        "providers/nacos/test_owner_anyio.py",
        "test_registration_is_seen_by_another_owner_and_removed_on_close",
        "assert anyio.current_time() - start < 2.5",
    ): Bound("upper", 0.20, 2.5, "one 200 ms poll"),
    (
        "providers/nacos/test_owner_anyio.py",
        "test_token_expiry_relogs_in_once_without_a_gap",
        "assert 2 <= fake.logins <= 2 + int(elapsed)",
    ): Bound("order", None, None, "one login per second of 1 s tokens: grows with the time"),
    (
        "providers/etcd/test_owner_scale.py",
        "test_registrations_share_a_lease_and_a_lost_one_registers_all_again",
        "assert provider.statistics().keepalives - sent <= 3 / 0.25 + 2",
    ): Bound("order", None, None, "keepalives over 3 s: a slower machine sends fewer"),
    (
        "observability/test_watch_tmux.py",
        "test_watch_reconnects_shows_age_redraws_on_resize_and_stops_on_ctrl_c",
        "assert trio.current_time() - restarted <= 12.0",
    ): Bound("upper", 1.1, 12.0, "nadisc watch reconnecting after a console restart"),
    # -- benchmark smoke runs: ratios of results measured in the same run --
    (
        "benchmarks/test_dispatch_overhead.py",
        "test_smoke_run_prints_the_table",
        "assert result.ratio(n) < 18.0, out",
    ): Bound("upper", 1.8, 18.0, "dispatch against the trio hand loop, 100 and 1,000 endpoints"),
    (
        "benchmarks/test_dispatch_scale.py",
        "test_smoke_run_prints_the_table",
        "assert result.worst_ratio < 16.0, out",
    ): Bound("upper", 1.6, 16.0, "the worst pool shape against the hand loop"),
    (
        "benchmarks/test_dispatch_scale.py",
        "test_smoke_run_prints_the_table",
        "assert all(result.busy_to_matched(n) < 15.0 for n in result.sizes), out",
    ): Bound("upper", 1.44, 15.0, "a busy pool against an all-ready one of as many ready"),
    (
        "benchmarks/test_reconcile_scale.py",
        "test_smoke_run_prints_the_table",
        "assert large.equal_us < 50 * max(small.equal_us, 1.0), out",
    ): Bound("upper", 1.8, 50.0, "an equal revision at 1,000 members against 100"),
    (
        "benchmarks/test_reconcile_scale.py",
        "test_smoke_run_prints_the_table",
        "assert large.apply_ms < 60 * small.apply_ms + 5, out",
    ): Bound("upper", 1.85, 60.0, "an apply at 1,000 members against 100"),
    (
        "benchmarks/test_console_fanout.py",
        "test_pages_smoke_run_is_fast_for_every_browser_and_sends_what_changed",
        "assert p99_ms <= 5000.0, out",
    ): Bound("upper", 0.21, 5.0, "change -> Chromium page p99 (ms/1000), the 500 ms goal x10"),
    (
        "benchmarks/test_console_fanout.py",
        "test_pages_smoke_run_is_fast_for_every_browser_and_sends_what_changed",
        "assert max(result.first_render_ms) <= 15_000.0, out",
    ): Bound("upper", 0.45, 15.0, "first render of the page (ms/1000), the 1.5 s goal x10"),
    (
        "benchmarks/test_console_fanout.py",
        "test_pages_smoke_run_is_fast_for_every_browser_and_sends_what_changed",
        "assert result.slow_max_lag_ms <= 10 * console_fanout.PAGES_INTERVAL * 1000, out",
    ): Bound("upper", 0.098, 1.0, "the slow client's sample age when read (ms/1000)"),
    # A lower bound on a ratio is listed as its inverse: 1/ratio < 1/bound.
    (
        "benchmarks/test_transport_throughput.py",
        "test_smoke_run_prints_a_table_per_loop",
        "assert result.memory_ratio > 0.08, out",
    ): Bound("upper", 1 / 0.82, 1 / 0.08, "discovery transport / plain httpx in memory, by CPU"),
    (
        "benchmarks/test_transport_throughput.py",
        "test_smoke_run_prints_a_table_per_loop",
        "assert result.mock_ratio > 0.07, out",
    ): Bound("upper", 1 / 0.78, 1 / 0.07, "discovery transport / plain httpx on MockTransport"),
    (
        "benchmarks/test_transport_throughput.py",
        "test_smoke_run_prints_a_table_per_loop",
        "assert result.loopback_ratio > 0.1, out",
    ): Bound("upper", 1 / 1.04, 10.0, "the same over loopback by wall clock (once 0.27, loaded)"),
    (
        "benchmarks/test_nacos_scale.py",
        "test_nacos_scale_smoke",
        'assert 0 < decoded["unchanged_ratio"] < decoded["careful_ratio"]',
    ): Bound("upper", 0.07 / 0.9, 1.0, "a digest against a careful decode of the same body"),
    (
        "grpc/test_deadline_start.py",
        "test_made_outside_a_scope_started_inside_it_carries_its_deadline",
        "assert sent is not None and 25 < sent <= 30",
    ): Bound("upper", 0.05, 5.0, "grpc-timeout is 30 s less the time to the send (tens of ms)"),
    (
        "grpc/test_deadline_start.py",
        "test_the_call_timeout_still_counts_from_the_call_and_the_earlier_wins",
        "assert first_sent is not None and 25 < first_sent <= 30",
    ): Bound("upper", 0.05, 5.0, "grpc-timeout is 30 s less the time to the send (tens of ms)"),
    (
        "grpc/test_deadline_start.py",
        "test_the_call_timeout_still_counts_from_the_call_and_the_earlier_wins",
        "assert second_sent is not None and 4 < second_sent <= 5",
    ): Bound("upper", 0.05, 1.0, "grpc-timeout is 5 s less the time to the send (tens of ms)"),
    (
        "grpc/test_hosting.py",
        "test_shutdown_goes_not_serving_and_deregisters_then_waits_the_ack_and_grace_then_stops",
        "assert g.stop_at <= g.stopped_at <= report.started_at + report.total_seconds",
    ): Bound("order", 0.51, None, "the stop ends before the shutdown that awaits it ends"),
    (
        "grpc/test_hosting.py",
        "test_shutdown_goes_not_serving_and_deregisters_then_waits_the_ack_and_grace_then_stops",
        "assert g.stopped_at - g.stop_at < 2.5",
    ): Bound("upper", 0.07, 2.5, "the stop once the held stream is released: 3-70 ms"),
    (
        "grpc/test_hosting.py",
        "test_shutdown_goes_not_serving_and_deregisters_then_waits_the_ack_and_grace_then_stops",
        "assert report.deregistered_at - g.not_serving_at >= 0.2",
    ): Bound("lower", 0.201, 0.2, "the registry's own 0.2 s sleep before it acknowledges"),
    (
        "grpc/test_hosting.py",
        "test_shutdown_goes_not_serving_and_deregisters_then_waits_the_ack_and_grace_then_stops",
        "assert report.refusing_at - report.deregistered_at >= 0.3",
    ): Bound("lower", 0.301, 0.3, "the host sleeps until the ack + the 300 ms grace"),
    (
        "grpc/test_hosting.py",
        "test_an_rpc_running_past_the_drain_budget_is_cancelled_and_counted",
        "assert g.stopped_at - g.stop_at >= 0.3",
    ): Bound("lower", 0.304, 0.3, "the listener waits the 0.3 s drain before cancelling"),
}


def _fold(text: str) -> str:
    return " ".join(text.split())


class _Source:
    """A file's text with ``ast.get_source_segment`` in O(length of the node)."""

    def __init__(self, text: str) -> None:
        self.lines = [line.encode() for line in text.splitlines(keepends=True)]

    def __call__(self, node: ast.AST | None) -> str:
        if node is None or not hasattr(node, "end_lineno"):
            return ""
        first: int = node.lineno - 1  # type: ignore[attr-defined]
        last: int = node.end_lineno - 1
        start: int = node.col_offset  # type: ignore[attr-defined]
        end: int = node.end_col_offset  # type: ignore[attr-defined]
        if first == last:
            return self.lines[first][start:end].decode()
        pieces = [self.lines[first][start:], *self.lines[first + 1 : last]]
        return b"".join([*pieces, self.lines[last][:end]]).decode()


def _top_level_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(node)
        elif isinstance(node, ast.ClassDef):
            found.extend(
                n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return found


def _is_virtual(function: ast.FunctionDef | ast.AsyncFunctionDef, source: str) -> bool:
    parameters = {a.arg for a in function.args.args}
    return bool(parameters & _VIRTUAL_FIXTURES) or "MockClock(" in source


def real_clock_comparisons() -> set[tuple[str, str, str]]:
    """(file, function, folded assertion) of every real-clock comparison found."""
    found: set[tuple[str, str, str]] = set()
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text()
        if not (_CLOCK.search(text) or _DURATION_WORDS.search(text)):
            continue  # nothing timed in this file
        segment = _Source(text)
        tree = ast.parse(text)
        for function in _top_level_functions(tree):
            source = segment(function)
            if _is_virtual(function, source):
                continue
            timed: set[str] = set()
            for node in ast.walk(function):
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                    value = segment(node.value)
                    if value and _CLOCK.search(value):
                        timed |= names
                    timed |= {n for n in names if _DURATION_NAMES.match(n)}
            for node in ast.walk(function):
                if not isinstance(node, ast.Assert):
                    continue
                comparisons = [
                    c
                    for c in ast.walk(node.test)
                    if isinstance(c, ast.Compare)
                    and any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in c.ops)
                ]
                if not comparisons:
                    continue
                names = {n.id for c in comparisons for n in ast.walk(c) if isinstance(n, ast.Name)}
                spelled = " ".join(segment(c) for c in comparisons)
                if names & timed or _CLOCK.search(spelled):
                    statement = _fold(segment(node))
                    found.add((path.relative_to(TESTS).as_posix(), function.name, statement))
    return found


def test_every_real_clock_comparison_is_reviewed() -> None:
    found = real_clock_comparisons()
    unlisted = sorted(found - set(REVIEWED))
    assert unlisted == [], (
        "a comparison of real elapsed time: move it to MockClock or to the order of "
        "events, or list it in REVIEWED with what it measures (an upper bound 10x above)"
    )


def test_every_listed_comparison_still_stands_where_it_is_listed() -> None:
    missing = []
    for file, function, statement in REVIEWED:
        text = (TESTS / file).read_text()
        segment = _Source(text)
        bodies = [
            _fold(segment(f)) for f in _top_level_functions(ast.parse(text)) if f.name == function
        ]
        if not any(statement in body for body in bodies):
            missing.append((file, function, statement))
    assert missing == []


def test_every_upper_bound_is_ten_times_what_it_measures() -> None:
    tight = {
        key: entry
        for key, entry in REVIEWED.items()
        if entry.kind == "upper"
        and (entry.measured is None or entry.bound is None or entry.bound < 10 * entry.measured)
    }
    assert tight == {}
    assert {entry.kind for entry in REVIEWED.values()} <= {"upper", "lower", "order"}
