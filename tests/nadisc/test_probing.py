"""First serving candidate, under trio's MockClock (no real sleeps)."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

from nadisc import (
    CandidateWithdrawn,
    ConfigError,
    DeadlineExceeded,
    FirstServing,
    Instance,
    NoServingCandidate,
    NotServing,
    first_serving,
)
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner


class Probes:
    """Scripted probes: per candidate a delay and an answer (bool or exception)."""

    def __init__(self, script: dict[str, tuple[float, bool | Exception]]) -> None:
        self.script = script
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.running = 0
        self.most_running = 0

    async def __call__(self, candidate: str) -> bool:
        delay, answer = self.script[candidate]
        self.started.append(candidate)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await trio.sleep(delay)
        except trio.Cancelled:
            self.cancelled.append(candidate)
            raise
        finally:
            self.running -= 1
        self.finished.append(candidate)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_first_explicit_serving_answer_wins_and_the_rest_are_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    probes = Probes({"a": (3.0, True), "b": (1.0, False), "c": (2.0, True), "d": (9.0, True)})
    start = trio.current_time()
    chosen = await first_serving(["a", "b", "c", "d"], probes, start + 100)
    assert chosen == "c"
    assert trio.current_time() - start == pytest.approx(2.0)
    assert sorted(probes.cancelled) == ["a", "d"]
    assert probes.most_running == 4


async def test_only_true_counts_as_serving(autojump_clock: trio.testing.MockClock) -> None:
    async def probe(candidate: str) -> bool:
        await trio.sleep(0.1)
        answer: object = "yes" if candidate == "truthy" else False
        return answer  # type: ignore[return-value]

    with pytest.raises(NoServingCandidate) as info:
        await first_serving(["truthy", "no"], probe, trio.current_time() + 10)
    assert [type(f.error) for f in info.value.failures] == [NotServing, NotServing]


async def test_at_most_16_probes_and_the_start_rotates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    names = [f"c{i:02d}" for i in range(20)]
    probes = Probes({n: (1.0, n == "c19") for n in names})
    selector = FirstServing(probes)
    with pytest.raises(NoServingCandidate) as info:
        await selector.select(names, trio.current_time() + 10)
    assert len(probes.started) == 16 and probes.most_running == 16
    assert [f.candidate for f in info.value.failures] == names[:16]
    # The next request starts one further along: c01..c16.
    probes.started.clear()
    with pytest.raises(NoServingCandidate):
        await selector.select(names, trio.current_time() + 10)
    assert sorted(probes.started) == names[1:17]
    # ...and so on until c19 is in the window and answers.
    for _ in range(2):
        with pytest.raises(NoServingCandidate):
            await selector.select(names, trio.current_time() + 10)
    assert await selector.select(names, trio.current_time() + 10) == "c19"


async def test_probing_spends_at_most_75_percent_of_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    probes = Probes({"slow": (50.0, True), "bad": (1.0, RuntimeError("refused"))})
    start = trio.current_time()
    with pytest.raises(NoServingCandidate) as info:
        await first_serving(["slow", "bad"], probes, start + 8)
    assert trio.current_time() - start == pytest.approx(6.0)
    errors = {f.candidate: f.error for f in info.value.failures}
    assert isinstance(errors["slow"], DeadlineExceeded)
    assert isinstance(errors["bad"], RuntimeError)
    group = info.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert [type(e) for e in group.exceptions] == [DeadlineExceeded, RuntimeError]


async def test_bad_settings_and_inputs(autojump_clock: trio.testing.MockClock) -> None:
    probes = Probes({})
    for bad in ({"max_probes": 0}, {"max_probes": 17}, {"budget_share": 0.9}):
        with pytest.raises(ConfigError):
            FirstServing(probes, **bad)
    with pytest.raises(NoServingCandidate):
        await first_serving([], probes, trio.current_time() + 1)
    with pytest.raises(DeadlineExceeded):
        await first_serving(["a"], probes, trio.current_time())
    assert probes.started == []


async def test_submit_rechecks_currency_and_never_resends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = Instance("a", "10.0.0.1", 80), Instance("b", "10.0.0.2", 80)
    memory = MemoryProvider(services={"svc": "svc"}, watch=True)
    memory.set("svc", [a, b])
    sent: list[str] = []

    async def send(instance: Instance) -> str:
        sent.append(instance.identity)
        await trio.sleep(1.0)
        raise ConnectionResetError("lost after sending")

    async with memory_owner({"primary": memory}) as owner:
        observation = await owner.client().observe("svc", anyio.current_time() + 5)

        async def probe(instance: Instance) -> bool:
            await trio.sleep(1.0)
            if instance.identity == "a":
                memory.set("svc", [b])  # a is withdrawn while it is being probed
                return True
            await trio.sleep(5.0)
            return True

        selector: FirstServing[Instance] = FirstServing(probe)
        with pytest.raises(CandidateWithdrawn):
            await selector.submit(observation, send, trio.current_time() + 20)
        assert sent == []
        # Now b (the only one left) is chosen; a failure after sending is not retried.
        with pytest.raises(ConnectionResetError):
            await selector.submit(observation, send, trio.current_time() + 20)
        assert sent == ["b"]
