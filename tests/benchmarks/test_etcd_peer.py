"""Smoke run of the etcd peer benchmark (starts its own etcd and a writer process;
aetcd is the peer)."""

from __future__ import annotations

import math
import os
import shutil

import pytest

from benchmarks import etcd_peer

pytestmark = [pytest.mark.real_server]


def test_smoke_run_prints_every_row_against_the_peer(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(reason="etcd is not installed (apt-get install etcd-server); never under CI")
    rows = etcd_peer.main(["--smoke", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "2 interleaved round(s)" in out
    assert [r.measure for r in rows] == [
        "put -> observed p50",
        "put -> observed p99",
        "put acked p99",
        "acked -> observed p99",
        "CPU per change",
        "p50, writer on this loop",
        f"{etcd_peer.SMOKE.keys:,}-key range wall",
        f"{etcd_peer.SMOKE.keys:,}-key range CPU",
        "  of it, the wire wall",
        "  of it, the wire CPU",
        "range wall, peer+json.loads",
        "range CPU, peer+json.loads",
    ]
    assert "load average" in out
    for row in rows:
        assert row.measure in out
        if row.measure == "acked -> observed p99":
            # The writer is another process: the watch may see a change
            # before the writer has read its put's answer (below zero).
            assert all(map(math.isfinite, (row.json, row.grpc, row.peer))), row
            continue
        # every side measured something real (each range checked its key count)
        assert row.json > 0 and row.grpc > 0 and row.peer > 0, row
        assert not math.isnan(row.ratio), row
    # Rows measured once per round carry the median of their rounds' ratios;
    # latency percentiles are of all samples, their ratio of the percentiles.
    assert all(r.round_ratios is None for r in rows[:4] + rows[5:6])
    assert all(r.round_ratios is not None for r in rows[4:5] + rows[6:])


def test_a_per_round_ratio_is_what_the_row_reports() -> None:
    row = etcd_peer.Row("m", 4.0, 3.0, 2.0, "ms", 1.0, round_ratios=(1.9, 1.4))
    assert (row.json_ratio, row.ratio, row.ok) == (1.9, 1.4, False)
    plain = etcd_peer.Row("m", 4.0, 3.0, 2.0, "ms", 2.0)
    assert (plain.json_ratio, plain.ratio, plain.ok) == (2.0, 1.5, True)


def test_rounds_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        etcd_peer.main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
