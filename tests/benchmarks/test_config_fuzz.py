"""Smoke run of the config fuzz campaign (a hundred documents)."""

from __future__ import annotations

import pytest

from benchmarks import config_fuzz


def test_config_fuzz_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    results = config_fuzz.main(["--smoke"])
    printed = capsys.readouterr().out
    assert "other exceptions" in printed and "yaml: ConfigError" in printed
    assert results["documents"] == 100
