"""REST callers owned by the owner (owner.rest, rest_clients) and the managed body cap."""

from __future__ import annotations

import httpx
import pytest

from nadisc import (
    ConfigError,
    DiscoveryConfig,
    LifecycleError,
    QualifierError,
    ResponseTooLarge,
    RestConfig,
    RestDiscoveryClient,
    open_discovery,
    rest_clients,
)
from nadisc._rest import MANAGED_BODY_LIMIT, _cap
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy
from tests.support_http import HttpBackend, serve_backends

SERVICE = "orders"


def provider(*backends: HttpBackend) -> MemoryProvider:
    memory = MemoryProvider(services={SERVICE: SERVICE}, watch=True)
    memory.set(SERVICE, [b.instance() for b in backends])
    return memory


async def test_owner_rest_is_shared_and_closed_with_the_owner() -> None:
    async with serve_backends(HttpBackend("s", chunks=2, chunk_delay=0.01)) as (s,):
        memory = provider(s)
        async with memory_owner(
            {"primary": memory}, policies={"primary": policy(rest=RestConfig(max_attempts=3))}
        ) as owner:
            rest = owner.rest("primary")
            assert owner.rest("primary") is rest
            assert owner.connection_policy("primary").rest.max_attempts == 3
            assert owner.connection_policy().rest.max_attempts == 3
            with pytest.raises(QualifierError):
                owner.connection_policy("elsewhere")
            with pytest.raises(QualifierError):
                owner.rest("elsewhere")
            assert (await rest.request("GET", service=SERVICE, path="/x")).text == "sss"
            # A managed response the caller forgot: the owner's close reclaims it.
            left_open = await rest.send_managed(
                rest.build_request("GET", service=SERVICE, path="/open")
            )
            assert rest.transport is not None
            route = rest.transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"s": 1}
        assert rest.closed and left_open.is_closed
        assert route.streaming.balance.statistics().in_flight == 0
        with pytest.raises(LifecycleError):
            owner.rest("primary")


async def test_rest_clients_is_the_named_collection() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        business, infra = provider(a), provider(b)
        async with memory_owner({"primary": business, "infra": infra}) as owner:
            clients = rest_clients(owner)
            assert set(clients) == {"primary", "infra"} and len(clients) == 2
            assert not clients.external_only
            assert clients["infra"] is owner.rest("infra")
            assert clients.default is owner.rest()
            with pytest.raises(QualifierError, match=r"^unknown connection 'elsewhere' \("):
                clients["elsewhere"]
            # still a mapping: a missing name is a KeyError to its protocol
            assert "elsewhere" not in clients and "infra" in clients
            assert clients.get("elsewhere") is None
            with pytest.raises(KeyError):
                clients["elsewhere"]
            assert (await clients["infra"].request("GET", service=SERVICE, path="/")).text == "b"
            assert (await clients.default.request("GET", service=SERVICE, path="/")).text == "a"
        assert all(client.closed for client in clients.values())


async def test_rest_clients_without_connections_is_external_only() -> None:
    async with (
        serve_backends(HttpBackend("external")) as (external,),
        open_discovery(DiscoveryConfig()) as owner,
    ):
        clients = rest_clients(owner)
        assert clients.external_only and len(clients) == 0
        assert clients.default.external_only
        assert (await clients.default.request("GET", url=external.url)).text == "external"
        with pytest.raises(QualifierError):
            await clients.default.request("GET", service=SERVICE, path="/x")


async def test_managed_bodies_are_capped_and_bare_sends_are_not() -> None:
    # Each backend answers its name once per chunk, plus once more.
    backends = (HttpBackend("0123456789", chunks=3), HttpBackend("small"))
    async with serve_backends(*backends) as (big, small):
        memory = provider(big)
        async with (
            memory_owner({"primary": memory}) as owner,
            RestDiscoveryClient(owner, max_body_bytes=25) as rest,
        ):
            assert rest.max_body_bytes == 25
            with pytest.raises(ResponseTooLarge) as info:
                await rest.request("GET", service=SERVICE, path="/big")
            assert info.value.limit == 25 and info.value.size > 25
            # An external body is capped the same way.
            with pytest.raises(ResponseTooLarge):
                await rest.request("GET", url=big.url + "/big")
            assert (await rest.request("GET", url=small.url)).text == "small"
            managed = await rest.send_managed(
                rest.build_request("GET", service=SERVICE, path="/big")
            )
            with pytest.raises(ResponseTooLarge):
                await managed.aread()
            await managed.aclose()
            async with rest.stream("GET", service=SERVICE, path="/big") as streamed:
                with pytest.raises(ResponseTooLarge):
                    await streamed.aread()
            # A bare send is the caller's business: the whole body can be read.
            bare = await rest.send(
                rest.build_request("GET", service=SERVICE, path="/big"), stream=True
            )
            try:
                assert len(await bare.aread()) == 40
            finally:
                await bare.aclose()
            assert rest.transport is not None
            route = rest.transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"0123456789": 0}


async def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"x" * 64)

    async with RestDiscoveryClient(
        None, transport=httpx.MockTransport(answer), max_body_bytes=32
    ) as rest:
        with pytest.raises(ResponseTooLarge) as info:
            await rest.request("GET", url="http://example.invalid/")
        assert info.value.size == 64
        assert rest.max_body_bytes == 32


@pytest.mark.parametrize("bad", [0, -1, MANAGED_BODY_LIMIT + 1, True, 1.5])
def test_the_cap_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        RestDiscoveryClient(None, max_body_bytes=bad)  # type: ignore[arg-type]
    assert info.value.path == "rest.max_body_bytes"
    assert RestDiscoveryClient(None).max_body_bytes == MANAGED_BODY_LIMIT == 4 * 1024 * 1024


@pytest.mark.parametrize("declared", ["²", "١٢", "12\u0663"])
async def test_a_content_length_of_non_ascii_digits_is_no_declared_size(declared: str) -> None:
    # str.isdigit() accepts these and int() refuses some of them: a declared
    # length counts only when it is ASCII digits; the read is still counted.
    response = httpx.Response(
        200,
        headers=[(b"content-length", declared.encode())],
        stream=httpx.ByteStream(b"x" * 8),
    )
    _cap(response, 4)
    with pytest.raises(ResponseTooLarge):
        await response.aread()
