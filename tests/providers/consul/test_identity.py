"""Instance identity across a fleet, and health before de-duplication.

A Consul service ID is unique per agent (node) only, and an ID left unset
defaults to the service name, so fleets commonly repeat one ID on every
node. Identities are therefore ``<node>/<ID>`` by default.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from nadisc_consul import ConsulProvider, ConsulSettings
from nadisc_consul._wire import decode_health_service

from tests.fakes.consul import ConsulFake

from .conftest import context


def service(node_address: str) -> dict[str, Any]:
    # ID omitted: Consul defaults it to the name, on every node alike
    return {
        "Name": "web",
        "Address": node_address,
        "Port": 8080,
        "Check": {"TTL": "1h", "Status": "passing"},
    }


async def test_the_default_identity_keeps_every_node_of_a_fleet_that_reuses_ids() -> None:
    assert ConsulSettings().identity_scope == "node"
    fake = ConsulFake()
    fake.add_node("node-b", "10.0.0.2")
    fake.add_node("node-c", "10.0.0.3")
    fake.register(service("10.0.0.1"), now=0.0)
    fake.register(service("10.0.0.2"), now=0.0, node="node-b")
    fake.register(service("10.0.0.3"), now=0.0, node="node-c")
    provider = ConsulProvider(context(), ConsulSettings(url=fake.url), transport=fake.transport())  # type: ignore[arg-type]
    try:
        snapshot = await provider.query("web", anyio.current_time() + 5)
    finally:
        await provider.aclose()
    assert sorted(i.host for i in snapshot.instances) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert len(set(snapshot.identities())) == 3
    assert all(identity.endswith("/web") for identity in snapshot.identities())
    assert not snapshot.invalid


def entry(node: str, address: str, status: str) -> dict[str, Any]:
    return {
        "Node": {"Node": node, "Address": address},
        "Service": {"ID": "web", "Service": "web", "Address": address, "Port": 8080},
        "Checks": [{"Node": node, "CheckID": "c", "Status": status}],
    }


def test_an_unhealthy_entry_never_makes_a_healthy_one_a_duplicate() -> None:
    # A server that does not filter ?passing: the unhealthy copy comes first.
    body = json.dumps(
        [entry("node-a", "10.0.0.1", "critical"), entry("node-b", "10.0.0.2", "passing")]
    ).encode()
    for scope in ("service", "node"):
        snapshot = decode_health_service(
            body,
            service="web",
            max_instances=10,
            identity_scope=scope,
        )
        assert [i.host for i in snapshot.instances] == ["10.0.0.2"], scope
        assert not snapshot.invalid
    # two healthy copies of one ID in service scope are still duplicates
    both = json.dumps(
        [entry("node-a", "10.0.0.1", "passing"), entry("node-b", "10.0.0.2", "passing")]
    ).encode()
    snapshot = decode_health_service(
        both, service="web", max_instances=10, identity_scope="service"
    )
    assert [i.host for i in snapshot.instances] == ["10.0.0.1"]
    assert "duplicate" in snapshot.invalid["node-b/web"]
