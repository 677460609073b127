"""The JSON Schema of a document's ``discovery`` node, provider blocks included.

Contract: :func:`config_json_schema` returns one JSON Schema (draft 2020-12,
as pydantic writes it) for the ``discovery`` node. Every installed
provider's block appears as an optional property of a connection, under the
provider's name, from that provider's ``settings_model`` (found through the
``nadisc.providers`` entry points; a new provider needs nothing here). A
block of a provider that is not installed stays an open object.

Every property carries a ``description``: the field's own
``Field(description=...)``, else the ``#:`` comment written above it in the
model's source, else the model's docstring line naming it. Secret fields
(``SecretStr``) never show a default.

::

    DiscoveryConfig schema
    └── $defs.ConnectionConfig.properties
        ├── static, dns                 (built in)
        └── <provider>: {"$ref": "#/$defs/<provider>.<Model>"}

Cost: one schema generation per model and a read of their source files;
the result is built per call (it is only asked for by tools).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache
from typing import Any, get_args

from pydantic import BaseModel

from ._config import BUILTIN_PROVIDERS, DiscoveryConfig

__all__ = ["config_json_schema", "field_descriptions"]


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of a document's ``discovery`` node, with the blocks of
    every installed provider and a description on every property."""
    from ._registry import available_providers, installed_settings_model

    schema = DiscoveryConfig.model_json_schema(mode="validation")
    schema["title"] = "discovery"
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    _describe(schema, defs, DiscoveryConfig, prefix="")
    connection = defs["ConnectionConfig"]
    for name in available_providers():
        if name in BUILTIN_PROVIDERS:
            continue
        model = installed_settings_model(name)
        if model is None:
            continue
        block = model.model_json_schema(mode="validation", ref_template=f"#/$defs/{name}.{{model}}")
        block_defs = block.pop("$defs", {})
        _describe(block, block_defs, model, prefix=f"{name}.")
        for key, value in block_defs.items():
            defs[f"{name}.{key}"] = value
        defs[f"{name}.{model.__name__}"] = block
        connection["properties"][name] = {
            "$ref": f"#/$defs/{name}.{model.__name__}",
            "description": f"settings of the {name!r} provider (only with provider: {name})",
        }
    return schema


def _describe(
    root: dict[str, Any], defs: dict[str, Any], model: type[BaseModel], prefix: str
) -> None:
    """Fill missing property descriptions from the models' comments."""
    by_title = {cls.__name__: cls for cls in _models(model)}
    _fill(root, model)
    for value in defs.values():
        cls = by_title.get(str(value.get("title", "")))
        if cls is not None:
            _fill(value, cls)


def _fill(schema: dict[str, Any], model: type[BaseModel]) -> None:
    described = field_descriptions(model)
    for name, prop in schema.get("properties", {}).items():
        if not isinstance(prop, dict):
            continue
        if _is_secret(prop) and prop.get("default") is not None:
            prop.pop("default")
        if prop.get("description"):
            continue
        text = described.get(name)
        if text:
            prop["description"] = text


def _is_secret(prop: dict[str, Any]) -> bool:
    """A ``SecretStr`` property, alone or in a union (``SecretStr | None``)."""
    branches = [prop, *prop.get("anyOf", ())]
    return any(
        isinstance(b, dict) and (b.get("format") == "password" or b.get("writeOnly"))
        for b in branches
    )


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    stack: list[Any] = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item in found:
                continue
            found.append(item)
            stack.extend(info.annotation for info in item.model_fields.values())
        else:
            stack.extend(get_args(item))
    return found


@lru_cache(maxsize=256)
def field_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """``{field: description}`` for ``model``: ``Field(description=...)``,
    else the ``#:`` comment above the field in any class of its MRO."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            out.update(_comments(cls))
    for name, info in model.model_fields.items():
        if info.description:
            out[name] = info.description
    return {name: text for name, text in out.items() if name in model.model_fields}


def _comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:  # pragma: no cover - the class was imported, so it parses
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        index = node.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if comment:
            out[node.target.id] = " ".join(comment)
    return out
