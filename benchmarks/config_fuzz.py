"""Config fuzzing: every document either loads or is one ``ConfigError``.

The property (checked for each generated document, YAML, JSON or TOML text):

* ``load_config`` returns a :class:`~nadisc.DiscoveryConfig`, or raises
  :class:`~nadisc.ConfigError` whose ``path`` is non-empty and is either
  ``<document>`` (the text itself cannot be read) or a dotted path into it;
* no other exception type escapes;
* no secret value planted in the input appears in the message or in any
  problem of the error (nor in the loaded config's ``repr``).

Documents are built from the config's own shape with hostile leaves: PyYAML
tags whose constructors fail (``!!bool abc``, ``2001-13-45``), base-60
numbers, over-long integers, lone surrogates, URLs with user-info,
placeholders, misspelt keys and roots, wrong types, secrets under ordinary
and secret-looking keys.

The suite runs 150 examples (and the smoke run 100) (``tests/nadisc/test_config_fuzz.py``);
this command runs the nightly-size campaign and prints a table::

    python -m benchmarks.config_fuzz [--examples 10000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nadisc import ConfigError, DiscoveryConfig, load_config

#: Planted in values; must never come back in a message.
SECRET = "Zq9SECRETvalue"

_SCALARS_YAML = [
    "!!bool abc",
    "2001-13-45",
    "!!timestamp abc",
    "!!float ''",
    "!!int ''",
    f"!!int {SECRET}",
    "!!binary '*'",
    "190:20:30",
    "1_000",
    "0x1F",
    "9" * 5000,
    '"\\ud800"',
    '"\\udfff x"',
    f"http://bob:{SECRET}@h:1",
    f"'{SECRET}'",
    "'${SOME_VAR}'",
    "${PORT}",
    "-1",
    "0",
    "3000",
    "86400001",
    "true",
    "yes",
    "null",
    "~",
    "[]",
    "{}",
    "[1, 2]",
    ".inf",
    ".nan",
    "1e999",
    "'round_robin'",
    "static",
    "etcd",
    "consul",
    "dns",
    "primary",
    "10.0.0.1",
    "0.0.0.0",
    "8080",
    "65536",
    "&a x",
    "*a",
]

_KEYS = {
    "root": ["discovery", "discvery", "Discovery", "application", "rest_discovery"],
    "discovery": [
        "enabled",
        "connections",
        "registrations",
        "limits",
        "default_connection",
        "shutdown_timeout_ms",
        "eligibility_probe",
        "enabeld",
    ],
    "connection": [
        "provider",
        "static",
        "dns",
        "etcd",
        "consul",
        "snapshot",
        "retry",
        "rest",
        "request_timeout_ms",
        "poll_interval_ms",
        "startup_required",
        "passwrd",
    ],
    "block": [
        "endpoints",
        "url",
        "password",
        "username",
        "token",
        "ttl_seconds",
        "ttl_secs",
        "services",
        "prefix",
        "wait",
        "passwrd",
        "meta",
        "nameservers",
        "min_refresh_ms",
    ],
    "registration": [
        "service_name",
        "qualifier",
        "ip",
        "port",
        "metadata",
        "weight",
        "listener_ref",
        "instance_id",
        "publish_secret_looking_metadata",
    ],
    "leaf": ["max_age_ms", "stale_if_error_ms", "name", "host", "port", "db_password", "x"],
}


def _scalar() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(_SCALARS_YAML),
        st.integers(min_value=-(10**6), max_value=10**8).map(str),
        st.text(alphabet="abc:-_./ ", min_size=1, max_size=8).map(lambda t: json.dumps(t)),
    )


def _node(kind: str, depth: int) -> st.SearchStrategy[Any]:
    """A YAML node as a Python tree of (key, value) pairs and scalar texts."""
    children = {
        "root": "discovery",
        "discovery": "named",
        "named": "connection",
        "connection": "block",
        "block": "leafmap",
        "leafmap": "leaf",
        "registration": "leafmap",
    }
    if depth <= 0 or kind == "leaf":
        return _scalar()
    keys = _KEYS.get(kind, _KEYS["leaf"])
    child = children.get(kind, "leaf")
    if kind == "named":
        keys = ["primary", "business", "web", "a.b", " x"]
    if kind == "discovery":
        pairs = st.lists(
            st.tuples(
                st.sampled_from(keys),
                st.deferred(
                    lambda: st.one_of(
                        _node("named", depth - 1),
                        st.dictionaries(
                            st.sampled_from(["web", "r"]),
                            _node("registration", depth - 2),
                            max_size=2,
                        ).map(lambda d: list(d.items())),
                        _scalar(),
                    )
                ),
            ),
            max_size=6,
        )
        return pairs
    return st.one_of(
        st.lists(
            st.tuples(st.sampled_from(keys), st.deferred(lambda: _node(child, depth - 1))),
            max_size=5,
        ),
        _scalar(),
        st.lists(_scalar(), max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
    )


def _render(node: Any, indent: int = 0) -> str:
    if isinstance(node, str):
        return " " + node + "\n"
    if not node:
        return " {}\n"
    pad = "  " * indent
    out = "\n"
    for key, value in node:
        out += f"{pad}{key}:{_render(value, indent + 1)}"
    return out


def yaml_documents() -> st.SearchStrategy[str]:
    """YAML texts shaped like configs, with hostile leaves."""
    return st.lists(
        st.tuples(st.sampled_from(_KEYS["root"]), _node("discovery", 5)), min_size=0, max_size=2
    ).map(lambda pairs: _render(pairs).lstrip("\n"))


def _json_value(depth: int) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**20), max_value=10**20),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([SECRET, f"http://u:{SECRET}@h", "\ud800", "${X}", "primary", "static"]),
    )
    if depth <= 0:
        return leaves
    keys = st.sampled_from(sorted({k for ks in _KEYS.values() for k in ks}))
    return st.one_of(
        leaves,
        st.lists(st.deferred(lambda: _json_value(depth - 1)), max_size=3),
        st.dictionaries(keys, st.deferred(lambda: _json_value(depth - 1)), max_size=5),
    )


def json_documents() -> st.SearchStrategy[str]:
    return st.fixed_dictionaries(
        {"discovery": _json_value(4)}, optional={"application": _json_value(1)}
    ).map(lambda d: json.dumps(d, ensure_ascii=True))


def toml_documents() -> st.SearchStrategy[str]:
    lines = st.sampled_from(
        [
            "[discovery]",
            "enabled = true",
            "enabled = 'yes'",
            "[discovery.connections.primary]",
            "provider = 'static'",
            "provider = 'etcd'",
            f"password = '{SECRET}'",
            "x = " + "9" * 5000,
            "[discovery.connections.primary.etcd]",
            "endpoints = ['http://127.0.0.1:2379']",
            f"endpoints = ['http://bob:{SECRET}@h:1']",
            "ttl_secs = 3",
            "a = 1\na = 2",
            "[[discovery.x]]",
            "when = 1979-05-27T07:32:00Z",
            "bad = ",
        ]
    )
    return st.lists(lines, max_size=8).map("\n".join)


def documents() -> st.SearchStrategy[tuple[str, str]]:
    return st.one_of(
        yaml_documents().map(lambda t: ("yaml", t)),
        json_documents().map(lambda t: ("json", t)),
        toml_documents().map(lambda t: ("toml", t)),
    )


def check(fmt: str, text: str) -> str:
    """Apply the property to one document; the outcome's label."""
    try:
        config = load_config(text, fmt)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert exc.path, "a ConfigError without a path"
        assert exc.path == "<document>" or not exc.path.startswith((".", "[")), exc.path
        texts = [str(exc), repr(exc), *(f"{p}: {m}" for p, m in exc.problems)]
        for message in texts:
            assert SECRET not in message, message
        return "ConfigError"
    assert isinstance(config, DiscoveryConfig)
    assert SECRET not in repr(config) or "'**********'" in repr(config)
    config.model_dump_json()  # every loaded config can be encoded
    return "loaded"


def run(examples: int, seed: int | None = None) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        suppress_health_check=list(HealthCheck),
    )
    @given(documents())
    def campaign(document: tuple[str, str]) -> None:
        fmt, text = document
        outcomes[f"{fmt}: {check(fmt, text)}"] += 1

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConfigWarning on literal placeholders
        campaign()
    return outcomes


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a hundred examples")
    parser.add_argument("--examples", type=int, default=10_000)
    args = parser.parse_args(argv)
    examples = 100 if args.smoke else max(args.examples, 1)
    started = time.perf_counter()
    outcomes = run(examples)
    elapsed = time.perf_counter() - started
    total = sum(outcomes.values())
    print(f"config fuzz: {total} documents in {elapsed:.1f} s")
    print(f"{'format: outcome':<24} {'documents':>10} {'share':>8}")
    for label, count in sorted(outcomes.items()):
        print(f"{label:<24} {count:>10} {count / total:>8.1%}")
    print(f"{'other exceptions':<24} {0:>10} {0:>8.1%}   (any would have failed the run)")
    return {"documents": float(total), "seconds": elapsed}


if __name__ == "__main__":
    main()
