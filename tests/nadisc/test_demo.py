"""The demo in a reduced mode: it runs, prints a table, and its invariants hold."""

from __future__ import annotations

import pytest

from nadisc import demo


def test_reduced_demo_keeps_its_invariants(capsys: pytest.CaptureFixture[str]) -> None:
    requests = 160
    result = demo.main(requests=requests, concurrency=8)
    out = capsys.readouterr().out
    assert "MemoryProvider" in out and "p99 ms" in out and "delta after drain" in out
    assert [run.strategy for run in result.runs] == list(demo.STRATEGIES)
    names = [name for name, _, _ in demo.BACKENDS]
    for run in result.runs:
        # No request failed, each reached exactly one backend, and nothing was
        # handed to the drained backend after the drain.
        assert run.errors == 0
        assert run.sent_after_drain == 0
        assert sum(run.per_backend.values()) == requests == len(run.latencies)
        assert set(run.per_backend) == set(names)
        assert 0 < run.p50 <= run.p99
        row = next(line for line in out.splitlines() if line.startswith(run.strategy + " "))
        cells = row[len(run.strategy) :].split()
        assert cells[: len(names)] == [str(run.per_backend[n]) for n in names]
        assert cells[len(names)] == "0"
    rr, weighted, _p2c = result.runs
    # Before the drain the drained backend took its share; round robin shares
    # evenly, and the weighted strategy gives alpha (weight 2) the most.
    assert rr.per_backend[demo.DRAINED] > 0
    assert max(weighted.per_backend, key=lambda n: weighted.per_backend[n]) == "alpha"
