"""Smoke run of the balancer latency benchmark (real Balance, trio virtual clock)."""

from __future__ import annotations

import contextlib
import io

import pytest

from benchmarks import _sim, balancer_latency


@pytest.fixture(scope="module")
def smoke() -> tuple[balancer_latency.AllResults, str]:
    """One smoke run shared by the tests of this module (it takes seconds)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        everything = balancer_latency.main(["--smoke"])
    return everything, buffer.getvalue()


def test_smoke_run_prints_the_table_and_orders_the_policies(
    smoke: tuple[balancer_latency.AllResults, str],
) -> None:
    everything, out = smoke
    results = everything.tower
    by_name = {r.name: r for r in results}
    assert set(by_name) == {
        "round robin",
        "P2C least loaded",
        "P2C peak-EWMA",
        "P2C peak-EWMA classic",
    }
    for name in by_name:
        assert name in out
    assert "Tower p99" in out
    for r in results:
        assert r.requests == balancer_latency.SMOKE_REQUESTS
        values = [r.quantiles[q] for q in balancer_latency.QUANTILES]
        assert values == sorted(values)  # quantiles are monotone
        assert values[0] >= 0.0 and values[-1] < 1000.0
        assert abs(sum(r.shares) - 1.0) < 1e-9
    rr, ewma = by_name["round robin"], by_name["P2C peak-EWMA"]
    # Round robin sends a tenth of the traffic to the 1 s endpoint; peak EWMA
    # learns to avoid it, which is what cuts its p99 by an order of magnitude.
    assert rr.slowest_share == pytest.approx(0.1)
    assert ewma.slowest_share < 0.02
    assert ewma.quantiles[0.99] < rr.quantiles[0.99] / 5


def test_nearest_rank_quantiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert _sim.nearest_rank(values, 0.5) == 50.0
    assert _sim.nearest_rank(values, 0.99) == 99.0
    assert _sim.nearest_rank(values, 0.999) == 100.0
    assert _sim.nearest_rank([7.0], 0.5) == 7.0


def test_smoke_run_prints_the_linkerd_and_outlier_tables(
    smoke: tuple[balancer_latency.AllResults, str],
) -> None:
    everything, out = smoke
    assert "Linkerd's experiment" in out and "Outlier ejection" in out
    linkerd = {r.name: r for r in everything.linkerd}
    assert set(linkerd) == {
        "round robin",
        "P2C least loaded",
        "P2C peak-EWMA",
        "P2C peak-EWMA classic",
    }
    rr, ewma = linkerd["round robin"], linkerd["P2C peak-EWMA"]
    assert ewma.requests > 1000
    # Round robin keeps sending its share to the 2 s backend; peak EWMA does not.
    assert rr.slow_share > 5 * ewma.slow_share
    assert ewma.quantiles[0.99] < 200.0
    outlier = {(r.name, r.detector): r for r in everything.outlier}
    assert len(outlier) == 4
    # Least loaded floods the fast-failing backend; the detector ejects it.
    off, on = outlier[("P2C least loaded", False)], outlier[("P2C least loaded", True)]
    assert off.error_share > 0.05 and on.ejections >= 1
    assert on.error_share < off.error_share / 5
    assert all(r.requests > 250 for r in everything.outlier)
