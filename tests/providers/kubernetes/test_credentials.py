"""kubeconfig credentials as managed clusters write them: exec plugins, merged
KUBECONFIG lists, and server URLs that must not carry credentials.

The exec plugins are small Python scripts run by the real interpreter (the
protocol of the "client-go credential plugins" documentation: the
ExecCredential in KUBERNETES_EXEC_INFO in, one on stdout out).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access
from nadisc_kubernetes._exec import ExecPlugin, ExecTokenSource, credential_fresh, parse_answer

from nadisc import ConfigError, IdentityRevoked, IncompleteSnapshot
from tests.fakes.kubernetes import KubernetesFake, slice_object

from .conftest import context, endpoint, write_kubeconfig

SECRET = "exec-issued-token-0f9e8d"

PLUGIN = """
import json, os, sys, time
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
runs = os.environ["RUNS_FILE"]
with open(runs, "a") as f:
    f.write("x")
mode = os.environ.get("PLUGIN_MODE", "ok")
print("debug: the token is " + os.environ.get("SECRET", ""), file=sys.stderr)
if mode == "sleep":
    time.sleep(60)
if mode == "fail":
    sys.exit(3)
status = {"token": os.environ.get("SECRET", "") + str(len(open(runs).read()))}
if os.environ.get("EXPIRES"):
    status["expirationTimestamp"] = os.environ["EXPIRES"]
if mode == "cert":
    status = {"clientCertificateData": "x", "clientKeyData": "y"}
print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}))
"""


def plugin_kubeconfig(
    tmp_path: Path, server: str, *, mode: str = "ok", expires: str = "", **exec_extra: Any
) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script)],
            "env": [
                {"name": "RUNS_FILE", "value": str(tmp_path / "runs")},
                {"name": "PLUGIN_MODE", "value": mode},
                {"name": "SECRET", "value": SECRET},
                {"name": "EXPIRES", "value": expires},
            ],
            "interactiveMode": "Never",
            **exec_extra,
        }
    }
    return write_kubeconfig(tmp_path / "config", server, token=None, user=user)


def settings_for(config: Path, **extra: Any) -> KubernetesSettings:
    return KubernetesSettings.model_validate(
        {
            "credentials": "kubeconfig",
            "kubeconfig": str(config),
            "services": {"orders": {}},
            **extra,
        }
    )


def runs(tmp_path: Path) -> int:
    path = tmp_path / "runs"
    return len(path.read_text()) if path.exists() else 0


async def test_an_exec_plugin_token_is_cached_until_its_expiry(tmp_path: Path) -> None:
    expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    config = plugin_kubeconfig(tmp_path, "https://k8s.example", expires=expires)
    access = resolve_access(settings_for(config), {})
    assert runs(tmp_path) == 0  # nothing runs at resolve time
    tokens = access.tokens
    assert await tokens.fetch() == SECRET + "1"
    assert await tokens.fetch() == SECRET + "1"
    assert runs(tmp_path) == 1
    assert await tokens.refetch() and await tokens.fetch() == SECRET + "2"  # after a 401
    assert SECRET not in repr(access) and SECRET not in repr(tokens)


async def test_an_expired_exec_token_runs_the_plugin_again(tmp_path: Path) -> None:
    expires = (datetime.now(UTC) + timedelta(seconds=10)).isoformat()  # inside the margin
    config = plugin_kubeconfig(tmp_path, "https://k8s.example", expires=expires)
    tokens = resolve_access(settings_for(config), {}).tokens
    await tokens.fetch()
    await tokens.fetch()
    assert runs(tmp_path) == 2


@pytest.mark.parametrize(
    ("mode", "failure", "text"),
    [
        ("fail", IdentityRevoked, "exited with status 3"),
        ("cert", IdentityRevoked, "only a client certificate"),
        ("sleep", IncompleteSnapshot, "did not finish within 0.5s"),
    ],
)
async def test_exec_plugin_failures_are_typed_and_never_show_stderr(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    failure: type[Exception],
    text: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    config = plugin_kubeconfig(tmp_path, "https://k8s.example", mode=mode)
    # Only the sleeping plugin is meant to run out of time: the others (a
    # Python start, about 0.1 s here, seconds on a loaded machine) get 30 s.
    timeout = 0.5 if mode == "sleep" else 30.0
    tokens = resolve_access(settings_for(config, exec_timeout=timeout), {}).tokens
    with pytest.raises(failure, match=text) as caught:
        await tokens.fetch()
    assert SECRET not in str(caught.value)
    assert all(SECRET not in r.getMessage() for r in caplog.records)


async def test_the_provider_authenticates_with_an_exec_plugin(tmp_path: Path) -> None:
    fake = KubernetesFake(tokens={SECRET + "1": "alice"})
    uid = fake.create_service("orders")["metadata"]["uid"]
    fake.put_slice(slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid))
    config = plugin_kubeconfig(tmp_path, fake.url)
    settings = settings_for(config)
    provider = KubernetesProvider(
        context(), settings, access=resolve_access(settings, {}), transport=fake.transport()
    )
    try:
        listed = await provider.query("orders", anyio.current_time() + 30)
        assert listed.identities() == ("pod-1",)
        assert runs(tmp_path) == 1  # one run for both lists
        fake.tokens = {SECRET + "2": "alice"}  # the old token is refused: one more run
        assert (await provider.query("orders", anyio.current_time() + 30)).identities()
        assert runs(tmp_path) == 2
    finally:
        await provider.aclose()


def test_exec_blocks_are_validated_when_read(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"interactiveMode": "Always"}, "needs a terminal"),
        ({"apiVersion": "client.authentication.k8s.io/v1alpha1"}, "v1alpha1 was removed"),
        ({"args": "not-a-list"}, "list of strings"),
        ({"env": [{"name": "A"}]}, r"env\[0\]"),
    ]
    for extra, problem in cases:
        config = plugin_kubeconfig(tmp_path, "https://k8s.example", **extra)
        with pytest.raises(ConfigError, match=problem):
            resolve_access(settings_for(config), {})


@given(
    expires=st.one_of(st.none(), st.floats(-1e9, 1e9)),
    now=st.floats(-1e9, 1e9),
    margin=st.floats(0, 1000),
)
def test_a_credential_is_fresh_only_before_its_expiry_minus_the_margin(
    expires: float | None, now: float, margin: float
) -> None:
    fresh = credential_fresh(expires, now, margin=margin)
    assert fresh == (expires is None or now < expires - margin)


def test_an_answer_of_another_version_or_shape_is_refused() -> None:
    plugin = ExecPlugin("client.authentication.k8s.io/v1", "/bin/plugin")
    good = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "status": {"token": "t"}}
    assert parse_answer(plugin, json.dumps(good).encode()) == ("t", None)
    for bad in (
        b"not json",
        b"[" * 100_000,
        json.dumps({**good, "apiVersion": "client.authentication.k8s.io/v1beta1"}).encode(),
        json.dumps({**good, "status": {"token": "t", "expirationTimestamp": "soon"}}).encode(),
        json.dumps(
            {**good, "status": {"token": "t", "expirationTimestamp": "2026-01-01T00:00:00"}}
        ).encode(),
    ):
        with pytest.raises(IdentityRevoked):
            parse_answer(plugin, bad)
    source = ExecTokenSource(plugin, timeout=1)
    assert "plugin" in repr(source) and source.current() is None


# -- merged KUBECONFIG ---------------------------------------------------------------------------


def test_a_kubeconfig_list_is_merged_as_kubectl_merges_it(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (second / "token").write_text("from-b")
    (first / "config").write_text(
        yaml.safe_dump(
            {
                "current-context": "prod",
                "contexts": [{"name": "prod", "context": {"cluster": "prod", "user": "ops"}}],
                "clusters": [{"name": "prod", "cluster": {"server": "https://first:6443"}}],
            }
        )
    )
    (second / "config").write_text(
        yaml.safe_dump(
            {
                "current-context": "other",  # the first file's current-context wins
                "clusters": [{"name": "prod", "cluster": {"server": "https://second:6443"}}],
                "users": [{"name": "ops", "user": {"tokenFile": "token"}}],
            }
        )
    )
    listed = os.pathsep.join(
        [str(first / "config"), str(tmp_path / "missing"), str(second / "config")]
    )
    access = resolve_access(KubernetesSettings.model_validate({}), {"KUBECONFIG": listed})
    assert access.server == "https://first:6443"  # the first file to name a cluster wins
    assert access.tokens.current() == "from-b"  # relative to the file that named the user
    with pytest.raises(ConfigError, match="none of the KUBECONFIG files exist"):
        resolve_access(
            KubernetesSettings.model_validate({}),
            {"KUBECONFIG": os.pathsep.join([str(tmp_path / "x"), str(tmp_path / "y")])},
        )


@pytest.mark.parametrize(
    "server",
    [
        "https://admin:hunter2@k8s.example:6443",
        "https://k8s.example:6443/?token=hunter2",
        "https://k8s.example:6443/#hunter2",
        "https://k8s.example:notaport",
        "ftp://k8s.example",
        # Dialled as something else than written: port 0, the default port
        # for a bare ':', the unspecified address.
        "https://k8s.example:0",
        "https://k8s.example:",
        "https://0.0.0.0:6443",
        "https://[::]:6443",
    ],
)
def test_a_server_url_with_credentials_is_refused_without_echoing_it(
    tmp_path: Path, server: str
) -> None:
    config = write_kubeconfig(tmp_path / "config", server)
    with pytest.raises(ConfigError) as caught:
        resolve_access(settings_for(config), {})
    assert caught.value.path == "kubeconfig clusters[fake].server"
    assert "hunter2" not in str(caught.value)
