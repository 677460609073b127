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
* each connection's provider block is validated with its installed
  provider's ``settings_model`` (found through the ``nadisc.providers``
  entry points; nothing is constructed, no network);
* every problem of a document is reported at once (``ConfigError.problems``);
* YAML is read as the data language it is used as here: base-60 numbers
  (``190:20:30``) are text, a constructor failure (``!!bool abc``,
  ``2001-13-45``) is a ``ConfigError`` naming the path; lone surrogates are
  refused in every format;
* nothing is half-built: the result is fully validated or an error is raised;
* placeholders like ``${VAR}`` are expanded only when asked (``environ=``, or
  :func:`expand_variables` between :func:`load_document` and
  :func:`parse_config`); otherwise they stay literal text and a secret field
  holding one warns (:class:`ConfigWarning`).

Cost: one parse plus one walk of the document; documents are small.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from ._config import (
    BUILTIN_PROVIDERS,
    WHOLE_PLACEHOLDER,
    ConnectionConfig,
    DiscoveryConfig,
    config_error,
    is_secret_key,
    validation_problems,
)
from ._errors import ConfigError, ProviderNotFound
from ._schema import config_json_schema

__all__ = [
    "LEGACY_ROOTS",
    "ConfigWarning",
    "config_json_schema",
    "expand_variables",
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


class ConfigWarning(UserWarning):
    """A config loads but is probably not what was meant (for instance a
    secret field holding a literal ``${VAR}`` that nothing expanded)."""


def parse_config(
    document: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
    require_root: bool = False,
    require_providers: bool = False,
) -> DiscoveryConfig:
    """Validate the ``discovery`` node of an already parsed document.

    A missing ``discovery`` node means discovery is disabled, unless
    ``require_root`` (then it is an error); a top-level key that looks like a
    misspelt root (``discvery``, ``Discovery``) is always an error. Each
    connection's provider block is validated with its installed provider's
    ``settings_model`` (no network); with ``require_providers`` a provider
    that is not installed is an error too (otherwise the owner reports it
    when it opens). With ``environ``, ``${VAR}`` placeholders are expanded
    first (:func:`expand_variables`). Every problem of the document is
    reported at once in :attr:`ConfigError.problems`. The caller is
    responsible for duplicate keys in ``document`` (a dict cannot show them).
    """
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError("<document>", "the document must be a mapping at the top level")
    _check_text(document, "")
    if "discovery" not in document:
        misspelt = _misspelt_root(document)
        if misspelt is not None:
            raise ConfigError(misspelt, "unknown top-level key (did you mean 'discovery'?)")
        if require_root:
            raise ConfigError(
                "discovery",
                "the document has no 'discovery' root (an empty document disables discovery "
                "for a library host; here it is required)",
            )
        return DiscoveryConfig()
    for legacy in LEGACY_ROOTS:
        if legacy in document:
            raise ConfigError(
                legacy,
                "the legacy root may not appear together with 'discovery' "
                "(even when one is disabled): remove it",
            )
    node = document["discovery"]
    if environ is not None:
        node = expand_variables(node, environ, "discovery")
    if not isinstance(node, Mapping):
        raise ConfigError("discovery", "must be a mapping")
    if environ is None:
        _warn_literal_secrets(node, "discovery")
    problems: list[tuple[str, str]] = []
    config: DiscoveryConfig | None = None
    try:
        config = DiscoveryConfig.model_validate(dict(node))
    except ValidationError as exc:
        problems.extend(validation_problems(exc, model=DiscoveryConfig))
    except RecursionError:
        raise ConfigError("discovery", "nested too deeply") from None
    problems.extend(_provider_block_problems(node, require_providers))
    if config is not None:
        problems.extend(_discovery_only_problems(config))
    if problems or config is None:
        raise config_error(_unique(problems))
    return config


def _unique(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()
    out = []
    for problem in problems:
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out


def _misspelt_root(document: Mapping[Any, Any]) -> str | None:
    for key in document:
        if not isinstance(key, str):
            continue
        if key.strip().lower() == "discovery" or difflib.get_close_matches(
            key.lower(), ["discovery"], n=1, cutoff=0.8
        ):
            return key
    return None


def _provider_block_problems(node: Mapping[str, Any], required: bool) -> list[tuple[str, str]]:
    """Validate each connection's block with its installed provider's model."""
    from ._registry import installed_settings_model, load_factory

    connections = node.get("connections")
    if not isinstance(connections, Mapping):
        return []
    problems: list[tuple[str, str]] = []
    for name, connection in connections.items():
        if not isinstance(connection, Mapping):
            continue
        provider = connection.get("provider")
        if not isinstance(provider, str) or provider in BUILTIN_PROVIDERS:
            continue
        if provider in ConnectionConfig.model_fields:
            continue  # refused by ConnectionConfig itself
        where = f"discovery.connections.{name}"
        model = installed_settings_model(provider)
        if model is None:
            if required:
                try:
                    load_factory(provider, path=f"{where}.provider")
                except ProviderNotFound as exc:
                    problems.append((exc.path, exc.detail))
            continue
        block = connection.get(provider, {})
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            continue  # refused by ConnectionConfig itself
        problems.extend(_validate_block(block, model, f"{where}.{provider}"))
    return problems


def _discovery_only_problems(config: DiscoveryConfig) -> list[tuple[str, str]]:
    """A registration on a connection whose provider's settings model says
    ``discovery_only`` (a ClassVar) is refused here, not at open."""
    from ._registry import installed_settings_model

    problems: list[tuple[str, str]] = []
    for name, registration in config.registrations.items():
        connection = config.connections.get(registration.qualifier)
        if connection is None or connection.provider in BUILTIN_PROVIDERS:
            continue
        model = installed_settings_model(connection.provider)
        if model is not None and getattr(model, "discovery_only", False) is True:
            problems.append(
                (
                    f"discovery.registrations.{name}.{registration.qualifier_field}",
                    f"the connection it names uses the {connection.provider} provider, which "
                    "only discovers and cannot register",
                )
            )
    return problems


def _validate_block(
    block: Mapping[str, Any], model: type[BaseModel], prefix: str
) -> list[tuple[str, str]]:
    try:
        model.model_validate(_plain(block))
    except ValidationError as exc:
        return validation_problems(exc, prefix=prefix, model=model)
    except (ValueError, TypeError):
        # a settings model that raises outside pydantic's protocol
        return [(prefix, "invalid provider settings")]
    return []


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


#: Deeper mappings/lists than this are refused before any recursive walk
#: (Python's own stack ends near 1,000 frames; no config is this deep).
MAX_NESTING = 100


def _too_deep(path: str) -> ConfigError:
    shown = path if len(path) <= 120 else path[:117] + "..."
    return ConfigError(shown or "<document>", f"nested more than {MAX_NESTING} levels deep")


def _check_text(value: Any, path: str, depth: int = 0) -> None:
    """Refuse lone surrogates anywhere (keys too): they are not text and
    break every later encoding (``model_dump_json``, logs, the wire); and
    refuse nesting over ``MAX_NESTING`` levels (a typed error, never a
    ``RecursionError``)."""
    if depth > MAX_NESTING and isinstance(value, Mapping | list | tuple):
        raise _too_deep(path)
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ConfigError(path or "<document>", "contains a lone surrogate (not valid text)")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            where = _join(path, str(key) if not _is_bad_text(key) else "?")
            if _is_bad_text(key):
                raise ConfigError(where, "a key contains a lone surrogate (not valid text)")
            _check_text(item, where, depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_text(item, f"{path}[{index}]", depth + 1)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_bad_text(value: object) -> bool:
    return isinstance(value, str) and _SURROGATE.search(value) is not None


def _warn_literal_secrets(value: Any, path: str, secret: bool = False, depth: int = 0) -> None:
    if depth > MAX_NESTING and isinstance(value, Mapping | list | tuple):
        raise _too_deep(path)
    if isinstance(value, Mapping):
        for key, item in value.items():
            _warn_literal_secrets(
                item, _join(path, str(key)), secret or is_secret_key(str(key)), depth + 1
            )
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _warn_literal_secrets(item, f"{path}[{index}]", secret, depth + 1)
    elif secret and isinstance(value, str) and _VARIABLE.search(value):
        warnings.warn(
            f"{path}: a secret field holds a literal ${{...}} placeholder; nadisc expands "
            "variables only when asked (pass environ=, or call expand_variables)",
            ConfigWarning,
            stacklevel=4,
        )


def load_config(
    text: str | bytes,
    format: Format = "yaml",
    *,
    environ: Mapping[str, str] | None = None,
    require_root: bool = False,
    require_providers: bool = False,
) -> DiscoveryConfig:
    """Parse ``text`` in ``format`` and validate its ``discovery`` node
    (see :func:`parse_config` for the keyword arguments)."""
    if not isinstance(text, str | bytes):
        raise TypeError(
            f"load_config reads YAML/TOML/JSON text, not {type(text).__name__}; "
            "validate an already parsed document with nadisc.parse_config"
        )
    return parse_config(
        load_document(text, format),
        environ=environ,
        require_root=require_root,
        require_providers=require_providers,
    )


def load_document(text: str | bytes, format: Format = "yaml") -> Any:
    """Parse ``text`` with the duplicate-key checks, without validating it.

    For hosts that transform the document before :func:`parse_config`.
    """
    if not isinstance(text, str | bytes):
        raise TypeError(f"load_document reads text, not {type(text).__name__}")
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
        raise ConfigError("<document>", "unknown format: yaml, toml or json")
    return document


def load_config_file(
    path: str | os.PathLike[str],
    format: Format | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    require_root: bool = False,
    require_providers: bool = False,
) -> DiscoveryConfig:
    """Read ``path`` and :func:`load_config` it; the format follows the suffix
    (``.yaml``/``.yml``, ``.toml``, ``.json``) unless given.

    ``${VAR}`` placeholders are expanded from ``environ`` when it is given
    (``environ=os.environ`` to use the process environment); without it they
    stay literal text, and a literal placeholder in a secret field warns
    (:class:`ConfigWarning`).
    """
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
    return load_config(
        data,
        format,
        environ=environ,
        require_root=require_root,
        require_providers=require_providers,
    )


# --------------------------------------------------------------------------- ${VARS}

_VARIABLE = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_INT = re.compile(r"^-?(?:0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?$")


def _typed(text: str) -> Any:
    """What a whole-placeholder expansion reads as: JSON's integers, numbers
    and ``true``/``false``; anything else stays text."""
    if _INT.match(text) and len(text) <= 20:
        return int(text)
    if _FLOAT.match(text) and len(text) <= 40:
        number = float(text)
        if number not in (float("inf"), float("-inf")):
            return number
    if text in ("true", "false"):
        return text == "true"
    return text


def expand_variables(
    document: Any, environ: Mapping[str, str] | None = None, path: str = ""
) -> Any:
    """Return a copy of ``document`` with ``${NAME}`` references expanded.

    Syntax (in string values only; keys are never expanded): ``${NAME}``
    (must be set and non-empty), ``${NAME:-fallback}`` (fallback when unset
    or empty), ``$${`` for a literal ``${``. A value that is exactly one
    placeholder takes the type its expansion reads as (``port: ${PORT}`` with
    ``PORT=8080`` gives the integer 8080; ``true``/``false`` give booleans,
    JSON numbers give numbers), except under secret-looking keys
    (``password``, ``token``, ...), which always stay text. An unset variable
    without a fallback, and an unterminated ``${``, raise
    :class:`~nadisc.ConfigError` naming the path and the variable, never a
    value. ``environ`` defaults to ``os.environ``.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    return _expand(document, env, path, secret=False)


def _expand(document: Any, environ: Mapping[str, str], path: str, *, secret: bool) -> Any:
    if isinstance(document, Mapping):
        return {
            key: _expand(
                value,
                environ,
                _join(path, str(key)),
                secret=secret or (isinstance(key, str) and is_secret_key(key)),
            )
            for key, value in document.items()
        }
    if isinstance(document, list | tuple):
        return [
            _expand(value, environ, f"{path}[{i}]", secret=secret)
            for i, value in enumerate(document)
        ]
    if not isinstance(document, str):
        return document
    where = path or "<document>"

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name, fallback = match.group(1), match.group(2)
        value = environ.get(name)
        if value:
            return value
        if fallback is not None:
            return fallback
        raise ConfigError(where, f"environment variable {name} is not set")

    leftover = _VARIABLE.sub("", document)
    if "${" in leftover:
        raise ConfigError(where, "unterminated or malformed ${...} reference")
    expanded = _VARIABLE.sub(replace, document)
    if not secret and WHOLE_PLACEHOLDER.match(document):
        return _typed(expanded)
    return expanded


# --------------------------------------------------------------------------- YAML


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader; duplicate keys are found by walking the composed node tree.

    YAML 1.1's base-60 integers and floats (``190:20:30`` is 685230) are not
    resolved: such a scalar stays text, so a duration written that way is
    refused instead of silently becoming a number nobody meant.
    """


#: PyYAML's YAML 1.1 int and float patterns without their base-60 alternatives.
_INT_PATTERN = re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"
)
_FLOAT_PATTERN = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?"
    r"|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"
)


def _without_sexagesimal() -> None:
    replacement = {"tag:yaml.org,2002:int": _INT_PATTERN, "tag:yaml.org,2002:float": _FLOAT_PATTERN}
    resolvers: dict[Any, list[tuple[str, re.Pattern[str]]]] = {}
    for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items():
        resolvers[first] = [(tag, replacement.get(tag, pattern)) for tag, pattern in entries]
    _YamlLoader.yaml_implicit_resolvers = resolvers


_without_sexagesimal()

#: What a constructor failure says per tag (never the value).
_TAG_NAMES = {
    "tag:yaml.org,2002:bool": "a boolean",
    "tag:yaml.org,2002:int": "an integer",
    "tag:yaml.org,2002:float": "a number",
    "tag:yaml.org,2002:timestamp": "a date or timestamp",
    "tag:yaml.org,2002:binary": "base64 binary",
    "tag:yaml.org,2002:null": "null",
}


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
        return _construct(nodes[0])
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError):
        # PyYAML's constructors let these escape, with the value in the message.
        raise _constructor_error(nodes[0]) from None


def _construct(node: yaml.Node) -> Any:
    loader = _YamlLoader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _constructor_error(root: yaml.Node) -> ConfigError:
    """The first scalar (in document order) that cannot be constructed."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                _construct(node)
            except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError):
                what = _TAG_NAMES.get(node.tag, "a value of its tag")
                line = node.start_mark.line + 1
                return ConfigError(
                    path or "<document>", f"YAML: cannot be read as {what} (line {line})"
                )
            except yaml.YAMLError as exc:
                return _yaml_error(exc)
        elif isinstance(node, yaml.MappingNode):
            children = []
            for key_node, value_node in node.value:
                label = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                children.append((key_node, path))
                children.append((value_node, _join(path, str(label))))
            stack.extend(reversed(children))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(node.value)]))
    return ConfigError("<document>", "YAML: a value cannot be constructed")


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
    except ValueError:
        # int() of an over-long integer (Python's digit limit) escapes the parser.
        raise ConfigError("<document>", "TOML: a number is too long to read") from None
    except Exception:  # pragma: no cover - defensive: nothing else may escape
        raise ConfigError("<document>", "TOML: the document cannot be read") from None
