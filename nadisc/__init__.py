"""nadisc: the discovery runtime.

One owner object per process manages named connections to several
registries, shared observations with precise evidence rules, registrations
with renewal and honest shutdown, and calling through discovery::

    async with open_discovery(config) as owner:
        observation = await owner.client("primary").observe("orders", deadline)
"""

from ._capacity import CapacityUse as CapacityUse
from ._config import ConnectionConfig as ConnectionConfig
from ._config import DiscoveryConfig as DiscoveryConfig
from ._config import DnsConfig as DnsConfig
from ._config import DnsServiceConfig as DnsServiceConfig
from ._config import LimitsConfig as LimitsConfig
from ._config import MaskedUrl as MaskedUrl
from ._config import OutlierConfig as OutlierConfig
from ._config import ProviderBlock as ProviderBlock
from ._config import RegistrationConfig as RegistrationConfig
from ._config import RestConfig as RestConfig
from ._config import RetryConfig as RetryConfig
from ._config import SnapshotConfig as SnapshotConfig
from ._config import StaticConfig as StaticConfig
from ._config import StaticInstanceConfig as StaticInstanceConfig
from ._config import binding_names as binding_names
from ._config import default_qualifier as default_qualifier
from ._config import provider_block as provider_block
from ._config import restart_required as restart_required
from ._config import validate_provider_block as validate_provider_block
from ._connection import DiscoveryHandle as DiscoveryHandle
from ._deadlines import multi_request_read as multi_request_read
from ._deadlines import time_left as time_left
from ._ejection import EjectionLog as EjectionLog
from ._ejection import EjectionOptions as EjectionOptions
from ._eligibility import Eligibility as Eligibility
from ._eligibility import EligibilityController as EligibilityController
from ._eligibility import EligibilityError as EligibilityError
from ._errors import CallCapacityExceeded as CallCapacityExceeded
from ._errors import CallError as CallError
from ._errors import CallEvidenceUnavailable as CallEvidenceUnavailable
from ._errors import CallLifecycleError as CallLifecycleError
from ._errors import CallQualifierError as CallQualifierError
from ._errors import CallTimeout as CallTimeout
from ._errors import CallUnknownService as CallUnknownService
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
from ._evidence import Reason as Reason
from ._instance import EvidenceKind as EvidenceKind
from ._instance import IncrementalListing as IncrementalListing
from ._instance import Instance as Instance
from ._instance import InvalidInstanceAddress as InvalidInstanceAddress
from ._instance import ProviderSnapshot as ProviderSnapshot
from ._loading import ConfigWarning as ConfigWarning
from ._loading import config_json_schema as config_json_schema
from ._loading import expand_variables as expand_variables
from ._loading import load_config as load_config
from ._loading import load_config_file as load_config_file
from ._loading import load_document as load_document
from ._loading import parse_config as parse_config
from ._observation import Observation as Observation
from ._observation import ObservationChanges as ObservationChanges
from ._observation import ObservationSnapshot as ObservationSnapshot
from ._observer import ConnectionMetrics as ConnectionMetrics
from ._observer import EndpointMetrics as EndpointMetrics
from ._observer import GrpcCallMetrics as GrpcCallMetrics
from ._observer import InstanceView as InstanceView
from ._observer import ObserverSnapshot as ObserverSnapshot
from ._observer import RegistrationMetrics as RegistrationMetrics
from ._observer import RouteMetrics as RouteMetrics
from ._observer import RuntimeObserver as RuntimeObserver
from ._observer import ServiceListing as ServiceListing
from ._observer import ServiceMetrics as ServiceMetrics
from ._owner import CloseReport as CloseReport
from ._owner import ConnectionSpec as ConnectionSpec
from ._owner import DiscoveryOwner as DiscoveryOwner
from ._owner import OwnerBuilder as OwnerBuilder
from ._owner import Phase as Phase
from ._owner import RegistrationComponent as RegistrationComponent
from ._owner import ShutdownWaiter as ShutdownWaiter
from ._owner import open_discovery as open_discovery
from ._probe import EligibilityProbe as EligibilityProbe
from ._probe import eligibility_probe_app as eligibility_probe_app
from ._probing import CandidateWithdrawn as CandidateWithdrawn
from ._probing import FirstServing as FirstServing
from ._probing import NoServingCandidate as NoServingCandidate
from ._probing import NotServing as NotServing
from ._probing import ProbeFailure as ProbeFailure
from ._probing import first_serving as first_serving
from ._provider import Capabilities as Capabilities
from ._provider import ConnectionContext as ConnectionContext
from ._provider import DiscoveryOnlyProvider as DiscoveryOnlyProvider
from ._provider import HealthCheck as HealthCheck
from ._provider import HealthStatus as HealthStatus
from ._provider import ObservationSink as ObservationSink
from ._provider import Provider as Provider
from ._provider import ProviderFactory as ProviderFactory
from ._provider import Registered as Registered
from ._provider import RegistrationRecord as RegistrationRecord
from ._provider import RenewalOutcomeUnknown as RenewalOutcomeUnknown
from ._redact import redacted_excerpt as redacted_excerpt
from ._registration import CloseOutcome as CloseOutcome
from ._registration import ConnectionPlan as ConnectionPlan
from ._registration import FrozenRegistration as FrozenRegistration
from ._registration import OwnerRegistrations as OwnerRegistrations
from ._registration import RegistrationCloseEntry as RegistrationCloseEntry
from ._registration import RegistrationSet as RegistrationSet
from ._registration import RegistrationSpec as RegistrationSpec
from ._registration import RegistrationStatus as RegistrationStatus
from ._registration import RegistrationTiming as RegistrationTiming
from ._registration import resolve_registrations as resolve_registrations
from ._registration_state import HealthEvidence as HealthEvidence
from ._registration_state import RegistrationState as RegistrationState
from ._registration_state import WriteOutcome as WriteOutcome
from ._registry import available_providers as available_providers
from ._rest import InvalidRequest as InvalidRequest
from ._rest import ResponseTooLarge as ResponseTooLarge
from ._rest import RestClients as RestClients
from ._rest import RestDiscoveryClient as RestDiscoveryClient
from ._rest import rest_client as rest_client
from ._rest import rest_clients as rest_clients
from ._route import CallFailureKind as CallFailureKind
from ._route import InstanceSchemeMismatch as InstanceSchemeMismatch
from ._route import RestOptions as RestOptions
from ._route import RouteStatistics as RouteStatistics
from ._route import declared_scheme as declared_scheme
from ._tls import default_tls_context as default_tls_context
from ._tls import grpc_tls_context as grpc_tls_context
from ._tls import tls_context_for as tls_context_for
from ._transport import Budget as Budget
from ._transport import DiscoveryTransport as DiscoveryTransport
from ._transport import NotDiscoveryUrl as NotDiscoveryUrl
from ._transport import call_budget as call_budget
from .providers._static import StaticProvider as StaticProvider

__all__ = [
    "Budget",
    "CallCapacityExceeded",
    "CallError",
    "CallEvidenceUnavailable",
    "CallFailureKind",
    "CallLifecycleError",
    "CallQualifierError",
    "CallTimeout",
    "CallUnknownService",
    "CandidateWithdrawn",
    "Capabilities",
    "CapacityExceeded",
    "CapacityRejected",
    "CapacityUse",
    "CloseOutcome",
    "CloseReport",
    "ConfigError",
    "ConfigWarning",
    "ConnectionConfig",
    "ConnectionContext",
    "ConnectionMetrics",
    "ConnectionPlan",
    "ConnectionSpec",
    "DeadlineExceeded",
    "DiscoveryConfig",
    "DiscoveryError",
    "DiscoveryHandle",
    "DiscoveryOnlyProvider",
    "DiscoveryOwner",
    "DiscoveryTransport",
    "DnsConfig",
    "DnsServiceConfig",
    "EjectionLog",
    "EjectionOptions",
    "Eligibility",
    "EligibilityController",
    "EligibilityError",
    "EligibilityProbe",
    "EndpointMetrics",
    "EvidenceKind",
    "EvidenceUnavailable",
    "FirstServing",
    "FrozenRegistration",
    "GrpcCallMetrics",
    "HealthCheck",
    "HealthEvidence",
    "HealthStatus",
    "IdentityRevoked",
    "IncompleteSnapshot",
    "IncrementalListing",
    "Instance",
    "InstanceSchemeMismatch",
    "InstanceView",
    "InvalidInstanceAddress",
    "InvalidRequest",
    "InvalidSnapshot",
    "LeaseLost",
    "LifecycleError",
    "LimitsConfig",
    "MaskedUrl",
    "NoServingCandidate",
    "NotDiscoveryUrl",
    "NotServing",
    "Observation",
    "ObservationChanges",
    "ObservationSink",
    "ObservationSnapshot",
    "ObserverSnapshot",
    "OutcomeUnknown",
    "OutlierConfig",
    "OwnerBuilder",
    "OwnerRegistrations",
    "Phase",
    "PrepareError",
    "ProbeFailure",
    "Provider",
    "ProviderBlock",
    "ProviderFactory",
    "ProviderFailure",
    "ProviderNotFound",
    "ProviderSnapshot",
    "QualifierError",
    "Reason",
    "Registered",
    "RegistrationCloseEntry",
    "RegistrationComponent",
    "RegistrationConfig",
    "RegistrationError",
    "RegistrationMetrics",
    "RegistrationRecord",
    "RegistrationRejected",
    "RegistrationSet",
    "RegistrationSpec",
    "RegistrationState",
    "RegistrationStatus",
    "RegistrationTiming",
    "RenewalOutcomeUnknown",
    "ResponseTooLarge",
    "RestClients",
    "RestConfig",
    "RestDiscoveryClient",
    "RestOptions",
    "RetryConfig",
    "RouteMetrics",
    "RouteStatistics",
    "RuntimeObserver",
    "ServiceListing",
    "ServiceMetrics",
    "ShutdownWaiter",
    "SnapshotConfig",
    "StaticConfig",
    "StaticInstanceConfig",
    "StaticProvider",
    "UnknownService",
    "WriteOutcome",
    "available_providers",
    "binding_names",
    "call_budget",
    "config_json_schema",
    "declared_scheme",
    "default_qualifier",
    "default_tls_context",
    "eligibility_probe_app",
    "expand_variables",
    "first_serving",
    "grpc_tls_context",
    "load_config",
    "load_config_file",
    "load_document",
    "multi_request_read",
    "open_discovery",
    "parse_config",
    "provider_block",
    "redacted_excerpt",
    "resolve_registrations",
    "rest_client",
    "rest_clients",
    "restart_required",
    "time_left",
    "tls_context_for",
    "validate_provider_block",
]
