"""The eligibility probe: direct ASGI calls and a real hypercorn server on loopback."""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve

from nadisc import Eligibility, RegistrationSet, RegistrationSpec, eligibility_probe_app

pytestmark = pytest.mark.trio_only


async def call(app: Any, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    start, body = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, body["body"]


def probe_for(
    eligibility: dict[str, Eligibility], *, enabled: bool = True, now: float = 100.0
) -> Any:
    return eligibility_probe_app(eligibility, enabled=enabled, clock=lambda: now)


async def test_direct_calls() -> None:
    controller, web = Eligibility.channel()
    controller.update(True, 10.0, now=95.0)
    _, off = Eligibility.channel()
    app = probe_for({"web": web, "grpc": off})

    status, headers, body = await call(app, "GET", "/discovery/eligible/web")
    assert status == 200
    assert json.loads(body) == {"registration": "web", "eligible": True}
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert headers["cache-control"] == "no-store"

    status, _, body = await call(app, "GET", "/discovery/eligible/grpc")
    assert status == 503 and json.loads(body)["eligible"] is False

    status, _, _ = await call(app, "GET", "/discovery/eligible/nope")
    assert status == 404
    status, _, _ = await call(app, "GET", "/discovery/eligible/web/extra")
    assert status == 404
    status, _, _ = await call(app, "GET", "/readyz")
    assert status == 404
    status, headers, _ = await call(app, "POST", "/discovery/eligible/web")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    status, headers, body = await call(app, "HEAD", "/discovery/eligible/web")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0

    # Lapse: the same probe answers 503 once the grant ran out.
    lapsed = probe_for({"web": web}, now=105.0)
    status, _, _ = await call(lapsed, "GET", "/discovery/eligible/web")
    assert status == 503


async def test_disabled_probe_is_404_everywhere() -> None:
    app = probe_for({"web": Eligibility.always()}, enabled=False)
    for method in ("GET", "HEAD", "POST"):
        status, _, _ = await call(app, method, "/discovery/eligible/web")
        assert status == 404


async def test_reads_only_local_eligibility_not_registration_state() -> None:
    # A frozen, never-published registration is not Active; the probe still
    # reports its local eligibility (no cycle through overall readiness).
    registrations = RegistrationSet()
    registrations.freeze(
        [
            RegistrationSpec(
                name="web",
                service_name="orders",
                ip="10.0.0.5",
                port=8080,
                eligibility=Eligibility.always(),
            )
        ],
        {"primary": (_capabilities(), {"orders": "orders"})},
    )
    app = probe_for(dict(registrations.eligibilities()))
    status, _, _ = await call(app, "GET", "/discovery/eligible/web")
    assert status == 200
    assert registrations.registrations(now=0.0)["web"].state.value == "pending"


def _capabilities() -> Any:
    from nadisc import Capabilities, EvidenceKind

    return Capabilities(evidence=EvidenceKind.REGISTRY_HEALTH, registration=True)


async def test_lifespan_and_other_scopes() -> None:
    app = probe_for({})
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    sent.clear()
    await app({"type": "websocket", "path": "/discovery/eligible/x"}, receive, send)
    assert sent == []


async def test_served_by_hypercorn_on_trio() -> None:
    controller, web = Eligibility.channel()
    controller.update(True, 30.0)
    _, grpc = Eligibility.channel()
    app = eligibility_probe_app({"web": web, "grpc": grpc}, enabled=True)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(
                cast(Any, app), config, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        base = binds[0]
        assert base.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=base) as client:
            ok = await client.get("/discovery/eligible/web")
            assert ok.status_code == 200 and ok.json() == {"registration": "web", "eligible": True}
            no = await client.get("/discovery/eligible/grpc")
            assert no.status_code == 503 and no.json()["eligible"] is False
            missing = await client.get("/discovery/eligible/other")
            assert missing.status_code == 404
            controller.close()
            closed = await client.get("/discovery/eligible/web")
            assert closed.status_code == 503
        stop.set()


async def test_probe_mounted_under_a_prefix_uses_root_path() -> None:
    app = eligibility_probe_app({"web": Eligibility.always()}, enabled=True, clock=lambda: 0.0)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    # What Starlette's Mount("/ops", app) passes down: full path, prefix in root_path.
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/ops/discovery/eligible/web",
        "root_path": "/ops",
        "headers": [],
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"])["eligible"] is True


# --------------------------------------------------------------------------- served by the owner


def _owner_config(*, probe: bool) -> Any:
    from nadisc import DiscoveryConfig

    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "eligibility_probe": probe,
            "connections": {
                "primary": {
                    "provider": "memory",
                    "memory": {"services": {"self": {"name": "order-api"}}},
                }
            },
            "registrations": {
                "business-http": {
                    "service_name": "self",
                    "listener_ref": "web",
                    "ip": "10.0.0.5",
                    "port": 18080,
                }
            },
        }
    )


async def test_owner_probe_served_by_hypercorn_on_trio() -> None:
    from nadisc import open_discovery
    from nadisc.testing import MemoryProvider, MemoryRegistry

    controller, web = Eligibility.channel()
    controller.update(True, 30.0)
    provider = MemoryProvider(registry=MemoryRegistry())
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    stop = trio.Event()
    async with open_discovery(
        _owner_config(probe=True),
        providers={"primary": provider},
        listeners={"web": ("10.0.0.5", 18080)},
        eligibility={"web": web},
    ) as owner:
        app = owner.eligibility_probe()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve(
                    cast(Any, app), config, shutdown_trigger=stop.wait, task_status=task_status
                )
            )
            async with httpx.AsyncClient(base_url=binds[0]) as client:
                # Keyed by registration name, not by the eligibility reference.
                ok = await client.get("/discovery/eligible/business-http")
                assert ok.status_code == 200
                assert ok.json() == {"registration": "business-http", "eligible": True}
                assert (await client.get("/discovery/eligible/web")).status_code == 404
                assert (await client.get("/discovery/eligible/other")).status_code == 404
                controller.close()
                closed = await client.get("/discovery/eligible/business-http")
                assert closed.status_code == 503 and closed.json()["eligible"] is False
            stop.set()


async def test_owner_probe_is_404_when_the_flag_is_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from nadisc import open_discovery
    from nadisc.testing import MemoryProvider, MemoryRegistry

    provider = MemoryProvider(registry=MemoryRegistry())
    async with open_discovery(
        _owner_config(probe=False),
        providers={"primary": provider},
        listeners={"web": ("10.0.0.5", 18080)},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        assert owner.registrations()["business-http"].eligible
        status, _, _ = await call(
            owner.eligibility_probe(), "GET", "/discovery/eligible/business-http"
        )
        assert status == 404


async def test_owner_probe_built_before_freeze_sees_the_plan(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from nadisc import OwnerBuilder
    from nadisc.testing import MemoryProvider, MemoryRegistry

    provider = MemoryProvider(registry=MemoryRegistry())
    builder = OwnerBuilder.from_config(
        _owner_config(probe=True),
        providers={"primary": provider},
        listeners={"web": ("10.0.0.5", 18080)},
        eligibility={"web": Eligibility.always()},
    )
    async with builder.open() as owner:
        await owner.prepare(trio.current_time() + 5)
        app = owner.eligibility_probe()
        status, _, _ = await call(app, "GET", "/discovery/eligible/business-http")
        assert status == 404  # not frozen yet: no registration known
        owner.freeze_registrations()
        status, _, _ = await call(app, "GET", "/discovery/eligible/business-http")
        assert status == 200  # the same app reads the live view
    # Without a registration component the probe knows nothing.
    bare = OwnerBuilder().enable_eligibility_probe()
    async with bare.open() as empty:
        status, _, _ = await call(empty.eligibility_probe(), "GET", "/discovery/eligible/x")
        assert status == 404


def test_registration_set_eligibilities_is_a_live_read_only_view() -> None:
    registrations = RegistrationSet()
    view = registrations.eligibilities()
    assert dict(view) == {}
    web = Eligibility.always()
    registrations.freeze(
        [
            RegistrationSpec(
                name="web", service_name="orders", ip="10.0.0.5", port=1, eligibility=web
            )
        ],
        {"primary": (_capabilities(), {"orders": "orders"})},
    )
    assert dict(view) == {"web": web}
    with pytest.raises(TypeError):
        view["x"] = web  # type: ignore[index]
