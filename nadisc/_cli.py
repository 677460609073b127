"""The ``nadisc`` command: a small host around the library.

The library never expands ``${VARS}`` in a config; a host does, before any
network resource is created. This command is such a host::

    nadisc check discovery.yaml            validate (after expanding ${VARS})
    nadisc schema                          print the JSON Schema of the config
    nadisc observe discovery.yaml orders   observe one service once and print it
    nadisc console discovery.yaml          serve the live console (nadisc.observability)
    nadisc watch discovery.yaml orders     a live table of services (or --connect ws://...)

Variable syntax (in string values only; :func:`nadisc.expand_variables`):
``${NAME}`` (must be set), ``${NAME:-fallback}`` (fallback when unset or
empty), and ``$${`` for a literal ``${``; a value that is exactly one
placeholder takes the type its expansion reads as (``port: ${PORT}``).
``check`` requires the ``discovery`` root, validates every provider block
with its installed provider's settings (no network) and reports every
problem at once, one per line. Errors name the config path and the
variable, never a value. It also warns (on stderr; the status stays 0)
when a connection serves callers with ``snapshot.stale_if_error_ms: 0``,
the fail-closed default that turns a registry outage into failed calls.
Exit status: 0 on success, 2 on a config or usage error, 1 when discovery
itself failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from ._config import DiscoveryConfig, binding_names
from ._errors import ConfigError, DiscoveryError
from ._loading import config_json_schema, expand_variables, load_document, parse_config

__all__ = ["expand_variables", "main"]  # expand_variables: also nadisc.expand_variables

_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}


def _load(path: str, environ: Mapping[str, str]) -> DiscoveryConfig:
    """Read, expand and validate like a host that means it: the ``discovery``
    root is required and every provider named must be installed."""
    file = Path(path)
    fmt = _SUFFIXES.get(file.suffix.lower())
    if fmt is None:
        raise ConfigError("<document>", f"cannot tell the format of {file.name!r} from its suffix")
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise ConfigError("<document>", f"cannot read {file.name!r}: {exc.strerror}") from exc
    document = load_document(text, fmt)  # type: ignore[arg-type]
    return parse_config(document, environ=environ, require_root=True, require_providers=True)


def _preflight(config: DiscoveryConfig, environ: Mapping[str, str]) -> None:
    """What ``open_discovery`` checks when it creates each provider, without
    the network: a factory with a ``preflight(settings, environ)`` method
    (the kubernetes one reads its kubeconfig there) refuses what creating
    the provider would refuse. Every problem at once, under its connection."""
    from ._config import BUILTIN_PROVIDERS, validate_provider_block
    from ._registry import load_factory

    problems: list[tuple[str, str]] = []
    for name, connection in config.connections.items():
        if connection.provider in BUILTIN_PROVIDERS:
            continue
        factory = load_factory(connection.provider)
        check = getattr(factory, "preflight", None)
        if check is None:
            continue
        try:
            check(validate_provider_block(name, connection, factory.settings_model), environ)
        except ConfigError as exc:
            where = f"discovery.connections.{name}.{connection.provider}"
            problems.extend((f"{where}: {path}", message) for path, message in exc.problems)
    if problems:
        raise ConfigError(problems[0][0], problems[0][1], problems=tuple(problems))


def _describe(config: DiscoveryConfig, out: TextIO) -> None:
    out.write(f"discovery: {'enabled' if config.enabled else 'disabled'}\n")
    for name, connection in config.connections.items():
        required = "startup-required" if connection.startup_required else "optional"
        out.write(f"  connection {name}: provider {connection.provider} ({required})\n")
    for name, registration in config.registrations.items():
        out.write(
            f"  registration {name}: {registration.service_name} on "
            f"{registration.qualifier or 'primary'}\n"
        )


async def _observe(
    config: DiscoveryConfig, service: str, qualifier: str | None, strict: bool, seconds: float
) -> list[dict[str, object]]:
    import anyio

    from ._owner import open_discovery

    async with open_discovery(config) as owner:
        handle = owner.client(qualifier) if qualifier is not None else owner.client()
        deadline = anyio.current_time() + seconds
        observation = await handle.observe(service, deadline)
        snapshot = observation.snapshot(strict=strict)
        return [
            {
                "identity": i.identity,
                "address": i.address,
                "weight": i.weight,
                "evidence": snapshot.evidence.value,
            }
            for i in snapshot.instances
        ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nadisc", description="nadisc discovery host")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a config file (after expanding ${VARS})")
    check.add_argument("config")
    sub.add_parser("schema", help="print the JSON Schema of the discovery config")
    observe = sub.add_parser("observe", help="observe one service once and print its instances")
    observe.add_argument("config")
    observe.add_argument("service", help="service alias bound on the connection")
    observe.add_argument("-q", "--qualifier", help="connection name (default: primary)")
    observe.add_argument("--strict", action="store_true", help="refuse evidence after a failure")
    observe.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    from .observability._commands import add_commands

    add_commands(sub)
    return parser


def _warnings(config: DiscoveryConfig) -> list[str]:
    """Defaults worth a second look (the config is valid either way)."""
    registered = {(r.qualifier, r.service_name) for r in config.registrations.values()}
    notes: list[str] = []
    for name, connection in config.connections.items():
        if connection.provider == "static" or connection.snapshot.stale_if_error_ms:
            continue
        called = [alias for alias in binding_names(connection) if (name, alias) not in registered]
        if called:
            notes.append(
                f"connections.{name}.snapshot.stale_if_error_ms: 0 (the default) fails calls "
                f"to {', '.join(sorted(called))} as soon as a refresh fails (a registry "
                "outage becomes a caller outage); production callers usually set a grace, "
                "e.g. 10000 (docs/calling.md)"
            )
    return notes


def main(
    argv: Sequence[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the command; return the exit status."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    env = environ if environ is not None else os.environ
    args = _parser().parse_args(argv)
    try:
        if args.command == "schema":
            json.dump(config_json_schema(), out, indent=2, sort_keys=True)
            out.write("\n")
            return 0
        run = getattr(args, "run", None)
        if run is not None:  # console / watch (nadisc.observability)
            return int(run(args, lambda path: _load(path, env), env, out, err))
        config = _load(args.config, env)
        if args.command == "check":
            _preflight(config, env)
            _describe(config, out)
            for note in _warnings(config):
                err.write(f"nadisc: warning: {note}\n")
            out.write("ok\n")
            return 0
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ConfigError("--timeout", "must be a positive number of seconds")
        import trio

        rows = trio.run(_observe, config, args.service, args.qualifier, args.strict, args.timeout)
    except ConfigError as exc:
        for path, message in exc.problems:
            err.write(f"nadisc: config error: {path}: {message}\n")
        return 2
    except DiscoveryError as exc:
        err.write(f"nadisc: {type(exc).__name__}: {exc}\n")
        return 1
    for row in rows:
        out.write(json.dumps(row, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
