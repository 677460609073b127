"""Registries without gRPC metadata: a real dnsmasq and the Kubernetes fake, with DiscoveryProtocol.

The instances these registries list carry no ``nadisc.grpc.*`` metadata, so
the caller names the protocol; the port comes from the instance (the DNS
service's configured port, the EndpointSlice's named port).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import anyio
import pytest

from nadisc import DiscoveryConfig, open_discovery
from nadisc.grpc import DiscoveryProtocol, GrpcProtocolMissing, discovery_channel
from tests.fakes.kubernetes import KubernetesFake
from tests.grpc.discovery_support import backends
from tests.nadisc.dns.conftest import DOMAIN, DnsServer, dns_server  # noqa: F401
from tests.providers.kubernetes.conftest import TOKEN, endpoint, owned_slice, write_kubeconfig
from tests.providers.kubernetes.test_owner import config as kubernetes_config
from tests.providers.kubernetes.test_owner import in_process


def dns_config(nameserver: str, port: int) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "shutdown_timeout_ms": 2000,
            "connections": {
                "primary": {
                    "provider": "dns",
                    "request_timeout_ms": 500,
                    "poll_interval_ms": 3000,
                    "snapshot": {"max_age_ms": 6000, "stale_if_error_ms": 3000},
                    "dns": {
                        "nameservers": [nameserver],
                        "services": {"orders": {"host": f"orders.{DOMAIN}", "port": port}},
                    },
                }
            },
        }
    )


@pytest.mark.real_server
async def test_a_dns_service_with_discovery_protocol(
    pb: ModuleType,
    pb_grpc: ModuleType,
    dns_server: DnsServer,  # noqa: F811
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        dns_server.set_hosts([("127.0.0.1", f"orders.{DOMAIN}")])
        cfg = dns_config(dns_server.nameserver, servers[0].port)
        async with open_discovery(cfg) as owner:
            protocol = DiscoveryProtocol(authority=f"orders.{DOMAIN}")
            async with discovery_channel(owner, "primary", "orders", protocol=protocol) as channel:
                stub = pb_grpc.TestServiceStub(channel)
                for _ in range(3):
                    response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                    assert response.username == "b0"
            # Without the protocol: the typed error that says to set it.
            async with discovery_channel(owner, "primary", "orders") as bare:
                with pytest.raises(GrpcProtocolMissing, match="DiscoveryProtocol"):
                    await pb_grpc.TestServiceStub(bare).UnaryCall(pb.SimpleRequest(), timeout=5)
        assert servers[0].calls == 3


async def test_a_kubernetes_service_with_discovery_protocol(
    pb: ModuleType, pb_grpc: ModuleType, tmp_path: Path
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        fake = KubernetesFake(tokens={TOKEN: "alice"})
        fake.create_service("orders")
        endpoints = []
        for n, server in enumerate(servers, 1):
            one = endpoint(n)
            one["addresses"] = ["127.0.0.1"]
            endpoints.append((one, server.port))
        # One slice per port (an EndpointSlice has one port list for all its endpoints).
        for n, (one, port) in enumerate(endpoints):
            owned_slice(
                fake, f"orders-{n}", endpoints=[one], ports=[{"name": "http", "port": port}]
            )
        cfg = kubernetes_config(write_kubeconfig(tmp_path / "config", fake.url))
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            assert len(observation.snapshot().instances) == 2
            async with discovery_channel(
                owner, "primary", "orders", protocol=DiscoveryProtocol()
            ) as channel:
                stub = pb_grpc.TestServiceStub(channel)
                names = {
                    (await stub.UnaryCall(pb.SimpleRequest(), timeout=10)).username
                    for _ in range(10)
                }
                assert names == {"b0", "b1"}
