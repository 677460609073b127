"""The host-flow examples in the docs run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def example(document: str, heading: str) -> str:
    text = (DOCS / document).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(
    ("document", "heading", "printed"),
    [
        (
            "nadisc.md",
            "## The host flow: registrations from the config",
            "business-http CloseOutcome.DEREGISTERED",
        ),
        (
            "registration.md",
            "## The host flow in one call",
            "business-http CloseOutcome.RESIDUAL",
        ),
    ],
)
def test_the_example_runs(
    document: str, heading: str, printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = compile(example(document, heading), f"docs/{document}", "exec")
    exec(code, {"__name__": "docs_example"})
    assert printed in capsys.readouterr().out
