"""Consul provider for nadisc: blocking-query discovery, self-registration, catalog.

Loaded through the ``nadisc.providers`` entry point ``consul``::

    connections:
      primary:
        provider: consul
        consul:
          url: http://127.0.0.1:8500
          services:
            orders: {name: order-worker, tag: grpc}

See ``docs/providers-consul.md`` for the settings, the blocking-query rules,
the registration payload and the catalog.
"""

from ._blocking import Backoff as Backoff
from ._blocking import BlockingCursor as BlockingCursor
from ._blocking import IndexOutcome as IndexOutcome
from ._blocking import TokenBucket as TokenBucket
from ._catalog import CatalogSnapshot as CatalogSnapshot
from ._catalog import CatalogStatistics as CatalogStatistics
from ._catalog import ConsulCatalog as ConsulCatalog
from ._catalog import DiscoveredService as DiscoveredService
from ._catalog import ResolvedEndpoint as ResolvedEndpoint
from ._catalog import catalog_for as catalog_for
from ._owner import open_catalog as open_catalog
from ._provider import ConsulProvider as ConsulProvider
from ._provider import ConsulProviderFactory as ConsulProviderFactory
from ._provider import factory as factory
from ._registration import Contribution as Contribution
from ._registration import HealthEndpoint as HealthEndpoint
from ._registration import RegistrationContributor as RegistrationContributor
from ._registration import ReregistrationState as ReregistrationState
from ._registration import build_registration as build_registration
from ._registration import merge_contributions as merge_contributions
from ._registration import run_reregistration as run_reregistration
from ._settings import ConsulSettings as ConsulSettings
from ._settings import ServiceBinding as ServiceBinding
from ._wire import decode_health_service as decode_health_service

__all__ = [
    "Backoff",
    "BlockingCursor",
    "CatalogSnapshot",
    "CatalogStatistics",
    "ConsulCatalog",
    "ConsulProvider",
    "ConsulProviderFactory",
    "ConsulSettings",
    "Contribution",
    "DiscoveredService",
    "HealthEndpoint",
    "IndexOutcome",
    "RegistrationContributor",
    "ReregistrationState",
    "ResolvedEndpoint",
    "ServiceBinding",
    "TokenBucket",
    "build_registration",
    "catalog_for",
    "decode_health_service",
    "factory",
    "merge_contributions",
    "open_catalog",
    "run_reregistration",
]
