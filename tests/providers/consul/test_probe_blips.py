"""One slow health probe must not take a live instance away from its callers.

The chain this pins, under trio's MockClock with the Consul fake in process:
the owner registers with an agent-run HTTP check; the fake's check runner
reports probe results (scripted here, as the agent's prober would); a caller
on the same connection sends requests through ``DiscoveryTransport``.

A probe that times out once (the instance answered late: a garbage-collection
pause, CPU throttling, or a loop held by synchronous work such as loading a
CA bundle) is not a dead instance. Consul marks the check critical on the
first failure unless the check carries ``FailuresBeforeCritical``; the
``passing`` filter then drops the instance, and a caller whose listing is now
an explicit empty one fails at once (no grace for an explicit empty set).
The registration carries ``health_check_failures_before_critical`` (default
3), so one or two failed probes leave the instance listed, and the third in a
row takes it out as before.
"""

from __future__ import annotations

import anyio
import httpx
import pytest
import trio.testing

from nadisc import CallEvidenceUnavailable, DiscoveryTransport, Eligibility, open_discovery
from tests.fakes.consul import ConsulFake, open_consul_fake
from tests.providers.consul.test_owner_registration import (
    INSTANCE,
    NODE,
    config,
    in_process,
    listeners,
)

pytestmark = pytest.mark.trio_only

CHECK = f"service:{INSTANCE}"


def instance_pool() -> httpx.MockTransport:
    """Every instance answers 200 (the pool the transport hands requests to)."""
    return httpx.MockTransport(lambda request: httpx.Response(200, text=request.url.host))


async def report_passing_once_registered(fake: ConsulFake) -> None:
    await fake.wait_for(lambda: (NODE, CHECK) in fake.checks)
    fake.probe_result(CHECK, "passing", "HTTP GET: 200", now=anyio.current_time())


async def test_one_timed_out_probe_leaves_the_only_instance_callable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(report_passing_once_registered, fake)
        cfg = config(fake.url, health_check_interval=1.0)
        async with (
            open_discovery(
                cfg,
                providers=in_process(cfg, fake),
                listeners=listeners(),
                eligibility={"web": Eligibility.always()},
            ) as owner,
            DiscoveryTransport(owner, transport=instance_pool()) as transport,
            httpx.AsyncClient(mounts={"nadisc://": transport}) as http,
        ):
            check = fake.checks[(NODE, CHECK)]
            assert check.definition["FailuresBeforeCritical"] == 3
            assert (await http.get("nadisc://primary/self/work")).status_code == 200
            # Two probes in a row time out: the instance stays listed and callable.
            for _ in range(2):
                fake.probe_result(CHECK, "critical", "Get: ReadTimeout", now=anyio.current_time())
                await anyio.sleep(1.0)  # a probe interval: the watch had every chance
                assert (await http.get("nadisc://primary/self/work")).status_code == 200
                assert check.status == "passing"
            # A passing probe resets the run; a real outage (three failures in
            # a row) still takes the instance out, and callers fail at once.
            fake.probe_result(CHECK, "passing", "HTTP GET: 200", now=anyio.current_time())
            for _ in range(3):
                fake.probe_result(
                    CHECK, "critical", "Get: connection refused", now=anyio.current_time()
                )
            assert check.status == "critical"
            with anyio.fail_after(5):
                while True:
                    try:
                        await http.get("nadisc://primary/self/work")
                    except CallEvidenceUnavailable as exc:
                        assert exc.reason == "empty"
                        break
                    await anyio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def test_the_threshold_is_a_setting_and_one_means_the_first_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_consul_fake() as fake, anyio.create_task_group() as nursery:
        nursery.start_soon(report_passing_once_registered, fake)
        cfg = config(fake.url, health_check_failures_before_critical=1)
        async with open_discovery(
            cfg,
            providers=in_process(cfg, fake),
            listeners=listeners(),
            eligibility={"web": Eligibility.always()},
        ):
            check = fake.checks[(NODE, CHECK)]
            assert check.definition["FailuresBeforeCritical"] == 1
            fake.probe_result(CHECK, "critical", "Get: ReadTimeout", now=anyio.current_time())
            assert check.status == "critical"
        nursery.cancel_scope.cancel()
