"""nadisc: the discovery runtime.

One owner object per process manages named connections to several
registries, shared observations with precise evidence rules, registrations
with renewal and honest shutdown, and calling through discovery::

    async with open_discovery(config) as owner:
        observation = await owner.client("primary").observe("orders", deadline)
"""

from ._errors import CapacityExceeded as CapacityExceeded
from ._errors import CapacityRejected as CapacityRejected
from ._errors import ConfigError as ConfigError
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import DiscoveryError as DiscoveryError
from ._errors import EvidenceUnavailable as EvidenceUnavailable
from ._errors import IdentityRevoked as IdentityRevoked
from ._errors import IncompleteSnapshot as IncompleteSnapshot
from ._errors import InvalidSnapshot as InvalidSnapshot
from ._errors import LeaseLost as LeaseLost
from ._errors import LifecycleError as LifecycleError
from ._errors import OutcomeUnknown as OutcomeUnknown
from ._errors import PrepareError as PrepareError
from ._errors import ProviderFailure as ProviderFailure
from ._errors import ProviderNotFound as ProviderNotFound
from ._errors import QualifierError as QualifierError
from ._errors import RegistrationError as RegistrationError
from ._errors import RegistrationRejected as RegistrationRejected
from ._errors import UnknownService as UnknownService
from ._instance import EvidenceKind as EvidenceKind
from ._instance import Instance as Instance
from ._instance import ProviderSnapshot as ProviderSnapshot
from ._provider import Capabilities as Capabilities
from ._provider import ConnectionContext as ConnectionContext
from ._provider import HealthCheck as HealthCheck
from ._provider import HealthStatus as HealthStatus
from ._provider import ObservationSink as ObservationSink
from ._provider import Provider as Provider
from ._provider import ProviderFactory as ProviderFactory
from ._provider import Registered as Registered
from ._provider import RegistrationRecord as RegistrationRecord

# (helpers: add your re-exports above this line, one `from ._x import Y as Y` each)

__all__ = [
    "Capabilities",
    "CapacityExceeded",
    "CapacityRejected",
    "ConfigError",
    "ConnectionContext",
    "DeadlineExceeded",
    "DiscoveryError",
    "EvidenceKind",
    "EvidenceUnavailable",
    "HealthCheck",
    "HealthStatus",
    "IdentityRevoked",
    "IncompleteSnapshot",
    "Instance",
    "InvalidSnapshot",
    "LeaseLost",
    "LifecycleError",
    "ObservationSink",
    "OutcomeUnknown",
    "PrepareError",
    "Provider",
    "ProviderFactory",
    "ProviderFailure",
    "ProviderNotFound",
    "ProviderSnapshot",
    "QualifierError",
    "Registered",
    "RegistrationError",
    "RegistrationRecord",
    "RegistrationRejected",
    "UnknownService",
]
