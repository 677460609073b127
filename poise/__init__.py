"""poise: client-side load balancing for trio and asyncio.

Endpoints with readiness, quarantine and load tracking; policies (round
robin, weighted, power-of-two-choices on peak EWMA, affinity hashing); and
transactional reconciliation of discovery snapshots into a live balance.

Depends only on the standard library and anyio.
"""

from ._cell import CellReader as CellReader
from ._cell import LatestCell as LatestCell
from ._cell import Subscription as Subscription
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
from ._protocols import LoadGuard as LoadGuard
from ._protocols import LoadTracker as LoadTracker
from ._protocols import Policy as Policy
from ._protocols import Service as Service
from ._protocols import Weighted as Weighted

# (helpers: add your re-exports above this line, one `from ._x import Y as Y` each)

__all__ = [
    "CellReader",
    "DuplicateIdentity",
    "EndpointError",
    "FactoryError",
    "ForeignSnapshot",
    "InvalidInput",
    "LatestCell",
    "LoadGuard",
    "LoadTracker",
    "PoiseError",
    "Policy",
    "ReadinessError",
    "ReconcileError",
    "SelectionError",
    "Service",
    "StaleRevision",
    "StreamClosed",
    "StreamingError",
    "Subscription",
    "Weighted",
]
