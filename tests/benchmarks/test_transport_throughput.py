"""Smoke run of the transport-throughput benchmark: it runs and prints a sane table."""

from __future__ import annotations

import pytest

from benchmarks import transport_throughput


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = transport_throughput.main(["--smoke"])
    out = capsys.readouterr().out
    assert "discovery transport" in out and "plain httpx" in out and "ratio" in out
    assert result.requests == 300 and result.concurrency == 16
    assert result.plain_rps > 0 and result.discovery_rps > 0
    # Not the 0.85 target (a smoke run on a busy machine is noisy), but a
    # gross regression of the request path shows up even here.
    assert result.ratio > 0.4, out
    assert f"{result.ratio:.2f}" in out
