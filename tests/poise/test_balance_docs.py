"""The runnable example of docs/poise.md runs and says what the guide claims."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "poise.md"


def test_first_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = GUIDE.read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", text, re.S)
    assert example is not None
    exec(compile(example.group(1), str(GUIDE), "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "endpoints=2 ready=2 idle=0 failed=0" in out
    fast_m = re.search(r"'fast': (\d+)", out)
    slow_m = re.search(r"'slow': (\d+)", out)
    assert fast_m is not None, out
    fast = int(fast_m.group(1))
    slow = int(slow_m.group(1)) if slow_m else 0
    assert fast + slow == 200
    assert fast > slow


def test_outlier_example_runs() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (example,) = [b for b in blocks if "OutlierDetector(" in b]
    scope: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(example, str(GUIDE), "exec"), scope)
    balance = scope["balance"]
    assert getattr(balance, "outlier_detector", None) is scope["detector"]
    assert scope["events"] == []
