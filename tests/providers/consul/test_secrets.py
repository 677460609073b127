"""The ACL token: sent as a bearer credential (masked by httpx), never in a
URL, never quoted back from a registry answer."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from nadisc_consul import ConsulProvider, ConsulSettings

from nadisc import ConfigError, ProviderFailure, RegistrationRecord, load_config

from .conftest import context

TOKEN = "b1gS3cr3t-acl-token"


def provider_with(handler: object) -> ConsulProvider:
    settings = ConsulSettings(token=TOKEN)  # type: ignore[arg-type]
    return ConsulProvider(context(), settings, transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


async def test_the_token_travels_as_authorization_bearer_and_is_masked() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, text="rpc error: No cluster leader")

    provider = provider_with(handler)
    try:
        with pytest.raises(ProviderFailure):
            await provider.query("web", anyio.current_time() + 5)
    finally:
        await provider.aclose()
    (request,) = seen
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert "x-consul-token" not in request.headers
    assert TOKEN not in repr(request.headers)  # httpx masks Authorization


def reflect(request: httpx.Request) -> httpx.Response:
    echoed = {"headers": dict(request.headers), "body": request.content.decode()}
    return httpx.Response(500, text=f"proxy error, request: {json.dumps(echoed)}")


async def test_an_echoed_request_never_puts_the_token_into_errors() -> None:
    provider = provider_with(reflect)
    record = RegistrationRecord(
        registration="web", service="web", instance_id="web-1", host="10.0.0.1", port=8080
    )
    failures: list[ProviderFailure] = []
    try:
        for attempt in (
            lambda: provider.query("web", anyio.current_time() + 5),
            lambda: provider.register(record, anyio.current_time() + 5),
        ):
            with pytest.raises(ProviderFailure) as caught:
                await attempt()
            failures.append(caught.value)
    finally:
        await provider.aclose()
    for failure in failures:
        assert TOKEN not in str(failure) and TOKEN not in repr(failure)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8500/?token=b1gS3cr3t", "http://127.0.0.1:8500?x-consul-token=b1g"]
)
def test_a_token_in_the_url_query_is_refused_at_load(url: str) -> None:
    text = (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: consul\n"
        f"      consul: {{url: '{url}'}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == "discovery.connections.primary.consul.url"
    assert "b1g" not in str(info.value)
