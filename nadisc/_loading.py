"""Reading a configuration document into a :class:`~nadisc.DiscoveryConfig`.

A document is the host's whole configuration (YAML, TOML or JSON); nadisc
reads only its ``discovery`` node and leaves every other top-level key to the
host. The loaders promise:

* duplicate keys are refused at any depth, in all three formats (YAML and
  JSON parsers silently keep the last value, so both are walked with their
  paths; TOML's parser already refuses them and its error is translated);
* unknown fields, unknown references, a provider block that belongs to
  another provider and budgets that cannot fit are refused;
* every refusal is one :class:`~nadisc.ConfigError` whose ``path`` is the
  full dotted path (``discovery.connections.business.provider``); messages
  carry names and line numbers, never input values (they may be secrets);
* nothing is half-built: the result is fully validated or an error is raised;
* placeholders like ``${VAR}`` are never expanded: they stay literal text.

Cost: one parse plus one walk of the document; documents are small.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from ._config import DiscoveryConfig, translate_validation_error
from ._errors import ConfigError

__all__ = [
    "LEGACY_ROOTS",
    "config_json_schema",
    "load_config",
    "load_config_file",
    "load_document",
    "parse_config",
]

Format = Literal["yaml", "toml", "json"]

#: Older top-level nodes that may not appear next to ``discovery``.
LEGACY_ROOTS = ("rest_discovery", "nacos_discovery", "nacos-discovery")

_SUFFIXES: dict[str, Format] = {
    ".yaml": "yaml",
    ".yml": "yaml",
    ".toml": "toml",
    ".json": "json",
}


def parse_config(document: Mapping[str, Any] | None) -> DiscoveryConfig:
    """Validate the ``discovery`` node of an already parsed document.

    A missing ``discovery`` node means discovery is disabled. The caller is
    responsible for duplicate keys in ``document`` (a dict cannot show them).
    """
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError("<document>", "the document must be a mapping at the top level")
    if "discovery" not in document:
        return DiscoveryConfig()
    for legacy in LEGACY_ROOTS:
        if legacy in document:
            raise ConfigError(
                legacy,
                "the legacy root may not appear together with 'discovery' "
                "(even when one is disabled): remove it",
            )
    node = document["discovery"]
    if not isinstance(node, Mapping):
        raise ConfigError("discovery", "must be a mapping")
    try:
        return DiscoveryConfig.model_validate(dict(node))
    except ValidationError as exc:
        raise translate_validation_error(exc, model=DiscoveryConfig) from None
    except RecursionError:
        raise ConfigError("discovery", "nested too deeply") from None


def load_config(text: str | bytes, format: Format = "yaml") -> DiscoveryConfig:
    """Parse ``text`` in ``format`` and validate its ``discovery`` node."""
    return parse_config(load_document(text, format))


def load_document(text: str | bytes, format: Format = "yaml") -> Any:
    """Parse ``text`` with the duplicate-key checks, without validating it.

    For hosts that transform the document (for instance, resolve ``${VARS}``)
    before :func:`parse_config`; nadisc itself never does.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("<document>", "the document is not valid UTF-8") from None
    if format == "yaml":
        document = _parse_yaml(text)
    elif format == "json":
        document = _parse_json(text)
    elif format == "toml":
        document = _parse_toml(text)
    else:
        raise ConfigError("<document>", f"unknown format {format!r}: yaml, toml or json")
    return document


def load_config_file(path: str | os.PathLike[str], format: Format | None = None) -> DiscoveryConfig:
    """Read ``path`` and :func:`load_config` it; the format follows the suffix
    (``.yaml``/``.yml``, ``.toml``, ``.json``) unless given."""
    file = Path(path)
    if format is None:
        guessed = _SUFFIXES.get(file.suffix.lower())
        if guessed is None:
            raise ConfigError(
                "<document>", f"cannot tell the format of {file.name!r}: pass format="
            )
        format = guessed
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError("<document>", f"cannot read {file.name!r}: {exc.strerror}") from exc
    return load_config(data, format)


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of a document's ``discovery`` node (no secret defaults)."""
    schema = DiscoveryConfig.model_json_schema(mode="validation")
    schema["title"] = "discovery"
    return schema


# --------------------------------------------------------------------------- YAML


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader; duplicate keys are found by walking the composed node tree."""


#: Aliases may share nodes; the document they expand to is bounded.
MAX_EXPANDED_NODES = 1_000_000


def _parse_yaml(text: str) -> Any:
    try:
        nodes = list(yaml.compose_all(text, Loader=_YamlLoader))
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    except RecursionError:
        raise ConfigError("<document>", "YAML: nested too deeply") from None
    if len(nodes) > 1:
        raise ConfigError("<document>", "expected one YAML document, found several")
    if not nodes or nodes[0] is None:
        return None
    try:
        size = _expanded_size(nodes[0], {}, set())
    except RecursionError:
        raise ConfigError("<document>", "YAML: nested too deeply") from None
    if size > MAX_EXPANDED_NODES:
        raise ConfigError(
            "<document>", f"YAML aliases expand to more than {MAX_EXPANDED_NODES} nodes"
        )
    _check_yaml_duplicates(nodes[0], "", set())
    try:
        loader = _YamlLoader("")
        try:
            return loader.construct_document(nodes[0])
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None


def _yaml_error(exc: yaml.YAMLError) -> ConfigError:
    # str(exc) would quote the offending line, which may hold a secret.
    if isinstance(exc, yaml.MarkedYAMLError):
        where = ""
        if exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        problem = exc.problem or exc.context or "invalid YAML"
        return ConfigError("<document>", f"YAML: {problem}{where}")
    return ConfigError("<document>", "invalid YAML")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _expanded_size(node: yaml.Node, memo: dict[int, int], active: set[int]) -> int:
    """How many nodes the document has once aliases are expanded (memoized,
    so a "billion laughs" document is measured without being expanded)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise ConfigError("<document>", "YAML: an alias refers to itself")
    active.add(key)
    size = 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            size += _expanded_size(key_node, memo, active)
            size += _expanded_size(value_node, memo, active)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            size += _expanded_size(item, memo, active)
    active.discard(key)
    memo[key] = min(size, MAX_EXPANDED_NODES + 1)
    return memo[key]


def _check_yaml_duplicates(node: yaml.Node, path: str, checked: set[int]) -> None:
    # A node shared through aliases is checked once, at its first path.
    if id(node) in checked:
        return
    checked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[object] = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                _check_yaml_duplicates(value_node, path, checked)
                continue
            key: object = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            label = str(key) if isinstance(key_node, yaml.ScalarNode) else "?"
            if isinstance(key_node, yaml.ScalarNode) and key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(_join(path, label), f"duplicate key (line {line})")
            seen.add(key)
            _check_yaml_duplicates(value_node, _join(path, label), checked)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_yaml_duplicates(item, f"{path}[{index}]", checked)


# --------------------------------------------------------------------------- JSON


class _Pairs(list[tuple[str, Any]]):
    """An object as written, duplicates included, until it is checked."""


def _parse_json(text: str) -> Any:
    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        raw = json.loads(text, object_pairs_hook=_Pairs, parse_constant=refuse_constant)
    except RecursionError:
        raise ConfigError("<document>", "JSON: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "<document>", f"JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except ValueError as exc:
        raise ConfigError("<document>", f"JSON: {exc}") from None
    try:
        return _json_objects(raw, "")
    except RecursionError:
        raise ConfigError("<document>", "JSON: nested too deeply") from None


def _json_objects(value: Any, path: str) -> Any:
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            where = _join(path, key)
            if key in out:
                raise ConfigError(where, "duplicate key")
            out[key] = _json_objects(item, where)
        return out
    if isinstance(value, list):
        return [_json_objects(item, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


# --------------------------------------------------------------------------- TOML


def _parse_toml(text: str) -> Any:
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError("<document>", "TOML: nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        # The parser refuses duplicate keys and tables itself ("Cannot overwrite
        # a value", "Cannot declare ... twice"); its message names the position.
        raise ConfigError("<document>", f"TOML: {exc}") from None
