"""The standard health protocol client (``grpc.health.v1.Health``: Check and Watch).

Contract: :meth:`HealthClient.check` returns the server's
:class:`HealthStatus` for a service (``""`` is the whole server) and raises
``RpcError`` as any call does (``NOT_FOUND`` for a service the server does
not know, per grpc's ``doc/health-checking.md``). :meth:`HealthClient.watch`
yields the status now and after every change, until the server ends the
stream or the caller stops.

The two messages are one field each (``HealthCheckRequest.service = 1``,
``HealthCheckResponse.status = 1``), encoded and decoded here directly so
the client needs no generated module; unknown fields are skipped, as
protobuf requires.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator

from ._channel import Channel

__all__ = ["HealthClient", "HealthStatus"]

_CHECK = "/grpc.health.v1.Health/Check"
_WATCH = "/grpc.health.v1.Health/Watch"


class HealthStatus(enum.IntEnum):
    """``HealthCheckResponse.ServingStatus``."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3  # only Watch says this


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_request(service: str) -> bytes:
    if not service:
        return b""
    raw = service.encode("utf-8")
    return b"\x0a" + _varint(len(raw)) + raw


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a truncated varint in HealthCheckResponse")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def decode_response(data: bytes) -> HealthStatus:
    """``HealthCheckResponse.status``; an unknown enum value reads as UNKNOWN."""
    status = 0
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire} in HealthCheckResponse")
        if pos > len(data):
            raise ValueError("a truncated field in HealthCheckResponse")
    try:
        return HealthStatus(status)
    except ValueError:
        return HealthStatus.UNKNOWN


def decode_request(data: bytes) -> str:
    """``HealthCheckRequest.service`` (the server's side); other fields skipped."""
    service = ""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            if pos + length > len(data):
                raise ValueError("a truncated field in HealthCheckRequest")
            if field == 1:
                service = data[pos : pos + length].decode("utf-8")
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} in HealthCheckRequest")
    if pos > len(data):
        raise ValueError("a truncated field in HealthCheckRequest")
    return service


def encode_response(status: int) -> bytes:
    """``HealthCheckResponse`` with ``status`` (the server's side)."""
    return b"\x08" + _varint(status) if status else b""


class HealthClient:
    """Check and Watch on a :class:`~nadisc.grpc.Channel`."""

    def __init__(self, channel: Channel) -> None:
        self._check = channel.unary_unary(
            _CHECK, request_serializer=encode_request, response_deserializer=decode_response
        )
        self._watch = channel.unary_stream(
            _WATCH, request_serializer=encode_request, response_deserializer=decode_response
        )

    # `timeout=` as on every gRPC call: it travels to the server as grpc-timeout.
    async def check(
        self,
        service: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> HealthStatus:
        status: HealthStatus = await self._check(service, timeout=timeout)
        return status

    async def watch(
        self,
        service: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncGenerator[HealthStatus, None]:
        call = self._watch(service, timeout=timeout)
        try:
            async for status in call:
                yield status
        finally:
            call.cancel()
