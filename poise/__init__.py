"""poise: client-side load balancing for trio and asyncio.

Endpoints with readiness, quarantine, load tracking and passive outlier
ejection; policies (round
robin, weighted, power-of-two-choices on peak EWMA, affinity hashing); and
transactional reconciliation of discovery snapshots into a live balance.

Depends only on the standard library and anyio.
"""

from ._balance import Balance as Balance
from ._balance import BalanceStatistics as BalanceStatistics
from ._balance import Held as Held
from ._balance import ReadinessObserver as ReadinessObserver
from ._budget import RetryBudget as RetryBudget
from ._cell import CellReader as CellReader
from ._cell import LatestCell as LatestCell
from ._cell import Subscription as Subscription
from ._context import ContextProjection as ContextProjection
from ._context import RequestContext as RequestContext
from ._context import UseRequest as UseRequest
from ._directory import Allocation as Allocation
from ._directory import Backend as Backend
from ._directory import Directory as Directory
from ._directory import Lineage as Lineage
from ._directory import Member as Member
from ._directory import Snapshot as Snapshot
from ._directory import SnapshotReader as SnapshotReader
from ._directory import SnapshotStream as SnapshotStream
from ._directory import UnknownMember as UnknownMember
from ._endpoint import Endpoint as Endpoint
from ._endpoint import ReadinessState as ReadinessState
from ._errors import CallDeclined as CallDeclined
from ._errors import DuplicateIdentity as DuplicateIdentity
from ._errors import EndpointError as EndpointError
from ._errors import FactoryError as FactoryError
from ._errors import ForeignSnapshot as ForeignSnapshot
from ._errors import InvalidInput as InvalidInput
from ._errors import PoiseError as PoiseError
from ._errors import ReadinessError as ReadinessError
from ._errors import ReconcileError as ReconcileError
from ._errors import SelectionError as SelectionError
from ._errors import StaleRevision as StaleRevision
from ._errors import StreamClosed as StreamClosed
from ._errors import StreamingError as StreamingError
from ._hedge import Hedging as Hedging
from ._hedge import LatencyWindow as LatencyWindow
from ._hedge import hedged_call as hedged_call
from ._load import InFlight as InFlight
from ._load import InFlightGuard as InFlightGuard
from ._outlier import OutlierDetector as OutlierDetector
from ._outlier import OutlierEvent as OutlierEvent
from ._outlier import OutlierObserver as OutlierObserver
from ._peak_ewma import PeakEwma as PeakEwma
from ._peak_ewma import PeakEwmaGuard as PeakEwmaGuard
from ._policies import LeastLoaded as LeastLoaded
from ._policies import PowerOfTwoChoices as PowerOfTwoChoices
from ._policies import RoundRobin as RoundRobin
from ._policies import WeightedRendezvous as WeightedRendezvous
from ._policies import WeightedRoundRobin as WeightedRoundRobin
from ._protocols import LoadGuard as LoadGuard
from ._protocols import LoadTracker as LoadTracker
from ._protocols import Policy as Policy
from ._protocols import Service as Service
from ._protocols import Weighted as Weighted
from ._reconcile import AsyncEndpointFactory as AsyncEndpointFactory
from ._reconcile import DiscoveryBalance as DiscoveryBalance
from ._reconcile import EndpointFactory as EndpointFactory
from ._reconcile import GenerationTracker as GenerationTracker
from ._reconcile import ReconcileReport as ReconcileReport
from ._reconcile import SyncEndpointFactory as SyncEndpointFactory
from ._reconcile import in_flight_factory as in_flight_factory
from ._service import ConcurrencyLimit as ConcurrencyLimit
from ._service import ReservingService as ReservingService
from ._service import ServiceFn as ServiceFn
from ._service import close_service as close_service
from ._service import release_reservation as release_reservation
from ._service import service_fn as service_fn
from ._streaming import StreamEndPolicy as StreamEndPolicy
from ._streaming import StreamingConfig as StreamingConfig
from ._streaming import StreamingDiscoveryBalance as StreamingDiscoveryBalance
from ._subset import ring_order as ring_order
from ._subset import subset as subset
from ._zones import ZonePlan as ZonePlan
from ._zones import hinted as hinted
from ._zones import zone_plan as zone_plan

__all__ = [
    "Allocation",
    "AsyncEndpointFactory",
    "Backend",
    "Balance",
    "BalanceStatistics",
    "CallDeclined",
    "CellReader",
    "ConcurrencyLimit",
    "ContextProjection",
    "Directory",
    "DiscoveryBalance",
    "DuplicateIdentity",
    "Endpoint",
    "EndpointError",
    "EndpointFactory",
    "FactoryError",
    "ForeignSnapshot",
    "GenerationTracker",
    "Hedging",
    "Held",
    "InFlight",
    "InFlightGuard",
    "InvalidInput",
    "LatencyWindow",
    "LatestCell",
    "LeastLoaded",
    "Lineage",
    "LoadGuard",
    "LoadTracker",
    "Member",
    "OutlierDetector",
    "OutlierEvent",
    "OutlierObserver",
    "PeakEwma",
    "PeakEwmaGuard",
    "PoiseError",
    "Policy",
    "PowerOfTwoChoices",
    "ReadinessError",
    "ReadinessObserver",
    "ReadinessState",
    "ReconcileError",
    "ReconcileReport",
    "RequestContext",
    "ReservingService",
    "RetryBudget",
    "RoundRobin",
    "SelectionError",
    "Service",
    "ServiceFn",
    "Snapshot",
    "SnapshotReader",
    "SnapshotStream",
    "StaleRevision",
    "StreamClosed",
    "StreamEndPolicy",
    "StreamingConfig",
    "StreamingDiscoveryBalance",
    "StreamingError",
    "Subscription",
    "SyncEndpointFactory",
    "UnknownMember",
    "UseRequest",
    "Weighted",
    "WeightedRendezvous",
    "WeightedRoundRobin",
    "ZonePlan",
    "close_service",
    "hedged_call",
    "hinted",
    "in_flight_factory",
    "release_reservation",
    "ring_order",
    "service_fn",
    "subset",
    "zone_plan",
]
