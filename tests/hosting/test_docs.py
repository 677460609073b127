"""The hosting guide's example runs as written, on trio and on asyncio."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hosting.support import BACKENDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def example(document: str, heading: str) -> str:
    text = (DOCS / document).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_one_call_example_runs(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = example("hosting.md", "## One call")
    # The last line runs the example: on anyio's default loop (asyncio)
    # as written; each backend is named explicitly here.
    head, call, tail = source.rpartition("anyio.run(main)")
    assert call and "\n" not in tail.strip(), "the example must end with anyio.run(main)"
    source = head + f'anyio.run(main, backend="{backend}")' + tail
    exec(compile(source, "docs/hosting.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "RegistrationState.ACTIVE order-api-127.0.0.1-" in out
    assert "CloseOutcome.DEREGISTERED" in out
