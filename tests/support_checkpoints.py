"""Counting the checkpoints a task takes (not a test module).

For tests that pin how many times a call yields to the event loop: the
loop passes between an event and the task it wakes are latency, and a call
that already waited needs no further checkpoint.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest


def count_yields(monkeypatch: pytest.MonkeyPatch, task_ids: set[int]) -> list[str]:
    """The checkpoints the tasks in ``task_ids`` take (their names, in order)."""
    taken: list[str] = []
    for name in ("checkpoint", "cancel_shielded_checkpoint"):
        original = getattr(anyio.lowlevel, name)

        async def counted(original: Any = original, name: str = name) -> None:
            if anyio.get_current_task().id in task_ids:
                taken.append(name)
            await original()

        monkeypatch.setattr(anyio.lowlevel, name, counted)
    return taken
