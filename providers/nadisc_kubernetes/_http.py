"""The HTTP shell: one httpx client per connection, bounded reads, typed failures.

Contract: moves bytes to and from the API server and maps statuses; it
decides nothing about evidence. Every body is read through the byte budget
(``max_response_bytes``) before it is decoded: a larger ``Content-Length``
is refused before reading, a body that grows past it is abandoned; a watch
line longer than the budget is refused the same way.

Status translation (the API server answers errors with a ``Status`` object)::

    401 Unauthorized   re-read the token file once and repeat the request;
                       401 again -> IdentityRevoked
    403 Forbidden      Forbidden, an IdentityRevoked (RBAC denial: no grace; the
                       caller tells a watch-only denial from a lost list)
    404 NotFound       NotFound (the caller decides: a missing Service is empty)
    410 Gone/Expired   Gone (resourceVersion or continue token too old: relist)
    504 "Too large resource version"
                       TooLarge, a Gone (a list from a version the server has
                       not reached, after 3 s: relist)
    429, 5xx with a delay
                       RetryLater, an IncompleteSnapshot carrying the seconds
                       the server asked for (``Retry-After``, else the Status's
                       ``details.retryAfterSeconds``)
    5xx, 429, other    IncompleteSnapshot
    token unavailable  IdentityRevoked (token file gone, exec plugin failed)
    transport errors, timeouts, truncated bodies   IncompleteSnapshot
    body over budget   CapacityRejected

A delay is read as client-go reads it (staging/src/k8s.io/client-go/rest/
request.go ``checkWait``/``retryAfterSeconds``): only for 429 and 5xx, and
only a whole number of seconds (an HTTP date is ignored). Priority and
fairness sends the header with a plain-text body; a ``Status`` whose
``details.retryAfterSeconds`` is set comes with the same header
(responsewriters ``ErrorNegotiated``), so the body is only read when a proxy
dropped the header.

The bearer token travels in the ``Authorization`` header only, and is
never part of a message or log line: every quoted server text goes through
:func:`nadisc.redacted_excerpt` with the current token as a secret
(a proxy that echoes ``Bearer <token>`` is quoted as ``Bearer ***``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx

from nadisc import (
    CapacityRejected,
    ConfigError,
    IdentityRevoked,
    IncompleteSnapshot,
    ProviderFailure,
    redacted_excerpt,
)

from ._credentials import ClusterAccess
from ._wire import Status, decode_status

__all__ = ["Forbidden", "Gone", "KubeHttp", "LineReader", "NotFound", "RetryLater", "TooLarge"]

logger = logging.getLogger(__name__)

_TEXT_LIMIT = 200


class Gone(IncompleteSnapshot):
    """410: the requested resourceVersion or continue token is too old."""


class TooLarge(Gone):
    """504 "Too large resource version": the server is behind the version we hold."""


class Forbidden(IdentityRevoked):
    """403: the credentials may not make this request (an RBAC denial)."""


class NotFound(Exception):
    """404 for the named object (not a failure by itself)."""


class RetryLater(IncompleteSnapshot):
    """429 (or a 5xx) whose server asked the client to wait ``retry_after``
    seconds before its next request."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after(header: str | None, status: Status | None) -> float | None:
    """The seconds to wait the server asked for, or None when it asked none:
    ``Retry-After`` when it is a whole number of seconds, else the Status's
    ``details.retryAfterSeconds`` when positive."""
    if header is not None:
        text = header.strip()
        if text.isdecimal() and text.isascii():
            return float(int(text))
    if status is not None and status.details is not None and status.details.retryAfterSeconds > 0:
        return float(status.details.retryAfterSeconds)
    return None


def _describe(status: int, body: bytes, secrets: tuple[str, ...]) -> str:
    decoded = decode_status(body)
    if decoded is not None:
        text = f"{decoded.reason or status}: {decoded.message}"
        return redacted_excerpt(text, secrets, limit=_TEXT_LIMIT)
    return redacted_excerpt(body, secrets, limit=_TEXT_LIMIT) or str(status)


def failure_for(
    status: int,
    body: bytes,
    what: str,
    secrets: tuple[str, ...] = (),
    retry_after_header: str | None = None,
) -> ProviderFailure | NotFound:
    """The typed outcome of a non-200 answer (401 is handled by the caller);
    ``retry_after_header`` is the answer's ``Retry-After``, if any."""
    detail = _describe(status, body, secrets)
    if status == 403:
        return Forbidden(f"{what}: HTTP 403 {detail}")
    if status == 401:
        return IdentityRevoked(f"{what}: HTTP 401 {detail}")
    if status == 404:
        return NotFound(f"{what}: {detail}")
    if status == 410:
        return Gone(f"{what}: HTTP 410 {detail}")
    if status == 504:
        decoded = decode_status(body)
        if decoded is not None and decoded.too_large_version:
            return TooLarge(f"{what}: HTTP 504 {detail}")
    if status == 429 or status >= 500:
        delay = retry_after(retry_after_header, decode_status(body))
        if delay is not None:
            return RetryLater(f"{what}: HTTP {status} {detail}", delay)
    return IncompleteSnapshot(f"{what}: HTTP {status} {detail}")


def status_failure(status: Status, what: str, secrets: tuple[str, ...] = ()) -> ProviderFailure:
    """The typed outcome of an ERROR event's Status."""
    detail = redacted_excerpt(
        f"{status.reason or status.code}: {status.message}", secrets, limit=_TEXT_LIMIT
    )
    if status.code == 410:
        return Gone(f"{what}: {detail}")
    if status.too_large_version:
        return TooLarge(f"{what}: {detail}")
    if status.code == 403:
        return Forbidden(f"{what}: {detail}")
    if status.code == 401:
        return IdentityRevoked(f"{what}: {detail}")
    message = f"{what}: watch ended with an error ({detail})"
    if status.code == 429 or status.code >= 500:
        delay = retry_after(None, status)
        if delay is not None:
            return RetryLater(message, delay)
    return IncompleteSnapshot(message)


async def _discard(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Abandon a watch body: close the connection, then run the body iterator
    into the closed connection so every generator in httpx's chain finishes
    now (a suspended one would be finalized later by the garbage collector,
    which trio reports as a leak). Shielded and bounded."""
    with anyio.CancelScope(shield=True) as scope:
        scope.deadline = anyio.current_time() + 1.0
        await response.aclose()
        with contextlib.suppress(Exception):  # the connection was closed on purpose
            while True:
                await chunks.__anext__()


class LineReader:
    """Newline-delimited events of one watch response, each at most ``limit`` bytes."""

    def __init__(self, chunks: AsyncIterator[bytes], limit: int, what: str) -> None:
        self._chunks = chunks
        self._limit = limit
        self._what = what
        self._buffer = bytearray()

    def __aiter__(self) -> LineReader:
        return self

    async def __anext__(self) -> list[bytes]:
        """The complete lines that arrived with the next chunk (possibly none).

        Stops when the server ends the response; raises ``IncompleteSnapshot``
        when it breaks, ``CapacityRejected`` for a line over the limit. A plain
        iterator object, not a generator: nothing is left suspended when the
        reader is abandoned half-way."""
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            if self._buffer.strip():
                # The server ends a watch between events; bytes left over
                # mean the connection was cut inside one.
                raise IncompleteSnapshot(
                    f"{self._what}: the watch stream ended inside an event"
                ) from None
            raise
        except (httpx.HTTPError, httpx.StreamError) as exc:
            raise IncompleteSnapshot(
                f"{self._what}: the watch stream broke ({type(exc).__name__})"
            ) from exc
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += chunk
        lines: list[bytes] = []
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            if end - start > self._limit:
                raise CapacityRejected(
                    f"{self._what}: a watch event exceeds max_response_bytes={self._limit}"
                )
            line = bytes(buffer[start:end]).strip()
            if line:
                lines.append(line)
            start = end + 1
        del buffer[:start]
        if len(buffer) > self._limit:
            raise CapacityRejected(
                f"{self._what}: a watch event exceeds max_response_bytes={self._limit}"
            )
        return lines


@dataclass(slots=True)
class HttpCounters:
    requests: int = 0
    unauthorized_retries: int = 0


class KubeHttp:
    """Moves bytes to and from one API server (see the module docstring)."""

    def __init__(
        self,
        access: ClusterAccess,
        *,
        max_response_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._access = access
        self._base = access.server
        self._max_bytes = max_response_bytes
        self._client = httpx.AsyncClient(
            headers={"User-Agent": "nadisc-kubernetes", "Accept": "application/json"},
            verify=access.ssl_context(),
            transport=transport,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
            follow_redirects=False,
            trust_env=False,
        )
        self._extensions = (
            {"sni_hostname": access.tls_server_name} if access.tls_server_name else {}
        )
        self.counters = HttpCounters()
        self._closed = False
        self._sent = ""

    @property
    def access(self) -> ClusterAccess:
        return self._access

    @property
    def secrets(self) -> tuple[str, ...]:
        """What must never be quoted: the token last sent (for redaction)."""
        return (self._sent,) if self._sent else ()

    async def _headers(self, what: str, identity: bool = False) -> dict[str, str]:
        try:
            token = await self._access.tokens.fetch()
        except ConfigError as exc:
            # The token file vanished (or became unreadable) after start.
            raise IdentityRevoked(f"{what}: {exc.detail}") from None
        self._sent = token or ""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if identity:
            headers["Accept-Encoding"] = "identity"
        return headers

    @asynccontextmanager
    async def _open(
        self,
        path: str,
        params: Mapping[str, str],
        *,
        timeout: httpx.Timeout,  # noqa: ASYNC109 - httpx per-request timeouts
        what: str,
        identity: bool = False,
    ) -> AsyncIterator[httpx.Response]:
        """A response with status 200 (after at most one 401 re-read), else typed."""
        if self._closed:
            raise IncompleteSnapshot(f"{what}: the connection is closed")
        for attempt in (0, 1):
            self.counters.requests += 1
            request = self._client.build_request(
                "GET",
                self._base + path,
                params=params,
                headers=await self._headers(what, identity),
                timeout=timeout,
                extensions=self._extensions,
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TimeoutException as exc:
                raise IncompleteSnapshot(f"{what}: timed out ({type(exc).__name__})") from exc
            except httpx.HTTPError as exc:
                detail = redacted_excerpt(str(exc), self.secrets, limit=_TEXT_LIMIT)
                raise IncompleteSnapshot(
                    f"{what}: transport failed ({type(exc).__name__}: {detail})"
                ) from exc
            try:
                if response.status_code == 200:
                    yield response
                    return
                body = await self._read_bounded(response, what)
                if response.status_code == 401 and attempt == 0:
                    try:
                        again = await self._access.tokens.refetch()
                    except ConfigError as exc:
                        raise IdentityRevoked(f"{what}: {exc.detail}") from None
                    if again:
                        self.counters.unauthorized_retries += 1
                        logger.info("%s: 401; the credential was renewed, trying once more", what)
                        continue
                raise failure_for(
                    response.status_code,
                    body,
                    what,
                    self.secrets,
                    response.headers.get("retry-after"),
                )
            finally:
                with anyio.CancelScope(shield=True) as scope:
                    scope.deadline = anyio.current_time() + 1.0
                    await response.aclose()
        raise AssertionError("unreachable")  # pragma: no cover

    async def get(self, path: str, params: Mapping[str, str], *, budget: float, what: str) -> bytes:
        """A bounded read: the body of a 200, else a typed failure (or NotFound)."""
        timeout = httpx.Timeout(budget, connect=min(budget, 10.0))
        try:
            with anyio.fail_after(budget):
                async with self._open(path, params, timeout=timeout, what=what) as response:
                    return await self._read_bounded(response, what)
        except TimeoutError as exc:
            raise IncompleteSnapshot(f"{what}: no complete answer within {budget:.1f}s") from exc

    @asynccontextmanager
    async def watch(
        self,
        path: str,
        params: Mapping[str, str],
        *,
        open_budget: float,
        idle_timeout: float,
        what: str,
    ) -> AsyncIterator[LineReader]:
        """An open watch response (status 200); reading it is bounded by
        ``idle_timeout`` of silence, opening it by ``open_budget``."""
        timeout = httpx.Timeout(idle_timeout, connect=min(open_budget, 10.0))
        async with AsyncExitStack() as stack:
            with anyio.CancelScope(deadline=anyio.current_time() + open_budget) as opened:
                response = await stack.enter_async_context(
                    self._open(path, params, timeout=timeout, what=what, identity=True)
                )
            if opened.cancelled_caught:
                raise IncompleteSnapshot(f"{what}: the watch did not open in time")
            # Raw bytes (the watch asks for no content coding): one generator
            # level, closed explicitly when the watch ends.
            chunks = response.aiter_raw()
            stack.push_async_callback(_discard, response, chunks)
            yield LineReader(chunks, self._max_bytes, what)

    async def _read_bounded(self, response: httpx.Response, what: str) -> bytes:
        limit = self._max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise CapacityRejected(
                f"{what}: response of {declared} bytes exceeds max_response_bytes={limit}"
            )
        chunks: list[bytes] = []
        total = 0
        body = response.aiter_bytes()
        try:
            try:
                async for chunk in body:
                    total += len(chunk)
                    if total > limit:
                        raise CapacityRejected(
                            f"{what}: response body exceeds max_response_bytes={limit}"
                        )
                    chunks.append(chunk)
            except BaseException:
                # Abandoned half-way (too large, timed out, cancelled): finish
                # httpx's generators now, not in the garbage collector.
                await _discard(response, body)
                raise
        except httpx.TimeoutException as exc:
            raise IncompleteSnapshot(f"{what}: timed out reading the body") from exc
        except httpx.HTTPError as exc:
            raise IncompleteSnapshot(
                f"{what}: the body could not be read ({type(exc).__name__})"
            ) from exc
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.move_on_after(5, shield=True):
            await self._client.aclose()
