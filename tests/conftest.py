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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if BACKEND != "asyncio":
        return
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.add_marker(pytest.mark.anyio)


@pytest.fixture
def anyio_backend() -> str:
    return BACKEND
