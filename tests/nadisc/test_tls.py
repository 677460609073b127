"""Pools share one TLS context: the CA bundle is loaded once per process."""

from __future__ import annotations

import ssl

import pytest

from nadisc import (
    DiscoveryConfig,
    DiscoveryTransport,
    default_tls_context,
    grpc_tls_context,
    open_discovery,
    tls_context_for,
)
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner


def _count_bundle_loads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    loads: list[object] = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args or kwargs)
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    return loads


def test_the_default_context_is_built_once_and_verifies() -> None:
    context = default_tls_context()
    assert context is default_tls_context()
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # a real trust store


async def test_rest_clients_and_transports_load_no_bundle_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    default_tls_context.cache_clear()
    loads = _count_bundle_loads(monkeypatch)
    memory = MemoryProvider(services={"orders": "orders"})
    async with memory_owner({"primary": memory}) as owner:
        async with DiscoveryTransport(owner, verify=False):
            pass
        assert loads == []  # no verification, no trust store
        for _ in range(3):
            async with DiscoveryTransport(owner):
                pass
        owner.rest()
    async with open_discovery(DiscoveryConfig()) as external:
        external.rest()
    assert len(loads) == 1  # the shared context, built by the first pool that verifies


def test_a_context_for_plain_http_urls_trusts_nothing_and_https_shares_the_default() -> None:
    plain = tls_context_for(["http://10.0.0.1:2379", "http://10.0.0.2:2379"])
    assert plain is not default_tls_context()
    assert plain.cert_store_stats()["x509_ca"] == 0
    assert plain.verify_mode is ssl.CERT_REQUIRED  # fails closed, should TLS be tried
    assert tls_context_for(["http://a:1", "https://b:2"]) is default_tls_context()


#: The ALPN extension (type 16) of a ClientHello offering exactly "h2".
_ALPN_H2_ONLY = b"\x00\x10\x00\x05\x00\x03\x02h2"


def _client_hello(context: ssl.SSLContext) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="example.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_the_grpc_context_offers_h2_and_leaves_the_shared_one_alone() -> None:
    grpc_context = grpc_tls_context()
    assert grpc_context is grpc_tls_context()
    assert grpc_context is not default_tls_context()
    assert grpc_context.verify_mode is ssl.CERT_REQUIRED and grpc_context.check_hostname
    assert _ALPN_H2_ONLY in _client_hello(grpc_context)
    # HTTP/1.1 pools share the default context: it offers no ALPN at all,
    # also after a gRPC channel was built on the gRPC context.
    from nadisc.grpc import Channel

    Channel("127.0.0.1:1", ssl_context=grpc_context)
    assert _ALPN_H2_ONLY not in _client_hello(default_tls_context())
