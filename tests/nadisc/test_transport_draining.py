"""Draining instances (``Instance.draining``): calls in flight finish, no new call starts.

Sans-IO through :meth:`Route.sync` (the directory member is drained with its
allocation kept) and at owner level through a :class:`DiscoveryTransport`
against real loopback backends.
"""

from __future__ import annotations

from typing import Any, cast

import anyio
import httpx
import pytest

from nadisc import (
    DiscoveryTransport,
    EvidenceKind,
    EvidenceUnavailable,
    Instance,
    Observation,
    ObservationSnapshot,
    RestOptions,
)
from nadisc._route import Attempt, InstanceService, Route
from nadisc.testing import MemoryProvider
from poise import CallDeclined
from tests.nadisc.owner_support import memory_owner
from tests.support_http import HttpBackend, serve_backends

SERVICE = "orders"


class _Observation:
    connection = "primary"
    service = SERVICE

    def __init__(self) -> None:
        self.current: ObservationSnapshot | None = None

    def submit_if_current(self, submit: Any) -> Any:
        assert self.current is not None
        return submit(self.current)

    submit_if_current_strict = submit_if_current

    def _usable_at(self, now: float, strict: bool) -> ObservationSnapshot:
        # What the route's hand-over reads (submit_if_current, inline).
        assert self.current is not None
        return self.current


def _snapshot(revision: int, *instances: Instance) -> ObservationSnapshot:
    return ObservationSnapshot(
        connection="primary",
        service=SERVICE,
        instances=instances,
        evidence=EvidenceKind.ORCHESTRATOR_READY,
        revision=revision,
        confirmed_at=0.0,
        degraded=False,
    )


def test_draining_keeps_the_allocation_and_a_return_is_a_new_generation() -> None:
    route = Route(cast(Observation, _Observation()), RestOptions())
    a = Instance("a", "127.0.0.1", 8000)
    route.sync(_snapshot(1, a, Instance("b", "127.0.0.1", 8001)))
    before = route._directory.snapshot().get("a")
    assert before is not None and not before.draining
    route.sync(_snapshot(2, Instance("a", "127.0.0.1", 8000, draining=True)))
    after = route._directory.snapshot().get("a")
    assert after is not None and after.draining
    assert after.allocation is before.allocation  # same endpoint: its calls go on
    assert route._directory.snapshot().get("b") is None
    # A new instance that is already draining is listed, drained.
    route.sync(
        _snapshot(
            3,
            after_a := Instance("a", "127.0.0.1", 8000, draining=True),
            Instance("c", "127.0.0.1", 8002, draining=True),
        )
    )
    c = route._directory.snapshot().get("c")
    assert c is not None and c.draining and route.current("a") == after_a
    # Draining with another change too (a new port) is a new, drained generation.
    route.sync(_snapshot(4, Instance("a", "127.0.0.1", 9000, draining=True)))
    moved = route._directory.snapshot().get("a")
    assert moved is not None and moved.draining and moved.allocation is not before.allocation
    # Serving again: a new active generation.
    route.sync(_snapshot(5, Instance("a", "127.0.0.1", 9000)))
    back = route._directory.snapshot().get("a")
    assert back is not None and not back.draining and back.allocation is not moved.allocation


async def test_an_attempt_on_an_instance_that_started_draining_is_declined() -> None:
    observation = _Observation()
    route = Route(cast(Observation, observation), RestOptions())
    a = Instance("a", "127.0.0.1", 8000)
    observation.current = _snapshot(1, a)
    route.sync(observation.current)
    service = InstanceService(route, a)
    observation.current = _snapshot(2, Instance("a", "127.0.0.1", 8000, draining=True))
    sent: list[Instance] = []

    async def send(instance: Instance) -> httpx.Response:
        sent.append(instance)
        return httpx.Response(200)

    with pytest.raises(CallDeclined, match="left the evidence"):
        await service.call(Attempt(send=send))
    assert sent == []


async def test_a_draining_instance_completes_its_call_in_flight_and_gets_no_new_one() -> None:
    async with serve_backends(HttpBackend("old"), HttpBackend("new")) as (old, new):
        # The old instance's call stays in flight until the checks below are
        # done (an event, not a latency that a slow machine could outlast).
        old.hold = anyio.Event()
        memory = MemoryProvider(services={SERVICE: SERVICE}, watch=True)
        memory.set(SERVICE, [old.instance()])
        async with memory_owner({"primary": memory}) as owner:
            transport = DiscoveryTransport(owner)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
                statuses: dict[str, int] = {}

                async def slow_call() -> None:
                    response = await http.get("nadisc://primary/orders/long")
                    statuses[response.text] = response.status_code

                async with anyio.create_task_group() as tg:
                    tg.start_soon(slow_call)
                    with anyio.fail_after(5):
                        while old.active == 0:  # noqa: ASYNC110 - the backend has no event
                            await anyio.sleep(0.01)
                    memory.set(SERVICE, [old.instance(draining=True), new.instance()])
                    route = transport.route("primary", SERVICE)
                    assert route is not None
                    for _ in range(8):
                        response = await http.get("nadisc://primary/orders/short")
                        assert response.status_code == 200 and response.text == "new"
                    # The drained endpoint kept its allocation: its call is still counted.
                    assert route.statistics().in_flight.get("old") == 1
                    assert old.active == 1
                    old.hold.set()
                assert statuses == {"old": 200}
                assert route is not None
                stats = route.statistics()
                assert stats.sent == {"old": 1, "new": 8}
                assert old.served == 1 and new.served == 8
                assert stats.in_flight.get("old", 0) == 0
                # Only draining instances left: nothing new is sent anywhere.
                memory.set(SERVICE, [old.instance(draining=True)])
                with pytest.raises(EvidenceUnavailable) as refused:
                    await http.get("nadisc://primary/orders/short")
                assert refused.value.reason == "draining"
                assert old.served == 1


async def test_first_serving_never_probes_a_draining_instance() -> None:
    from nadisc import FirstServing

    memory = MemoryProvider(services={SERVICE: SERVICE}, watch=True)
    memory.set(
        SERVICE,
        [Instance("a", "10.0.0.1", 80, draining=True), Instance("b", "10.0.0.2", 80)],
    )
    probed: list[str] = []

    async def probe(instance: Instance) -> bool:
        probed.append(instance.identity)
        return True

    async def send(instance: Instance) -> str:
        return instance.identity

    async with memory_owner({"primary": memory}) as owner:
        observation = await owner.client().observe(SERVICE, anyio.current_time() + 5)
        selector: FirstServing[Instance] = FirstServing(probe)
        for _ in range(3):  # the start rotates; a is never a candidate
            assert await selector.submit(observation, send, anyio.current_time() + 5) == "b"
        assert probed == ["b", "b", "b"]
