"""Every ``python`` example in docs/calling.md is a complete program and runs as written.

Each block runs in a fresh event loop; the ``text`` block right after it
(when the doc shows one) is exactly what it prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "calling.md"
_BLOCK = re.compile(r"```python\n(.*?)```(?:\n\nprints\n\n```text\n(.*?)```)?", re.DOTALL)


def _examples() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(DOC.read_text(encoding="utf-8"))]


def test_the_guide_has_runnable_examples() -> None:
    assert len(_examples()) >= 2


@pytest.mark.parametrize(("code", "printed"), _examples(), ids=lambda v: "")
def test_the_example_runs_and_prints_what_the_guide_says(
    code: str, printed: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    if printed is not None:
        assert capsys.readouterr().out == printed
