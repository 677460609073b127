"""The eligibility probe: a tiny ASGI app over local eligibility.

``GET /discovery/eligible/{registration}`` answers ``200`` with
``{"registration": ..., "eligible": true}`` when that registration is
locally eligible now, ``503`` with ``"eligible": false`` when it is not, and
``404`` for an unknown registration. ``HEAD`` answers the same without a
body; other methods get ``405``. When the probe is disabled (config
``eligibility_probe: false``, the default) every request gets ``404``, so the
path reveals nothing.

The probe reads *only* the local eligibility of the named registration —
never an overall readiness that includes the registration's own result, so
a registry health check pointed at this probe cannot form a cycle
(registration waits on readiness waits on registration). It does no I/O
besides answering and costs one dictionary lookup per request. Restrict
its network exposure: it tells whoever can reach it which registrations the
process currently offers.

Serve it with any ASGI server (hypercorn, uvicorn) or mount it under a
prefix of an application router (Starlette/FastAPI ``Mount``). Under a
mount the router keeps the full ``path`` and puts the prefix in
``root_path``; the probe routes on what lies below ``root_path`` (a router
that strips the prefix from ``path`` works too)::

    app = owner.eligibility_probe()     # enabled by config eligibility_probe
    app = eligibility_probe_app(registration_set.eligibilities(), enabled=True)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

import anyio

from ._eligibility import Eligibility

__all__ = ["EligibilityProbe", "eligibility_probe_app"]

Scope = Mapping[str, object]
Message = Mapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[dict[str, object]], Awaitable[None]]

PREFIX = "/discovery/eligible/"


class EligibilityProbe:
    """The ASGI application (see the module docstring)."""

    __slots__ = ("_clock", "_eligibility", "_enabled")

    def __init__(
        self,
        eligibility: Mapping[str, Eligibility],
        *,
        enabled: bool,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self._eligibility = eligibility
        self._enabled = bool(enabled)
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return  # websockets etc.: not served
        status, body = self._answer(scope)
        full = json.dumps(body).encode()
        payload = b"" if scope.get("method") == "HEAD" else full
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(full)).encode()),
            (b"cache-control", b"no-store"),
        ]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def _answer(self, scope: Scope) -> tuple[int, dict[str, object]]:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        # ASGI: a mounting router keeps the full path and puts its prefix in
        # root_path (Starlette's Mount does); route on what lies below it.
        if (
            isinstance(path, str)
            and isinstance(root, str)
            and root
            and path.startswith(root)
            and path[len(root) : len(root) + 1] in ("", "/")
        ):
            path = path[len(root) :]
        if not self._enabled or not isinstance(path, str) or not path.startswith(PREFIX):
            return 404, {"error": "not found"}
        name = path[len(PREFIX) :]
        eligibility = self._eligibility.get(name) if name and "/" not in name else None
        if eligibility is None:
            return 404, {"error": "unknown registration"}
        if scope.get("method") not in ("GET", "HEAD"):
            return 405, {"error": "method not allowed"}
        eligible = eligibility.is_eligible(self._clock())
        return (200 if eligible else 503), {"registration": name, "eligible": eligible}

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message.get("type") == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message.get("type") == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def eligibility_probe_app(
    eligibility: Mapping[str, Eligibility],
    *,
    enabled: bool,
    clock: Callable[[], float] = anyio.current_time,
) -> EligibilityProbe:
    """An ASGI app answering ``GET /discovery/eligible/{registration}``.

    ``eligibility`` maps registration names to their local eligibility
    (``RegistrationSet.eligibilities()``); ``enabled`` mirrors the config's
    ``eligibility_probe``; ``clock`` defaults to the event loop's clock.
    """
    return EligibilityProbe(eligibility, enabled=enabled, clock=clock)
