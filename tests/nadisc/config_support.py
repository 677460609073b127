"""Installing a provider's settings model for a config test, without a package.

``installed(monkeypatch, acme=Model)`` makes ``provider: acme`` validate and
mask its block with ``Model`` at load, exactly as an installed entry point's
factory would; other names keep their real lookup. Tests that need a name to
stay uninstalled use :data:`UNINSTALLED` (never an entry point here).
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

import nadisc._registry as registry

#: A provider name no package registers.
UNINSTALLED = "acme-registry"


def installed(monkeypatch: pytest.MonkeyPatch, **models: type[BaseModel]) -> None:
    real = registry.installed_settings_model

    def lookup(name: str) -> type[BaseModel] | None:
        return models[name] if name in models else real(name)

    monkeypatch.setattr(registry, "installed_settings_model", lookup)
