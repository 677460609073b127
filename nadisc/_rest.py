"""The REST caller of one connection: discovered services and external URLs.

::

    rest = owner.rest("primary")     # owned by the owner: closed when it closes
    clients = rest_clients(owner)    # every connection's caller, by name
    r = await rest.get("/v1/orders", service="orders", timeout=2.0)   # httpx's verbs
    r = await rest.get("https://api.example.com/v1/x")                # external
    r = await rest.request("GET", service="orders", path="/v1/orders")

Two kinds of call, never mixed:

* ``service=`` + ``path=``: uses the qualifier's discovery evidence, through a
  :class:`~nadisc.DiscoveryTransport` (``nadisc://<qualifier>/<service>/<path>``).
  No other connection and no plain DNS is ever tried in its place.
* ``url=``: an absolute ``http(s)`` URL through a plain ``httpx.AsyncClient``;
  no registry is asked and no qualifier is taken or inherited. Passing both,
  or neither, is an error.

An owner with zero connections gives an external-only client (a service call
raises :class:`~nadisc.QualifierError`); with named connections but none
called ``primary``, an unqualified client's service calls raise
:class:`~nadisc.QualifierError` too: the default is never inferred.

Budget: the smallest of the connection's ``request_timeout``, the httpx
timeout (client or ``timeout=``) and a ``"nadisc.deadline"`` extension,
covering the body too for calls that read it; running out raises
:class:`~nadisc.CallTimeout` naming the limit. Every failure is an
``httpx.RequestError`` as well as a nadisc error.

Responses:

* :meth:`RestDiscoveryClient.request` reads the body within the budget and
  returns a closed response (the load guard already ended).
* :meth:`RestDiscoveryClient.send` with ``stream=True`` is a *bare* send: the
  caller owns the response and must close it; until then the instance's
  load stays counted.
* :meth:`RestDiscoveryClient.send_managed` returns a streamed response that
  the client tracks: whatever the caller has not closed is closed by
  :meth:`RestDiscoveryClient.aclose`.
* :meth:`RestDiscoveryClient.stream` is the ``async with`` form.
* Bodies read or managed by the client are capped at ``max_body_bytes``
  (the seed's 4 MiB by default): :class:`ResponseTooLarge`. A bare send is
  not capped.

``rest_client(owner, q)`` / ``RestDiscoveryClient(owner, q, ...)`` build a
client the caller owns (and closes); ``owner.rest(q)`` hands out the
owner's shared one.

Bad input is refused before any network I/O: unknown qualifier
(:class:`~nadisc.QualifierError`), unknown service alias
(:class:`~nadisc.UnknownService`), invalid options
(:class:`~nadisc.ConfigError`: attempts outside 1-16, a budget that cannot
fit the connect timeout, an unsupported instance scheme), and
:class:`InvalidRequest` for a malformed call.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import anyio
import httpx
from httpx._client import USE_CLIENT_DEFAULT
from httpx._types import (
    CookieTypes,
    HeaderTypes,
    QueryParamTypes,
    RequestContent,
    RequestData,
    RequestExtensions,
    RequestFiles,
)

from ._errors import (
    CallError,
    CallLifecycleError,
    CallQualifierError,
    CallTimeout,
    ConfigError,
    DiscoveryError,
    QualifierError,
    for_call,
)
from ._route import RestOptions
from ._tls import default_tls_context
from ._transport import (
    BUDGET_EXTENSION,
    QUALIFIER_EXTENSION,
    REST_LIMIT,
    SCHEME,
    Budget,
    DiscoveryTransport,
    call_budget,
    check_service,
    connection_of,
    enforces_timeouts,
    url_host,
)

if TYPE_CHECKING:
    from ._owner import DiscoveryOwner

__all__ = [
    "MANAGED_BODY_LIMIT",
    "InvalidRequest",
    "ResponseTooLarge",
    "RestClients",
    "RestDiscoveryClient",
    "rest_client",
    "rest_clients",
]

logger = logging.getLogger(__name__)

_CLOSE_GRACE = 5.0
_TARGET_CACHE = 1024
_now = anyio.current_time
#: The seed's cap on a managed response body: 4 MiB.
MANAGED_BODY_LIMIT = 4 * 1024 * 1024


def _what(request: httpx.Request) -> str:
    name = request.extensions.get(QUALIFIER_EXTENSION)
    return f"connection {name!r}" if isinstance(name, str) else "the external call"


class InvalidRequest(CallError, ValueError):
    """A REST call was malformed (both or neither of ``service`` and ``url``, ...)."""


class ResponseTooLarge(CallError):
    """A managed response body is larger than the client's ``max_body_bytes``.

    ``limit`` is the cap; ``size`` the declared ``Content-Length`` when the
    headers already announced too much (nothing was read), otherwise the
    number of bytes received when the cap was crossed. The rest of a body
    that crosses the cap is read off the connection and dropped (never
    kept), then this is raised: by :meth:`RestDiscoveryClient.request`
    after closing the response (within the call's budget), and for a
    managed streamed response from the read that crossed the cap. The cap
    counts body bytes as received, before any content decoding.
    """

    def __init__(self, message: str, *, limit: int, size: int) -> None:
        CallError.__init__(self, message)
        self.limit = limit
        self.size = size


class _CappedStream(httpx.AsyncByteStream):
    """A body that yields at most ``limit`` bytes in total, then raises ResponseTooLarge."""

    __slots__ = ("_inner", "_iterator", "_limit", "_received")

    def __init__(self, inner: httpx.AsyncByteStream, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        self._received = 0
        self._iterator: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._iterator = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        iterator = self._iterator
        if iterator is None:
            iterator = self._iterator = self._inner.__aiter__()
        chunk = await iterator.__anext__()
        self._received += len(chunk)
        if self._received > self._limit:
            await self._abandon(iterator)
            raise ResponseTooLarge(
                f"the response body exceeds the cap of {self._limit} bytes",
                limit=self._limit,
                size=self._received,
            )
        return chunk

    async def _abandon(self, iterator: AsyncIterator[bytes]) -> None:
        # Read the rest of the body off the wire and drop it: memory stays
        # within the cap, the connection stays reusable, and no half-run
        # generator of the HTTP stack is left to the garbage collector.
        # request() bounds this by the call's budget.
        async for _ in iterator:
            pass

    async def aclose(self) -> None:
        await self._inner.aclose()


#: Statuses whose responses carry no body (RFC 9110 section 6.4.1).
_NO_BODY = frozenset({204, 304})


def _cap(response: httpx.Response, limit: int) -> None:
    """Refuse a too-large declared body now; count the rest while it is read."""
    try:
        method = response.request.method
    except RuntimeError:  # a response built without its request
        method = ""
    if method == "HEAD" or response.status_code in _NO_BODY:
        # No body follows, whatever Content-Length says (it tells the size
        # a GET would get, RFC 9110 sections 8.6 and 15.4.5).
        return
    declared = response.headers.get("content-length")
    # ASCII digits only: str.isdigit() also accepts digits int() refuses ("²").
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise ResponseTooLarge(
            f"the response declares {declared} bytes, over the cap of {limit} bytes",
            limit=limit,
            size=int(declared),
        )
    stream = response.stream
    if isinstance(stream, httpx.AsyncByteStream) and not response.is_closed:
        response.stream = _CappedStream(stream, limit)


async def _close_quietly(response: httpx.Response) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_GRACE):
        await response.aclose()


def rest_client(owner: DiscoveryOwner, qualifier: str | None = None) -> RestDiscoveryClient:
    """The REST caller of connection ``qualifier`` (``None``: ``primary``).

    Options come from that connection's ``rest`` block. An owner with zero
    connections gives an external-only client. An explicitly named unknown
    connection raises :class:`~nadisc.QualifierError` now.
    """
    return RestDiscoveryClient(owner, qualifier)


class RestClients(Mapping[str, "RestDiscoveryClient"]):
    """The named collection of an owner's REST callers: one per connection.

    ``clients["business"]`` is ``owner.rest("business")``; :attr:`default`
    is ``owner.rest()``, the caller for calls that name no connection (the
    ``primary`` connection, or an external-only client when the owner has
    zero connections; with named connections but no ``primary`` its service
    calls fail with :class:`~nadisc.QualifierError`). The owner owns every
    client: they close when it closes.
    """

    __slots__ = ("_clients", "_default")

    def __init__(
        self, clients: Mapping[str, RestDiscoveryClient], default: RestDiscoveryClient
    ) -> None:
        self._clients = dict(clients)
        self._default = default

    @property
    def default(self) -> RestDiscoveryClient:
        return self._default

    @property
    def external_only(self) -> bool:
        """True when the owner has no connection: only ``url=`` calls work."""
        return not self._clients

    def __getitem__(self, qualifier: str) -> RestDiscoveryClient:
        try:
            return self._clients[qualifier]
        except KeyError:
            raise QualifierError(
                f"unknown connection {qualifier!r} "
                f"(configured: {', '.join(sorted(self._clients)) or 'none'})"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    def __repr__(self) -> str:
        names = ", ".join(self._clients) or "external-only"
        return f"<RestClients {names}>"


def rest_clients(owner: DiscoveryOwner) -> RestClients:
    """Every connection's REST caller, owned by ``owner`` (see :class:`RestClients`).

    Raises :class:`~nadisc.LifecycleError` when the owner is not prepared
    or already closing.
    """
    clients = {name: owner.rest(name) for name in owner.connection_names()}
    return RestClients(clients, owner.rest())


class RestDiscoveryClient:
    """Calls discovered services of one connection, and external URLs.

    ``RestDiscoveryClient(owner, qualifier, options=...)``: ``options``
    (a :class:`~nadisc.RestOptions`) replaces the connection's ``rest``
    block for this client. ``headers`` are sent with every request.
    ``transport`` replaces the shared HTTP pool under both clients (tests,
    custom TLS); it is not closed by this client. ``max_body_bytes``
    (1 to 4 MiB, default 4 MiB) caps the bodies the client reads or manages.

    Use it as ``async with``, or call :meth:`aclose` (idempotent).
    """

    def __init__(
        self,
        owner: DiscoveryOwner | None,
        qualifier: str | None = None,
        *,
        options: RestOptions | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: httpx.Limits | None = None,
        max_body_bytes: int = MANAGED_BODY_LIMIT,
    ) -> None:
        if options is not None and not isinstance(options, RestOptions):
            raise TypeError(f"options must be RestOptions, got {type(options).__name__}")
        if (
            isinstance(max_body_bytes, bool)
            or not isinstance(max_body_bytes, int)
            or not 1 <= max_body_bytes <= MANAGED_BODY_LIMIT
        ):
            raise ConfigError(
                "rest.max_body_bytes",
                f"must be an integer between 1 and {MANAGED_BODY_LIMIT}, got {max_body_bytes!r}",
            )
        self._max_body = max_body_bytes
        self._owner = owner
        self._qualifier = qualifier
        self._connection_name: str | None = None
        self._external_only = owner is None or not owner.connection_names()
        if not self._external_only and owner is not None and qualifier is not None:
            # An explicitly named unknown connection fails now; the default
            # (None) is resolved per call so that its absence fails the call.
            self._connection_name = connection_of(owner, qualifier).qualifier
        self._options = options
        base = options if options is not None else RestOptions()
        # The one connection this client calls (None: no default exists).
        served: str | None = None
        if not self._external_only and owner is not None:
            try:
                served = connection_of(owner, self._connection_name).qualifier
            except QualifierError:
                served = None
            if served is not None and options is None:
                base = RestOptions.from_config(owner.connection_policy(served).rest)
        self._external_options = base
        timeout = httpx.Timeout(base.request_timeout, connect=base.connect_timeout)
        pool: httpx.AsyncBaseTransport = (
            _Borrowed(transport)
            if transport is not None
            else httpx.AsyncHTTPTransport(
                limits=limits if limits is not None else httpx.Limits(),
                verify=default_tls_context(),
            )
        )
        self._discovery: DiscoveryTransport | None = None
        mounts: dict[str, httpx.AsyncBaseTransport] = {}
        if not self._external_only and owner is not None:
            self._discovery = DiscoveryTransport(
                owner,
                options=options,
                qualifiers=() if served is None else (served,),
                transport=pool,
            )
            mounts[f"{SCHEME}://"] = self._discovery
        self._http = httpx.AsyncClient(
            transport=pool, mounts=mounts, headers=headers, timeout=timeout
        )
        self._managed: set[httpx.Response] = set()
        self._per_connection: dict[str, RestOptions] = {}
        self._targets: dict[tuple[object, object], tuple[httpx.URL, str]] = {}
        self._pool_enforces = enforces_timeouts(pool)
        self._closed = False

    # -- views ---------------------------------------------------------------------------

    @property
    def qualifier(self) -> str | None:
        """The connection named at construction (``None``: the default, per call)."""
        return self._qualifier

    @property
    def external_only(self) -> bool:
        """True when the owner has no connection: only ``url=`` calls work."""
        return self._external_only

    @property
    def transport(self) -> DiscoveryTransport | None:
        """The discovery transport (``None`` for an external-only client)."""
        return self._discovery

    @property
    def managed(self) -> int:
        """Managed responses not yet closed."""
        return len(self._managed)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        target = "external-only" if self._external_only else repr(self._qualifier or "primary")
        return f"<RestDiscoveryClient {target} managed={len(self._managed)}>"

    # -- building requests ---------------------------------------------------------------

    def build_request(
        self,
        method: str,
        url: str | httpx.URL | None = None,
        *,
        service: str | None = None,
        path: str | None = None,
        extensions: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> httpx.Request:
        """An ``httpx.Request`` for a service call or an external URL (no I/O).

        A service call names ``service=`` and its path, either as ``url``
        (httpx's position: ``build_request("GET", "/v1/x", service="orders")``)
        or as ``path=``; an external call gives an absolute ``http(s)`` ``url``.
        ``kwargs`` are ``httpx.AsyncClient.build_request`` arguments
        (``params``, ``headers``, ``content``, ``json``, ``timeout``, ...).
        Validates the qualifier and the service alias of a service call now.
        """
        if self._closed:
            raise CallLifecycleError("the REST client is closed")
        extra = dict(extensions) if extensions else None
        if extra is not None and QUALIFIER_EXTENSION in extra:
            raise InvalidRequest(f"the {QUALIFIER_EXTENSION} extension is set by the REST client")
        if service is None:
            if url is None:
                raise InvalidRequest("give exactly one of service= (with its path) or url=")
            if path is not None:
                raise InvalidRequest("path= belongs to service calls; put it in url=")
            parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise InvalidRequest(
                    f"url= must be an absolute http(s) URL, got scheme {parsed.scheme!r}"
                )
            return self._http.build_request(method, parsed, extensions=extra, **kwargs)
        if url is not None:
            if path is not None:
                raise InvalidRequest(
                    "a service call takes its path once: as the url argument or as path="
                )
            if not isinstance(url, str):
                raise InvalidRequest(
                    "with service=, the url argument is the path on the service "
                    f"('/v1/orders'), not {type(url).__name__}"
                )
            if "://" in url:
                raise InvalidRequest(
                    "give exactly one of service= (with its path) or an absolute url="
                )
            path = url
        target, name = self._service_target(service, path)
        extensions_out: dict[str, Any] = {QUALIFIER_EXTENSION: name}
        if extra:
            extensions_out.update(extra)
        return self._http.build_request(method, target, extensions=extensions_out, **kwargs)

    def _service_target(self, service: object, path: object) -> tuple[httpx.URL, str]:
        # (service, path) -> the nadisc:// URL and the connection name; the
        # checks run once per (service, path), then the URL is reused.
        key = (service, path)
        known = self._targets.get(key)
        if known is not None:
            return known
        if not isinstance(service, str) or not service:
            raise InvalidRequest(f"service must be a non-empty alias, got {service!r}")
        if path is None:
            path = "/"
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidRequest(f"path must start with '/', got {path!r}")
        if self._discovery is None or self._owner is None:
            raise CallQualifierError(
                "no connections are configured: this client calls external URLs only"
            )
        try:
            handle = connection_of(self._owner, self._connection_name)
            check_service(handle, service)  # UnknownService now, before any I/O
            name = handle.qualifier
            self._options_for(name)  # invalid options fail now
        except CallError:
            raise
        except DiscoveryError as exc:
            raise for_call(exc) from exc
        target = httpx.URL(f"{SCHEME}://{url_host(name)}/{quote(service, safe='')}{path}")
        if len(self._targets) >= _TARGET_CACHE:
            self._targets.clear()
        made = self._targets[key] = (target, name)
        return made

    def _options_for(self, name: str) -> RestOptions:
        options = self._per_connection.get(name)
        if options is None:
            assert self._discovery is not None
            options = self._per_connection[name] = self._discovery.options_for(name)
        return options

    # -- calls ---------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        url: str | httpx.URL | None = None,
        *,
        service: str | None = None,
        path: str | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send and read the whole body within the budget; return a closed response.

        Arguments as :meth:`build_request`, plus httpx's ``auth`` and
        ``follow_redirects``. A body over ``max_body_bytes`` raises
        :class:`ResponseTooLarge`.
        """
        request = self.build_request(method, url, service=service, path=path, **kwargs)
        return await self.send(request, auth=auth, follow_redirects=follow_redirects)

    async def get(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``GET``: httpx's signature; with ``service=``, ``url`` is the path on the service."""
        return await self.request(
            "GET", url, service=service, params=params, headers=headers, cookies=cookies,
            auth=auth, follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def head(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``HEAD``, as :meth:`get`."""
        return await self.request(
            "HEAD", url, service=service, params=params, headers=headers, cookies=cookies,
            auth=auth, follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def options(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``OPTIONS``, as :meth:`get`."""
        return await self.request(
            "OPTIONS", url, service=service, params=params, headers=headers, cookies=cookies,
            auth=auth, follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def delete(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``DELETE``, as :meth:`get` (never retried)."""
        return await self.request(
            "DELETE", url, service=service, params=params, headers=headers, cookies=cookies,
            auth=auth, follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def post(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``POST``: httpx's signature; with ``service=``, ``url`` is the path (never retried)."""
        return await self.request(
            "POST", url, service=service, content=content, data=data, files=files, json=json,
            params=params, headers=headers, cookies=cookies, auth=auth,
            follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def put(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``PUT``, as :meth:`post`."""
        return await self.request(
            "PUT", url, service=service, content=content, data=data, files=files, json=json,
            params=params, headers=headers, cookies=cookies, auth=auth,
            follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def patch(
        self,
        url: str | httpx.URL,
        *,
        service: str | None = None,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        timeout: Any = USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's signature)
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """``PATCH``, as :meth:`post`."""
        return await self.request(
            "PATCH", url, service=service, content=content, data=data, files=files, json=json,
            params=params, headers=headers, cookies=cookies, auth=auth,
            follow_redirects=follow_redirects, timeout=timeout, extensions=extensions,
        )  # fmt: skip

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        """Send a request built by :meth:`build_request`.

        ``stream=False`` reads the body within the budget (external calls
        too), capped at ``max_body_bytes`` (:class:`ResponseTooLarge`), and
        closes the response. ``stream=True`` is a bare send: the caller
        closes the response (``await response.aclose()``), and the
        instance's load stays counted until then; no cap is applied (the
        caller reads what it wants).

        The budget starts now: the smallest of the connection's
        ``request_timeout``, the request's httpx timeout and a
        ``"nadisc.deadline"`` extension (see :func:`~nadisc.call_budget`);
        running out raises :class:`~nadisc.CallTimeout` naming which.
        """
        if self._closed:
            raise CallLifecycleError("the REST client is closed")
        http = self._http
        name = request.extensions.get(QUALIFIER_EXTENSION)
        if not isinstance(name, str):
            return await self._send_external(request, stream, auth, follow_redirects)
        discovery = self._discovery
        # The transport's clock, resolved once per run (anyio.current_time
        # looks the backend up on every call).
        loop = discovery._run_loop() if discovery is not None else None
        try:
            budget = call_budget(
                request, self._options_for(name), _now() if loop is None else loop.now()
            )
        except DiscoveryError as exc:
            raise for_call(exc) from exc
        if stream:
            return await http.send(
                request, stream=True, auth=auth, follow_redirects=follow_redirects
            )
        # The transport takes this budget as is (it started here).
        request.extensions[BUDGET_EXTENSION] = budget
        direct = auth is USE_CLIENT_DEFAULT and follow_redirects is USE_CLIENT_DEFAULT
        # Until the headers are in, the transport holds the call to the
        # budget itself (the pool's timeouts, or a scope of its own): a hung
        # instance then ends as the attempt's timeout, counted against it (an
        # outlier), and the CallTimeout names the service and chains the
        # attempt's error. The body's read is bounded here (_read_body).
        return await self._read(request, budget, name, direct, auth, follow_redirects)

    @staticmethod
    async def _read_body(response: httpx.Response, budget: Budget, name: str) -> None:
        """Read the (capped) body within the call's budget."""
        if budget.deadline >= anyio.current_effective_deadline():
            await response.aread()  # the caller's own scope ends first
            return
        with anyio.move_on_at(budget.deadline):
            await response.aread()
            return
        service = unquote(response.request.url.raw_path.split(b"/")[1].decode("ascii"))
        raise CallTimeout(
            f"connection {name!r} service {service!r}: {budget.describe()} ran out "
            "while the response body was read",
            limit=budget.limit,
            seconds=budget.seconds,
        )

    async def _read(
        self,
        request: httpx.Request,
        budget: Budget,
        name: str,
        direct: bool,
        auth: Any,
        follow_redirects: Any,
    ) -> httpx.Response:
        discovery = self._discovery
        if direct and discovery is not None:
            # No auth flow, redirects or event hooks are set on this client's
            # own httpx client: hand the request to the discovery transport
            # directly, as the client would (cookies a service sets are not
            # kept between calls).
            started = time.perf_counter()
            try:
                response = await discovery.handle_async_request(request)
            except httpx.RequestError as exc:
                exc.request = request
                raise
            response.request = request
            try:
                _cap(response, self._max_body)
                await self._read_body(response, budget, name)
            finally:
                if not response.is_closed:
                    await _close_quietly(response)
            response.elapsed = datetime.timedelta(seconds=time.perf_counter() - started)
            return response
        response = await self._http.send(
            request, stream=True, auth=auth, follow_redirects=follow_redirects
        )
        try:
            _cap(response, self._max_body)
            await self._read_body(response, budget, name)
        finally:
            if not response.is_closed:
                await _close_quietly(response)
        return response

    async def _send_external(
        self, request: httpx.Request, stream: bool, auth: Any, follow_redirects: Any
    ) -> httpx.Response:
        http = self._http
        if stream:
            return await http.send(
                request, stream=True, auth=auth, follow_redirects=follow_redirects
            )
        budget = self._external_options.request_timeout
        with anyio.move_on_after(budget):
            response = await http.send(
                request, stream=True, auth=auth, follow_redirects=follow_redirects
            )
            try:
                _cap(response, self._max_body)
                await response.aread()
            finally:
                if not response.is_closed:
                    await _close_quietly(response)
            return response
        raise CallTimeout(
            f"the external call: the {REST_LIMIT} budget of {budget:g} s ran out",
            limit=REST_LIMIT,
            seconds=budget,
        )

    @property
    def max_body_bytes(self) -> int:
        """The cap on bodies the client reads or manages (default 4 MiB)."""
        return self._max_body

    async def send_managed(self, request: httpx.Request) -> httpx.Response:
        """A streamed response the client closes on :meth:`aclose` if the caller did not.

        Its body is capped at ``max_body_bytes``: a declared larger body
        raises :class:`ResponseTooLarge` here (the response closed), a read
        that crosses the cap raises it from the read.
        """
        response = await self.send(request, stream=True)
        if self._closed:
            # The client closed while the headers were on their way: nothing
            # would close this response later, so close it now.
            await _close_quietly(response)
            raise CallLifecycleError("the REST client was closed while the request was in flight")
        try:
            _cap(response, self._max_body)
        except ResponseTooLarge:
            await _close_quietly(response)
            raise
        managed = self._managed
        managed.add(response)
        close = response.aclose

        async def aclose() -> None:
            managed.discard(response)
            await close()

        response.aclose = aclose  # type: ignore[method-assign]
        return response

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str | httpx.URL | None = None,
        *,
        service: str | None = None,
        path: str | None = None,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
        **kwargs: Any,
    ) -> AsyncIterator[httpx.Response]:
        """``async with rest.stream("GET", "/v1/x", service="orders") as response``.

        httpx's ``stream`` signature (plus ``service=``); the response is
        closed when the block exits. The body is capped at
        ``max_body_bytes`` like :meth:`send_managed`.
        """
        request = self.build_request(method, url, service=service, path=path, **kwargs)
        response = await self.send(
            request, stream=True, auth=auth, follow_redirects=follow_redirects
        )
        try:
            _cap(response, self._max_body)
            yield response
        finally:
            await _close_quietly(response)

    # -- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close managed responses, the discovery routes and the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_GRACE):
            for response in list(self._managed):
                try:
                    await response.aclose()
                except Exception as exc:
                    logger.debug("closing a managed response raised %s", type(exc).__name__)
            self._managed.clear()
            if self._discovery is not None:
                await self._discovery.aclose()
            await self._http.aclose()

    async def __aenter__(self) -> RestDiscoveryClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()


class _Borrowed(httpx.AsyncBaseTransport):
    """A transport the caller owns: used, never closed, by this client."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self.nadisc_enforces_timeouts = enforces_timeouts(inner)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        return None
