"""Finding provider factories through the ``nadisc.providers`` entry points.

``provider: consul`` in a config loads the entry point named ``consul`` of
the group ``nadisc.providers`` lazily, the first time an owner is built. A
third party adds a backend the same way: publish a distribution whose entry
point names a :class:`~nadisc.ProviderFactory`. An unknown name is a
:class:`~nadisc.ProviderNotFound` that says what to install.
"""

from __future__ import annotations

import importlib.metadata
import logging

from ._errors import ProviderNotFound
from ._provider import ProviderFactory

__all__ = ["GROUP", "available_providers", "load_factory"]

logger = logging.getLogger(__name__)

GROUP = "nadisc.providers"

#: Where the providers this project knows about come from.
_KNOWN_SOURCES: dict[str, str] = {
    "static": "poise-nadisc (built in)",
    "dns": "poise-nadisc (built in)",
    "etcd": "poise-nadisc (its nadisc_etcd package)",
    "consul": "poise-nadisc (its nadisc_consul package)",
}


def available_providers() -> tuple[str, ...]:
    """Names registered in the ``nadisc.providers`` group, sorted."""
    return tuple(sorted({ep.name for ep in importlib.metadata.entry_points(group=GROUP)}))


def _install_hint(name: str) -> str:
    source = _KNOWN_SOURCES.get(name)
    if source is not None:
        return f"reinstall {source} so that its entry point is registered"
    return (
        f"install a package that registers a {name!r} entry point in the {GROUP!r} "
        f"group (for example `pip install nadisc-{name}`)"
    )


def load_factory(name: str, *, path: str = "provider") -> ProviderFactory:
    """The factory registered as ``name``; ``ProviderNotFound`` naming ``path`` otherwise."""
    matches = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == name]
    if not matches:
        installed = ", ".join(available_providers()) or "none"
        raise ProviderNotFound(
            path,
            f"no provider named {name!r} is installed (installed: {installed}); "
            + _install_hint(name),
        )
    try:
        factory = matches[0].load()
    except ImportError as exc:
        raise ProviderNotFound(
            path,
            f"provider {name!r} is registered but its module cannot be imported "
            f"({exc.name or 'unknown module'}); " + _install_hint(name),
        ) from exc
    for attribute in ("name", "settings_model", "create"):
        if not hasattr(factory, attribute):
            raise ProviderNotFound(
                path,
                f"the entry point for provider {name!r} does not name a provider factory "
                f"(missing {attribute!r})",
            )
    logger.debug("loaded provider factory %r", name)
    result: ProviderFactory = factory
    return result
