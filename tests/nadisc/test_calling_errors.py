"""Every failure of a call through discovery is an httpx error and a nadisc error.

One test per row of the mapping table in docs/calling.md: the call fails the
same way twice, caught once as ``httpx.HTTPError`` and once as the nadisc
type, and the httpx-facing class is the documented one. In-memory pools and
the memory provider, so this runs on both event loops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
import pytest

import nadisc
from nadisc import (
    CallCapacityExceeded,
    CallEvidenceUnavailable,
    CallLifecycleError,
    CallQualifierError,
    CallTimeout,
    CallUnknownService,
    DiscoveryOwner,
    DiscoveryTransport,
    Instance,
    LimitsConfig,
    RestDiscoveryClient,
)
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner

DOCS_TABLE_ROWS = 11


async def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/slow":
        await anyio.sleep(5)
    if request.url.path == "/big":
        return httpx.Response(200, content=b"x" * 64)
    return httpx.Response(200, content=b"ok")


@dataclass
class World:
    owner: DiscoveryOwner
    memory: MemoryProvider
    transport: DiscoveryTransport
    http: httpx.AsyncClient
    rest: RestDiscoveryClient


@asynccontextmanager
async def world() -> AsyncIterator[World]:
    memory = MemoryProvider(services={"orders": "orders", "billing": "billing", "tls": "tls"})
    memory.set("orders", [Instance("a", "10.0.0.1", 8080)])
    memory.set("billing", [Instance("b", "10.0.0.2", 8080)])
    memory.set("tls", [Instance("t", "10.0.0.3", 8443, metadata={"scheme": "https"})])
    pool = httpx.MockTransport(_answer)
    limits = LimitsConfig(max_service_watches_per_connection=2)
    async with memory_owner({"primary": memory}, limits=limits) as owner:
        transport = DiscoveryTransport(owner, transport=pool)
        async with (
            httpx.AsyncClient(mounts={"nadisc://": transport}) as http,
            RestDiscoveryClient(owner, transport=pool, max_body_bytes=16) as rest,
        ):
            yield World(owner, memory, transport, http, rest)


Call = Callable[[World], Awaitable[object]]


async def _unknown_service(w: World) -> object:
    return await w.http.get("nadisc://primary/nosuch/")


async def _unknown_connection(w: World) -> object:
    return await w.http.get("nadisc://elsewhere/orders/")


async def _not_a_discovery_url(w: World) -> object:
    return await w.transport.handle_async_request(httpx.Request("GET", "http://primary/orders/"))


async def _closed_transport(w: World) -> object:
    await w.transport.aclose()
    return await w.http.get("nadisc://primary/orders/")


async def _too_many_watches(w: World) -> object:
    await w.http.get("nadisc://primary/orders/")
    await w.http.get("nadisc://primary/billing/")
    return await w.http.get("nadisc://primary/tls/")


async def _empty_listing(w: World) -> object:
    w.memory.set("orders", [])
    return await w.http.get("nadisc://primary/orders/")


async def _budget(w: World) -> object:
    # The listing first, so that the 50 ms run out during the slow answer on
    # any machine (not before the first listing, which is another message).
    await w.owner.client().observe("orders", anyio.current_time() + 10)
    return await w.http.get("nadisc://primary/orders/slow", timeout=0.05)


async def _scheme_mismatch(w: World) -> object:
    return await w.http.get("nadisc://primary/tls/")


async def _rest_unknown_service(w: World) -> object:
    return await w.rest.get("/", service="nosuch")


async def _rest_too_large(w: World) -> object:
    return await w.rest.get("/big", service="orders")


async def _rest_invalid(w: World) -> object:
    return await w.rest.get("ftp://example.com/")


ROWS: list[tuple[str, Call, type[Exception], type[Exception], type[Exception]]] = [
    # (row, call, nadisc type, raised class, httpx base)
    ("UnknownService", _unknown_service, nadisc.UnknownService, CallUnknownService,
     httpx.RequestError),
    ("QualifierError", _unknown_connection, nadisc.QualifierError, CallQualifierError,
     httpx.RequestError),
    ("NotDiscoveryUrl", _not_a_discovery_url, nadisc.NotDiscoveryUrl, nadisc.NotDiscoveryUrl,
     httpx.UnsupportedProtocol),
    ("LifecycleError", _closed_transport, nadisc.LifecycleError, CallLifecycleError,
     httpx.RequestError),
    ("CapacityExceeded", _too_many_watches, nadisc.CapacityExceeded, CallCapacityExceeded,
     httpx.RequestError),
    ("EvidenceUnavailable", _empty_listing, nadisc.EvidenceUnavailable,
     CallEvidenceUnavailable, httpx.TransportError),
    ("DeadlineExceeded", _budget, nadisc.DeadlineExceeded, CallTimeout,
     httpx.TimeoutException),
    ("InstanceSchemeMismatch", _scheme_mismatch, nadisc.InstanceSchemeMismatch,
     nadisc.InstanceSchemeMismatch, httpx.RequestError),
    ("REST UnknownService", _rest_unknown_service, nadisc.UnknownService, CallUnknownService,
     httpx.RequestError),
    ("ResponseTooLarge", _rest_too_large, nadisc.ResponseTooLarge, nadisc.ResponseTooLarge,
     httpx.RequestError),
    ("InvalidRequest", _rest_invalid, nadisc.InvalidRequest, nadisc.InvalidRequest,
     httpx.RequestError),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "nadisc_type", "raised", "httpx_base"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
async def test_each_failure_is_caught_as_httpx_and_as_nadisc(
    call: Call,
    nadisc_type: type[Exception],
    raised: type[Exception],
    httpx_base: type[Exception],
) -> None:
    async with world() as w:
        try:
            await call(w)
        except httpx.HTTPError as exc:
            caught: Exception = exc
        else:  # pragma: no cover - the assertion below reports it
            pytest.fail("the call did not fail")
    assert type(caught) is raised
    assert isinstance(caught, httpx_base)
    assert isinstance(caught, nadisc.DiscoveryError)
    assert isinstance(caught, nadisc_type)
    cause = caught.__cause__
    if isinstance(cause, nadisc.DiscoveryError) and not isinstance(cause, nadisc.CallError):
        # Translated at the boundary: the original nadisc error is the cause.
        assert isinstance(cause, nadisc_type)
        assert str(caught) == str(cause)
    async with world() as w:
        with pytest.raises(nadisc_type):
            await call(w)


def test_the_docs_table_lists_every_row() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "calling.md").read_text()
    section = text[text.index("### Errors") :]
    section = section[: section.index("\n### ", 4)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) == DOCS_TABLE_ROWS == len(ROWS)
    for _, _call, nadisc_type, raised, httpx_base in ROWS:
        assert any(
            f"`{nadisc_type.__name__}`" in row
            and f"`{raised.__name__}`" in row
            and f"`httpx.{httpx_base.__name__}`" in row
            for row in rows
        ), nadisc_type


async def test_attributes_survive_the_translation() -> None:
    async with world() as w:
        w.memory.set("orders", [])
        with pytest.raises(CallEvidenceUnavailable) as empty:
            await w.http.get("nadisc://primary/orders/")
        assert empty.value.reason == "empty"
        assert empty.value.request.url == httpx.URL("nadisc://primary/orders/")
        await w.http.get("nadisc://primary/billing/")
        with pytest.raises(CallCapacityExceeded) as capacity:
            await w.http.get("nadisc://primary/tls/")
        assert capacity.value.limit == "max_service_watches_per_connection"


async def test_errors_of_the_pool_pass_through_unchanged() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    memory = MemoryProvider(services={"orders": "orders"})
    memory.set("orders", [Instance("a", "10.0.0.1", 8080)])
    async with memory_owner({"primary": memory}) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(refuse))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            with pytest.raises(httpx.ConnectError) as info:
                await http.get("nadisc://primary/orders/")
    assert not isinstance(info.value, nadisc.DiscoveryError)
