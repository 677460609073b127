"""Shared test setup.

Async tests run on trio (pytest-trio's trio_mode). With TEST_BACKEND=asyncio
(the Makefile's second pass over tests/poise, tests/nadisc, tests/providers
and the docs' examples) they run on asyncio through anyio's pytest plugin
instead; tests marked ``trio_only`` are deselected there. A test asking for
trio's virtual clock (``autojump_clock``, ``mock_clock``) or a trio nursery
fixture is marked ``trio_only`` automatically.
"""

from __future__ import annotations

import gc
import inspect
import os
from collections.abc import Iterator

import pytest

BACKEND = os.environ.get("TEST_BACKEND", "trio")
#: Under CI a test that needs a real server fails when it is missing; it never skips.
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    # Mark coroutine tests for anyio *before* items are generated, so that
    # parametrized async tests get the same treatment as plain ones.
    if BACKEND == "asyncio" and inspect.iscoroutinefunction(obj):
        pytest.mark.anyio(obj)


@pytest.fixture
def anyio_backend() -> str:
    return BACKEND


#: Fixtures that only exist on trio: virtual time (``MockClock``) cannot be
#: had on asyncio, so a test asking for one is trio-only by construction.
TRIO_ONLY_FIXTURES = frozenset({"autojump_clock", "mock_clock", "nursery"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & TRIO_ONLY_FIXTURES:
            item.add_marker(pytest.mark.trio_only)
    if BACKEND != "asyncio":
        return
    # The asyncio pass re-runs what depends on the loop: coroutine tests. A
    # plain test (pure logic, or one that starts its own loop) already ran on
    # the trio pass, so it is left out here to keep the suite's time bounded.
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        function = getattr(item, "function", None)
        is_async = function is not None and inspect.iscoroutinefunction(function)
        (kept if is_async or item.get_closest_marker("both_loops") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_per_module() -> Iterator[None]:
    """Collect garbage as each test module ends.

    An object that a test leaks (an unclosed transport, a socket) warns when
    the garbage collector frees it, and ``filterwarnings = error`` turns that
    warning into a failure of whichever test is running then. Collecting at
    the end of every module pins the failure on the module that leaked, every
    time, instead of on a random later test.
    """
    yield
    gc.collect()
