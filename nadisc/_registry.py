"""Finding provider factories through the ``nadisc.providers`` entry points.

``provider: consul`` in a config loads the entry point named ``consul`` of
the group ``nadisc.providers`` lazily, the first time an owner is built.
The group is scanned once per process (:func:`forget_settings_models`
rescans it). A third party adds a backend the same way: publish a
distribution whose entry point names a :class:`~nadisc.ProviderFactory`.
An unknown name is a :class:`~nadisc.ProviderNotFound` that says what to
install.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import logging

from pydantic import BaseModel

from ._errors import ProviderNotFound
from ._provider import ProviderFactory

__all__ = [
    "GROUP",
    "available_providers",
    "forget_settings_models",
    "installed_settings_model",
    "load_factory",
]

logger = logging.getLogger(__name__)

GROUP = "nadisc.providers"

#: Where the providers this project knows about come from.
_KNOWN_SOURCES: dict[str, str] = {
    "static": "poise-nadisc (built in)",
    "dns": "poise-nadisc (built in)",
    "etcd": "poise-nadisc (its nadisc_etcd package)",
    "consul": "poise-nadisc (its nadisc_consul package)",
}


@functools.lru_cache(maxsize=1)
def _entry_points() -> tuple[importlib.metadata.EntryPoint, ...]:
    """The group's entry points, read once per process (a scan of every
    installed distribution's metadata: tens of milliseconds, synchronous).
    :func:`forget_settings_models` drops it with the models."""
    return tuple(importlib.metadata.entry_points(group=GROUP))


def available_providers() -> tuple[str, ...]:
    """Names registered in the ``nadisc.providers`` group, sorted."""
    return tuple(sorted({ep.name for ep in _entry_points()}))


def _install_hint(name: str) -> str:
    source = _KNOWN_SOURCES.get(name)
    if source is not None:
        return f"reinstall {source} so that its entry point is registered"
    return f"install a package that registers an entry point of this name in the {GROUP!r} group"


def load_factory(name: str, *, path: str = "provider") -> ProviderFactory:
    """The factory registered as ``name``; ``ProviderNotFound`` naming ``path`` otherwise."""
    matches = [ep for ep in _entry_points() if ep.name == name]
    if not matches:
        names = available_providers()
        installed = ", ".join(names) or "none"
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        # The name itself is not repeated: messages never quote config values.
        raise ProviderNotFound(
            path,
            f"no provider of this name is installed ({hint}installed: {installed}); "
            + _install_hint(name),
        )
    try:
        factory = matches[0].load()
    except ImportError as exc:
        raise ProviderNotFound(
            path,
            "the provider is registered but its module cannot be imported "
            f"({exc.name or 'unknown module'}); " + _install_hint(name),
        ) from exc
    for attribute in ("name", "settings_model", "create"):
        if not hasattr(factory, attribute):
            raise ProviderNotFound(
                path,
                "the entry point of this provider does not name a provider factory "
                f"(missing {attribute!r})",
            )
    logger.debug("loaded provider factory %r", name)
    result: ProviderFactory = factory
    return result


@functools.lru_cache(maxsize=64)
def installed_settings_model(name: str) -> type[BaseModel] | None:
    """The ``settings_model`` of the installed provider ``name``, or ``None``.

    Used while loading a config (no network, nothing constructed): a provider
    that is not installed, cannot be imported or is not a factory gives
    ``None`` here and is reported by the owner when it opens. Cached per
    process; :func:`forget_settings_models` drops the cache (after installing
    a provider at run time).
    """
    try:
        factory = load_factory(name)
    except ProviderNotFound:
        return None
    model = factory.settings_model
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return None


def forget_settings_models() -> None:
    """Forget the cached entry points and the settings models of
    :func:`installed_settings_model` (after installing a provider at run time)."""
    _entry_points.cache_clear()
    installed_settings_model.cache_clear()
