"""The catalog as a child of a :class:`~nadisc.DiscoveryOwner`.

::

    catalog = await open_catalog(owner, "primary")
        -> owner.start_child("primary", CATALOG_KEY, run)   (once per connection)
             -> ConsulCatalog.run in the owner's task group
    catalog.resolve("orders") / catalog.list("grpc") / catalog.changes()

The worker belongs to the owner, never to the caller: asking again (from any
task) returns the same catalog without starting a second worker, and the
worker is cancelled with every other task of the owner when it closes. The
first call waits for the first build attempt, so the snapshot is filled
when Consul was reachable (otherwise the error is in ``statistics()`` and
the worker keeps retrying with backoff).
"""

from __future__ import annotations

from anyio.abc import TaskStatus

from nadisc import DiscoveryOwner, LifecycleError, Provider, QualifierError

from ._catalog import ConsulCatalog, catalog_for
from ._provider import ConsulProvider

__all__ = ["CATALOG_KEY", "open_catalog"]

#: The key the catalog worker is started under (see ``DiscoveryOwner.start_child``).
CATALOG_KEY = "nadisc_consul.catalog"


async def _run_catalog(provider: Provider, *, task_status: TaskStatus[ConsulCatalog]) -> None:
    if not isinstance(provider, ConsulProvider):
        raise QualifierError(
            f"the connection's provider is {type(provider).__name__}, not Consul: it has no catalog"
        )
    await catalog_for(provider).run(task_status=task_status)


async def open_catalog(owner: DiscoveryOwner, qualifier: str | None = None) -> ConsulCatalog:
    """The catalog of the Consul connection ``qualifier`` (``None``: the
    owner's default connection), its worker running in the owner's task group.

    Started at most once per connection; every later call returns the same
    object. Raises ``QualifierError`` for an unknown or non-Consul connection
    and ``LifecycleError`` once the owner began to quiesce or close (or when
    the connection's catalog already ran and stopped).
    """
    catalog = await owner.start_child(qualifier, CATALOG_KEY, _run_catalog)
    if not isinstance(catalog, ConsulCatalog):  # pragma: no cover - another user of the key
        raise LifecycleError(f"the owner's child {CATALOG_KEY!r} is not a Consul catalog")
    return catalog
