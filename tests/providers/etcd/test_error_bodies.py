"""Registry answers in errors: filtered, never the password or the token;
a lease grant answered 200 without an ID is classified like a garbage 200."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from nadisc_etcd import EtcdProvider, EtcdSettings

from nadisc import OutcomeUnknown, ProviderFailure, RegistrationRecord, RegistrationRejected

from .conftest import make_context
from .test_etcd_units import reply

PASSWORD = "pa55-w0rd-Xy"
TOKEN = "tok.en-Secret-123"


def settings() -> EtcdSettings:
    return EtcdSettings.model_validate(
        {"endpoints": ["http://a:1"], "username": "app", "password": PASSWORD}
    )


def record() -> RegistrationRecord:
    return RegistrationRecord(
        registration="web", service="orders", instance_id="i-1", host="10.0.0.1", port=8080
    )


def provider_with(handler: httpx.MockTransport) -> EtcdProvider:
    return EtcdProvider(make_context(), settings(), transport=handler)


def authenticate(request: httpx.Request) -> httpx.Response | None:
    if request.url.path == "/v3/auth/authenticate":
        return reply(200, {"header": {}, "token": TOKEN})
    return None


def reflect(request: httpx.Request) -> httpx.Response:
    """A proxy that echoes the whole request (headers and body) in its error."""
    answered = authenticate(request)
    if answered is not None:
        return answered
    echoed = {
        "headers": dict(request.headers),
        "body": request.content.decode(),
        "password": PASSWORD,
    }
    return reply(502, raw=f"bad gateway; request was {json.dumps(echoed)}".encode())


def reflect_as_grpc_error(request: httpx.Request) -> httpx.Response:
    answered = authenticate(request)
    if answered is not None:
        return answered
    message = f"auth failed for token {TOKEN} with Authorization: {TOKEN} password={PASSWORD}"
    return reply(500, {"code": 2, "error": message, "message": message})


@pytest.mark.parametrize("handler", [reflect, reflect_as_grpc_error])
async def test_an_echoed_request_never_puts_credentials_into_errors(handler: object) -> None:
    provider = provider_with(httpx.MockTransport(handler))  # type: ignore[arg-type]
    failures: list[ProviderFailure] = []
    try:
        for attempt in (
            lambda: provider.query("orders", anyio.current_time() + 5),
            lambda: provider.register(record(), anyio.current_time() + 5),
        ):
            with pytest.raises(ProviderFailure) as caught:
                await attempt()
            failures.append(caught.value)
    finally:
        await provider.aclose()
    for failure in failures:
        text = str(failure) + repr(failure)
        assert PASSWORD not in text and TOKEN not in text, text


async def test_a_lease_grant_without_an_id_is_outcome_unknown_like_a_garbage_200() -> None:
    def grant(body: bytes) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            answered = authenticate(request)
            if answered is not None:
                return answered
            return reply(200, raw=body)

        return httpx.MockTransport(handler)

    outcomes: list[type[BaseException]] = []
    for body in (b'{"header": {}, "TTL": "15"}', b"garbage"):
        provider = provider_with(grant(body))
        try:
            with pytest.raises(ProviderFailure) as caught:
                await provider.register(record(), anyio.current_time() + 5)
        finally:
            await provider.aclose()
        outcomes.append(type(caught.value))
    assert outcomes == [OutcomeUnknown, OutcomeUnknown]
    # an explicit error in the answer is still a definitive refusal
    provider = provider_with(grant(b'{"header": {}, "error": "too many leases"}'))
    try:
        with pytest.raises(RegistrationRejected):
            await provider.register(record(), anyio.current_time() + 5)
    finally:
        await provider.aclose()
