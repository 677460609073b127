"""What a discovery-channel call may re-send, and the first-serving probe.

Transparent retries (the server never saw the call): a refused stream, a
GOAWAY whose last stream id is below the call's, a connection refused before
any byte; each goes to another instance. A call the server may have
processed is never re-sent unless a retry policy covers it (idempotent).
The probe runs against real grpcio servers whose health answer is set per
server (SERVING, NOT_SERVING, or a Check that never answers).
"""

from __future__ import annotations

import math
import random
import socket
from types import ModuleType

import anyio
import grpc
import h2.errors
import h2.events
import pytest

from nadisc import Instance
from nadisc._grpc_protocol import GRPC_TLS_KEY
from nadisc._observer import route_metrics
from nadisc.grpc import (
    PROBE_SHARE,
    DiscoveryChannel,
    NoServingInstance,
    RetryPolicy,
    RetryThrottle,
    RpcError,
)
from nadisc.grpc._first_serving import candidates
from tests.grpc.conftest import Opener
from tests.grpc.discovery_support import HOLD, backends, failing
from tests.grpc.support import HEADERS, PREFACE, Conn, frame_types, h2_server, hung_listener

PLAIN = {GRPC_TLS_KEY: "plaintext"}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def refuse(conn: Conn, event: h2.events.Event) -> None:
    if isinstance(event, h2.events.RequestReceived) and event.stream_id:
        conn.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)


async def goaway_below(conn: Conn, event: h2.events.Event) -> None:
    if isinstance(event, h2.events.RequestReceived) and event.stream_id:
        conn.h2.close_connection(last_stream_id=max(event.stream_id - 2, 0))


@pytest.mark.parametrize("scenario", [refuse, goaway_below], ids=["refused", "goaway"])
async def test_a_call_the_server_never_saw_goes_to_another_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, scenario: object
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with h2_server(scenario) as bad:  # type: ignore[arg-type]
            bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
            async with discovery(bad_one, servers[0].instance()) as (_owner, channel, _memory):
                stub = pb_grpc.TestServiceStub(channel)
                for _ in range(6):
                    response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                    assert response.username == "b0"
                picked = channel.route.statistics().sent["bad"]
            assert picked >= 1  # the bad instance was picked and refused
            # The subchannel's own same-host retries are off under discovery:
            # each pick of the refusing instance is one request there.
            assert len(bad.record.requests) == picked
            assert servers[0].calls == 6


@pytest.mark.parametrize("scenario", [refuse, goaway_below], ids=["refused", "goaway"])
async def test_with_every_instance_tried_one_more_round_then_unavailable(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, scenario: object
) -> None:
    # One listed instance: the first attempt, then one transparent retry (at
    # most one per listed instance), then the caller gets the unprocessed error.
    async with h2_server(scenario) as bad:  # type: ignore[arg-type]
        bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
        async with discovery(bad_one) as (_owner, channel, _memory):
            with pytest.raises(RpcError) as info:
                await pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.unprocessed
            assert channel.route.statistics().sent == {"bad": 2}
        assert len(bad.record.requests) == 2


async def test_the_subchannel_retry_is_not_an_option_under_discovery(discovery: Opener) -> None:
    with pytest.raises(TypeError, match="transparent_retries"):
        async with discovery(transparent_retries=2):
            pass


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"authority": "x:1"}, TypeError, "authority is the discovery channel's decision"),
        ({"ssl_context": None}, TypeError, "ssl_context is the discovery channel's decision"),
        ({"keepalive_time": float("nan")}, ValueError, "keepalive_time"),
        ({"max_send_message_length": "1"}, TypeError, "max_send_message_length"),
        ({"no_such_option": 1}, TypeError, "no_such_option"),
    ],
)
async def test_subchannel_options_are_checked_when_the_channel_is_made(
    discovery: Opener, options: dict[str, object], error: type[Exception], words: str
) -> None:
    # Not at the first call, inside the subchannel's task.
    with pytest.raises(error, match=words):
        async with discovery(**options):
            pass


async def test_a_refused_connection_goes_to_another_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        dead = Instance("dead", "127.0.0.1", closed_port(), metadata=PLAIN)
        async with discovery(dead, servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(6):
                response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                assert response.username == "b0"
            assert channel.route.statistics().failed.get("dead", 0) >= 1
            assert channel.stats.codes[grpc.StatusCode.OK.value[0]] == 6


async def test_a_call_held_by_a_silent_listener_goes_to_another_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    # A hung process: the kernel accepts, nothing answers (no SETTINGS). No
    # stream opens before the server's SETTINGS, so the request never left;
    # at connect_timeout the call moves to the live instance.
    with backends(pb, pb_grpc, 1) as servers:
        async with hung_listener() as hung:
            silent = Instance("silent", "127.0.0.1", hung.port, metadata=PLAIN)
            async with discovery(silent, servers[0].instance(), connect_timeout=0.3) as (
                _owner,
                channel,
                _memory,
            ):
                stub = pb_grpc.TestServiceStub(channel)
                for _ in range(4):
                    response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                    assert response.username == "b0"
                assert channel.route.statistics().sent.get("silent", 0) >= 1
            assert hung.accepted >= 1
            assert HEADERS not in frame_types(bytes(hung.received).replace(PREFACE, b""))
            assert servers[0].calls == 4


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_an_instance_still_connecting_takes_no_new_call(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, kind: str
) -> None:
    # The hung listener's connection never gets SETTINGS (no connect_timeout):
    # the one call that opened it waits out its deadline; while it connects,
    # every other call goes to the live instance (grpc picks READY only).
    with backends(pb, pb_grpc, 1) as servers:
        async with hung_listener() as hung:
            silent = Instance("silent", "127.0.0.1", hung.port, metadata=PLAIN)
            async with discovery(silent, servers[0].instance(), connect_timeout=None) as (
                _owner,
                channel,
                _memory,
            ):
                stub = pb_grpc.TestServiceStub(channel)
                failed = 0
                for _ in range(10):
                    try:
                        if kind == "unary":
                            response = await stub.UnaryCall(pb.SimpleRequest(), timeout=1)
                            assert response.username == "b0"
                        else:
                            request = pb.StreamingOutputCallRequest(
                                response_parameters=[pb.ResponseParameters(size=1)]
                            )
                            async for _ in stub.StreamingOutputCall(request, timeout=1):
                                pass
                    except RpcError as exc:
                        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        failed += 1
                statistics = channel.route.statistics()
            assert failed <= 1
            assert servers[0].calls == 10 - failed
            assert statistics.sent.get("silent", 0) == failed  # moved calls are not counted
            assert HEADERS not in frame_types(bytes(hung.received).replace(PREFACE, b""))


async def test_a_processed_call_is_never_re_sent_without_a_policy(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(RpcError) as info:
                await stub.UnaryCall(failing(pb, grpc.StatusCode.UNAVAILABLE), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert sum(s.calls for s in servers) == 1
            assert channel.stats.codes[grpc.StatusCode.UNAVAILABLE.value[0]] == 1


async def test_the_retry_policy_covers_idempotent_calls_under_throttling(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002)
    throttle = RetryThrottle(max_tokens=4, token_ratio=0.1)
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(
            *(s.instance() for s in servers), retry_policy=policy, retry_throttle=throttle
        ) as (_owner, channel, _memory):
            call = channel.unary_unary(
                "/grpc.testing.TestService/UnaryCall",
                request_serializer=pb.SimpleRequest.SerializeToString,
                response_deserializer=pb.SimpleResponse.FromString,
            )
            request = failing(pb, grpc.StatusCode.UNAVAILABLE)
            # Not marked idempotent: one attempt.
            with pytest.raises(RpcError):
                await call(request, timeout=10)
            assert sum(s.calls for s in servers) == 1
            assert throttle.tokens == 4.0  # an unmarked call leaves the throttle alone
            # Marked: the first failure takes 4 -> 3 (above half: retry), the
            # second 3 -> 2 (not above half: no third attempt).
            with pytest.raises(RpcError):
                await call(request, timeout=10, idempotent=True)
            assert sum(s.calls for s in servers) == 3
            assert throttle.tokens == 2.0
            # Throttled: one attempt only.
            with pytest.raises(RpcError):
                await call(request, timeout=10, idempotent=True)
            assert sum(s.calls for s in servers) == 4
            assert throttle.tokens == 1.0


async def test_the_retry_policy_retries_up_to_max_attempts(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002)
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(
            *(s.instance() for s in servers), retry_policy=policy, retry_throttle=RetryThrottle(100)
        ) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(RpcError) as info:
                await stub.UnaryCall(
                    failing(pb, grpc.StatusCode.UNAVAILABLE), timeout=10, idempotent=True
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert sum(s.calls for s in servers) == 3
            # A code outside retryable_status_codes: one attempt.
            with pytest.raises(RpcError):
                await stub.UnaryCall(
                    failing(pb, grpc.StatusCode.INVALID_ARGUMENT), timeout=10, idempotent=True
                )
            assert sum(s.calls for s in servers) == 4


# -- the first-serving probe ----------------------------------------------------------


async def test_the_probe_finds_the_one_serving_candidate_of_16(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 16, workers=2) as servers:
        for i, server in enumerate(servers):
            server.health = "not_serving" if i % 2 else "hang"
        servers[11].health = "serving"
        others = [s for s in servers if s is not servers[11]]
        # b11 answers once all 15 others got a probe: the probes run at once,
        # and none is cancelled before it reached its server.
        servers[11].serve_after = lambda: all(s.health_checks >= 1 for s in others)
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(3):
                response = await stub.UnaryCall(pb.SimpleRequest(), timeout=20, first_serving=True)
                # Refusal would have come at the 75% mark: an answer means the
                # probe found b11 before it.
                assert response.username == "b11"
            assert servers[11].calls == 3
            assert sum(s.calls for s in servers) == 3
            assert all(s.health_checks >= 1 for s in servers)


async def test_all_hung_is_refused_at_the_75_percent_mark_with_nothing_sent(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, autojump_clock: object
) -> None:
    with backends(pb, pb_grpc, 16, workers=2) as servers:
        for server in servers:
            server.health = "hang"
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            start = anyio.current_time()
            with pytest.raises(NoServingInstance) as info:
                await stub.UnaryCall(pb.SimpleRequest(), timeout=8, first_serving=True)
            assert anyio.current_time() - start == pytest.approx(PROBE_SHARE * 8)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "none of 16 candidate(s)" in str(info.value.details())
            assert sum(s.calls for s in servers) == 0
            assert channel.stats.codes[grpc.StatusCode.UNAVAILABLE.value[0]] == 1


async def test_all_not_serving_is_refused_with_nothing_sent(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 3, workers=2) as servers:
        for server in servers:
            server.health = "not_serving"
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            with pytest.raises(NoServingInstance):
                await pb_grpc.TestServiceStub(channel).UnaryCall(
                    pb.SimpleRequest(), timeout=20, first_serving=True
                )
            assert sum(s.calls for s in servers) == 0
            assert channel.probe_start == 1  # the next such call starts one further on


def test_candidates_rotate_and_stop_at_16() -> None:
    names = [f"i{n}" for n in range(20)]
    assert candidates(names, 0) == names[:16]
    assert candidates(names, 18) == [*names[18:], *names[:14]]
    assert candidates(names[:3], 4) == ["i1", "i2", "i0"]
    assert candidates([], 3) == []


# -- load guards of first-serving calls ---------------------------------------------


def open_guards(channel: DiscoveryChannel) -> dict[str, int]:
    """Identity -> load guards open on its endpoint (all generations of the route)."""
    view = route_metrics(channel.route)
    assert view.in_flight == sum(e.in_flight for e in view.endpoints)
    return {e.identity: e.in_flight for e in view.endpoints}


async def test_a_first_serving_call_holds_a_guard_on_the_instance_it_picked(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 3, workers=4) as servers:
        servers[0].health = servers[2].health = "not_serving"
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.SimpleRequest(response_size=HOLD)

            async def call() -> None:
                await stub.UnaryCall(request, timeout=20, first_serving=True)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                assert await anyio.to_thread.run_sync(servers[1].arrived.wait, 20)
                # In flight on b1: its guard is open, nothing elsewhere.
                assert open_guards(channel) == {"b0": 0, "b1": 1, "b2": 0}
                servers[1].release.set()
            assert open_guards(channel) == {"b0": 0, "b1": 0, "b2": 0}
            assert channel.route.statistics().sent == {"b1": 1}


async def test_random_cancellations_leave_no_guard_behind(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    rng = random.Random(29)
    outcomes = {"cancelled": 0, "completed": 0, "error": 0}
    with backends(pb, pb_grpc, 3, workers=8) as servers:
        servers[2].health = "hang"  # its probes are always cancelled
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            limiter = anyio.CapacityLimiter(16)

            async def run(index: int) -> None:
                request = pb.SimpleRequest(response_size=rng.choice((0, 2, 10)))
                # One call in five is never cancelled and one in five is
                # cancelled at its first checkpoint, whatever the machine's
                # speed; the rest at a random point of their first 50 ms.
                delay = (math.inf, 0.0)[index % 5] if index % 5 < 2 else rng.uniform(0, 0.05)
                async with limiter:
                    with anyio.move_on_after(delay) as scope:
                        try:
                            # A plain call picked for the hung server can wait for
                            # a worker its hung probes hold: DEADLINE_EXCEEDED.
                            await stub.UnaryCall(request, timeout=5, first_serving=index % 2 == 0)
                        except RpcError as exc:
                            # Only what a short budget explains: the probe's refusal
                            # at 75% of it, or the server's deadline (never a
                            # subchannel left broken by an earlier cancellation).
                            assert isinstance(exc, NoServingInstance) or (
                                exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                            ), exc
                            outcomes["error"] += 1
                            return
                    outcomes["cancelled" if scope.cancelled_caught else "completed"] += 1

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for index in range(300):
                        tg.start_soon(run, index)
            assert sum(outcomes.values()) == 300
            assert outcomes["cancelled"] >= 60 and outcomes["completed"] >= 30, outcomes
            assert set(open_guards(channel).values()) == {0}
            assert channel.route.streaming.balance.statistics().in_flight == 0
            assert all(sub.active == 0 for sub in channel._subs.values())
