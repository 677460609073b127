"""The REST client speaks httpx: get/post/put/patch/delete/head/options/stream."""

from __future__ import annotations

import inspect
import json

import anyio
import httpx
import pytest

from nadisc import Instance, InvalidRequest, RestDiscoveryClient
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner

SEEN: list[httpx.Request] = []


async def _echo(request: httpx.Request) -> httpx.Response:
    SEEN.append(request)
    body = await request.aread()
    return httpx.Response(
        200,
        json={
            "method": request.method,
            "url": str(request.url),
            "host": request.headers.get("host"),
            "body": body.decode(),
            "x": request.headers.get("x-test"),
        },
    )


def _memory() -> MemoryProvider:
    memory = MemoryProvider(services={"orders": "orders"})
    memory.set("orders", [Instance("a", "10.0.0.1", 8080)])
    return memory


@pytest.mark.parametrize("verb", ["get", "post", "put", "patch", "delete", "head", "options"])
async def test_each_verb_calls_the_service_with_httpx_arguments(verb: str) -> None:
    async with (
        memory_owner({"primary": _memory()}) as owner,
        RestDiscoveryClient(owner, transport=httpx.MockTransport(_echo)) as rest,
    ):
        call = getattr(rest, verb)
        kwargs: dict[str, object] = {"params": {"q": "1"}, "headers": {"X-Test": "yes"}}
        if verb in ("post", "put", "patch"):
            kwargs["json"] = {"n": 1}
        response = await call("/v1/items", service="orders", **kwargs)
        assert response.status_code == 200
        assert response.is_closed
        assert response.request.method == verb.upper()
        assert str(response.request.url) == "nadisc://primary/orders/v1/items?q=1"
        if verb != "head":
            seen = response.json()
            assert seen["url"] == "http://10.0.0.1:8080/v1/items?q=1"
            assert seen["host"] == "10.0.0.1:8080" and seen["x"] == "yes"
            if verb in ("post", "put", "patch"):
                assert json.loads(seen["body"]) == {"n": 1}


def test_the_verbs_take_httpx_parameters() -> None:
    for verb in ("get", "post", "put", "patch", "delete", "head", "options"):
        ours = inspect.signature(getattr(RestDiscoveryClient, verb)).parameters
        theirs = inspect.signature(getattr(httpx.AsyncClient, verb)).parameters
        assert set(theirs) <= set(ours), verb
        assert set(ours) - set(theirs) == {"service"}, verb
        assert list(ours)[1] == "url"
    ours = inspect.signature(RestDiscoveryClient.stream).parameters
    theirs = inspect.signature(httpx.AsyncClient.stream).parameters
    assert set(theirs) <= set(ours) | {
        "content",
        "data",
        "files",
        "json",
        "params",
        "headers",
        "cookies",
        "timeout",
        "extensions",
    }


async def test_external_urls_and_the_stream_form() -> None:
    async with (
        memory_owner({"primary": _memory()}) as owner,
        RestDiscoveryClient(owner, transport=httpx.MockTransport(_echo)) as rest,
    ):
        external = await rest.get("https://api.example.com/v1/quote")
        assert external.json()["url"] == "https://api.example.com/v1/quote"
        async with rest.stream("GET", "/v1/stream", service="orders") as streamed:
            body = await streamed.aread()
        assert json.loads(body)["url"] == "http://10.0.0.1:8080/v1/stream"
        assert streamed.is_closed
        # The keyword form of earlier releases still works.
        old = await rest.request("GET", service="orders", path="/v1/x")
        assert old.json()["url"] == "http://10.0.0.1:8080/v1/x"
        with pytest.raises(InvalidRequest, match="path once"):
            await rest.request("GET", "/a", service="orders", path="/b")
        with pytest.raises(InvalidRequest, match="absolute http"):
            await rest.get("/relative")
        with pytest.raises(InvalidRequest):
            await rest.get("https://api.example.com/", service="orders")


async def test_a_direct_call_looks_like_an_httpx_one() -> None:
    memory = MemoryProvider(services={"orders": "orders"}, watch=True)
    memory.set("orders", [Instance("a", "10.0.0.1", 8080)])
    async with (
        memory_owner({"primary": memory}) as owner,
        RestDiscoveryClient(owner, transport=httpx.MockTransport(_echo)) as rest,
    ):
        response = await rest.get("/v1/items", service="orders")
        assert response.elapsed.total_seconds() >= 0
        assert response.request.url == httpx.URL("nadisc://primary/orders/v1/items")
        memory.set("orders", [])
        await anyio.sleep(0.05)  # the watch delivers the empty listing
        with pytest.raises(httpx.TransportError) as info:
            await rest.get("/v1/gone", service="orders")
        assert info.value.request.url == httpx.URL("nadisc://primary/orders/v1/gone")
