"""Kubernetes provider for nadisc: a Service and its owned EndpointSlices, watched.

Loaded through the ``nadisc.providers`` entry point ``kubernetes``
(discovery only)::

    connections:
      primary:
        provider: kubernetes
        kubernetes:
          namespace: shop
          services:
            orders: {name: order-api, port: http}

Evidence is the joint fact of the Service and the EndpointSlices that are
correctly its own (owned by its current UID, or mirrored from its Endpoints
object when it has no selector); ready endpoints are served, serving + terminating ones are
draining members. Each watched Service holds two watch streams. See
``docs/providers-kubernetes.md``.
"""

from ._credentials import ClusterAccess as ClusterAccess
from ._credentials import TokenSource as TokenSource
from ._credentials import resolve_access as resolve_access
from ._provider import KubernetesProvider as KubernetesProvider
from ._provider import KubernetesProviderFactory as KubernetesProviderFactory
from ._provider import KubernetesStatistics as KubernetesStatistics
from ._provider import factory as factory
from ._settings import KubernetesSettings as KubernetesSettings
from ._settings import ServiceBinding as ServiceBinding
from ._state import ServiceView as ServiceView
from ._state import build_snapshot as build_snapshot
from ._state import endpoint_state as endpoint_state
from ._wire import decode_event as decode_event
from ._wire import decode_page as decode_page

__all__ = [
    "ClusterAccess",
    "KubernetesProvider",
    "KubernetesProviderFactory",
    "KubernetesSettings",
    "KubernetesStatistics",
    "ServiceBinding",
    "ServiceView",
    "TokenSource",
    "build_snapshot",
    "decode_event",
    "decode_page",
    "endpoint_state",
    "factory",
    "resolve_access",
]
