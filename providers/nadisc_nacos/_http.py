"""The HTTP shell: one httpx client per connection, bounded reads, login tokens.

Every body is read through the byte budget (``max_response_bytes``): a
``Content-Length`` over it is refused before reading, a body that grows past
it is abandoned there (``CapacityRejected``). Several ``server_addr`` entries
are tried in turn on transport failures (the next request starts at the
server that answered last); an HTTP answer is final.

Auth (only with ``username``/``password``)::

    no token / now >= refresh_at  --login (single flight: one lock, re-checked)-->
        200 {accessToken, tokenTtl}  token, refresh_at = now + ttl - margin
        403/401                      IdentityRevoked (a refused login is revocation)
        other / transport            IncompleteSnapshot
    request --403 "token expired!" / "token invalid!" / "Invalid signature" /
        "unsupported signature algorithm"--> forget that token, one re-login,
        one retry; a second 403 is IdentityRevoked (a rotated token key, or
        servers with different keys, answer "Invalid signature": the token,
        not the identity, is refused)
    request --403 anything else (authorization failed!)--> IdentityRevoked

The token travels in the ``Authorization: Bearer`` and ``accessToken``
headers (Nacos reads either), never in a URL; the password only in the login
form body. Neither ever appears in a message: every quote of a server's
answer goes through :func:`nadisc._redact.redacted_excerpt` with this
connection's password (as sent, form- and JSON-encoded) and its issued tokens
masked, so a server that echoes the request cannot put them into an error or
a log line; ``repr(NacosResponse)`` shows the status and size only.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
import httpx

from nadisc import (
    CapacityRejected,
    ConfigError,
    IdentityRevoked,
    IncompleteSnapshot,
    tls_context_for,
)
from nadisc._redact import redacted_excerpt

from ._settings import NacosSettings
from ._wire import decode_login

__all__ = ["LOGIN_PATHS", "NacosHttp", "NacosResponse", "NotDelivered"]

logger = logging.getLogger(__name__)

#: Login endpoint per API generation (relative to the context path).
LOGIN_PATHS = {"v3": "/v3/auth/user/login", "v1": "/v1/auth/login"}
#: Statuses of a path the server does not serve (Nacos 3 answers 410 for
#: turned-off compatibility APIs, Spring 404/405 for unknown ones).
NOT_SERVED = frozenset({404, 405, 410, 501})
#: 403 texts that refuse the token, not the identity (the default auth
#: plugin's ``NacosSignatureAlgorithm.verify``: a token of another key is
#: "Invalid signature", an unknown header "unsupported signature algorithm",
#: a malformed one "token invalid!", an old one "token expired!").
_TOKEN_MARKERS = (
    "token expired",
    "token invalid",
    "invalid signature",
    "unsupported signature algorithm",
)
#: Tokens kept for masking after they were replaced (an echo may quote an old one).
_TOKENS_REMEMBERED = 4
#: Connections per connection's pool, and requests in flight at once. Callers
#: beyond it wait at our own FIFO gate, not in httpcore's pool queue: the pool
#: re-scans its whole queue on every request it finishes, which with hundreds
#: of waiting beats cost milliseconds of CPU per request and stalled the loop.
POOL_SIZE = 32
_TEXT_LIMIT = 200


class NotDelivered(IncompleteSnapshot):
    """No server of the connection took the request (every connect refused or
    timed out): a write certainly did not apply, unlike a failure after sending."""


@dataclass(frozen=True, slots=True)
class NacosResponse:
    status: int
    #: Never in the repr: a server may echo the request (the password, the token).
    body: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"NacosResponse(status={self.status}, {len(self.body)} bytes)"

    # No ``text()``: quoting a body needs the connection's secrets
    # (:meth:`NacosHttp.quote`); a generic mask cannot know where a password
    # with a space in it ends.


def token_problem(body: bytes) -> bool:
    """A 403 that says the token (not the permission) is the problem: Nacos's
    auth filter answers ``token expired!`` / ``token invalid!`` (plain text,
    or inside Spring's JSON error body)."""
    lowered = body[:2048].decode("utf-8", "replace").lower()
    return any(marker in lowered for marker in _TOKEN_MARKERS)


class NacosHttp:
    """Moves bytes to and from the Nacos servers of one connection."""

    def __init__(
        self,
        settings: NacosSettings,
        *,
        max_response_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._settings = settings
        self._bases = settings.base_urls
        #: host:port per base URL, for messages (never the credentials).
        self._hosts = tuple(f"{u.host}:{u.port}" for u in settings.server_addr)
        self._current = 0
        self._max_bytes = max_response_bytes
        # Loading a CA bundle is synchronous and slow (it holds the event
        # loop): the configured bundle is loaded once here, the default store
        # is the process's shared context, and plain-http servers get a
        # context that trusts nothing and loads nothing.
        verify: ssl.SSLContext
        if settings.ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=settings.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("nacos.ca_file", f"cannot load CA bundle: {exc}") from exc
        else:
            verify = tls_context_for(str(url) for url in settings.server_addr)
        self._client = httpx.AsyncClient(
            headers={"User-Agent": "nadisc-nacos", "Accept": "application/json"},
            verify=verify,
            transport=transport,
            limits=httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE),
            follow_redirects=False,
            trust_env=False,
        )
        self._gate = anyio.CapacityLimiter(POOL_SIZE)
        self._token: str | None = None
        self._issued: deque[str] = deque(maxlen=_TOKENS_REMEMBERED)
        self._refresh_at = 0.0
        self._login_lock = anyio.Lock()
        #: Which API generation's login path to use (set by the provider's probe).
        self.login_api = "v3" if settings.api != "v1" else "v1"
        self.logins = 0
        self._closed = False

    @property
    def max_response_bytes(self) -> int:
        return self._max_bytes

    @property
    def authenticated(self) -> bool:
        return self._settings.username is not None

    @property
    def server(self) -> str:
        """The server the next request goes to first (host:port, no credentials)."""
        url = self._settings.server_addr[self._current]
        return f"{url.host}:{url.port}"

    def _secrets(self) -> list[str]:
        secrets = list(self._issued)
        password = self._settings.password
        if password is not None:
            # redacted_excerpt masks it in every spelling an echo gives it too
            # (form-encoded as sent, JSON-escaped, ...).
            secrets.append(password.get_secret_value())
        return secrets

    def quote(self, response: NacosResponse | bytes | str) -> str:
        """A server's answer, safe to put in a message: short, one line, this
        connection's password and tokens masked, credential-looking values cut."""
        body = response.body if isinstance(response, NacosResponse) else response
        return redacted_excerpt(body, self._secrets(), limit=_TEXT_LIMIT)

    # -- auth ---------------------------------------------------------------
    async def token(self, budget: float) -> str | None:
        """A current token (logging in when none is, single flight)."""
        if not self.authenticated:
            return None
        token = self._token
        if token is not None and anyio.current_time() < self._refresh_at:
            return token
        deadline = anyio.current_time() + budget
        try:
            with anyio.fail_after(budget):
                await self._login_lock.acquire()  # another caller may be logging in
        except TimeoutError:
            raise IncompleteSnapshot(f"login: no token within {budget:.1f}s") from None
        try:
            if self._token is not None and anyio.current_time() < self._refresh_at:
                return self._token
            return await self._login(_left(deadline, "login"))
        finally:
            self._login_lock.release()

    async def _login(self, budget: float) -> str:
        settings = self._settings
        assert settings.username is not None and settings.password is not None
        form = {"username": settings.username, "password": settings.password.get_secret_value()}
        order = [self.login_api] + [api for api in ("v3", "v1") if api != self.login_api]
        if settings.api != "auto":
            order = [settings.api]
        response: NacosResponse | None = None
        for api in order:
            response = await self.send(
                "POST", LOGIN_PATHS[api], None, budget=budget, what="login", form=form
            )
            if response.status not in NOT_SERVED:
                self.login_api = api
                break
        assert response is not None
        self.logins += 1
        if response.status in (401, 403):
            self._token = None
            raise IdentityRevoked(
                f"login of user {settings.username!r} refused by Nacos "
                f"(HTTP {response.status}): {self.quote(response)}"
            )
        if response.status != 200:
            raise IncompleteSnapshot(f"login: Nacos answered HTTP {response.status}")
        answer = decode_login(response.body, max_bytes=self._max_bytes)
        margin = min(settings.token_refresh_margin, answer.token_ttl / 2)
        self._token = answer.access_token
        self._issued.append(answer.access_token)
        self._refresh_at = anyio.current_time() + answer.token_ttl - margin
        logger.debug("nacos: logged in, token refreshed in %.0fs", answer.token_ttl - margin)
        return answer.access_token

    def _forget(self, token: str | None) -> None:
        if token is not None and self._token == token:
            self._token = None
            self._refresh_at = 0.0

    async def call(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        *,
        budget: float,
        what: str,
    ) -> NacosResponse:
        """An authenticated request; handles token expiry (one re-login) and
        turns a 403 into ``IdentityRevoked``. Other statuses are returned."""
        deadline = anyio.current_time() + budget
        for attempt in (1, 2):
            token = await self.token(_left(deadline, what))
            response = await self.send(
                method, path, params, budget=_left(deadline, what), what=what, token=token
            )
            if response.status != 403:
                return response
            if token is not None and attempt == 1 and token_problem(response.body):
                logger.info(
                    "nacos: %s: the token was refused (%s); logging in again",
                    what,
                    self.quote(response),
                )
                self._forget(token)
                continue
            raise IdentityRevoked(f"{what}: denied by Nacos (403): {self.quote(response)}")
        raise AssertionError("unreachable")  # pragma: no cover

    # -- transport ----------------------------------------------------------
    async def send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        *,
        budget: float,
        what: str,
        token: str | None = None,
        form: Mapping[str, str] | None = None,
    ) -> NacosResponse:
        if self._closed:
            raise IncompleteSnapshot(f"{what}: the connection is closed")
        headers = {}
        if token is not None:
            headers = {"Authorization": f"Bearer {token}", "accessToken": token}
        failures: list[str] = []
        delivered = False
        deadline = anyio.current_time() + budget
        count = len(self._bases)
        for step in range(count):
            index = (self._current + step) % count
            left = deadline - anyio.current_time()
            if left <= 0:
                break
            try:
                response = await self._once(
                    method,
                    self._bases[index] + path,
                    self._hosts[index],
                    params,
                    form,
                    headers,
                    left,
                    what,
                )
            except IncompleteSnapshot as exc:
                failures.append(str(exc))
                delivered = delivered or not isinstance(exc, NotDelivered)
                continue
            self._current = index
            return response
        self._current = (self._current + 1) % count
        message = "; ".join(failures) or f"{what}: no time left for a request"
        raise (NotDelivered if failures and not delivered else IncompleteSnapshot)(message)

    async def _once(
        self,
        method: str,
        url: str,
        host: str,
        params: Mapping[str, str] | None,
        form: Mapping[str, str] | None,
        headers: Mapping[str, str],
        budget: float,
        what: str,
    ) -> NacosResponse:
        timeout = httpx.Timeout(budget, connect=min(budget, 10.0))
        try:
            with anyio.fail_after(budget):
                async with (
                    self._gate,
                    self._client.stream(
                        method, url, params=params, data=form, headers=headers, timeout=timeout
                    ) as response,
                ):
                    body = await self._read_bounded(response, what)
                # httpx binds a response's stream back to the response (a
                # reference cycle: request, headers, URL and streams then
                # wait for the cyclic collector, about 20 objects a request).
                # It is closed now: unbind it, and they go when we let go.
                response.stream = _CLOSED
                return NacosResponse(response.status_code, body)
        except TimeoutError as exc:
            raise IncompleteSnapshot(
                f"{what}: no complete answer from {host} within {budget:.1f}s"
            ) from exc
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotDelivered(
                f"{what}: could not connect to {host} ({type(exc).__name__})"
            ) from exc
        except httpx.TimeoutException as exc:
            raise IncompleteSnapshot(f"{what}: {host} timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise IncompleteSnapshot(
                f"{what}: transport to {host} failed ({type(exc).__name__})"
            ) from exc
        except httpx.HTTPError as exc:
            raise IncompleteSnapshot(f"{what}: {type(exc).__name__}") from exc

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


#: What a finished response's stream is replaced with (nothing more to read).
_CLOSED = httpx.ByteStream(b"")


def _left(deadline: float, what: str) -> float:
    left = deadline - anyio.current_time()
    if left <= 0:
        raise IncompleteSnapshot(f"{what}: the request budget ran out")
    return left
