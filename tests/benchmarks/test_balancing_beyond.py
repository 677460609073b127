"""Smoke run of benchmarks/balancing_beyond.py: every table prints and orders as it should."""

from __future__ import annotations

import contextlib
import io

import pytest

from benchmarks import balancing_beyond


@pytest.fixture(scope="module")
def smoke() -> tuple[balancing_beyond.AllResults, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        results = balancing_beyond.main(["--smoke"])
    return results, buffer.getvalue()


def test_tables_print(smoke: tuple[balancing_beyond.AllResults, str]) -> None:
    _, out = smoke
    for title in (
        "Hedged requests",
        "Retry budget",
        "Zone-aware routing",
        "Deterministic subsetting",
        "SRE deterministic subsetting",
        "Finagle deterministic aperture",
        "load average",
    ):
        assert title in out


def test_hedging_cuts_the_slow_backends_tail(
    smoke: tuple[balancing_beyond.AllResults, str],
) -> None:
    plain, hedged, _ = smoke[0].hedge
    assert plain.quantiles[0.9999] >= 1900.0  # the 2 s backend sets the plain tail
    assert hedged.quantiles[0.9999] < 500.0
    assert 0.0 < hedged.extra_share < 0.1
    assert plain.extra_share == 0.0


def test_the_budget_bounds_attempts_when_everything_fails(
    smoke: tuple[balancing_beyond.AllResults, str],
) -> None:
    by_case = {(r.failing, r.budgeted): r for r in smoke[0].budget}
    assert by_case[(11, False)].per_request == 4.0
    rate, duration = 200.0, 3.0  # the smoke run's load
    bound = 1 + 0.2 + 10.0 * duration / by_case[(11, True)].requests
    assert by_case[(11, True)].per_request <= bound + 1e-9
    assert by_case[(11, True)].refused > 0
    assert rate * duration / 2 < by_case[(11, True)].requests < rate * duration * 2


def test_zones_stay_local_and_spill_evenly(
    smoke: tuple[balancing_beyond.AllResults, str],
) -> None:
    equal, lost = smoke[0].zones
    assert equal.in_zone >= 0.99
    assert lost.in_zone == pytest.approx(3 / 7)
    assert lost.busiest <= 1.1 < lost.stay_local
    shares = [r.in_zone for r in smoke[0].curve]
    assert shares == sorted(shares, reverse=True)


def test_subsets_are_even_and_move_no_more_than_the_aperture(
    smoke: tuple[balancing_beyond.AllResults, str],
) -> None:
    ours, sre, aperture = smoke[0].subsets
    assert ours.max_conn - ours.mean_conn <= 1 and ours.mean_conn - ours.min_conn <= 1
    assert 0.95 <= ours.load_low <= ours.load_high <= 1.05
    for event in ("backend leaves", "backend joins"):
        assert sum(ours.churn[event]) < sum(sre.churn[event]) / 5
        # Fewer connections moved in all than the aperture (it closes fewer).
        assert sum(ours.churn[event]) < sum(aperture.churn[event])
    # A client's subset depends on its index alone: a joining client moves nobody.
    assert ours.churn["client joins"] == (0.0, 0.0)
    assert aperture.churn["client joins"][0] > 0
