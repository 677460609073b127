"""The HTTP shell: one httpx client per connection, bounded reads, typed failures.

Every request reads its body through a byte budget (``max_response_bytes``)
before anything decodes it: a ``Content-Length`` above the budget is refused
before reading, a body that grows past it is abandoned at the budget, so a
misbehaving server cannot make us hold more than the budget in memory.

Failure translation (reads / writes)::

    403 (plain text "Permission denied", "ACL not found")  IdentityRevoked
    200 + X-Consul-Results-Filtered-By-ACLs: true          AclFiltered (an IdentityRevoked)
        raised by the provider for /v1/health/service reads only; a filtered
        /v1/catalog/services answer is a normal least-privilege listing
    no connection (refused, connect timeout, closed)       NotDelivered (an IncompleteSnapshot):
                                                           a write was never sent
    read/timeout/truncated body after sending              IncompleteSnapshot / OutcomeUnknown
    429 (rate limited: refused before it applied)          IncompleteSnapshot / IncompleteSnapshot
    5xx, other non-2xx                                     IncompleteSnapshot / OutcomeUnknown
    400 on a write                                         RegistrationRejected
    body over budget                                       CapacityRejected

A write's lost answer is ``OutcomeUnknown``, or the class the caller names
(``RenewalOutcomeUnknown`` for a TTL ``check/pass``, which cannot create a
record). ``IncompleteSnapshot`` from a write means it certainly did not
apply: the lifecycle retries it like any write that was never sent.

The ACL token travels in the ``X-Consul-Token`` header only and is never part
of a message.

Connections: requests share one pool. A watch's blocking queries, which
hold a connection for up to ``wait``, do not: :meth:`ConsulHttp.channel`
opens a channel with one connection of its own for each watch (closed with
it), so a thousand watches are a thousand sockets the pool never scans, and
a short request never queues behind a long poll. The TLS context is built
once per connection and shared by its channels; a CA bundle is loaded only
for an ``https`` agent (:func:`tls_context`), since loading one holds the
event loop for tens to hundreds of milliseconds.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx

from nadisc import (
    CapacityRejected,
    ConfigError,
    IdentityRevoked,
    IncompleteSnapshot,
    OutcomeUnknown,
    ProviderFailure,
    RegistrationRejected,
    redacted_excerpt,
    tls_context_for,
)

from ._settings import ConsulSettings

__all__ = [
    "FILTERED_HEADER",
    "AclFiltered",
    "ConsulHttp",
    "ConsulResponse",
    "NotDelivered",
    "tls_context",
]

#: Consul sets this header (value ``true``) on a read whose results it trimmed
#: because the token may not read all of them; the status stays 200.
FILTERED_HEADER = "x-consul-results-filtered-by-acls"


class AclFiltered(IdentityRevoked):
    """A read answered 200 but Consul left results out for lack of ``read``
    permission (``X-Consul-Results-Filtered-By-ACLs: true``): the listing is
    not the service's membership, so it is a trimmed permission, never an
    explicit empty listing. Unlike a 403 ``ACL not found`` the token itself is
    valid, which is why the catalog can skip just that service."""


class NotDelivered(IncompleteSnapshot):
    """The request never reached the agent (the connection was refused, the
    connect timed out, or the connection is closed): a write certainly did
    not apply, unlike a failure after the request was sent."""


logger = logging.getLogger(__name__)

_TEXT_LIMIT = 200
#: Consul's rate limiters (``http_max_conns_per_client``, the servers'
#: request-rate limits) refuse with 429 before the endpoint runs.
_RATE_LIMITED = 429


@dataclass(frozen=True, slots=True)
class ConsulResponse:
    status: int
    body: bytes
    headers: Mapping[str, str]
    #: What must never be quoted from the body (the connection's token).
    secrets: tuple[str, ...] = field(default=(), repr=False)

    def text(self) -> str:
        """A short, filtered excerpt of the body for messages and logs."""
        return redacted_excerpt(self.body, self.secrets, limit=_TEXT_LIMIT)

    @property
    def filtered_by_acls(self) -> bool:
        return self.headers.get(FILTERED_HEADER, "").strip().lower() == "true"


def tls_context(settings: ConsulSettings) -> ssl.SSLContext:
    """The TLS context of a connection to the agent at ``settings.url``.

    ``https``: the CA bundle of ``ca_file``, else httpx's default trust store.
    Loading a bundle is synchronous and parses every certificate in it (tens
    of milliseconds idle, hundreds on a loaded machine): the event loop
    stands still meanwhile, long enough to time out a health probe the same
    process answers. A plain ``http`` agent URL never starts a handshake
    (redirects are not followed), so it gets a client context that trusts
    nothing and loads nothing: should TLS ever be attempted through it,
    verification fails closed.
    """
    if settings.url.scheme != "https" or settings.ca_file is None:
        return tls_context_for([str(settings.url)])
    try:
        return ssl.create_default_context(cafile=settings.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("consul.ca_file", f"cannot load CA bundle: {exc}") from exc


class ConsulHttp:
    """Moves bytes to and from one Consul agent. No decisions beyond status mapping."""

    def __init__(
        self,
        settings: ConsulSettings,
        *,
        max_response_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
        _verify: ssl.SSLContext | None = None,
    ) -> None:
        self._settings = settings
        self._base = settings.base_url
        self._max_bytes = max_response_bytes
        self._given = transport
        headers = {"User-Agent": "nadisc-consul", "Accept": "application/json"}
        self._secrets: tuple[str, ...] = ()
        if settings.token is not None:
            # Consul accepts the ACL token as a bearer credential; httpx masks
            # Authorization in every repr (X-Consul-Token it would show).
            token = settings.token.get_secret_value()
            headers["Authorization"] = f"Bearer {token}"
            self._secrets = (token,)
        dedicated = _verify is not None
        if _verify is None:
            _verify = tls_context(settings)
        self._verify = _verify
        if dedicated:
            # A channel: exactly one connection, kept for the channel's life.
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            if transport is None:
                transport = httpx.AsyncHTTPTransport(verify=_verify, limits=limits)
        else:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        self._client = httpx.AsyncClient(
            headers=headers,
            verify=_verify,
            transport=transport,
            limits=limits,
            follow_redirects=False,
            trust_env=False,
        )
        self._closed = False
        #: Channels of this connection open right now (see :meth:`channel`).
        self.channels_open = 0
        #: Requests sent through the shared pool / through channels.
        self.pool_requests = 0
        self.channel_requests = 0
        #: Blocking queries (``?index=``) that went through the pool: only
        #: the catalog's two long polls ever do.
        self.pool_blocking_requests = 0
        self._parent: ConsulHttp | None = None

    @asynccontextmanager
    async def channel(self) -> AsyncIterator[ConsulHttp]:
        """A channel with one connection of its own (for one watch's blocking
        queries), closed on exit. An injected transport (tests) serves it too."""
        if self._closed:
            raise IncompleteSnapshot("the connection is closed")
        child = ConsulHttp(
            self._settings,
            max_response_bytes=self._max_bytes,
            transport=self._given,
            _verify=self._verify,
        )
        child._parent = self
        self.channels_open += 1
        try:
            yield child
        finally:
            self.channels_open -= 1
            await child.aclose()

    @property
    def max_response_bytes(self) -> int:
        return self._max_bytes

    async def get(
        self, path: str, params: Mapping[str, str] | None, *, budget: float, what: str
    ) -> ConsulResponse:
        """A read: 200 returns, everything else raises a typed failure."""
        response = await self._send("GET", path, params, None, budget=budget, what=what)
        if response.status == 200:
            return response
        raise self._read_failure(response, what)

    async def get_any(
        self, path: str, params: Mapping[str, str] | None, *, budget: float, what: str
    ) -> ConsulResponse:
        """A read whose non-200 statuses carry meaning (403 still raises)."""
        response = await self._send("GET", path, params, None, budget=budget, what=what)
        if response.status == 403:
            raise self._read_failure(response, what)
        return response

    async def put(
        self,
        path: str,
        body: object | None,
        *,
        budget: float,
        what: str,
        allow: tuple[int, ...] = (),
        unknown: type[OutcomeUnknown] = OutcomeUnknown,
    ) -> ConsulResponse:
        """A write. 200 (and statuses in ``allow``) return; others raise.

        A write that never left (:class:`NotDelivered`) or that Consul refused
        as rate limited (429) raises ``IncompleteSnapshot``: it did not apply.
        One whose answer was lost raises ``unknown`` (``OutcomeUnknown``, or a
        subclass that tells the lifecycle what the write could do)."""
        try:
            response = await self._send("PUT", path, None, body, budget=budget, what=what)
        except NotDelivered:
            raise
        except IncompleteSnapshot as exc:
            raise unknown(f"{what}: {exc}; the write may or may not have applied") from exc
        if response.status == 200 or response.status in allow:
            return response
        if response.status == 403:
            raise IdentityRevoked(f"{what}: denied by Consul (403): {response.text()}")
        if response.status == 400:
            raise RegistrationRejected(f"{what}: rejected by Consul (400): {response.text()}")
        if response.status == _RATE_LIMITED:
            raise IncompleteSnapshot(
                f"{what}: Consul refused the write as rate limited (429): {response.text()}; "
                "it was not applied"
            )
        raise unknown(
            f"{what}: Consul answered HTTP {response.status}: {response.text()}; "
            "the write may or may not have applied"
        )

    def _read_failure(self, response: ConsulResponse, what: str) -> ProviderFailure:
        if response.status == 403:
            return IdentityRevoked(f"{what}: denied by Consul (403): {response.text()}")
        return IncompleteSnapshot(
            f"{what}: Consul answered HTTP {response.status}: {response.text()}"
        )

    async def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: object | None,
        *,
        budget: float,
        what: str,
    ) -> ConsulResponse:
        if self._closed or (self._parent is not None and self._parent._closed):
            raise NotDelivered(f"{what}: the connection is closed")
        if self._parent is not None:
            self._parent.channel_requests += 1
        else:
            self.pool_requests += 1
            if params is not None and "index" in params:
                self.pool_blocking_requests += 1
        url = self._base + path
        # httpx enforces the socket-level timeouts; the outer scope also bounds
        # transports without sockets and the whole read (a slow trickle).
        http_timeout = httpx.Timeout(budget, connect=min(budget, 10.0))
        logger.debug("consul %s %s", method, path)
        try:
            with anyio.fail_after(budget):
                async with self._client.stream(
                    method, url, params=params, json=body, timeout=http_timeout
                ) as response:
                    content = await self._read_bounded(response, what)
                    return ConsulResponse(
                        response.status_code, content, response.headers, self._secrets
                    )
        except TimeoutError as exc:
            raise IncompleteSnapshot(f"{what}: no complete answer within {budget:.1f}s") from exc
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            # No connection was made (or none was free): nothing was sent.
            raise NotDelivered(
                f"{what}: transport failed before anything was sent ({type(exc).__name__}: {exc})"
            ) from exc
        except httpx.TimeoutException as exc:
            raise IncompleteSnapshot(f"{what}: timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise IncompleteSnapshot(
                f"{what}: transport failed ({type(exc).__name__}: {exc})"
            ) from exc
        except httpx.HTTPError as exc:  # decoding errors of a compressed body
            raise IncompleteSnapshot(f"{what}: {type(exc).__name__}: {exc}") from exc

    async def _read_bounded(self, response: httpx.Response, what: str) -> bytes:
        limit = self._max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise CapacityRejected(
                f"{what}: response of {declared} bytes exceeds max_response_bytes={limit}"
            )
        chunks: list[bytes] = []
        total = 0
        # Close the byte iterator explicitly when we stop early, rather than
        # leaving an unfinished async generator to the garbage collector.
        body = response.aiter_bytes()
        try:
            async for chunk in body:
                total += len(chunk)
                if total > limit:
                    raise CapacityRejected(
                        f"{what}: response body exceeds max_response_bytes={limit}"
                    )
                chunks.append(chunk)
        finally:
            close = getattr(body, "aclose", None)
            if close is not None:
                await close()
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.move_on_after(5, shield=True):
            await self._client.aclose()
