"""The docs' complete examples run as written, on trio and on asyncio.

HOW TO ADD AN EXAMPLE (the convention): put an HTML comment on the line
right before a fenced block in any ``docs/*.md`` or the ``README.md``; it is
invisible in the rendered page.

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
  ``anyio.run`` bound to trio and once to asyncio. Words after the colon
  qualify it (several may be combined, ``<!-- runnable: trio etcd -->``):

  - ``trio``: it may only run on trio (and ends with ``trio.run(main)``);
  - ``sync``: it starts no event loop; it is executed once;
  - ``etcd``: it needs an etcd server; a real one is running and its URL is
    in the ``ETCD_ENDPOINT`` environment variable (what the example's
    config reads through ``${ETCD_ENDPOINT}``).

* ``<!-- runnable: output -->`` before a ``text`` block: what the closest
  python example above it (in the same document) prints, exactly, on every
  loop it runs on.

A marked block that fails fails the suite; nothing is skipped.

EVERY OTHER ``python``/``yaml``/``toml``/``json`` BLOCK must be listed in
``FRAGMENTS`` below with the reason it cannot run on its own (it continues
an earlier example, shows a signature, needs a server the suite has no
stand-in for, ...). An unmarked block that is not listed fails
``test_every_code_block_is_runnable_or_a_listed_fragment``, and so does a
listed fragment that no longer exists: a new example is either executed or
reviewed as a fragment. A ``yaml`` block that starts with ``discovery:`` is
a complete document and must be marked ``runnable: config``.
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

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: Every fenced block: its info string, and the ``runnable`` comment right before it.
_FENCE = re.compile(
    r"(?:<!--\s*runnable(?::\s*(?P<mode>[^>]*?))?\s*-->\s*\n)?"
    r"^```(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<body>.*?)^```",
    re.DOTALL | re.MULTILINE,
)
#: The languages of code a user would copy (program text, config documents).
CODE_LANGUAGES = frozenset({"python", "py", "yaml", "yml", "toml", "json"})
PYTHON_WORDS = frozenset({"trio", "sync", "etcd"})


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    marked: bool
    mode: str
    lang: str
    body: str

    @property
    def label(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.body.splitlines() if ln.strip()), "")

    @property
    def words(self) -> frozenset[str]:
        return frozenset(self.mode.split())


def documents() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def all_blocks() -> Iterator[Block]:
    for path in documents():
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            fence = match.start("lang") - 3
            yield Block(
                path.name,
                text.count("\n", 0, fence) + 1,
                match.group(0).lstrip().startswith("<!--"),
                (match.group("mode") or "").strip(),
                match.group("lang"),
                match.group("body").removesuffix("\n"),
            )


EVERY = list(all_blocks())
ALL = [b for b in EVERY if b.marked]

#: Code blocks that are deliberately not runnable on their own, by
#: (document, the start of the block's first non-blank line), with the reason.
#: Each key must match exactly one unmarked block. Reviewed: adding an
#: entry means deciding that the block is a fragment a reader completes.
# fmt: off
FRAGMENTS: dict[tuple[str, str], str] = {
    ("calling.md", "rest:"):
        "the keys of a connection's rest block; tests/nadisc/test_transport_faults.py "
        "runs them against a hung instance",
    ("calling.md", "connections:"):
        "the snapshot keys of a connection; tests/nadisc/test_cli.py checks the warning "
        "about the default",
    ("README.md", "async with open_discovery(config) as owner:"):
        "the two-line teaser; docs/nadisc.md has the complete program",
    ("config.md", "import nadisc"):
        "a menu of the loading functions (`text` and the resolver are the host's); "
        "each one is exercised by tests/nadisc/test_config_loading.py",
    ("config.md", "static:"):
        "the `static:` block of a connection alone; complete documents above are executed",
    ("discovery-balance.md", "streaming = StreamingDiscoveryBalance("):
        "continues the example above it inside an async function (top-level await)",
    ("hosting.md", "from nadisc.hosting import Bind, GrpcServe, serve"):
        "needs stubs generated by grpcio-tools and a registry; tests/grpc/test_hosting.py "
        "hosts the same shape (generated interop stubs) and benchmarks/grpc_rolling.py on etcd",
    ("hosting.md", "async with open_host("):
        "the context-manager form of the executed serve() example; binds a fixed public port",
    ("observability.md", "from prometheus_client import CollectorRegistry"):
        "needs the host's running owner and its own CollectorRegistry",
    ("observability.md", "groups:"):
        "Prometheus alert rules, not a nadisc document; promtool checks them in "
        "tests/observability/test_metrics_calls.py",
    ("poise.md", "Endpoint(key, service, *, weight=1.0"):
        "a signature",
    ("poise.md", "async with balance.open(request) as response:"):
        "a call site inside an async function, with the caller's balance and request",
    ("poise.md", "from operator import attrgetter"):
        "constructor variants with the caller's endpoints",
    ("poise.md", "while True:"):
        "a loop body of a component that drives a balance (apply_pending_updates is the host's)",
    ("policies.md", "index = policy.pick(ready, context, now)"):
        "a signature",
    ("providers-consul.md", "catalog = await nadisc_consul.open_catalog("):
        "a call inside an owner's block; the full flow is the example further down",
    ("providers-consul.md", "from nadisc_consul import catalog_for"):
        "needs the host's provider and task group; see tests/providers/consul/test_catalog.py",
    ("providers-consul.md", "import anyio"):
        "needs a Consul agent (none runs here); the same owner flow runs against the "
        "fake in tests/providers/consul/test_owner_*.py and test_catalog_owner.py",
    ("providers-consul.md", "settings = nadisc.validate_provider_block("):
        "test-side injection; `context` and `fake` are a test's fixtures",
    ("providers-nacos.md", "import os"):
        "needs two Nacos clusters (none runs here); the same YAML and flow run "
        "against two fakes in tests/providers/nacos/test_seed.py",
    ("providers-nacos.md", "import gc"):
        "a step of a started service; freezing the test process's heap would outlive the "
        "example (benchmarks/nacos_scale.py runs it, with gc.unfreeze() after)",
    ("registration.md", "from nadisc import Eligibility, RegistrationSet, resolve_registrations"):
        "a step of the by-hand flow; `config` and `connections` come from the host",
    ("registration.md", "epoch = await registrations.identity_revoked("):
        "call sites inside an async function",
    ("registration.md", "controller, eligibility = Eligibility.channel()"):
        "call sites; `...` stands for the host's serving",
    ("registration.md", "app = owner.eligibility_probe()"):
        "a call on the host's owner",
    ("registration.md", "from hypercorn.config import Config"):
        "needs the host's nursery and owner; binds a fixed operations address",
    ("registration.md", "from starlette.routing import Mount"):
        "a route table fragment of the host's application",
    ("registration.md", "async with anyio.create_task_group() as tg:"):
        "the steps the owner runs, with `...` for the host's work",
    ("registration.md", "builder = OwnerBuilder.from_config("):
        "the by-hand owner flow; `bound`, `web` and `spec` come from the host",
}
# fmt: on


class _Environ(dict[str, str]):
    """Every variable is set (to a plausible value) for the config examples."""

    def __missing__(self, key: str) -> str:
        if key.endswith("PORT"):
            return "8080"
        if key.endswith("_IP"):
            return "10.0.0.5"
        return "placeholder-value"

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


RUNNABLE = [
    b for b in ALL if b.lang == "python" and not b.mode.startswith("file ") and b.mode != "config"
]


def _output_of(block: Block) -> str | None:
    """The ``output`` block that follows ``block`` before the next example."""
    later = [b for b in ALL if b.document == block.document and b.line > block.line]
    for other in later:
        if other in RUNNABLE:
            return None
        if other.mode == "output":
            return other.body
    return None


def _backends(block: Block) -> tuple[str | None, ...]:
    if "sync" in block.words:
        return (None,)
    return ("trio",) if "trio" in block.words else ("trio", "asyncio")


CASES = [
    pytest.param(block, backend, id=f"{block.label}-{backend or 'sync'}")
    for block in RUNNABLE
    for backend in _backends(block)
]


@pytest.mark.parametrize(("block", "backend"), CASES)
def test_python_examples_run_as_written(
    block: Block,
    backend: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert block.words <= PYTHON_WORDS, f"unknown runnable words {sorted(block.words)}"
    _files_for(block.document, tmp_path)
    monkeypatch.chdir(tmp_path)
    if "etcd" in block.words:
        monkeypatch.setenv("ETCD_ENDPOINT", request.getfixturevalue("etcd_server").url)
    real_run = anyio.run
    runs: list[str] = []

    def run(func: Any, *args: Any, **kwargs: Any) -> Any:
        assert backend is not None, "a `sync` example must not start an event loop"
        runs.append(backend)
        kwargs["backend"] = backend
        return real_run(func, *args, **kwargs)

    monkeypatch.setattr(anyio, "run", run)
    code = compile(block.body, f"docs/{block.document}:{block.line}", "exec")
    capsys.readouterr()
    exec(code, {"__name__": "__main__"})
    expected = _output_of(block)
    if expected is not None:
        assert capsys.readouterr().out.rstrip("\n") == expected
    if backend == "asyncio" or (backend == "trio" and "trio" not in block.words):
        assert runs == [backend], "the example must end with anyio.run(main)"


def _fragment_key(block: Block) -> list[tuple[str, str]]:
    return [
        key for key in FRAGMENTS if key[0] == block.document and block.first_line.startswith(key[1])
    ]


def test_every_code_block_is_runnable_or_a_listed_fragment() -> None:
    unmarked = [b for b in EVERY if not b.marked and b.lang in CODE_LANGUAGES]
    unlisted = [f"{b.label} ({b.lang}: {b.first_line!r})" for b in unmarked if not _fragment_key(b)]
    assert unlisted == [], (
        "mark these runnable (see the convention at the top of this file) or list them "
        "in FRAGMENTS with the reason"
    )
    matches = {key: [b.label for b in unmarked if key in _fragment_key(b)] for key in FRAGMENTS}
    stale = sorted(key for key, found in matches.items() if not found)
    assert stale == [], "FRAGMENTS lists blocks that are gone or now marked runnable"
    shared = sorted((key, found) for key, found in matches.items() if len(found) > 1)
    assert shared == [], "a FRAGMENTS key matches several blocks: make it longer"
    documents_ = [
        b.label for b in unmarked if b.lang in ("yaml", "yml") and b.first_line == "discovery:"
    ]
    assert documents_ == [], "a complete discovery document must be marked runnable: config"


def test_every_marker_is_understood() -> None:
    for block in ALL:
        if block.mode.startswith("file "):
            continue
        if block.mode == "config":
            assert block.lang == "yaml", block.label
            continue
        if block.mode == "output":
            assert block.lang == "text", block.label
            assert any(_output_of(b) == block.body for b in RUNNABLE), (
                f"{block.label}: no example above it in the document"
            )
            continue
        assert block.lang == "python", f"{block.label}: runnable blocks are python"
        assert block.words <= PYTHON_WORDS, f"{block.label}: unknown words {block.mode!r}"


def test_there_are_examples_of_each_kind() -> None:
    assert [b for b in ALL if b.mode == "config"], "no config example is marked runnable"
    assert RUNNABLE, "no python example is marked runnable"
    assert [b for b in RUNNABLE if "etcd" in b.words], "no example runs against a real etcd"
    assert os.path.isdir(DOCS)


def test_the_nacos_docs_two_cluster_yaml_is_the_seed_example_that_runs() -> None:
    # docs/providers-nacos.md says this document "runs as written" and points
    # at tests/providers/nacos/test_seed.py, which runs SEED_EXAMPLE end to end.
    from tests.seed_yaml import SEED_EXAMPLE

    (shown,) = [
        b for b in ALL if b.document == "providers-nacos.md" and "infrastructure:" in b.body
    ]
    seed = SEED_EXAMPLE[SEED_EXAMPLE.index("discovery:") :].rstrip("\n")
    assert shown.body == seed
