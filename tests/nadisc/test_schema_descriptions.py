"""``nadisc schema`` describes every property: the core config models and the
block of every installed provider (entry points), nested models included."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field, SecretStr

from nadisc._cli import main
from nadisc._config import BUILTIN_PROVIDERS
from nadisc._registry import available_providers, installed_settings_model
from nadisc._schema import _fill


def _schema() -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    assert main(["schema"], environ={}, out=out, err=err) == 0, err.getvalue()
    document: dict[str, Any] = json.loads(out.getvalue())
    return document


def _properties(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every ``(path, property schema)`` under any ``properties`` in ``node``."""
    if isinstance(node, dict):
        for name, prop in (node.get("properties") or {}).items():
            yield f"{where}.{name}", prop
            yield from _properties(prop, f"{where}.{name}")
        for key, value in node.items():
            if key != "properties":
                yield from _properties(value, f"{where}/{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _properties(item, f"{where}[{index}]")


def test_every_property_of_the_schema_has_a_description() -> None:
    schema = _schema()
    found = list(_properties(schema, "discovery"))
    missing = [
        path
        for path, prop in found
        if not (isinstance(prop, dict) and str(prop.get("description", "")).strip())
    ]
    assert missing == []
    # The walk saw the core models and the provider blocks, not an empty document.
    assert len(found) > 120
    assert {"ConnectionConfig", "RegistrationConfig", "SnapshotConfig"} <= set(schema["$defs"])


def test_every_installed_provider_block_is_in_the_schema() -> None:
    schema = _schema()
    connection = schema["$defs"]["ConnectionConfig"]["properties"]
    with_models = {
        name: model
        for name in available_providers()
        if (model := installed_settings_model(name)) is not None
    }
    assert {"etcd", "consul", "nacos", "kubernetes"} <= set(with_models)
    for name, model in with_models.items():
        assert connection[name]["description"]
        if name in BUILTIN_PROVIDERS:  # static, dns: fields of ConnectionConfig itself
            continue
        block = schema["$defs"][f"{name}.{model.__name__}"]
        # every field of the settings model, none left out of the schema
        assert set(block["properties"]) == {
            info.alias or field for field, info in model.model_fields.items()
        }


def test_a_secret_default_is_never_shown() -> None:
    class Secretive(BaseModel):
        token: SecretStr = Field(default=SecretStr("hunter2"), description="a token")
        maybe: SecretStr | None = Field(default=SecretStr("hunter3"), description="maybe one")
        plain: str = Field(default="visible", description="not a secret")

    schema = Secretive.model_json_schema(mode="validation")
    _fill(schema, Secretive)
    assert "default" not in schema["properties"]["token"]
    assert "default" not in schema["properties"]["maybe"]
    assert schema["properties"]["plain"]["default"] == "visible"
    assert "hunter" not in json.dumps(schema)
