"""A closed provider refuses work with its typed error, on trio and on asyncio."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from anyio.abc import TaskStatus

from nadisc import IncompleteSnapshot
from tests.fakes.kubernetes import KubernetesFake

from .conftest import TOKEN, RecordingSink, in_process, owned_slice

CLOSED = "the kubernetes provider of connection 'primary' is closed"


def seeded() -> KubernetesFake:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    return fake


async def test_a_watch_running_when_the_provider_closes_raises_the_typed_error(
    tmp_path: Path,
) -> None:
    fake = seeded()
    provider = in_process(fake, tmp_path)
    sink = RecordingSink()
    raised: list[BaseException] = []

    async def run(*, task_status: TaskStatus[None]) -> None:
        try:
            await provider.watch("orders", sink, task_status=task_status)
        except Exception as exc:  # what the caller of watch() gets, unwrapped
            raised.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            await group.start(run)
            await fake.wait_for(lambda: fake.open_watches == 2)
            await provider.aclose()
            fake.end_watches()  # the streams come back to a closed provider
    (error,) = raised
    assert type(error) is IncompleteSnapshot, repr(error)
    assert str(error) == CLOSED
    # Closing is no failure of the registry: the sink heard none.
    assert not sink.failures


async def test_a_watch_or_a_query_after_close_raises_the_typed_error(tmp_path: Path) -> None:
    fake = seeded()
    provider = in_process(fake, tmp_path)
    await provider.aclose()
    with pytest.raises(IncompleteSnapshot, match=CLOSED):
        await provider.watch("orders", RecordingSink(), task_status=anyio.TASK_STATUS_IGNORED)
    with pytest.raises(IncompleteSnapshot, match=CLOSED):
        await provider.query("orders", anyio.current_time() + 5)
