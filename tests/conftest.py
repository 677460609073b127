"""Shared test setup.

Async tests run on trio (pytest-trio's trio_mode). With TEST_BACKEND=asyncio
(the Makefile's second pass over tests/poise) they run on asyncio through
anyio's pytest plugin instead; tests marked ``trio_only`` are deselected
there.
"""

from __future__ import annotations

import inspect
import os

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
