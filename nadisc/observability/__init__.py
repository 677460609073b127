"""Observability of a discovery owner: Prometheus metrics, the live console, ``nadisc watch``.

Everything here reads ``owner.observer()`` only: no close rights, and no
task outside the owner's or the host's task group (the ASGI apps do their
work inside the request handlers hypercorn runs).

* :func:`metrics_app` / :func:`register_metrics` / :class:`DiscoveryCollector`:
  ``nadisc_discovery_*`` families read at scrape time.
* :func:`console_app`: the read-only page and its WebSocket feed, mountable
  under any path prefix of a host's admin listener.
* :func:`serve`: hypercorn on the running loop (trio or asyncio).
* ``nadisc console`` and ``nadisc watch`` (see :mod:`nadisc.observability._commands`).
"""

from ._commands import ConsoleRefused, format_table, watch_remote
from ._console import ConsoleApp, console_app
from ._metrics import DiscoveryCollector, MetricsApp, metrics_app, register_metrics
from ._model import ConsoleModel, ConsoleSample
from ._serve import serve

__all__ = [
    "ConsoleApp",
    "ConsoleModel",
    "ConsoleRefused",
    "ConsoleSample",
    "DiscoveryCollector",
    "MetricsApp",
    "console_app",
    "format_table",
    "metrics_app",
    "register_metrics",
    "serve",
    "watch_remote",
]
