"""The seed's two-cluster example runs end to end: its YAML verbatim (only the
environment variables supplied), two Nacos fakes (business and
infrastructure), the ``business-http`` registration, a weighted REST call,
``client("infrastructure")`` seeing only its own cluster, and a failed
``primary`` that never falls back."""

from __future__ import annotations

import pytest
import trio

from nadisc import (
    DiscoveryError,
    Eligibility,
    RegistrationState,
    UnknownService,
    load_document,
    open_discovery,
    parse_config,
)
from nadisc._cli import expand_variables
from tests.fakes.nacos import Fault, NacosFake
from tests.support_http import HttpBackend, serve_backends

from ...seed_yaml import SEED_EXAMPLE
from .owner_support import identities, providers_for

pytestmark = pytest.mark.trio_only


ENVIRON = {
    "BUSINESS_NACOS_USERNAME": "order-api",
    "BUSINESS_NACOS_PASSWORD": "business-secret",
    "INFRA_NACOS_USERNAME": "order-api-infra",
    "INFRA_NACOS_PASSWORD": "infra-secret",
    "BUSINESS_REGISTER_IP": "10.20.0.5",
}


def clusters() -> tuple[NacosFake, NacosFake]:
    business = NacosFake(url="http://nacos-business:8848", users={"order-api": "business-secret"})
    infra = NacosFake(url="http://nacos-infra:8848", users={"order-api-infra": "infra-secret"})
    return business, infra


async def test_the_seed_two_cluster_yaml_runs_end_to_end() -> None:
    cfg = parse_config(expand_variables(load_document(SEED_EXAMPLE), ENVIRON))
    assert "business-secret" not in repr(cfg)
    async with serve_backends(
        HttpBackend("w1", weight=3), HttpBackend("w2", weight=1), HttpBackend("infra-worker")
    ) as (w1, w2, stray):
        business, infra = clusters()
        now = trio.current_time()
        for backend in (w1, w2):
            business.register(
                "order-worker",
                backend.host,
                backend.port,
                now=now,
                group="BUSINESS",
                weight=backend.weight,
                ephemeral=False,
            )
        # the same remote name in the other cluster must never be used by primary
        infra.register(
            "order-worker",
            stray.host,
            stray.port,
            now=now,
            group="INFRASTRUCTURE",
            ephemeral=False,
        )
        infra.register(
            "saga-server", "10.30.0.9", 9000, now=now, group="INFRASTRUCTURE", ephemeral=False
        )
        async with open_discovery(
            cfg,
            providers=providers_for(cfg, {"primary": business, "infrastructure": infra}),
            listeners={"web": ("10.20.0.5", 18080)},
            eligibility={"web": Eligibility.always()},
            publish_deadline=trio.current_time() + 10,
        ) as owner:
            status = owner.registrations()["business-http"]
            assert status.state is RegistrationState.ACTIVE and status.qualifier == "primary"
            mine = business.find("order-api", "10.20.0.5", 18080, group="BUSINESS")
            assert mine is not None and mine.ephemeral
            assert business.logins >= 1 and infra.logins >= 1
            # weighted REST calls over primary reach only the business cluster's workers
            rest = owner.rest("primary")
            answers = [
                (await rest.request("GET", service="orders", path="/work")).text for _ in range(8)
            ]
            assert sorted(set(answers)) == ["w1", "w2"]
            assert answers.count("w1") == 6 and answers.count("w2") == 2
            assert stray.requests == []
            # infrastructure sees only its own services
            infrastructure = owner.client("infrastructure")
            coordinator = await infrastructure.observe("coordinator", trio.current_time() + 5)
            assert identities(coordinator) == (
                "10.30.0.9#9000#DEFAULT#INFRASTRUCTURE@@saga-server",
            )
            with pytest.raises(UnknownService):
                await infrastructure.observe("orders", trio.current_time() + 5)
        assert business.find("order-api", "10.20.0.5", 18080, group="BUSINESS") is None

        # a primary whose listings fail never falls back to the other cluster
        business, infra = clusters()
        infra.register(
            "order-worker",
            stray.host,
            stray.port,
            now=trio.current_time(),
            group="INFRASTRUCTURE",
            ephemeral=False,
        )
        business.inject("/v1", Fault("status", 503, b"busy", service="order-worker"), times=10**6)
        business.inject("/v3", Fault("status", 503, b"busy", service="order-worker"), times=10**6)
        async with open_discovery(
            cfg,
            providers=providers_for(cfg, {"primary": business, "infrastructure": infra}),
            listeners={"web": ("10.20.0.5", 18080)},
            eligibility={"web": Eligibility.always()},
            publish_deadline=trio.current_time() + 10,
        ) as owner:
            with pytest.raises(DiscoveryError):
                await owner.rest("primary").request("GET", service="orders", path="/work")
            with pytest.raises(DiscoveryError):
                await owner.rest().request("GET", service="orders", path="/work")
        assert stray.requests == []
