"""Prometheus metrics: scraped through the ASGI app, parsed with prometheus_client.parser.

A scripted scenario (queries, a failed refresh, a registration whose first
write's answer is lost: OutcomeUnknown) is checked value by value against
the observer. A hostile scenario puts service names, metadata and a
credential full of exposition syntax through the owner; none of it may
reach the exposition text.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nadisc_consul import ConsulSettings, factory
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryTransport,
    Eligibility,
    IncompleteSnapshot,
    RegistrationState,
    open_discovery,
    validate_provider_block,
)
from nadisc.observability import DiscoveryCollector, metrics_app, register_metrics
from nadisc.testing import Fault, MemoryProvider, MemoryRegistry
from tests.fakes.consul import open_consul_fake
from tests.nadisc.owner_support import inst

pytestmark = pytest.mark.trio_only

WEB = ("10.0.0.5", 18080)
ADMIN = ("10.0.1.5", 19090)


def memory_connection() -> dict[str, Any]:
    return {
        "provider": "memory",
        "monitor_interval_ms": 1000,
        "observation_grace_ms": 5000,
        "request_timeout_ms": 500,
        "poll_interval_ms": 1000,
        "deregister_timeout_ms": 700,
        "retry": {"initial_backoff_ms": 200, "max_backoff_ms": 2000},
        "memory": {"services": {"self": {"name": "order-api"}, "orders": {"name": "order-worker"}}},
    }


def scenario_config() -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {"primary": memory_connection(), "infra": memory_connection()},
            "registrations": {
                "business-http": {
                    "service_name": "self",
                    "listener_ref": "web",
                    "ip": WEB[0],
                    "port": WEB[1],
                },
                "infra-http": {
                    "qualifier": "infra",
                    "service_name": "self",
                    "listener_ref": "admin",
                    "ip": ADMIN[0],
                    "port": ADMIN[1],
                    "startup_required": False,
                },
            },
            "shutdown_timeout_ms": 5000,
        }
    )


async def scrape(app: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET the app; parse the exposition into {(sample name, sorted labels): value}."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://metrics"
    ) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_scripted_scenario_matches_the_observer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    business_registry = MemoryRegistry(idempotent_renewal=True)
    business = MemoryProvider(registry=business_registry)
    infra_registry = MemoryRegistry(idempotent_renewal=True)
    infra = MemoryProvider(registry=infra_registry)
    business.set("order-worker", [inst("w1"), inst("w2")])
    infra_registry.inject("register", Fault.drop())  # the first write's answer is lost
    always = Eligibility.always()
    async with open_discovery(
        scenario_config(),
        providers={"primary": business, "infra": infra},
        listeners={"web": WEB, "admin": ADMIN},
        eligibility={"web": always, "admin": always},
    ) as owner:
        orders = await owner.client().observe("orders", trio.current_time() + 5)
        await trio.sleep(3.5)  # a few polls and renewals
        business.fail("order-worker", IncompleteSnapshot("connection reset"), times=1)
        await trio.sleep(1.2)  # one failed refresh (then a retry after backoff works)
        assert orders.snapshot().identities() == ("w1", "w2")

        app = metrics_app(owner)
        samples = await scrape(app)
        snap = owner.observer().snapshot()
        primary = snap.connection("primary")

        assert value(samples, "nadisc_discovery_phase", phase=snap.phase.value) == 1
        assert value(samples, "nadisc_discovery_prepared") == 1
        assert value(samples, "nadisc_discovery_queries_total", connection="primary") == (
            primary.queries
        )
        assert primary.queries >= 4
        assert primary.failures == 1 and primary.failure_kinds == (("incomplete", 1),)
        assert (
            value(
                samples,
                "nadisc_discovery_query_errors_total",
                connection="primary",
                kind="incomplete",
            )
            == 1
        )
        assert (
            value(
                samples, "nadisc_discovery_query_errors_total", connection="primary", kind="revoked"
            )
            == 0
        )
        assert (
            value(samples, "nadisc_discovery_query_duration_seconds_count", connection="primary")
            == primary.queries
        )
        assert (
            value(
                samples,
                "nadisc_discovery_query_duration_seconds_bucket",
                connection="primary",
                le="+Inf",
            )
            == primary.queries
        )
        assert value(samples, "nadisc_discovery_instances_served", connection="primary") == 2
        assert value(samples, "nadisc_discovery_observations", connection="primary") == 1
        (service,) = primary.services
        assert service.evidence_age is not None
        assert value(
            samples, "nadisc_discovery_evidence_age_seconds", connection="primary"
        ) == pytest.approx(service.evidence_age)
        assert value(samples, "nadisc_discovery_watch_streams") == snap.capacity.watch_streams
        assert value(samples, "nadisc_discovery_transport_tasks") == snap.capacity.transport_tasks

        infra_state = snap.registration("infra-http")
        assert infra_state.state is RegistrationState.OUTCOME_UNKNOWN
        for state in RegistrationState:
            expected = 1.0 if state is RegistrationState.OUTCOME_UNKNOWN else 0.0
            assert (
                value(
                    samples,
                    "nadisc_discovery_registration_state",
                    registration="infra-http",
                    connection="infra",
                    state=state.value,
                )
                == expected
            )
        assert (
            value(
                samples,
                "nadisc_discovery_registration_state",
                registration="business-http",
                connection="primary",
                state="active",
            )
            == 1
        )
        assert (
            value(
                samples,
                "nadisc_discovery_registration_residual_risk",
                registration="infra-http",
                connection="infra",
            )
            == 1
        )
        business_state = snap.registration("business-http")
        assert business_state.renewals >= 2
        assert (
            value(
                samples,
                "nadisc_discovery_registration_renewals_total",
                registration="business-http",
                connection="primary",
            )
            == business_state.renewals
        )
        renew_ops = [op for op in business_registry.operations("renew")]
        assert business_state.renewals == len(renew_ops)
        # The history shows the way to Active.
        assert [s for _, s in business_state.history][-1] is RegistrationState.ACTIVE
        assert RegistrationState.PENDING in [s for _, s in business_state.history]
        # Close outcomes are one-hot per registration ("registered" before close).
        assert (
            value(
                samples,
                "nadisc_discovery_close_outcome",
                registration="infra-http",
                connection="infra",
                outcome="outcome_unknown",
            )
            == 1
        )


async def test_registration_into_an_existing_registry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = MemoryProvider(services={"orders": "order-worker"})
    provider.set("order-worker", [inst("w1")])
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    registry = CollectorRegistry()
    app_requests = Counter("app_requests", "The host's own metric.", registry=registry)
    app_requests.inc(3)
    async with open_discovery(config, providers={"primary": provider}) as owner:
        await owner.client().observe("orders", trio.current_time() + 5)
        collector = register_metrics(owner, registry)
        assert isinstance(collector, DiscoveryCollector)
        samples = await scrape(metrics_app(owner, registry=CollectorRegistry()))
        assert value(samples, "nadisc_discovery_instances_served", connection="primary") == 1
        # The host's registry now serves both.
        from prometheus_client import generate_latest

        text = generate_latest(registry).decode()
        assert "app_requests_total 3.0" in text
        assert 'nadisc_discovery_instances_served{connection="primary"} 1.0' in text
        # A second owner's families would collide: prometheus_client refuses.
        with pytest.raises(ValueError):
            register_metrics(owner, registry)
        registry.unregister(collector)
        assert "nadisc_discovery" not in generate_latest(registry).decode()


async def test_a_bearer_token_guards_the_metrics_app(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = MemoryProvider(services={"orders": "order-worker"})
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    async with open_discovery(config, providers={"primary": provider}) as owner:
        app = metrics_app(owner, token="t0ken")
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://m"
        ) as client:
            assert (await client.get("/")).status_code == 401
            assert (
                await client.get("/", headers={"authorization": "Bearer nope"})
            ).status_code == 401
            ok = await client.get("/", headers={"authorization": "Bearer t0ken"})
            assert ok.status_code == 200 and "t0ken" not in ok.text
            assert (
                await client.post("/", headers={"authorization": "Bearer t0ken"})
            ).status_code == 405


HOSTILE = st.text(
    alphabet=st.sampled_from('abcXYZ09"{}=,\\\n#-_. <>/'), min_size=12, max_size=30
).filter(lambda s: s.strip() == s and "\n" not in s and len(set(s)) > 6)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=HOSTILE, meta=HOSTILE, secret=HOSTILE)
async def test_hostile_names_metadata_and_secrets_never_reach_the_exposition(
    name: str, meta: str, secret: str
) -> None:
    alias = "svc_" + "".join(c for c in name if c.isalnum()) + "_alias"
    async with open_consul_fake() as fake:
        remote = f"remote-{name}"
        cfg = DiscoveryConfig.model_validate(
            {
                "enabled": True,
                "connections": {
                    "primary": {
                        "provider": "consul",
                        "consul": {
                            "url": "http://consul.invalid:8500",
                            "token": f"tok-{secret}",
                            "identity_scope": "service",
                            "services": {alias: {"name": remote}},
                        },
                    }
                },
            }
        )
        fake.register(
            {
                "Name": remote,
                "ID": f"id-{name}",
                "Address": "10.9.9.9",
                "Port": 9999,
                "Tags": [f"tag-{meta}"],
                "Meta": {"k": f"meta-{meta}", "password": f"pw-{secret}"},
                "Check": {"TTL": "1h", "Status": "passing"},
            },
            now=trio.current_time(),
        )
        connection = cfg.connections["primary"]
        settings_block = validate_provider_block("primary", connection, ConsulSettings)
        context = ConnectionContext(
            name="primary",
            request_timeout=connection.request_timeout_ms / 1000,
            max_instances_per_service=cfg.limits.max_instances_per_service,
            max_response_bytes=cfg.limits.max_snapshot_bytes,
        )
        provider = factory.create_with(context, settings_block, transport=fake.transport())
        async with open_discovery(cfg, providers={"primary": provider}) as owner:
            observation = await owner.client().observe(alias, trio.current_time() + 5)
            assert observation.snapshot().identities() == (f"id-{name}",)
            # Calls to the hostile instance fail (a 500, then a refused connection):
            # the balancer families count them without naming service or instance.
            answers = iter([httpx.Response(500, text=f"boom {secret}")])

            async def answer(request: httpx.Request) -> httpx.Response:
                for response in answers:
                    return response
                raise httpx.ConnectError(f"refused by {name}", request=request)

            async with (
                DiscoveryTransport(owner, transport=httpx.MockTransport(answer)) as calls,
                httpx.AsyncClient(mounts={"nadisc://": calls}) as caller,
            ):
                assert (await caller.get(f"nadisc://primary/{alias}/x")).status_code == 500
                with pytest.raises(httpx.ConnectError):
                    await caller.get(f"nadisc://primary/{alias}/x")
                app = metrics_app(owner, transports=[calls])
                async with httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://m"
                ) as client:
                    text = (await client.get("/metrics")).text
    assert 'nadisc_discovery_instances_served{connection="primary"} 1.0' in text
    for kind, count in (("status", 1), ("transport", 1), ("timeout", 0)):
        line = f'nadisc_discovery_balancer_failures_total{{connection="primary",kind="{kind}"}}'
        assert f"{line} {count:.1f}" in text
    assert 'nadisc_discovery_balancer_calls_total{connection="primary"} 2.0' in text
    # (The port is not searched as a bare number: sample values are numbers.)
    for leaked in (alias, remote, name, f"id-{name}", meta, secret, "10.9.9.9"):
        assert leaked not in text, leaked
    # Every label value is a configured name or a member of a closed set.
    closed = {"primary"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label, label_value in sample.labels.items():
                if label == "connection":
                    assert label_value in closed
                elif label == "le":
                    float(label_value)
                elif label == "provider":
                    assert label_value == "consul"  # the configured provider name
                elif label == "version":
                    assert family.name == "nadisc_build_info"
                else:
                    assert label in ("phase", "state", "kind", "reason", "outcome", "readiness")
                    assert label_value.replace("_", "").isalpha()
