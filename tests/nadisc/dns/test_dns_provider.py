"""The dns provider against a real dnsmasq on loopback."""

from __future__ import annotations

import math

import anyio
import anyio.lowlevel
import pytest

from nadisc import (
    CapacityRejected,
    DeadlineExceeded,
    DnsConfig,
    EvidenceKind,
    IncompleteSnapshot,
)
from nadisc.providers._dns import SRV_ZERO_WEIGHT, DnsProvider

from ._support import WEB, context, provider_for, soon
from .conftest import DOMAIN, DnsServer

pytestmark = pytest.mark.real_server


async def test_a_records_become_sorted_address_instances(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.2", WEB), ("10.1.0.1", WEB), ("fd00::7", WEB)])
    provider = provider_for(
        dns_server.nameserver, {"web": {"host": WEB, "port": 8080, "address_types": ["A"]}}
    )
    snapshot = await provider.query("web", soon())
    assert snapshot.service == "web"
    assert snapshot.evidence is EvidenceKind.ADDRESS_ONLY
    assert snapshot.identities() == ("10.1.0.1:8080", "10.1.0.2:8080")
    assert [(i.host, i.port, i.weight) for i in snapshot.instances] == [
        ("10.1.0.1", 8080, 1.0),
        ("10.1.0.2", 8080, 1.0),
    ]
    assert snapshot.instances[0].metadata["dns.record"] == "A"


async def test_a_and_aaaa_are_joined(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", WEB), ("fd00::7", WEB), ("fd00::1", WEB)])
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 443}})
    snapshot = await provider.query("web", soon())
    assert snapshot.identities() == ("10.1.0.1:443", "[fd00::1]:443", "[fd00::7]:443")
    assert [i.metadata["dns.record"] for i in snapshot.instances] == ["A", "AAAA", "AAAA"]
    assert snapshot.instances[1].host == "fd00::1"


async def test_aaaa_only(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", WEB), ("fd00::9", WEB)])
    provider = provider_for(
        dns_server.nameserver, {"web": {"host": WEB, "port": 80, "address_types": ["AAAA"]}}
    )
    snapshot = await provider.query("web", soon())
    assert snapshot.identities() == ("[fd00::9]:80",)


async def test_hosts_reload_is_seen_by_the_next_query(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", WEB)])
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 80}})
    assert (await provider.query("web", soon())).identities() == ("10.1.0.1:80",)
    dns_server.set_hosts([("10.1.0.3", WEB)])
    assert (await provider.query("web", soon())).identities() == ("10.1.0.3:80",)


async def test_nxdomain_is_a_complete_explicit_empty(dns_server: DnsServer) -> None:
    provider = provider_for(
        dns_server.nameserver, {"gone": {"host": f"missing.{DOMAIN}", "port": 80}}
    )
    snapshot = await provider.query("gone", soon())
    assert snapshot.instances == ()
    assert snapshot.evidence is EvidenceKind.ADDRESS_ONLY


async def test_name_without_records_of_the_type_is_empty(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", f"v4only.{DOMAIN}")])
    provider = provider_for(
        dns_server.nameserver,
        {"v6": {"host": f"v4only.{DOMAIN}", "port": 80, "address_types": ["AAAA"]}},
    )
    snapshot = await provider.query("v6", soon())
    assert snapshot.instances == ()
    # a NOERROR/no-data answer carries the SOA's negative TTL
    assert provider.next_refresh("v6") is not None


async def test_srv_publishes_only_the_best_priority(dns_server: DnsServer) -> None:
    dns_server.configure(
        srv=[
            f"_http._tcp.{DOMAIN},b.{DOMAIN},8081,10,0",
            f"_http._tcp.{DOMAIN},a.{DOMAIN},8080,10,5",
            f"_http._tcp.{DOMAIN},c.{DOMAIN},8082,5,1",
            f"_http._tcp.{DOMAIN},d.{DOMAIN},8083,20,60",
        ]
    )
    provider = provider_for(
        dns_server.nameserver, {"api": {"host": f"_http._tcp.{DOMAIN}", "srv": True}}
    )
    snapshot = await provider.query("api", soon())
    # Priority 5 is reachable: the backups at 10 and 20 are not published,
    # whatever their weights, so a weighted balancer cannot pick them.
    assert snapshot.identities() == (f"c.{DOMAIN}:8082",)
    first = snapshot.instances[0]
    assert (first.host, first.port, first.weight) == (f"c.{DOMAIN}", 8082, 1.0)
    assert first.metadata["dns.srv.priority"] == "5"


async def test_srv_falls_back_to_the_next_priority_without_usable_targets(
    dns_server: DnsServer,
) -> None:
    dns_server.configure(
        srv=[
            f"_http._tcp.{DOMAIN},c.{DOMAIN},0,5,1",  # port 0: cannot be an instance
            f"_http._tcp.{DOMAIN},b.{DOMAIN},8081,10,0",
            f"_http._tcp.{DOMAIN},a.{DOMAIN},8080,10,5",
            f"_http._tcp.{DOMAIN},d.{DOMAIN},8083,20,60",
        ]
    )
    provider = provider_for(
        dns_server.nameserver, {"api": {"host": f"_http._tcp.{DOMAIN}", "srv": True}}
    )
    snapshot = await provider.query("api", soon())
    assert snapshot.identities() == (f"a.{DOMAIN}:8080", f"b.{DOMAIN}:8081")
    assert [i.weight for i in snapshot.instances] == [5.0, SRV_ZERO_WEIGHT]
    assert {i.metadata["dns.srv.priority"] for i in snapshot.instances} == {"10"}
    assert snapshot.instances[1].metadata["dns.srv.weight"] == "0"
    assert list(snapshot.invalid) == [f"c.{DOMAIN}:0"]


async def test_srv_target_dot_means_decidedly_unavailable(dns_server: DnsServer) -> None:
    dns_server.configure(srv=[f"_gone._tcp.{DOMAIN}"])
    provider = provider_for(
        dns_server.nameserver, {"gone": {"host": f"_gone._tcp.{DOMAIN}", "srv": True}}
    )
    snapshot = await provider.query("gone", soon())
    assert snapshot.instances == ()
    assert snapshot.invalid == {}


async def test_srv_change_after_restart(dns_server: DnsServer) -> None:
    dns_server.configure(srv=[f"_x._tcp.{DOMAIN},a.{DOMAIN},1000,1,1"])
    provider = provider_for(
        dns_server.nameserver, {"x": {"host": f"_x._tcp.{DOMAIN}", "srv": True}}
    )
    assert (await provider.query("x", soon())).identities() == (f"a.{DOMAIN}:1000",)
    dns_server.configure(srv=[f"_x._tcp.{DOMAIN},b.{DOMAIN},1001,1,1"])
    assert (await provider.query("x", soon())).identities() == (f"b.{DOMAIN}:1001",)


async def test_ttl_is_exposed_for_refresh(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", WEB)])
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 80}})
    assert provider.next_refresh("web") is None
    assert provider.refresh_delay("web", 5.0) == 5.0
    await provider.query("web", soon())
    left = provider.next_refresh("web")
    assert left is not None and 25.0 < left <= 30.0
    assert provider.refresh_delay("web", 5.0) == 5.0
    assert provider.refresh_delay("web", 60.0) == pytest.approx(left, abs=1.0)


async def test_zero_ttl_refresh_is_floored(dns_server: DnsServer) -> None:
    dns_server.configure(ttl=0)
    dns_server.set_hosts([("10.1.0.1", WEB)])
    provider = provider_for(
        dns_server.nameserver, {"web": {"host": WEB, "port": 80}}, min_refresh_ms=750
    )
    await provider.query("web", soon())
    assert provider.next_refresh("web") == 0.75
    assert provider.refresh_delay("web", 5.0) == 0.75


async def test_refused_is_incomplete(dns_server: DnsServer) -> None:
    # dnsmasq has no upstream: names outside its local domain are REFUSED.
    provider = provider_for(
        dns_server.nameserver, {"ext": {"host": "www.elsewhere.invalid", "port": 80}}
    )
    with pytest.raises(IncompleteSnapshot, match="no nameserver gave a usable answer"):
        await provider.query("ext", soon())


async def test_deadline_in_the_past_sends_nothing(dns_server: DnsServer) -> None:
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 80}})
    with pytest.raises(DeadlineExceeded):
        await provider.query("web", anyio.current_time() - 1)
    with pytest.raises(DeadlineExceeded):
        await provider.query("web", math.nan)
    assert "query[" not in dns_server.log()


async def test_capacity_limit_rejects_large_answers(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.1", WEB), ("10.1.0.2", WEB)])
    settings = DnsConfig.model_validate(
        {"services": {"web": {"host": WEB, "port": 80}}, "nameservers": [dns_server.nameserver]}
    )
    provider = DnsProvider(context(max_instances=1), settings)
    with pytest.raises(CapacityRejected, match="max_instances_per_service"):
        await provider.query("web", soon())


async def test_tcp_transport(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.5", WEB)])
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 80}}, tcp=True)
    assert (await provider.query("web", soon())).identities() == ("10.1.0.5:80",)


def test_works_on_asyncio(dns_server: DnsServer) -> None:
    dns_server.set_hosts([("10.1.0.8", WEB)])
    provider = provider_for(dns_server.nameserver, {"web": {"host": WEB, "port": 80}})

    async def main() -> tuple[str, ...]:
        return (await provider.query("web", anyio.current_time() + 3)).identities()

    assert anyio.run(main, backend="asyncio") == ("10.1.0.8:80",)


async def test_srv_records_that_cannot_be_instances_are_reported_invalid(
    dns_server: DnsServer,
) -> None:
    dns_server.configure(
        srv=[f"_m._tcp.{DOMAIN},a.{DOMAIN},0,1,1", f"_m._tcp.{DOMAIN},b.{DOMAIN},80,1,1"]
    )
    provider = provider_for(
        dns_server.nameserver, {"m": {"host": f"_m._tcp.{DOMAIN}", "srv": True}}
    )
    snapshot = await provider.query("m", soon())
    assert snapshot.identities() == (f"b.{DOMAIN}:80",)
    assert list(snapshot.invalid) == [f"a.{DOMAIN}:0"]
