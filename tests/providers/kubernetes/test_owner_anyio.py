"""The Kubernetes provider through the owner on any anyio backend (the Makefile runs
this file on asyncio too): list, watch, draining, a 410 relist and an RBAC denial,
against the in-process fake on the real clock."""

from __future__ import annotations

from pathlib import Path

import anyio

from nadisc import EvidenceUnavailable, Observation, open_discovery
from tests.fakes.kubernetes import KubernetesFake

from .conftest import TOKEN, endpoint, owned_slice, write_kubeconfig
from .test_owner import config, in_process


def served(observation: Observation) -> list[tuple[str, bool]] | str:
    try:
        return [(i.identity, i.draining) for i in observation.snapshot().instances]
    except EvidenceUnavailable as exc:
        return exc.reason


async def settle(observation: Observation, expected: object) -> None:
    with anyio.fail_after(10):
        while served(observation) != expected:
            await observation.changed(anyio.current_time() + 10)


async def test_watch_drain_relist_and_denial_on_this_backend(tmp_path: Path) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
    async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
        observation = await owner.client().observe("orders", anyio.current_time() + 5)
        assert served(observation) == [("pod-1", False)]
        with anyio.fail_after(10):
            await fake.wait_for(lambda: fake.open_watches == 2)
        owned_slice(
            fake, "orders-a",
            endpoints=[endpoint(1, ready=False, serving=True, terminating=True), endpoint(2)],
        )  # fmt: skip
        await settle(observation, [("pod-1", True), ("pod-2", False)])
        fake.compact()
        fake.expire_watches()
        owned_slice(fake, "orders-b", 3)
        await settle(observation, [("pod-1", True), ("pod-2", False), ("pod-3", False)])
        fake.deny("alice", "*", "endpointslices")
        fake.end_watches()
        await settle(observation, "revoked")
    report = owner.close_report
    assert report is not None and report.tasks_left == 0
    assert fake.open_watches == 0
