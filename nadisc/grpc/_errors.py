"""Status codes and the error every failed call raises.

Contract: a failed call raises :class:`RpcError`, a subclass of
``grpc.aio.AioRpcError`` (and so of ``grpc.RpcError``), whose ``code()`` is a
``grpc.StatusCode``. Code written against ``grpc.aio`` (``except
grpc.aio.AioRpcError as e: if e.code() == grpc.StatusCode.UNAVAILABLE``)
catches it unchanged. ``grpcio`` is imported for these two types only (the
generated ``*_pb2_grpc.py`` stubs import it anyway); its channel, its C core
and its event-loop glue are never used.
"""

from __future__ import annotations

import grpc
import grpc.aio
from h2.errors import ErrorCodes

__all__ = ["RpcError", "StatusCode", "code_from_http_status", "code_from_int", "code_from_reset"]

StatusCode = grpc.StatusCode

_BY_INT: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    """The status for a numeric ``grpc-status``; unknown numbers are UNKNOWN (as the spec says)."""
    return _BY_INT.get(value, grpc.StatusCode.UNKNOWN)


def code_from_http_status(status: int) -> grpc.StatusCode:
    """The spec's mapping of an HTTP status to a gRPC code when ``grpc-status`` is missing.

    From grpc's ``doc/http-grpc-status-mapping.md``.
    """
    if status == 400:
        return grpc.StatusCode.INTERNAL
    if status == 401:
        return grpc.StatusCode.UNAUTHENTICATED
    if status == 403:
        return grpc.StatusCode.PERMISSION_DENIED
    if status == 404:
        return grpc.StatusCode.UNIMPLEMENTED
    if status in (429, 502, 503, 504):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.UNKNOWN


def code_from_reset(error_code: int) -> grpc.StatusCode:
    """The status for a stream the server reset without trailers (grpc's PROTOCOL-HTTP2 doc)."""
    if error_code == ErrorCodes.REFUSED_STREAM:
        return grpc.StatusCode.UNAVAILABLE
    if error_code == ErrorCodes.CANCEL:
        return grpc.StatusCode.CANCELLED
    if error_code == ErrorCodes.ENHANCE_YOUR_CALM:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if error_code == ErrorCodes.INADEQUATE_SECURITY:
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.INTERNAL


class RpcError(grpc.aio.AioRpcError):
    """A call ended with a status other than OK.

    ``code()``, ``details()``, ``initial_metadata()``, ``trailing_metadata()``
    and ``debug_error_string()`` are ``grpc.aio.AioRpcError``'s accessors
    (synchronous, as there). Metadata is a ``grpc.aio.Metadata``; ``-bin``
    values are ``bytes``. The message never quotes request data or metadata
    values.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        initial_metadata: grpc.aio.Metadata | None = None,
        trailing_metadata: grpc.aio.Metadata | None = None,
        where: str = "",
    ) -> None:
        super().__init__(
            code,
            initial_metadata if initial_metadata is not None else grpc.aio.Metadata(),
            trailing_metadata if trailing_metadata is not None else grpc.aio.Metadata(),
            details,
            f"nadisc.grpc: {where}" if where else "nadisc.grpc",
        )
        self._where = where

    @property
    def where(self) -> str:
        """Which part of the call failed, when the channel knows (``"send"``: a
        request the client refused to send), else ``""``."""
        return self._where

    def __str__(self) -> str:
        code = self.code()
        where = f" ({self._where})" if self._where else ""
        return f"{code.name}: {self.details()}{where}"

    __repr__ = __str__

    #: True when the server never saw the call (a refused stream, a stream
    #: above a GOAWAY's last id, a connection that failed before any byte):
    #: a discovery channel may send it to another instance.
    unprocessed: bool = False
