"""A switchable transport in front of an in-process registry fake.

The fake can be swapped for a new one (a registry restarted empty), the
agent can refuse connections, and single requests can be answered with a
status, hang, or be applied with their answer never coming: the faults a
registration meets on the wire, without sockets (trio's MockClock runs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import anyio
import httpx

from nadisc import ConnectionContext, DiscoveryConfig

Action = Literal["hang", "apply_then_hang", "deliver_later", "refuse"] | int


class Fake(Protocol):
    def transport(self) -> httpx.AsyncBaseTransport: ...


@dataclass
class Once:
    """Answer the next request matching ``method`` and ``path`` (a substring
    of the URL path) with ``action``; ``skip_query`` leaves requests whose
    query has that parameter alone and ``with_query`` takes only those (a
    Nacos v3 heartbeat is a POST to the register path with ``heartBeat``)."""

    method: str
    path: str
    action: Action
    skip_query: str | None = None
    #: Only requests whose query has this parameter.
    with_query: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def matches(self, request: httpx.Request) -> bool:
        if request.method != self.method or self.path not in request.url.path:
            return False
        params = request.url.params
        if self.with_query is not None and self.with_query not in params:
            return False
        return self.skip_query is None or self.skip_query not in params


class FaultTransport(httpx.AsyncBaseTransport):
    def __init__(self, fake: Fake) -> None:
        self.inner = fake.transport()
        #: While set, every connection is refused (nothing reaches the fake).
        self.down = False
        self.faults: list[Once] = []
        self.log: list[tuple[float, str, str]] = []
        #: Requests taken by a ``deliver_later`` fault, not yet delivered.
        self.delayed: list[httpx.Request] = []

    def restart(self, fake: Fake) -> None:
        """The registry came back as ``fake`` (typically a new, empty one)."""
        self.inner = fake.transport()

    def once(self, *faults: Once) -> None:
        self.faults.extend(faults)

    async def deliver_delayed(self) -> None:
        """The requests ``deliver_later`` held reach the registry now (the
        one running now, after any :meth:`restart`): a write whose answer was
        lost, arriving late. Their answers go nowhere."""
        delayed, self.delayed = self.delayed, []
        for request in delayed:
            await self.inner.handle_async_request(request)

    def mark(self) -> int:
        """A position in the request log, for :meth:`requests`."""
        return len(self.log)

    def requests(self, method: str, path: str, since: int = 0) -> list[float]:
        """When requests with ``method`` and ``path`` in their path were made,
        from log position ``since`` (see :meth:`mark`) on."""
        return [t for t, m, p in self.log[since:] if m == method and path in p]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.log.append((anyio.current_time(), request.method, request.url.path))
        for position, fault in enumerate(self.faults):
            if fault.matches(request):
                del self.faults[position]
                action = fault.action
                if action == "refuse":
                    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
                if action == "hang":
                    await anyio.sleep_forever()
                if action == "deliver_later":
                    self.delayed.append(request)
                    await anyio.sleep_forever()
                if action == "apply_then_hang":
                    await self.inner.handle_async_request(request)
                    await anyio.sleep_forever()
                assert isinstance(action, int)
                return httpx.Response(
                    action,
                    headers={"Content-Type": "text/plain", **fault.headers},
                    content=b"injected failure",
                    request=request,
                )
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


def primary_context(cfg: DiscoveryConfig) -> ConnectionContext:
    """The context the owner gives connection ``primary`` of ``cfg``."""
    connection = cfg.connections["primary"]
    return ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
