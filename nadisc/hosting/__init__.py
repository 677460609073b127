"""Hosting: serve ASGI apps with hypercorn, register the real bound address,
deregister and drain on SIGTERM — on trio and on asyncio; gRPC listeners
(``Bind(grpc=GrpcServe(...))``) serve a grpcio server beside or instead of
the app, with the standard health service and the gRPC protocol metadata.

::

    from nadisc.hosting import Bind, serve

    report = await serve(app, config, listeners={"web": Bind("0.0.0.0", 0,
                         advertised_host="10.0.0.5")})

See :mod:`nadisc.hosting._host` for the lifecycle (bind -> serve -> publish
-> run -> quiesce -> drain -> close) and ``docs/hosting.md`` for the guide.
This package sits above the discovery owner; the owner never imports it.
"""

from ._asgi import ASGIApp, Gate, PrefixRouter
from ._grpc import GrpcListenerReport, GrpcServe
from ._host import Host, HostingError, HostPhase, HostReport, open_host, serve
from ._listen import Bind
from ._timing import (
    DEREGISTER_GRACE_MS,
    EligibilityLease,
    ShutdownBudget,
    default_deregister_grace,
)

__all__ = [
    "DEREGISTER_GRACE_MS",
    "ASGIApp",
    "Bind",
    "EligibilityLease",
    "Gate",
    "GrpcListenerReport",
    "GrpcServe",
    "Host",
    "HostPhase",
    "HostReport",
    "HostingError",
    "PrefixRouter",
    "ShutdownBudget",
    "default_deregister_grace",
    "open_host",
    "serve",
]
