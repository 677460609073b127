"""The dns provider through the owner (``open_discovery``, ``provider: dns``),
against a real dnsmasq: TTL-paced refresh, explicit empties, outage grace."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    DiscoveryConfig,
    EvidenceKind,
    EvidenceUnavailable,
    Observation,
    open_discovery,
)

from .conftest import DOMAIN, DnsServer

pytestmark = pytest.mark.real_server

WEB = f"web.{DOMAIN}"


def config(nameserver: str, *, poll_ms: int = 3000) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "shutdown_timeout_ms": 2000,
            "connections": {
                "primary": {
                    "provider": "dns",
                    "request_timeout_ms": 500,
                    "poll_interval_ms": poll_ms,
                    "snapshot": {"max_age_ms": 2 * poll_ms, "stale_if_error_ms": 3000},
                    "retry": {"initial_backoff_ms": 100, "max_backoff_ms": 200},
                    "dns": {
                        "nameservers": [nameserver],
                        "min_refresh_ms": 200,
                        "services": {
                            "web": {"host": WEB, "port": 8080},
                            "gone": {"host": f"gone.{DOMAIN}", "port": 1},
                        },
                    },
                }
            },
        }
    )


def reason(observation: Observation, *, strict: bool = False) -> str:
    with pytest.raises(EvidenceUnavailable) as info:
        observation.snapshot(strict=strict)
    return info.value.reason


async def test_the_record_ttl_paces_the_refresh_not_the_poll_interval(
    dns_server: DnsServer,
) -> None:
    dns_server.configure(ttl=1)
    dns_server.set_hosts([("10.1.0.1", WEB)])
    async with open_discovery(config(dns_server.nameserver, poll_ms=30000)) as owner:
        web = await owner.client().observe("web", anyio.current_time() + 2)
        assert web.snapshot(strict=True).identities() == ("10.1.0.1:8080",)
        start = anyio.current_time()
        dns_server.set_hosts([("10.1.0.2", WEB)])
        await web.changed(start + 15)
        # Measured 1.0-1.1 s (the TTL); the bound is 11x that and still well
        # below the 30 s poll interval, so only the TTL can have paced it.
        assert anyio.current_time() - start < 12.0
        assert web.snapshot().identities() == ("10.1.0.2:8080",)


async def test_dns_through_the_owner(dns_server: DnsServer) -> None:
    dns_server.configure(ttl=1)
    dns_server.set_hosts([("10.1.0.1", WEB), ("fd00::1", WEB)])
    async with open_discovery(config(dns_server.nameserver)) as owner:
        web = await owner.client().observe("web", anyio.current_time() + 2)
        snap = web.snapshot(strict=True)
        assert snap.identities() == ("10.1.0.1:8080", "[fd00::1]:8080")
        assert snap.evidence is EvidenceKind.ADDRESS_ONLY
        dns_server.set_hosts([("10.1.0.2", WEB)])
        await web.changed(anyio.current_time() + 5)
        assert web.snapshot().identities() == ("10.1.0.2:8080",)
        # NXDOMAIN: an explicit empty set, no grace
        gone = await owner.client().observe("gone", anyio.current_time() + 2)
        assert reason(gone) == "empty"
        # records removed: empty at the next refresh although stale_if_error > 0
        dns_server.set_hosts([])
        await web.changed(anyio.current_time() + 5)
        assert reason(web) == "empty"
        dns_server.set_hosts([("10.1.0.3", WEB)])
        await web.changed(anyio.current_time() + 5)
        assert web.snapshot().identities() == ("10.1.0.3:8080",)
        # server gone: incomplete -> degraded within the grace, strict refuses, then stale
        dns_server.stop()
        await web.changed(anyio.current_time() + 5)
        assert reason(web, strict=True) == "incomplete"
        assert web.snapshot().degraded
        await web.changed(anyio.current_time() + 5)
        assert reason(web) == "stale"
        assert owner.observer().snapshot().connection("primary").failures >= 1
    assert owner.close_report is not None and owner.close_report.tasks_left == 0
