"""The Kubernetes credentials never leave through anything but the
``Authorization`` header, even when the server (or a proxy in front of it)
echoes the request back: not in errors, reprs, DEBUG logs, the observer,
the console's JSON or the metrics exposition."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from nadisc_kubernetes import KubernetesSettings, factory, resolve_access

from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    EvidenceUnavailable,
    PrepareError,
    ProviderFailure,
    open_discovery,
    validate_provider_block,
)
from nadisc.observability import ConsoleModel, metrics_app
from tests.fakes.kubernetes import KubernetesFake

from .conftest import RecordingSink, owned_slice, write_kubeconfig

pytestmark = pytest.mark.trio_only

SECRET = "sha256~Zm9vYmFyLXNlY3JldC10b2tlbg"
#: Lines of the client key's PEM body, filled in from the generated key.
KEY_LINES: list[str] = []


class Echoing(httpx.AsyncBaseTransport):
    """A reflecting proxy in front of the fake: requests to ``echo_paths``
    are answered with ``status`` and a body quoting the request's headers
    (the bearer token included), the way debugging proxies and some
    authenticating gateways answer."""

    def __init__(self, fake: KubernetesFake) -> None:
        self.inner = fake.transport()
        self.status = 0
        self.watch_error = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        authorization = request.headers.get("authorization", "")
        is_slices = "endpointslices" in request.url.path
        if is_slices and self.watch_error and request.url.params.get("watch"):
            message = f"watch refused for {authorization}; token={SECRET}"
            event = {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "code": 500,
                    "reason": "InternalError",
                    "message": message,
                },
            }
            return httpx.Response(200, content=json.dumps(event).encode() + b"\n", request=request)
        if is_slices and self.status:
            if self.status in (401, 403):
                body = {
                    "kind": "Status",
                    "code": self.status,
                    "reason": "Forbidden",
                    "message": f"invalid credentials: {authorization}",
                }
                return httpx.Response(self.status, json=body, request=request)
            dump = {"error": "upstream failed", "request": {"headers": dict(request.headers)}}
            return httpx.Response(self.status, text=json.dumps(dump), request=request)
        return await self.inner.handle_async_request(request)


def the_config(tmp_path: Path, url: str, cert: tuple[str, str]) -> DiscoveryConfig:
    cert_pem, key_pem = Path(cert[0]).read_bytes(), Path(cert[1]).read_bytes()
    KEY_LINES[:] = [line for line in key_pem.decode().splitlines() if "-----" not in line]
    kubeconfig = write_kubeconfig(
        tmp_path / "config",
        url,
        token=SECRET,
        user={
            "token": SECRET,
            "client-certificate-data": base64.b64encode(cert_pem).decode(),
            "client-key-data": base64.b64encode(key_pem).decode(),
        },
    )
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "kubernetes",
                    "request_timeout_ms": 2000,
                    "kubernetes": {
                        "credentials": "kubeconfig",
                        "kubeconfig": str(kubeconfig),
                        "initial_backoff": 1,
                        "max_backoff": 2,
                        "services": {"orders": {"port": "http"}},
                    },
                }
            },
        }
    )


def leaks(text: str) -> bool:
    return SECRET[7:] in text or any(line in text for line in KEY_LINES)


async def test_echoed_credentials_reach_no_error_log_observer_console_or_metric(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    self_signed_cert: tuple[str, str],
) -> None:
    caplog.set_level(logging.DEBUG)
    fake = KubernetesFake(tokens={SECRET: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    echo = Echoing(fake)
    cfg = the_config(tmp_path, fake.url, self_signed_cert)
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, KubernetesSettings)
    context = ConnectionContext(
        name="primary",
        request_timeout=2.0,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
    provider = factory.create_with(context, settings, transport=echo, environ={})
    seen: list[str] = [repr(provider), repr(provider.access), repr(settings), str(settings)]
    # Direct queries: every failure kind quotes the echo.
    for status in (401, 403, 500, 502):
        echo.status = status
        with pytest.raises(ProviderFailure) as caught:
            await provider.query("orders", trio.current_time() + 5)
        seen += [str(caught.value), repr(caught.value)]
        assert "***" in str(caught.value) or status >= 500
    echo.status = 0
    # The watch: an ERROR event quoting the token.
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        echo.watch_error = True
        fake.end_watches()
        await sink.wait_for(lambda: bool(sink.failures))
        nursery.cancel_scope.cancel()
    echo.watch_error = False
    seen += [str(f) for f in sink.failures] + [repr(f) for f in sink.failures]
    # Through the owner: a refused start, then the observer, console JSON, metrics.
    echo.status = 403
    with pytest.raises(PrepareError) as refused:
        async with open_discovery(cfg, providers={"primary": provider}):
            pass
    seen.append(str(refused.value))
    echo.status = 0
    again = factory.create_with(context, settings, transport=echo, environ={})
    async with open_discovery(cfg, providers={"primary": again}) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        assert observation.snapshot().identities() == ("pod-1",)
        echo.status = 403
        fake.end_watches()
        await trio.sleep(20)
        with pytest.raises(EvidenceUnavailable) as unavailable:
            observation.snapshot(strict=True)
        seen.append(str(unavailable.value))
        seen.append(repr(owner.observer().snapshot()))
        console = ConsoleModel(owner.observer()).current.delta({}, full=True)
        assert console is not None and "primary" in console
        seen.append(console)
        app = metrics_app(owner)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://m"
        ) as client:
            seen.append((await client.get("/metrics")).text)
    seen += [record.getMessage() for record in caplog.records]
    seen += [str(record.args) for record in caplog.records]
    assert any("invalid credentials" in text for text in seen)  # the echoes were quoted...
    leaked = [text[:200] for text in seen if leaks(text)]
    assert not leaked  # ...without the credentials


def test_the_token_is_not_in_the_access_repr_or_settings(tmp_path: Path) -> None:
    config = write_kubeconfig(tmp_path / "config", "https://k:6443", token=SECRET)
    settings = KubernetesSettings.model_validate(
        {"credentials": "kubeconfig", "kubeconfig": str(config)}
    )
    access = resolve_access(settings, {})
    assert not leaks(repr(access)) and not leaks(repr(access.tokens))
    assert access.tokens.current() == SECRET
