"""The docs' complete examples run as written, on trio and on asyncio.

HOW TO ADD AN EXAMPLE (the convention): put an HTML comment on the line
right before a fenced block in any ``docs/*.md``; it is invisible in the
rendered page.

* ``<!-- runnable: file NAME -->`` before a block: the block's text is
  written to ``NAME`` in the example's working directory (a fresh temporary
  directory per document), for the python examples that follow it in the
  same document (``nadisc.load_config_file("app.yaml")``).
* ``<!-- runnable: config -->`` before a ``yaml`` block: it must load as a
  complete document (``discovery`` root required, every provider installed,
  every provider block valid; ``${VARS}`` are expanded from a test
  environment where every variable is set).
* ``<!-- runnable -->`` before a ``python`` block: it is executed as a
  script. It must end with ``anyio.run(main)``: the test runs it once with
  ``anyio.run`` bound to trio and once to asyncio. A block that may only
  run on trio writes ``<!-- runnable: trio -->`` (and ``trio.run(main)``).

A marked block that fails fails the suite; nothing is skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import nadisc

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(
    r"<!--\s*runnable(?::\s*(?P<mode>[^>]*?))?\s*-->\s*\n```(?P<lang>[a-z]*)\n(?P<body>.*?)\n```",
    re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    mode: str
    lang: str
    body: str

    @property
    def label(self) -> str:
        return f"{self.document}:{self.line}"


def blocks() -> Iterator[Block]:
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            yield Block(
                path.name,
                text.count("\n", 0, match.start()) + 1,
                (match.group("mode") or "").strip(),
                match.group("lang"),
                match.group("body"),
            )


ALL = list(blocks())


class _Environ(dict[str, str]):
    """Every variable is set (to a plausible value) for the config examples."""

    def __missing__(self, key: str) -> str:
        return "8080" if key.endswith("PORT") else "placeholder-value"

    def get(self, key: str, default: Any = None) -> Any:
        return self[key]


@pytest.mark.parametrize("block", [b for b in ALL if b.mode == "config"], ids=lambda b: b.label)
def test_config_examples_load(block: Block) -> None:
    assert block.lang == "yaml", "config examples are yaml blocks"
    config = nadisc.load_config(
        block.body, environ=_Environ(), require_root=True, require_providers=True
    )
    assert isinstance(config, nadisc.DiscoveryConfig)


def _files_for(document: str, directory: Path) -> None:
    for block in ALL:
        if block.document == document and block.mode.startswith("file "):
            (directory / block.mode.removeprefix("file ").strip()).write_text(block.body + "\n")


RUNNABLE = [b for b in ALL if b.lang == "python" and b.mode in ("", "trio")]
CASES = [
    pytest.param(block, backend, id=f"{block.label}-{backend}")
    for block in RUNNABLE
    for backend in (("trio",) if block.mode == "trio" else ("trio", "asyncio"))
]


@pytest.mark.parametrize(("block", "backend"), CASES)
def test_python_examples_run_as_written(
    block: Block, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _files_for(block.document, tmp_path)
    monkeypatch.chdir(tmp_path)
    real_run = anyio.run

    def run(func: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = backend
        return real_run(func, *args, **kwargs)

    monkeypatch.setattr(anyio, "run", run)
    code = compile(block.body, f"docs/{block.document}:{block.line}", "exec")
    exec(code, {"__name__": "__main__"})


def test_there_are_examples_of_each_kind() -> None:
    assert [b for b in ALL if b.mode == "config"], "no config example is marked runnable"
    assert RUNNABLE, "no python example is marked runnable"
    assert os.path.isdir(DOCS)
