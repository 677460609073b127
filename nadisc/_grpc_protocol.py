"""Keys of the gRPC protocol metadata a registration of a ``grpc`` listener publishes.

Hosting writes them (for registrations whose listener serves gRPC, and only
those); the discovery channel of :mod:`nadisc.grpc` reads them. A registry
without instance metadata (DNS, Kubernetes) carries none, and the caller then
names the protocol explicitly with ``DiscoveryProtocol``.
"""

from __future__ import annotations

from typing import Final

__all__ = ["GRPC_AUTHORITY_KEY", "GRPC_METADATA_PREFIX", "GRPC_TLS_KEY", "GRPC_TLS_MODES"]

#: Every key of the gRPC protocol metadata starts with this. Hyphens, not
#: dots: Consul refuses ``.`` in service meta keys (letters, digits, ``-``,
#: ``_``), and the keys must be valid in every registry that has metadata.
GRPC_METADATA_PREFIX: Final = "nadisc-grpc-"
#: The ``:authority`` calls to the instance carry (optional; default ``host:port``).
GRPC_AUTHORITY_KEY: Final = GRPC_METADATA_PREFIX + "authority"
#: ``plaintext`` or ``tls``: how the instance's gRPC port is dialled. Its
#: presence is what marks an instance as published by a gRPC listener.
GRPC_TLS_KEY: Final = GRPC_METADATA_PREFIX + "tls"
#: The values ``GRPC_TLS_KEY`` may take.
GRPC_TLS_MODES: Final = frozenset({"plaintext", "tls"})
