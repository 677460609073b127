"""hedged_call never drops a result: each one is returned or discarded, exactly once.

An attempt's result (a response, with its load guard and connection) must
reach the caller or ``discard`` even when the caller's cancel scope ends just
as it answers, when two attempts answer in the same scheduling round, or when
an attempt answers after the winner while the race's task group is being
cancelled. No test sleeps for timing: attempts wait at gates the test opens,
and ``settle()`` (``anyio.wait_all_tasks_blocked``) lets every task run
until it waits again. Everything runs on both loops except the test that
moves trio's virtual clock to launch hedges one by one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.lowlevel
import pytest
import sniffio

from poise import Hedging, hedged_call

if TYPE_CHECKING:
    from trio.testing import MockClock

#: answers: once its gate opens it answers, cancelled or not (a pool that
#:     returns the response it already had when the cancellation came);
#: cancellable: answers when its gate opens, unless it was cancelled first;
#: fails: raises when its gate opens, unless it was cancelled first.
Mode = Literal["answers", "cancellable", "fails"]
MODES: tuple[Mode, ...] = ("answers", "cancellable", "fails")

#: An action of the test: ("open", n) opens attempt n's gate, ("cancel", 0)
#: cancels the caller's scope, ("tick", 0) moves trio's virtual clock by 1 s.
Action = tuple[str, int]


async def settle() -> None:
    """Let every task run until it waits again.

    trio's ``wait_all_tasks_blocked``; on asyncio the same check (every other
    task waits on a pending future), made after each single yield instead of
    anyio's 0.1 s sleeps, which would cost the exhaustive tests minutes.
    """
    if sniffio.current_async_library() != "asyncio":
        await anyio.wait_all_tasks_blocked()
        return
    this = asyncio.current_task()
    while True:
        await anyio.lowlevel.checkpoint()
        waiters = (
            getattr(task, "_fut_waiter", None) for task in asyncio.all_tasks() if task is not this
        )
        if all(waiter is not None and not waiter.done() for waiter in waiters):
            return


class Gated:
    """Attempt n waits at gate n, then answers n or fails, per ``modes[n]``."""

    def __init__(self, modes: Sequence[Mode]) -> None:
        self.modes = modes
        self.gates = [anyio.Event() for _ in modes]
        self.started: list[int] = []
        self.produced: list[int] = []
        self.ended: list[int] = []

    async def __call__(self, n: int) -> int:
        self.started.append(n)
        try:
            if self.modes[n] == "answers":
                with anyio.CancelScope(shield=True):
                    await self.gates[n].wait()
            else:
                await self.gates[n].wait()
            if self.modes[n] == "fails":
                raise RuntimeError(f"attempt {n} failed")
            self.produced.append(n)
            return n
        finally:
            self.ended.append(n)


class Discards:
    """A ``discard`` that yields first: unshielded, a cancelled caller would skip it."""

    def __init__(self, *, raises: bool = False) -> None:
        self.values: list[int] = []
        self.raises = raises

    async def __call__(self, value: int) -> None:
        await anyio.lowlevel.checkpoint()
        self.values.append(value)
        if self.raises:
            raise OSError(f"closing {value} failed")


class Caller:
    """Runs one hedged_call in a cancel scope of its own; records how it ended."""

    def __init__(self, attempts: Gated, hedging: Hedging, discard: Discards) -> None:
        self.attempts = attempts
        self.hedging = hedging
        self.discard = discard
        self.scope = anyio.CancelScope()
        self.returned: list[int] = []
        self.failed: list[Exception] = []
        self.done = False

    async def run(self) -> None:
        with self.scope:
            try:
                self.returned.append(
                    await hedged_call(
                        self.attempts, self.hedging, idempotent=True, discard=self.discard
                    )
                )
            except Exception as error:
                self.failed.append(error)
        self.done = True

    def check(self) -> None:
        """Every result produced was returned or discarded, exactly once; the race's rules."""
        attempts, returned, discarded = self.attempts, self.returned, self.discard.values
        assert self.done
        assert sorted(attempts.ended) == sorted(attempts.started)  # nothing outlived the call
        assert sorted(returned + discarded) == sorted(attempts.produced)
        assert len(set(discarded)) == len(discarded)
        if returned:
            assert returned == attempts.produced[:1]  # the first answer won
            assert not self.scope.cancelled_caught and not self.failed
        elif self.failed:
            # Every attempt failed: the last failure is raised, nothing was produced.
            assert attempts.produced == [] and not self.scope.cancelled_caught
            assert isinstance(self.failed[0], RuntimeError) and len(self.failed) == 1
        else:
            assert self.scope.cancelled_caught  # the caller's cancellation, nothing else


async def drive(
    modes: Sequence[Mode],
    rounds: Sequence[Sequence[Action]],
    *,
    delay: float = 0.0,
    tick: Callable[[], None] | None = None,
) -> Caller:
    """Run one call: the actions of a round back to back, then let every task settle."""
    attempts = Gated(modes)
    caller = Caller(attempts, Hedging(delay=delay, max_extra=len(modes) - 1), Discards())
    async with anyio.create_task_group() as group:
        group.start_soon(caller.run)
        await settle()
        for actions in rounds:
            for kind, n in actions:
                if kind == "open":
                    attempts.gates[n].set()
                elif kind == "cancel":
                    caller.scope.cancel()
                else:
                    assert tick is not None
                    tick()
            await settle()
        # Whatever the schedule, every gate ends open: an attempt that answers
        # when cancelled would otherwise hold the call (and the test) forever.
        for gate in attempts.gates:
            gate.set()
    caller.check()
    return caller


def ordered_partitions(actions: Sequence[Action]) -> Iterator[list[list[Action]]]:
    """Every order of the actions, cut into rounds in every way (Fubini numbers)."""
    for order in itertools.permutations(actions):
        for cuts in itertools.product((False, True), repeat=max(0, len(order) - 1)):
            rounds: list[list[Action]] = [[order[0]]] if order else []
            for action, cut in zip(order[1:], cuts, strict=True):
                if cut:
                    rounds.append([action])
                else:
                    rounds[-1].append(action)
            yield rounds


# -- the reported leak and its neighbours, one by one --------------------------------------


async def test_a_winner_answering_as_the_caller_is_cancelled_is_discarded() -> None:
    """The tester's case: the hedge cancels its caller and answers in the same step.

    trio ends the call with the cancellation, so the answer is discarded;
    asyncio's task group may take the cancellation for its own (it had just
    cancelled the losers) and return the answer. Either way it is not lost.
    """
    discard = Discards()
    produced: list[int] = []
    returned: list[int] = []
    scope = anyio.CancelScope()

    async def attempt(n: int) -> int:
        if n == 0:
            await anyio.sleep_forever()  # the slow first attempt, cancelled
        scope.cancel()  # the caller gives up right now...
        produced.append(n)
        return n  # ...as the hedge's answer arrives

    with scope:
        returned.append(
            await hedged_call(attempt, Hedging(delay=0.0), idempotent=True, discard=discard)
        )
    assert produced == [1]
    assert sorted(returned + discard.values) == [1]
    assert scope.cancelled_caught == (returned == [])
    if sniffio.current_async_library() == "trio":
        assert scope.cancelled_caught and discard.values == [1]


async def test_the_first_attempt_answering_as_the_caller_is_cancelled_is_discarded() -> None:
    caller = await drive(["answers", "cancellable"], [[("cancel", 0), ("open", 0)]])
    assert caller.scope.cancelled_caught
    assert caller.returned == [] and caller.discard.values == [0]


async def test_two_answers_in_one_round_return_the_first_and_discard_the_other() -> None:
    caller = await drive(["answers", "answers"], [[("open", 0), ("open", 1)]])
    assert caller.returned == caller.attempts.produced[:1]
    assert sorted(caller.returned + caller.discard.values) == [0, 1]


async def test_an_answer_after_the_winner_while_the_losers_are_cancelled_is_discarded() -> None:
    # Attempt 0 wins; attempt 1 is cancelled but answers anyway, later.
    caller = await drive(["cancellable", "answers"], [[("open", 0)], [("open", 1)]])
    assert caller.returned == [0] and caller.discard.values == [1]
    # The same, with the caller cancelled while the race waits for that loser.
    caller = await drive(
        ["cancellable", "answers"], [[("open", 0)], [("cancel", 0)], [("open", 1)]]
    )
    # trio returns the winner (the group's body had ended), asyncio ends the
    # call with the cancellation: then the winner is discarded after the loser.
    assert (caller.scope.cancelled_caught, caller.returned, caller.discard.values) in (
        (False, [0], [1]),
        (True, [], [1, 0]),
    )


async def test_a_discard_that_raises_masks_neither_the_answer_nor_the_cancellation() -> None:
    # A loser whose discard raises: the winner is still returned.
    attempts = Gated(["answers", "answers"])
    caller = Caller(attempts, Hedging(delay=0.0), Discards(raises=True))
    async with anyio.create_task_group() as group:
        group.start_soon(caller.run)
        await settle()
        attempts.gates[0].set()
        attempts.gates[1].set()
    caller.check()
    assert len(caller.returned) == 1 and len(caller.discard.values) == 1
    # A winner discarded because its caller was cancelled: the cancellation still ends it.
    attempts = Gated(["answers", "cancellable"])
    caller = Caller(attempts, Hedging(delay=0.0), Discards(raises=True))
    async with anyio.create_task_group() as group:
        group.start_soon(caller.run)
        await settle()
        caller.scope.cancel()
        attempts.gates[0].set()
    caller.check()
    assert caller.scope.cancelled_caught and caller.discard.values == [0]


# -- every schedule -------------------------------------------------------------------------


@pytest.mark.parametrize("attempt_count", [2, 3])
@pytest.mark.parametrize("cancelled", [True, False])
async def test_no_result_is_dropped_whatever_the_schedule(
    attempt_count: int, cancelled: bool
) -> None:
    """Exhaustive: every mode of every attempt, every order and grouping of its events.

    Every hedge is out (delay 0) before the first event; the events are each
    attempt's gate opening and, when ``cancelled``, the caller's cancellation,
    so the cancellation reaches the race at each of its await points: waiting
    for an answer, cancelling the losers, waiting for them in the task
    group's exit, discarding a loser.
    """
    actions: list[Action] = [("open", n) for n in range(attempt_count)]
    if cancelled:
        actions.append(("cancel", 0))
    schedules = list(ordered_partitions(actions))
    cases = 0
    for modes in itertools.product(MODES, repeat=attempt_count):
        for rounds in schedules:
            await drive(modes, rounds)
            cases += 1
    assert cases == 3**attempt_count * len(schedules)


async def test_no_result_is_dropped_before_any_hedge_went_out() -> None:
    """The caller's cancellation while the race waits out the hedge delay."""
    for mode in MODES:
        for rounds in ordered_partitions([("open", 0), ("cancel", 0)]):
            caller = await drive([mode, "answers"], rounds, delay=1e9)
            assert caller.attempts.started == [0]


async def test_no_result_is_dropped_while_hedges_go_out_one_delay_apart(
    mock_clock: MockClock,
) -> None:
    """On trio's virtual clock: hedges leave one by one, between any two events.

    Attempt 1 leaves on the first tick, attempt 2 on the second; a gate that
    opened before its attempt started makes a hedge that answers at once.
    """
    actions: list[Action] = [
        ("open", 0),
        ("open", 1),
        ("open", 2),
        ("tick", 0),
        ("tick", 0),
        ("cancel", 0),
    ]
    orders = sorted(set(itertools.permutations(actions)))
    for modes in (("answers",) * 3, ("cancellable",) * 3, ("cancellable", "answers", "fails")):
        for order in orders:
            await drive(
                modes, [[action] for action in order], delay=1.0, tick=lambda: mock_clock.jump(1.0)
            )
