"""The demo in a reduced mode: it runs, prints a table, and its invariants hold."""

from __future__ import annotations

import pytest

from nadisc import demo
from nadisc.testing import MemoryProvider


def test_reduced_demo_keeps_its_invariants(capsys: pytest.CaptureFixture[str]) -> None:
    requests = 160
    result = demo.main(requests=requests, concurrency=8)
    out = capsys.readouterr().out
    assert "MemoryProvider" in out and "p99 ms" in out and "delta after drain" in out
    assert "invariants held" in out and "FAILED" not in out
    assert result.problems == []
    # The rolling restart of hosted instances: no failed request, nothing
    # reached a replaced instance after its deregistration.
    rolling = result.rolling
    assert rolling is not None and rolling.problems == []
    assert rolling.errors == 0 and rolling.requests > 0
    assert rolling.late == {"v0": 0, "v1": 0, "v2": 0}
    assert set(rolling.served) == {f"v{i}" for i in range(6)}
    assert all(count > 0 for count in rolling.served.values()), rolling.served
    assert "rolling restart" in out and "after deregistration" in out
    assert [run.strategy for run in result.runs] == list(demo.STRATEGIES)
    names = [name for name, _, _ in demo.BACKENDS]
    for run in result.runs:
        # No request failed, each reached exactly one backend, and nothing
        # issued after the drain was handed to or arrived at the drained backend.
        assert run.errors == 0
        assert run.sent_after_drain == 0
        assert run.arrived_after_drain == 0
        assert sum(run.per_backend.values()) == requests == len(run.latencies)
        assert set(run.per_backend) == set(names)
        assert 0 < run.p50 <= run.p99
        row = next(line for line in out.splitlines() if line.startswith(run.strategy + " "))
        cells = row[len(run.strategy) :].split()
        assert cells[: len(names)] == [str(run.per_backend[n]) for n in names]
        assert cells[len(names)] == "0"
        assert cells[len(names) + 4] == "0"  # the "after drain" column
    rr, weighted, _p2c = result.runs
    # Before the drain the drained backend took its share; round robin shares
    # evenly, and the weighted strategy gives alpha (weight 2) the most.
    assert rr.per_backend[demo.DRAINED] > 0
    assert max(weighted.per_backend, key=lambda n: weighted.per_backend[n]) == "alpha"


def _record_backends(monkeypatch: pytest.MonkeyPatch) -> list[demo.Backend]:
    made: list[demo.Backend] = []
    real_init = demo.Backend.__init__

    def recording_init(self: demo.Backend, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(demo.Backend, "__init__", recording_init)
    return made


def test_every_request_arrives_once_numbered_as_issued(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = _record_backends(monkeypatch)
    requests = 40
    demo.main(requests=requests, concurrency=4)
    capsys.readouterr()
    assert len(made) == len(demo.BACKENDS) * len(demo.STRATEGIES)
    for start in range(0, len(made), len(demo.BACKENDS)):
        backends = made[start : start + len(demo.BACKENDS)]
        arrived = sorted(n for b in backends for n in b.received)
        assert arrived == list(range(1, requests + 1))


def test_a_drain_that_does_not_happen_fails_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_drain(registry: MemoryProvider, backends: list[demo.Backend]) -> None:
        pass

    monkeypatch.setattr(demo, "_drain", no_drain)
    with pytest.raises(SystemExit) as exited:
        demo.main(requests=40, concurrency=4)
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert f"issued after the drain arrived at {demo.DRAINED}" in out
    assert "FAILED" in out and "invariants held" not in out


def test_failed_requests_fail_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def drain_everything(registry: MemoryProvider, backends: list[demo.Backend]) -> None:
        registry.set(demo.SERVICE, [])

    monkeypatch.setattr(demo, "_drain", drain_everything)
    with pytest.raises(SystemExit) as exited:
        demo.main(requests=40, concurrency=4)
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert "request(s) failed" in out and "invariants held" not in out
