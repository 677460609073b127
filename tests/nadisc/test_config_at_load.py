"""Validation at load: provider blocks, the root, every problem at once,
``${VAR}`` expansion, and documents that used to escape as raw exceptions."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest

import nadisc
from nadisc import ConfigError, ConfigWarning, expand_variables, load_config, parse_config
from nadisc._cli import main

from .config_support import UNINSTALLED


def run(argv: list[str], environ: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, environ=environ or {}, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def etcd_doc(block: str, extra: str = "") -> str:
    return (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: etcd\n"
        f"{extra}      etcd:\n{block}"
    )


GOOD_ETCD = "        endpoints: [http://127.0.0.1:2379]\n"


# ----------------------------------------------------------------- provider blocks at load


@pytest.mark.parametrize(
    ("block", "path", "words"),
    [
        (GOOD_ETCD + "        ttl_secs: 5\n", "etcd.ttl_secs", "did you mean 'ttl_seconds'"),
        (GOOD_ETCD + "        ttl_seconds: -5\n", "etcd.ttl_seconds", "greater than or equal"),
        ("        endpoints: [http://bob:hunter2@e:2379]\n", "etcd.endpoints", "credentials"),
        ("        prefix: x\n", "etcd.endpoints", "Field required"),
    ],
)
def test_the_installed_providers_model_validates_its_block_at_load(
    block: str, path: str, words: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(etcd_doc(block))
    assert info.value.path == f"discovery.connections.primary.{path}"
    assert words in info.value.detail
    assert "hunter2" not in str(info.value)
    # the command refuses the same document, instead of printing ok
    file = tmp_path / "app.yaml"
    file.write_text(etcd_doc(block))
    status, out, err = run(["check", str(file)])
    assert status == 2 and "ok" not in out
    assert f"discovery.connections.primary.{path}" in err and "hunter2" not in err


def test_consul_block_is_validated_at_load() -> None:
    doc = (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: consul\n"
        "      consul: {url: 'http://127.0.0.1:8500', wiat: 5}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.path == "discovery.connections.primary.consul.wiat"
    assert "did you mean 'wait'" in info.value.detail


def test_check_refuses_an_unknown_provider_but_the_library_defers_it(tmp_path: Path) -> None:
    doc = f"discovery:\n  enabled: true\n  connections:\n    primary: {{provider: {UNINSTALLED}}}\n"
    assert load_config(doc).connections["primary"].provider == UNINSTALLED  # owner reports it
    with pytest.raises(ConfigError, match="no provider of this name is installed"):
        load_config(doc, require_providers=True)
    file = tmp_path / "app.yaml"
    file.write_text(doc)
    status, out, err = run(["check", str(file)])
    assert status == 2 and out == ""
    assert "discovery.connections.primary.provider" in err and "installed: " in err
    assert UNINSTALLED not in err  # config values are not echoed


@pytest.mark.parametrize(
    ("text", "path", "hint"),
    [
        ("discvery:\n  enabled: true\n", "discvery", "did you mean 'discovery'"),
        ("Discovery:\n  enabled: true\n", "Discovery", "did you mean 'discovery'"),
        ("", "discovery", "no 'discovery' root"),
        ("application: {name: x}\n", "discovery", "no 'discovery' root"),
    ],
)
def test_check_refuses_a_missing_or_misspelt_root(
    text: str, path: str, hint: str, tmp_path: Path
) -> None:
    file = tmp_path / "app.yaml"
    file.write_text(text)
    status, out, err = run(["check", str(file)])
    assert (status, out) == (2, "")
    assert f"config error: {path}: " in err and hint in err


def test_the_library_refuses_a_misspelt_root_and_allows_a_missing_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'discovery'"):
        load_config("discvery:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="did you mean 'discovery'"):
        parse_config({"DISCOVERY": {"enabled": True}})
    assert load_config("").enabled is False  # a library host without discovery
    with pytest.raises(ConfigError, match="no 'discovery' root"):
        load_config("", require_root=True)


def test_every_problem_of_a_document_is_reported_at_once(tmp_path: Path) -> None:
    text = etcd_doc(GOOD_ETCD + "        ttl_secs: 5\n", extra="      request_timeout_ms: -1\n") + (
        "    files: {provider: static, static: {services: {x: [{host: h, port: 0}]}}}\n"
        "  registrations:\n"
        "    r: {qualifier: primary, service_name: nope, ip: 10.0.0.1, port: 80}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    paths = [path for path, _ in info.value.problems]
    assert paths == [
        "discovery.connections.primary.request_timeout_ms",
        "discovery.connections.files.static.services.x[0].port",
        "discovery.connections.primary.etcd.ttl_secs",
    ]
    file = tmp_path / "app.yaml"
    file.write_text(text)
    status, _, err = run(["check", str(file)])
    assert status == 2
    assert [line.split(": ")[2] for line in err.splitlines()] == paths


def test_load_config_refuses_a_mapping_by_naming_parse_config() -> None:
    with pytest.raises(TypeError, match="parse_config"):
        load_config({"discovery": {"enabled": True}})  # type: ignore[arg-type]


def test_schema_command_includes_provider_blocks_with_descriptions() -> None:
    status, out, _ = run(["schema"])
    assert status == 0
    schema = json.loads(out)
    connection = schema["$defs"]["ConnectionConfig"]["properties"]
    for provider in ("etcd", "consul", "static", "dns"):
        assert connection[provider]["description"]
    assert schema["$defs"]["etcd.EtcdSettings"]["properties"]["ttl_seconds"]["description"]


# ----------------------------------------------------------------- ${VAR} expansion


def test_a_whole_placeholder_takes_the_type_of_its_expansion() -> None:
    env = {"PORT": "8080", "ON": "true", "WEIGHT": "2.5", "HOST": "10.0.0.1", "PW": "12345"}
    doc = {
        "port": "${PORT}",
        "enabled": "${ON}",
        "weight": "${WEIGHT}",
        "host": "${HOST}",
        "label": "port-${PORT}",
        "password": "${PW}",
        "auth": {"token": "${PORT}"},
        "fallback": "${MISSING:-7}",
        "literal": "$${PORT}",
    }
    assert expand_variables(doc, env) == {
        "port": 8080,
        "enabled": True,
        "weight": 2.5,
        "host": "10.0.0.1",
        "label": "port-8080",
        "password": "12345",  # secret-looking keys stay text
        "auth": {"token": "8080"},
        "fallback": 7,
        "literal": "${PORT}",
    }
    assert nadisc._cli.expand_variables is nadisc.expand_variables  # the old import still works


def test_port_from_a_variable_loads(tmp_path: Path) -> None:
    text = (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: static\n"
        "      static: {services: {orders: [{host: '${HOST}', port: '${PORT}'}]}}\n"
        "      poll_interval_ms: ${POLL}\n"
    )
    env = {"HOST": "10.1.2.3", "PORT": "8080", "POLL": "4000"}
    config = load_config(text, environ=env)
    connection = config.connections["primary"]
    assert connection.poll_interval_ms == 4000
    assert connection.static is not None
    assert connection.static.services["orders"][0].port == 8080
    file = tmp_path / "app.yaml"
    file.write_text(text)
    assert nadisc.load_config_file(file, environ=env) == config
    status, out, err = run(["check", str(file)], env)
    assert (status, err) == (0, "") and out.endswith("ok\n")


def test_a_literal_placeholder_in_a_secret_field_warns_unless_expanded(tmp_path: Path) -> None:
    block = GOOD_ETCD + "        username: app\n        password: ${ETCD_PASSWORD}\n"
    file = tmp_path / "app.yaml"
    file.write_text(etcd_doc(block))
    with pytest.warns(ConfigWarning, match=r"discovery\.connections\.primary\.etcd\.password"):
        config = nadisc.load_config_file(file)
    assert "${ETCD_PASSWORD}" not in repr(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expanded = nadisc.load_config_file(file, environ={"ETCD_PASSWORD": "from-env"})
    block_values = nadisc.provider_block(expanded.connections["primary"])
    assert block_values.thaw()["password"] == "from-env"  # type: ignore[attr-defined]
    assert "from-env" not in repr(expanded)


# ----------------------------------------------------------------- hostile scalars


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("discovery:\n  enabled: !!bool abc\n", "discovery.enabled"),
        ("discovery:\n  when: 2001-13-45\n", "discovery.when"),
        ("discovery:\n  when: !!timestamp abc\n", "discovery.when"),
        ("discovery:\n  x: !!float ''\n", "discovery.x"),
        ("discovery:\n  x: !!int ''\n", "discovery.x"),
        ("discovery:\n  password: !!int hunter2\n", "discovery.password"),
        ("discovery:\n  blob: !!binary '*'\n", "discovery.blob"),
        ("discovery:\n  list: [1, !!float x]\n", "discovery.list[1]"),
    ],
)
def test_yaml_constructor_failures_are_config_errors_with_a_path(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == path
    assert "hunter2" not in str(info.value) and "abc" not in str(info.value)


def test_toml_over_long_integer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="TOML") as info:
        load_config("[discovery]\nx = " + "9" * 5000 + "\n", "toml")
    assert "9999" not in str(info.value)


def test_yaml_base_60_numbers_are_not_durations() -> None:
    text = "discovery:\n  enabled: true\n  shutdown_timeout_ms: 190:20:30\n"
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.path == "discovery.shutdown_timeout_ms"
    assert load_config("discovery:\n  enabled: true\n  shutdown_timeout_ms: 1_000\n")


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ('{"discovery": {"enabled": true, "default_connection": "\\ud800"}}', "json"),
        ('discovery:\n  enabled: true\n  "\\ud800": 1\n', "yaml"),
    ],
)
def test_lone_surrogates_are_refused(text: str, fmt: str) -> None:
    with pytest.raises(ConfigError, match="surrogate") as info:
        load_config(text, fmt)  # type: ignore[arg-type]
    assert info.value.path.startswith("discovery")


# ----------------------------------------------------------------- published metadata


def registration_doc(metadata: str, extra: str = "") -> str:
    return (
        "discovery:\n  enabled: true\n  connections:\n    primary:\n      provider: etcd\n"
        "      etcd: {endpoints: ['http://127.0.0.1:2379'], services: {self: {name: api}}}\n"
        "  registrations:\n    web:\n      service_name: self\n      ip: 10.0.0.5\n"
        f"      port: 8080\n      metadata: {metadata}\n{extra}"
    )


@pytest.mark.parametrize("key", ["db_password", "api_key", "authToken", "client-secret"])
def test_secret_looking_registration_metadata_is_refused(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(registration_doc(f"{{{key}: hunter2, zone: a}}"))
    assert info.value.path == f"discovery.registrations.web.metadata.{key}"
    assert "hunter2" not in str(info.value)


def test_secret_looking_metadata_can_be_published_explicitly() -> None:
    config = load_config(
        registration_doc(
            "{public_key: ssh-ed25519-AAAA, zone: a}",
            "      publish_secret_looking_metadata: [public_key]\n",
        )
    )
    assert config.registrations["web"].metadata["public_key"] == "ssh-ed25519-AAAA"
    assert load_config(registration_doc("{zone: a, version: '2'}")).registrations["web"]
