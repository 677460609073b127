"""Echoing servers cannot put the password or a token anywhere: not into an
error, a repr, a log line (DEBUG included), the observer, the console JSON or
the metrics. Runs on both loops (the asyncio pass re-runs it), in-process and
over loopback."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, MutableMapping
from typing import Any
from urllib.parse import quote, quote_plus

import anyio
import httpx
import pytest
from nadisc_nacos import NacosProvider, NacosSettings
from nadisc_nacos._http import NacosHttp, NacosResponse
from prometheus_client import CollectorRegistry, generate_latest

from nadisc import (
    DiscoveryConfig,
    DiscoveryError,
    Eligibility,
    IdentityRevoked,
    IncompleteSnapshot,
    PrepareError,
    ProviderFailure,
    RegistrationRejected,
    open_discovery,
    validate_provider_block,
)
from nadisc.observability import ConsoleModel, register_metrics
from tests.fakes.nacos import NacosFake
from tests.support_http import _config as loopback_config
from tests.support_http import serve_app

from .conftest import context, record
from .owner_support import LONG_LIVED, config, identities, until

#: Characters that the form encoding, URL quoting and JSON escaping each change.
PASSWORD = 's3cr3t P@ss/wörd&x=1"q'
USER = "svc"
FAST = {
    "poll_interval_ms": 200,
    "request_timeout_ms": 1000,
    "monitor_interval_ms": 200,
    "observation_grace_ms": 3000,
}

Scope = MutableMapping[str, Any]


class Echo:
    """A reflecting proxy in front of the fake: a request whose path ends with
    a rule's suffix is answered with the rule's status and a dump of the
    request (method, URL, every header, the form body), once per count."""

    def __init__(self, fake: NacosFake) -> None:
        self.fake = fake
        self.rules: list[list[Any]] = []  # [suffix, status, prefix, times]

    def echo(self, suffix: str, status: int, prefix: str, *, times: int = 1) -> None:
        self.rules.append([suffix, status, prefix, times])

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.fake(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        for rule in self.rules:
            if rule[3] > 0 and scope["path"].endswith(rule[0]):
                rule[3] -= 1
                headers = {k.decode(): v.decode() for k, v in scope["headers"]}
                query = scope.get("query_string", b"").decode()
                # What is echoed first is what a short excerpt would quote.
                dump = (
                    f"{rule[2]} body={body.decode()} headers={json.dumps(headers)} "
                    f"request {scope['method']} {scope['path']}?{query}"
                )
                data = dump.encode()
                if rule[1] == 200:  # a v3 envelope whose message echoes
                    data = json.dumps({"code": 500, "message": dump, "data": None}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": rule[1],
                        "headers": [(b"content-type", b"text/plain")],
                    }
                )
                await send({"type": "http.response.body", "body": data})
                return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # type: ignore[no-any-return]

        await self.fake(scope, replay, send)


def built(cfg: DiscoveryConfig, transport: httpx.AsyncBaseTransport | None) -> NacosProvider:
    settings = validate_provider_block("primary", cfg.connections["primary"], NacosSettings)
    ctx = context(request_timeout=cfg.connections["primary"].request_timeout_ms / 1000)
    return NacosProvider(ctx, settings, transport=transport)


def issued(fake: NacosFake) -> list[str]:
    """Record every token the fake signs."""
    tokens: list[str] = []
    sign = fake.issue_token

    def recording(username: str, now: float) -> str:
        token = sign(username, now)
        tokens.append(token)
        return token

    fake.issue_token = recording  # type: ignore[method-assign]
    return tokens


def forms(secret: str) -> set[str]:
    """The secret as an echo could carry it: raw, form-encoded, URL-quoted,
    JSON-escaped (ASCII or not), and its longer halves."""
    out = {secret, quote_plus(secret), quote(secret, safe=""), json.dumps(secret)[1:-1]}
    out.add(json.dumps(secret, ensure_ascii=False)[1:-1])
    if len(secret) >= 16:
        out |= {secret[: len(secret) // 2 + 4], secret[len(secret) // 2 - 4 :]}
    return out


def assert_clean(texts: Iterable[str], secrets: Iterable[str]) -> None:
    needles = set().union(*(forms(s) for s in secrets))
    for text in texts:
        for needle in needles:
            assert needle not in text, f"a secret leaked into: {text[:300]!r}"


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


async def test_echoed_requests_never_leak_through_the_provider(
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    fake = NacosFake(users={USER: PASSWORD})
    tokens = issued(fake)
    echo = Echo(fake)
    settings = NacosSettings.model_validate(
        {"server_addr": fake.url, "username": USER, "password": PASSWORD, "api": "v3"}
    )
    provider = NacosProvider(
        context(), settings, transport=httpx.ASGITransport(app=echo, raise_app_exceptions=False)
    )
    failures: list[BaseException] = []
    soon = anyio.current_time() + 10
    # a login refused with an echo of the form body (the password)
    echo.echo("/auth/user/login", 403, "access denied")
    with pytest.raises(IdentityRevoked) as revoked:
        await provider.prepare(soon)
    failures.append(revoked.value)
    await provider.prepare(anyio.current_time() + 10)
    assert tokens  # logged in for real
    # an expired-token page echoing the headers (the token): one re-login
    echo.echo("/instance/list", 403, "token expired!")
    await provider.query("orders", anyio.current_time() + 10)
    assert len(tokens) == 2
    # a denial that echoes, a server error that echoes, a refused write that echoes
    echo.echo("/instance/list", 403, "authorization failed!")
    echo.echo("/instance/list", 500, "proxy error")
    echo.echo("/client/ns/instance", 200, "refused")  # v3 envelope, message echoes
    for attempt, kind in (
        (lambda: provider.query("orders", anyio.current_time() + 10), IdentityRevoked),
        (lambda: provider.query("orders", anyio.current_time() + 10), IncompleteSnapshot),
        (lambda: provider.register(record(), anyio.current_time() + 10), RegistrationRejected),
    ):
        with pytest.raises(kind) as caught:
            await attempt()
        failures.append(caught.value)
    texts = [str(f) for f in failures] + [repr(f) for f in failures]
    texts += [repr(provider), repr(settings), str(settings.model_dump())]
    texts += [record.getMessage() for record in debug_logs.records]
    texts += [debug_logs.text]
    assert any("token expired" in t for t in texts)  # the verdicts stay readable
    assert any("authorization failed" in t for t in texts)
    assert_clean(texts, [PASSWORD, *tokens])
    await provider.aclose()


async def test_a_refused_login_that_echoes_never_reaches_prepare_error_or_logs(
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    fake = NacosFake(users={USER: PASSWORD})
    echo = Echo(fake)
    echo.echo("/auth/user/login", 403, "denied", times=100)
    echo.echo("/v1/auth/login", 403, "denied", times=100)
    cfg = config(fake.url, policy=FAST, username=USER, password=PASSWORD)
    provider = built(cfg, httpx.ASGITransport(app=echo, raise_app_exceptions=False))
    with pytest.raises(PrepareError) as caught:
        async with open_discovery(cfg, providers={"primary": provider}):
            pass
    texts = [str(caught.value), repr(caught.value), debug_logs.text]
    cause: BaseException | None = caught.value
    while cause is not None:
        texts.append(str(cause))
        cause = cause.__cause__
    assert_clean(texts, [PASSWORD])


async def test_owner_over_loopback_with_an_echoing_server(
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    fake = NacosFake(users={USER: PASSWORD}, token_ttl=3600)
    tokens = issued(fake)
    fake.register("order-worker", "10.0.0.1", 80, now=anyio.current_time(), metadata=LONG_LIVED)
    echo = Echo(fake)
    stop = anyio.Event()
    async with anyio.create_task_group() as servers:
        binds = await servers.start(serve_app, echo, loopback_config(), stop)
        fake.origin = binds[0]
        cfg = config(
            fake.url, policy=FAST, registration={}, username=USER, password=PASSWORD, api="v3"
        )
        provider = built(cfg, None)  # real sockets: httpx and httpcore log too
        registry = CollectorRegistry()
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": ("10.0.0.7", 18080)},
            eligibility={"web": Eligibility.always()},
        ) as owner:
            register_metrics(owner, registry)
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            await until(lambda: len(identities(observation)) == 2, limit=10)
            echo.echo("/instance/list", 403, "token expired!", times=2)
            echo.echo("/instance/list", 500, "proxy error", times=3)
            echo.echo("/client/ns/instance", 403, "token invalid!", times=2)
            await until(lambda: all(rule[3] == 0 for rule in echo.rules), limit=10)
            await anyio.sleep(0.5)
            snapshot = owner.observer().snapshot()
            console = ConsoleModel(owner.observer(), interval=0.1).resample()
            texts = [
                repr(snapshot),
                console.delta({}, full=True) or "",
                generate_latest(registry).decode(),
                repr(owner.registrations()),
                repr(provider),
            ]
        assert len(tokens) >= 2  # the token-expired echoes were re-logins
        stop.set()
    texts += [record.getMessage() for record in debug_logs.records] + [debug_logs.text]
    assert_clean(texts, [PASSWORD, *tokens])
    assert isinstance(IdentityRevoked("x"), ProviderFailure | DiscoveryError)


async def test_a_response_repr_shows_no_body() -> None:
    response = NacosResponse(403, f"password={PASSWORD}".encode())
    assert repr(response) == f"NacosResponse(status=403, {len(response.body)} bytes)"
    http = NacosHttp(
        NacosSettings.model_validate({"username": USER, "password": PASSWORD}),
        max_response_bytes=1024,
    )
    assert_clean([repr(response), http.quote(response)], [PASSWORD])
    await http.aclose()
