"""``nadisc check`` refuses the kubeconfigs ``open_discovery`` refuses, and a
registration on a kubernetes connection is refused when the config is read."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from nadisc import ConfigError, parse_config
from nadisc._cli import main

from .conftest import write_kubeconfig


def config_file(tmp_path: Path, kubeconfig: Path, **extra: Any) -> Path:
    document = {
        "discovery": {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "kubernetes",
                    # A production grace, so that `check` has nothing to say
                    # about the fail-closed default (stale_if_error_ms: 0).
                    "snapshot": {"stale_if_error_ms": 20000, "max_age_ms": 60000},
                    "kubernetes": {
                        "credentials": "kubeconfig",
                        "kubeconfig": str(kubeconfig),
                        "services": {"orders": {"port": "http"}},
                    },
                }
            },
            **extra,
        }
    }
    path = tmp_path / "discovery.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def check(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(["check", str(path)], environ={}, out=out, err=err)
    return status, err.getvalue()


def test_a_good_kubeconfig_passes(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://10.1.2.3:6443")
    assert check(config_file(tmp_path, kubeconfig)) == (0, "")


@pytest.mark.parametrize(
    ("user", "problem"),
    [
        (
            {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}},
            "interactiveMode",
        ),
        ({"auth-provider": {"name": "oidc"}}, "auth-provider"),
        ({"username": "admin", "password": "hunter2"}, "basic authentication"),
        ({"client-certificate-data": "!!!", "client-key-data": "eA=="}, "not valid base64"),
        ({"token": 12345}, "token: must be a string"),
    ],
)
def test_check_refuses_what_open_discovery_refuses(
    tmp_path: Path, user: dict[str, Any], problem: str
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://k:6443", token=None, user=user)
    status, err = check(config_file(tmp_path, kubeconfig))
    assert status == 2 and problem in err
    assert "discovery.connections.primary.kubernetes" in err
    assert "hunter2" not in err and "12345" not in err


def test_check_refuses_a_kubeconfig_that_is_not_yaml(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("clusters: [unclosed\n")
    status, err = check(config_file(tmp_path, kubeconfig))
    assert status == 2 and "is not valid YAML" in err


def test_a_registration_on_a_kubernetes_connection_is_refused_when_read(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://10.1.2.3:6443")
    registrations = {"self": {"service_name": "orders", "ip": "10.0.0.5", "port": 8080}}
    path = config_file(tmp_path, kubeconfig, registrations=registrations)
    status, err = check(path)
    assert status == 2
    assert "discovery.registrations.self.qualifier" in err and "cannot register" in err
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_load(path.read_text()))
    assert caught.value.path == "discovery.registrations.self.qualifier"
