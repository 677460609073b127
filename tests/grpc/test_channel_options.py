"""Bad input from the caller is refused up front, naming what was wrong.

Targets, every constructor option and every per-call argument: a
``TypeError`` for a wrong type, a ``ValueError`` for a wrong value, both
naming the option (never a metadata value), before anything is sent, and
never a late ``struct.error``, ``UnicodeEncodeError`` or unnamed error from
inside a call.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc
import grpc
import pytest

from nadisc.grpc import Channel, RpcError
from nadisc.grpc._channel import _tls_server_name

from .support import answer_ok, h2_server

METHOD = "/options.Service/Call"


# -- targets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "host", "port"),
    [
        ("localhost:50051", "localhost", 50051),
        ("orders.svc.cluster.local:443", "orders.svc.cluster.local", 443),
        ("127.0.0.1:80", "127.0.0.1", 80),
        ("[::1]:80", "::1", 80),
        ("dns:localhost:80", "localhost", 80),
        ("dns:///localhost:80", "localhost", 80),
        ("dns:///[::1]:80", "::1", 80),
        ("ipv4:127.0.0.1:80", "127.0.0.1", 80),
        ("ipv6:[::1]:80", "::1", 80),
    ],
)
def test_grpc_target_forms_are_accepted(target: str, host: str, port: int) -> None:
    channel = Channel(target)
    assert (channel._host, channel._port) == (host, port)
    assert channel.authority == (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:80",
        "https://localhost:443",
        "unix:/tmp/sock:80",
        "unix:///tmp/sock",
        "a b:80",
        "bücher.example:80",
        "host\n:80",
        "::1:80",
        "host:80/path",
        "ipv4:localhost:80",
        "ipv4:[::1]:80",
        "ipv6:::1:80",
        "[not-v6]:80",
        "dns:",
        "",
    ],
)
def test_other_targets_are_refused_with_the_accepted_forms(target: str) -> None:
    with pytest.raises(ValueError, match="accepted forms: host:port") as caught:
        Channel(target)
    assert repr(target) in str(caught.value)


def test_a_dns_server_in_the_target_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"names a DNS server \('127.0.0.53'\)"):
        Channel("dns://127.0.0.53/localhost:80")


@pytest.mark.parametrize("target", [None, 80, b"localhost:80"])
def test_a_target_that_is_not_a_str_is_a_type_error(target: object) -> None:
    with pytest.raises(TypeError, match="gRPC target must be a str"):
        Channel(target)  # type: ignore[arg-type]


async def test_a_dns_prefixed_target_connects() -> None:
    async with (
        h2_server(answer_ok) as server,
        Channel(f"dns:localhost:{server.port}") as first,
        Channel(f"dns:///localhost:{server.port}") as second,
        Channel(f"ipv4:127.0.0.1:{server.port}") as third,
    ):
        for channel in (first, second, third):
            with anyio.fail_after(10):
                assert await channel.unary_unary(METHOD)(b"x", timeout=5) == b"ok"
        assert {headers[b":authority"] for _, headers in server.record.requests} == {
            f"localhost:{server.port}".encode(),
            f"127.0.0.1:{server.port}".encode(),
        }


# -- constructor options -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"max_send_message_length": "1"}, TypeError, "max_send_message_length"),
        ({"max_send_message_length": 1.5}, TypeError, "max_send_message_length"),
        ({"max_send_message_length": 0}, ValueError, "max_send_message_length"),
        ({"max_receive_message_length": None}, TypeError, "max_receive_message_length"),
        ({"max_receive_message_length": -1}, ValueError, "max_receive_message_length"),
        ({"max_metadata_size": True}, TypeError, "max_metadata_size"),
        ({"stream_window": 1.5e6}, TypeError, "stream_window"),
        ({"stream_window": 1000}, ValueError, "stream_window"),
        ({"connection_window": 2**31}, ValueError, "connection_window"),
        ({"keepalive_time": math.nan}, ValueError, "keepalive_time"),
        ({"keepalive_time": 0}, ValueError, "keepalive_time"),
        ({"keepalive_time": -5}, ValueError, "keepalive_time"),
        ({"keepalive_time": math.inf}, ValueError, "keepalive_time"),
        ({"keepalive_time": "5"}, TypeError, "keepalive_time"),
        ({"keepalive_timeout": math.nan}, ValueError, "keepalive_timeout"),
        ({"keepalive_timeout": 0}, ValueError, "keepalive_timeout"),
        ({"keepalive_timeout": -1}, ValueError, "keepalive_timeout"),
        ({"keepalive_timeout": None}, TypeError, "keepalive_timeout"),
        ({"keepalive_without_calls": 1}, TypeError, "keepalive_without_calls"),
        ({"compression": grpc.Compression.Deflate}, ValueError, "compression Deflate"),
        ({"compression": "gzip"}, TypeError, "compression"),
        ({"compression": 2}, TypeError, "compression"),
        ({"ssl_context": "yes"}, TypeError, "ssl_context"),
        ({"authority": 5}, TypeError, "authority"),
        ({"authority": "bücher:1"}, ValueError, "authority"),
        ({"authority": "host\r\nx-evil: 1"}, ValueError, "authority"),
        ({"authority": "a b:1"}, ValueError, "authority"),
        ({"authority": ""}, ValueError, "authority"),
    ],
)
def test_bad_options_are_refused_by_name(
    options: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        Channel("127.0.0.1:80", **options)


@pytest.mark.parametrize(
    "options",
    [
        {"compression": grpc.Compression.Gzip},
        {"compression": grpc.Compression.NoCompression},
        {"keepalive_time": 30, "keepalive_timeout": 5.5, "keepalive_without_calls": True},
        {"authority": "orders.example:443"},
        {"authority": "[::1]:443"},
        {"connect_timeout": None},
        {"connect_timeout": 2.5},
    ],
)
def test_good_options_are_accepted(options: dict[str, Any]) -> None:
    Channel("127.0.0.1:80", **options)


@pytest.mark.parametrize(
    ("authority", "name"),
    [
        ("orders.example:443", "orders.example"),
        ("orders.example", "orders.example"),
        ("[::1]:443", "::1"),
        ("127.0.0.1:80", "127.0.0.1"),
    ],
)
def test_the_tls_server_name_is_the_authority_host(authority: str, name: str) -> None:
    assert _tls_server_name(authority) == name


async def test_supported_compression_is_used_and_no_compression_overrides_the_channel() -> None:
    async with (
        h2_server(answer_ok) as server,
        Channel(f"127.0.0.1:{server.port}", compression=grpc.Compression.Gzip) as channel,
    ):
        method = channel.unary_unary(METHOD)
        with anyio.fail_after(10):
            assert await method(b"x", timeout=5) == b"ok"
            assert await method(b"x", timeout=5, compression=grpc.Compression.NoCompression)
        (_, gzipped), (_, plain) = server.record.requests
    assert gzipped.get(b"grpc-encoding") == b"gzip"
    assert b"grpc-encoding" not in plain


# -- per-call arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"timeout": "5"}, TypeError, "timeout must be a number"),
        ({"timeout": True}, TypeError, "timeout must be a number"),
        ({"timeout": math.nan}, ValueError, "timeout must be >= 0"),
        ({"timeout": -1}, ValueError, "timeout must be >= 0"),
        ({"compression": "gzip"}, TypeError, "compression must be a grpc.Compression"),
        ({"compression": grpc.Compression.Deflate}, ValueError, "compression Deflate"),
        ({"metadata": (("key",),)}, ValueError, r"metadata item 0 \(key 'key'\) is not a"),
        ({"metadata": (("a", "1"), ("b", "2", "3"))}, ValueError, "metadata item 1"),
        ({"metadata": ("notpairs",)}, ValueError, "metadata item 0 is not a"),
        ({"metadata": {"key": "v"}}, TypeError, "not dict"),
        ({"metadata": "key=v"}, TypeError, "not str"),
        ({"metadata": 5}, TypeError, "not int"),
    ],
)
async def test_bad_call_arguments_are_refused_by_name(
    arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    async with Channel("127.0.0.1:1") as channel:
        for make in (channel.unary_unary(METHOD), channel.unary_stream(METHOD)):
            with pytest.raises(error, match=match):
                make(b"x", **arguments)
        for streaming in (channel.stream_unary(METHOD), channel.stream_stream(METHOD)):
            with pytest.raises(error, match=match):
                streaming(iter([b"x"]), **arguments)


async def test_a_metadata_error_never_shows_the_value() -> None:
    async with Channel("127.0.0.1:1") as channel:
        with pytest.raises(ValueError) as caught:
            channel.unary_unary(METHOD)(b"x", metadata=(("authorization", "Bearer s3cr3t", "x"),))  # type: ignore[arg-type]
    assert "s3cr3t" not in str(caught.value)
    assert "authorization" in str(caught.value)


@pytest.mark.parametrize("requests", [5, object(), b"x"[0]])
async def test_a_request_iterator_that_is_not_iterable_is_a_type_error(requests: Any) -> None:
    async with Channel("127.0.0.1:1") as channel:
        for make in (channel.stream_unary(METHOD), channel.stream_stream(METHOD)):
            with pytest.raises(TypeError, match="request_iterator must be an iterable"):
                make(requests)


async def test_a_str_request_without_serializer_is_a_type_error() -> None:
    async with Channel("127.0.0.1:1") as channel:
        with pytest.raises(TypeError, match="without a request_serializer the method takes bytes"):
            channel.unary_unary(METHOD)("text", timeout=1)
        with pytest.raises(TypeError, match="the request_serializer returned it"):
            channel.unary_unary(METHOD, request_serializer=str)(5, timeout=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "error"), [(5, TypeError), ("/a.B/Mé", ValueError), ("/a.B/M\n", ValueError)]
)
async def test_bad_method_paths_are_refused(method: Any, error: type[Exception]) -> None:
    async with Channel("127.0.0.1:1") as channel:
        with pytest.raises(error, match="gRPC method"):
            channel.unary_unary(method)


# -- the OS's reason -----------------------------------------------------------------------


async def test_a_refused_connection_says_why() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    async with Channel(f"127.0.0.1:{port}") as channel:
        with anyio.fail_after(10), pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details() == f"cannot connect to 127.0.0.1:{port}: Connection refused"
    assert caught.value.unprocessed
