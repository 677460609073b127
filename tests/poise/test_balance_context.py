"""Affinity context: unit, whole request, or a projection of one field."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import pytest

from poise import (
    Balance,
    ContextProjection,
    Endpoint,
    InvalidInput,
    RequestContext,
    UseRequest,
    WeightedRendezvous,
    service_fn,
)

from ._balance_support import First, endpoints


@dataclass
class Order:
    user_id: object
    body: bytes


async def test_default_context_is_none() -> None:
    policy = First()
    balance: Balance[object, object] = Balance(policy, endpoints("a"))
    await balance.dispatch(Order("u1", b"x"))
    assert policy.seen[0][1] is None


async def test_use_request_passes_the_request_itself() -> None:
    policy = First()
    balance: Balance[object, object] = Balance(policy, endpoints("a"), context=UseRequest())
    request = Order("u1", b"x")
    await balance.dispatch(request)
    assert policy.seen[0][1] is request


async def test_request_context_passes_the_projected_field_without_copying() -> None:
    policy = First()
    user = ("tenant", 42)
    balance: Balance[object, object] = Balance(
        policy, endpoints("a"), context=RequestContext(attrgetter("user_id"))
    )
    await balance.dispatch(Order(user, b"payload"))
    assert policy.seen[0][1] is user


class Tenant:
    """A mutable context value: a copy would be a different object."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tags: list[str] = []


async def test_the_projection_hands_the_policy_the_field_itself_on_every_path() -> None:
    policy = First()
    tenant = Tenant("t1")
    request = Order(tenant, b"payload")
    balance: Balance[object, object] = Balance(
        policy, endpoints("a"), context=RequestContext(attrgetter("user_id"))
    )
    await balance.dispatch(request)
    held = await balance.dispatch_held(request)
    held.complete()
    await balance.ready()
    await balance.call(request)
    async with balance.open(request):
        pass
    assert len(policy.seen) == 4
    assert all(context is tenant for _keys, context in policy.seen)
    # The very object: a change through the request is visible in what the
    # policy received, and the request was not replaced either.
    tenant.tags.append("gold")
    seen = policy.seen[0][1]
    assert isinstance(seen, Tenant) and seen.tags == ["gold"]
    assert request.user_id is tenant


async def test_any_object_with_project_is_a_context() -> None:
    class Shard:
        def project(self, request: Order) -> int:
            return len(request.body)

    projection: ContextProjection[Order, int] = Shard()
    policy = First()
    balance: Balance[Order, object] = Balance(
        policy,
        [Endpoint("a", service_fn(_echo))],
        context=projection,
    )
    await balance.dispatch(Order("u", b"abc"))
    assert policy.seen[0][1] == 3


async def _echo(order: Order) -> object:
    return order.user_id


async def test_affinity_policy_keeps_a_user_on_one_endpoint() -> None:
    eps = [Endpoint(f"e{i}", service_fn(_tag(f"e{i}"))) for i in range(5)]
    balance: Balance[Order, str] = Balance(
        WeightedRendezvous(), eps, context=RequestContext(attrgetter("user_id"))
    )
    for user in ("alice", "bob", "carol"):
        seen = {await balance.dispatch(Order(user, b"")) for _ in range(10)}
        assert len(seen) == 1


def _tag(name: str):
    async def serve(order: Order) -> str:
        return name

    return serve


def test_request_context_needs_a_callable() -> None:
    with pytest.raises(InvalidInput):
        RequestContext(42)  # type: ignore[arg-type]
    assert "user_id" in repr(RequestContext(attrgetter("user_id")))
    assert repr(UseRequest()) == "UseRequest()"
