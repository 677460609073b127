"""gRPC for trio and asyncio: a client channel on anyio byte streams and ``h2``.

See ``docs/grpc.md``. Needs the ``grpc`` extra (``h2``, ``protobuf``, and
``grpcio`` for the ``grpc`` module that generated stubs import and for the
``grpc.StatusCode`` / ``grpc.aio.AioRpcError`` types reused here).
"""

from ._channel import (
    Channel,
    StreamStreamMultiCallable,
    StreamUnaryMultiCallable,
    UnaryStreamMultiCallable,
    UnaryUnaryMultiCallable,
)
from ._discovery import (
    DiscoveryChannel,
    DiscoveryProtocol,
    DiscoveryStreamCall,
    DiscoveryStreamUnaryCall,
    DiscoveryUnaryCall,
    GrpcProtocolConflict,
    GrpcProtocolError,
    GrpcProtocolMissing,
    discovery_channel,
)
from ._errors import RpcError, StatusCode
from ._first_serving import PROBE_SHARE, PROBE_WIDTH, NoServingInstance
from ._health import HealthClient, HealthStatus
from ._reconnect import ConnectBackoff
from ._retry import RetryPolicy, RetryThrottle
from ._wire import DEFAULT_MAX_MESSAGE_LENGTH, DEFAULT_MAX_METADATA_SIZE

__all__ = [
    "DEFAULT_MAX_MESSAGE_LENGTH",
    "DEFAULT_MAX_METADATA_SIZE",
    "PROBE_SHARE",
    "PROBE_WIDTH",
    "Channel",
    "ConnectBackoff",
    "DiscoveryChannel",
    "DiscoveryProtocol",
    "DiscoveryStreamCall",
    "DiscoveryStreamUnaryCall",
    "DiscoveryUnaryCall",
    "GrpcProtocolConflict",
    "GrpcProtocolError",
    "GrpcProtocolMissing",
    "HealthClient",
    "HealthStatus",
    "NoServingInstance",
    "RetryPolicy",
    "RetryThrottle",
    "RpcError",
    "StatusCode",
    "StreamStreamMultiCallable",
    "StreamUnaryMultiCallable",
    "UnaryStreamMultiCallable",
    "UnaryUnaryMultiCallable",
    "discovery_channel",
]
