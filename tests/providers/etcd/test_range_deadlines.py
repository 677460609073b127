"""A deadline that passes between the requests of one read.

A complete range is several requests (pages, a count, a key alone), and so
is the probe's keys-only read; each request checks the deadline before it
starts. A deadline that passes between two of them is a timeout of the
read, ``IncompleteSnapshot``, as one that passes during a request: a watch
reports it and ranges again after its backoff. Before, the second page
raised ``DeadlineExceeded`` out of the watch (a watch's range runs under
the provider's own request deadline), which ended the watch's task group
on a loaded machine. A deadline already past when a read starts is still
the caller's ``DeadlineExceeded``.

The stall is real time on a real etcd: the wrapped client waits until the
range's deadline has passed before it asks for the next page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nadisc_etcd._provider as provider_module
import pytest
from nadisc_etcd import EtcdProvider

from nadisc import ConnectionContext, DeadlineExceeded, IncompleteSnapshot

from .conftest import EtcdServer, ProviderMaker, RawEtcd, RecordingSink, both_wires, make_context

TIMEOUT = 0.5
RECORDS = 40


class StallOnce:
    """Wraps a client's ``range``: the first later page (one read at a pinned
    revision) waits until its deadline has passed, then is asked as usual."""

    def __init__(self, provider: EtcdProvider) -> None:
        self.inner = provider._client.range
        self.armed = True
        self.stalled = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed and kwargs.get("revision"):
            self.armed = False
            self.stalled += 1
            await anyio.sleep(max(0.0, kwargs["deadline"] - anyio.current_time()) + 0.01)
        return await self.inner(*args, **kwargs)


async def fill(provider: EtcdProvider, raw: RawEtcd) -> list[str]:
    head = f"{provider.settings.prefix}/orders"
    names = [f"i{n:02d}" for n in range(RECORDS)]
    for n, name in enumerate(names):
        await raw.put_record(f"{head}/{name}", f"10.0.0.{n + 1}:80")
    return names


def small_pages() -> ConnectionContext:
    # A budget of 2 KiB a page: 40 records are several pages.
    return make_context(request_timeout=TIMEOUT, max_response_bytes=4096)


@pytest.mark.real_server
@both_wires
@pytest.mark.parametrize("watch", ["shared", "per_service"])
async def test_a_watch_whose_range_runs_out_of_time_reports_it_and_ranges_again(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    watch: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = make_provider(etcd_server, context=small_pages(), watch=watch)
    names = await fill(provider, raw)
    stall = StallOnce(provider)
    monkeypatch.setattr(provider._client, "range", stall)

    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        # Started by the first outcome: the failed range.
        await nursery.start(provider.watch, "orders", sink)
        await sink.wait_for(lambda: len(sink.publishes) > 0, within=10)
        nursery.cancel_scope.cancel()
    assert stall.stalled == 1
    [failure] = sink.failures
    assert isinstance(failure, IncompleteSnapshot)
    assert "the range of 'orders' did not finish by its deadline" in str(failure)
    assert list(sink.latest.identities()) == names
    assert sink.events.index(failure) < sink.events.index(sink.publishes[0])


async def query(provider: EtcdProvider, deadline: float) -> list[str]:
    return list((await provider.query("orders", deadline)).identities())


async def probe_keys(provider: EtcdProvider, deadline: float) -> list[str]:
    head = f"{provider.settings.prefix}/orders".encode()
    _, kvs = await provider._keys_of(head, deadline)
    return [kv.key.rsplit(b"/", 1)[1].decode() for kv in kvs]


@pytest.mark.real_server
@both_wires
@pytest.mark.parametrize(
    ("read", "match"),
    [
        (query, "the range of 'orders' did not finish"),
        (probe_keys, r"the keys-only range of .* did not finish"),
    ],
    ids=["query", "probe_keys"],
)
async def test_a_read_whose_deadline_passes_between_pages_is_incomplete(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    read: Callable[[EtcdProvider, float], Awaitable[list[str]]],
    match: str,
) -> None:
    provider = make_provider(etcd_server, context=small_pages())
    names = await fill(provider, raw)
    monkeypatch.setattr(provider_module, "RANGE_PAGE", 10)  # the probe's keys: 4 pages
    monkeypatch.setattr(provider._client, "range", StallOnce(provider))
    with pytest.raises(IncompleteSnapshot, match=match):
        await read(provider, anyio.current_time() + TIMEOUT)
    # A deadline already past when the read starts is the caller's.
    with pytest.raises(DeadlineExceeded):
        await read(provider, anyio.current_time() - 1)
    # Unstalled, the same read completes.
    assert await read(provider, anyio.current_time() + 5) == names
