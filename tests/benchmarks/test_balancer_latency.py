"""Smoke run of the balancer latency benchmark (real Balance, trio virtual clock)."""

from __future__ import annotations

import pytest

from benchmarks import balancer_latency


def test_smoke_run_prints_the_table_and_orders_the_policies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = balancer_latency.main(["--smoke"])
    out = capsys.readouterr().out
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
    assert balancer_latency.nearest_rank(values, 0.5) == 50.0
    assert balancer_latency.nearest_rank(values, 0.99) == 99.0
    assert balancer_latency.nearest_rank(values, 0.999) == 100.0
    assert balancer_latency.nearest_rank([7.0], 0.5) == 7.0
