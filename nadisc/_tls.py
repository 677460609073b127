"""One client TLS context per process, for every pool that trusts the defaults.

Contract: :func:`default_tls_context` returns the same ``ssl.SSLContext``
(httpx's defaults: its CA bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``
when set) every time; it is built on the first call. Pools and providers that
would otherwise let httpx build a context of their own pass this one.

Why: building a context loads and parses the whole CA bundle synchronously,
80-100 ms on an idle machine here and several hundred when it is loaded, and
httpx does it for every ``AsyncClient`` or ``AsyncHTTPTransport`` created
with the default ``verify=True``. Inside a running event loop that stands
every task still, long enough to time out a health probe the same process
answers. An ``SSLContext`` is meant to be shared by many connections and
threads; nothing here changes it after it is built, and callers must not
either (a caller with its own CA bundle or client certificate builds its own
context).

Cost: the first call is the bundle load; every later call is a dictionary
look-up. The environment variables are read at that first call only.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Iterable

import httpx

__all__ = ["default_tls_context", "grpc_tls_context", "tls_context_for"]


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """The process's shared client TLS context with httpx's default trust store."""
    return httpx.create_ssl_context()


@functools.cache
def grpc_tls_context() -> ssl.SSLContext:
    """The process's shared client TLS context for gRPC (HTTP/2 over TLS).

    The same trust store as :func:`default_tls_context`, but a context of its
    own that offers only ``h2`` by ALPN: gRPC needs that offer, and setting it
    on the shared context would make every HTTP/1.1 pool using that context
    offer HTTP/2 too. Built on the first call; never changed afterwards.
    """
    context = httpx.create_ssl_context()
    context.set_alpn_protocols(["h2"])
    return context


def tls_context_for(urls: Iterable[str]) -> ssl.SSLContext:
    """The context for a client of ``urls`` that trusts the default store.

    The shared :func:`default_tls_context` when any URL is ``https``;
    otherwise a client context that trusts nothing and loads nothing (a
    plain-http client never starts a handshake; should one be attempted,
    verification fails closed).
    """
    if any(str(url).startswith("https://") for url in urls):
        return default_tls_context()
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
