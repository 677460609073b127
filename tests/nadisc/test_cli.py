"""The ``nadisc`` command: the host that expands ${VARS} before validation."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from nadisc import ConfigError
from nadisc._cli import expand_variables, main

CONFIG = """\
discovery:
  enabled: true
  connections:
    primary:
      provider: static
      static:
        services:
          orders:
            - {host: "${ORDERS_HOST}", port: 8080}
            - {host: "${OTHER_HOST:-10.0.0.9}", port: 8081, id: second}
"""


def run(argv: list[str], environ: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, environ=environ or {}, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_expand_variables_rules() -> None:
    env = {"A": "alpha", "EMPTY": ""}
    doc = {"x": "${A}-${B:-beta}", "y": ["$${A}", "${EMPTY:-fallback}"], "n": 3, "k": {"z": "${A}"}}
    assert expand_variables(doc, env) == {
        "x": "alpha-beta",
        "y": ["${A}", "fallback"],
        "n": 3,
        "k": {"z": "alpha"},
    }


def test_missing_variable_names_path_and_variable_not_values() -> None:
    with pytest.raises(ConfigError) as info:
        expand_variables({"discovery": {"pw": "${SECRET_PW}"}}, {"OTHER": "hunter2"})
    assert info.value.path == "discovery.pw"
    assert "SECRET_PW" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_malformed_reference_is_an_error() -> None:
    with pytest.raises(ConfigError, match="malformed"):
        expand_variables({"a": "${UNTERMINATED"}, {})


def test_check_expands_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG)
    status, out, err = run(["check", str(path)], {"ORDERS_HOST": "10.0.0.1"})
    assert (status, err) == (0, "")
    assert "connection primary: provider static" in out
    assert out.endswith("ok\n")


def test_check_reports_missing_variable(tmp_path: Path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG)
    status, _, err = run(["check", str(path)])
    assert status == 2
    assert "ORDERS_HOST" in err
    assert "discovery.connections.primary.static.services.orders[0].host" in err


def test_check_reports_invalid_config_with_path(tmp_path: Path) -> None:
    path = tmp_path / "app.json"
    path.write_text(
        json.dumps(
            {
                "discovery": {
                    "enabled": True,
                    "connections": {
                        "primary": {"provider": "static", "static": {"services": {}}, "bogus": 1}
                    },
                }
            }
        )
    )
    status, _, err = run(["check", str(path)])
    assert status == 2
    assert "discovery.connections.primary.bogus" in err


def test_schema_is_json() -> None:
    status, out, _ = run(["schema"])
    assert status == 0
    schema = json.loads(out)
    assert "properties" in schema and "connections" in schema["properties"]


def test_observe_prints_instances(tmp_path: Path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG)
    status, out, err = run(["observe", str(path), "orders"], {"ORDERS_HOST": "10.0.0.1"})
    assert (status, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["address"] for r in rows] == ["10.0.0.1:8080", "10.0.0.9:8081"]
    assert {r["evidence"] for r in rows} == {"static_fact"}


def test_observe_unknown_service_fails_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG)
    status, _, err = run(["observe", str(path), "nope"], {"ORDERS_HOST": "10.0.0.1"})
    assert status == 1
    assert "nope" in err


DNS_CONFIG = """\
discovery:
  enabled: true
  connections:
    edge:
      provider: dns
      dns:
        nameservers: ["10.0.0.2"]
        services:
          billing: {host: billing.internal.example, port: 8443}
      snapshot: {max_age_ms: 15000, stale_if_error_ms: GRACE}
"""


@pytest.mark.parametrize("grace", [0, 10000])
def test_check_warns_about_the_fail_closed_default_on_a_calling_connection(
    tmp_path: Path, grace: int
) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(DNS_CONFIG.replace("GRACE", str(grace)))
    status, out, err = run(["check", str(path)])
    assert status == 0 and out.endswith("ok\n")
    if grace:
        assert err == ""
    else:
        assert err == (
            "nadisc: warning: connections.edge.snapshot.stale_if_error_ms: 0 (the default) "
            "fails calls to billing as soon as a refresh fails (a registry outage becomes a "
            "caller outage); production callers usually set a grace, e.g. 10000 "
            "(docs/calling.md)\n"
        )


def test_check_does_not_warn_for_static_connections(tmp_path: Path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG)
    assert run(["check", str(path)], {"ORDERS_HOST": "10.0.0.1"})[2] == ""


@pytest.mark.parametrize("text", ["127.0.0.1:\u00b2", "127.0.0.1:", ":8080", "127.0.0.1:70000"])
def test_a_console_bind_that_is_not_host_port_is_a_config_error(text: str) -> None:
    from nadisc.observability._commands import _bind

    # A superscript two passes str.isdigit() and then fails int(): the error
    # must still be the typed one that names the option.
    with pytest.raises(ConfigError) as caught:
        _bind(text)
    assert caught.value.path == "--bind"
