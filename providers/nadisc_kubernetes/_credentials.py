"""Where the API server is and how to authenticate: in-cluster or a kubeconfig.

Contract: :func:`resolve_access` turns the settings (plus the environment
and files, read once, when the provider is created) into a
:class:`ClusterAccess`, or raises :class:`~nadisc.ConfigError` naming the
setting or kubeconfig entry that is wrong. Secrets (tokens, key material)
never appear in a ``repr``, a log line or an error message.

::

    credentials: in_cluster   https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT_HTTPS
                              <root>/token (re-read), <root>/ca.crt, <root>/namespace
    credentials: kubeconfig   current-context (or ``context``) -> cluster + user
                              user: token | tokenFile | client-certificate(-data)/key
                                    | exec (client.authentication.k8s.io/v1, v1beta1)
                              auth-provider, basic auth -> ConfigError (not supported)
                              $KUBECONFIG lists several files: merged as kubectl does
                              (the first file to set a name or current-context wins)
    credentials: auto         in_cluster if KUBERNETES_SERVICE_HOST is set, else kubeconfig

:class:`TokenSource` holds the bearer token. A token file is re-read by path
whenever its identity (inode, size, mtime) changes — projected
service-account tokens rotate by an atomic symlink swap — and once more,
unconditionally, after a 401; it is never kept open. Cost: one ``stat`` per
request.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from nadisc import ConfigError, tls_context_for
from nadisc._config import empty_port, undialable

from ._exec import API_VERSIONS, ExecPlugin, ExecTokenSource
from ._settings import KubernetesSettings

__all__ = ["ClusterAccess", "TokenSource", "resolve_access"]

_PREFIX = "kubernetes"


def _problem(field_name: str, message: str) -> ConfigError:
    return ConfigError(f"{_PREFIX}.{field_name}", message)


class TokenSource:
    """The bearer token: fixed, or read from a file by path (see the module docstring)."""

    __slots__ = ("_fixed", "_path", "_stamp", "_token", "reads")

    def __init__(self, *, token: str | None = None, path: str | None = None) -> None:
        self._fixed = token
        self._path = path
        self._token: str | None = token
        self._stamp: tuple[int, int, int] | None = None
        #: How many times the file was read.
        self.reads = 0

    def __repr__(self) -> str:
        kind = "file" if self._path else "fixed" if self._fixed else "none"
        return f"<TokenSource {kind}>"

    @property
    def path(self) -> str | None:
        return self._path

    def _read(self) -> None:
        assert self._path is not None
        try:
            stat = os.stat(self._path)
            text = Path(self._path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"{_PREFIX}.token_file", f"cannot read the token file: {exc.strerror}"
            ) from None
        self._stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        self._token = text or None
        self.reads += 1

    def current(self) -> str | None:
        """The token to send now (re-reading the file when it changed)."""
        if self._path is not None:
            try:
                stat = os.stat(self._path)
                stamp: tuple[int, int, int] | None = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            except OSError:
                stamp = None
            if stamp is None or stamp != self._stamp:
                self._read()
        return self._token

    def reload(self) -> bool:
        """Re-read the file now (after a 401). False when there is no file."""
        if self._path is None:
            return False
        self._read()
        return True

    async def fetch(self) -> str | None:
        """:meth:`current`, for the HTTP shell (an exec plugin's source runs a command)."""
        return self.current()

    async def refetch(self) -> bool:
        """:meth:`reload`, for the HTTP shell."""
        return self.reload()


@dataclass(frozen=True, slots=True)
class ClusterAccess:
    """The resolved API server address, TLS material and credentials."""

    server: str
    namespace: str
    tokens: TokenSource | ExecTokenSource = field(repr=False)
    ca_file: str | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    insecure: bool = False
    client_cert: tuple[bytes, bytes] | None = field(default=None, repr=False)
    tls_server_name: str | None = None
    #: Where it came from, for messages: "in-cluster" or "kubeconfig <path> context <name>".
    origin: str = ""

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of this cluster's server.

        A configured CA (file or data) is the only one trusted, as kubectl
        does; without one, the default trust store (the process's shared
        context, unless a client certificate or ``insecure`` needs a context
        of its own). A plain-http server gets a context that trusts nothing
        and loads nothing (loading a bundle holds the event loop).
        """
        no_ca = self.ca_file is None and self.ca_data is None
        if not self.server.startswith("https://") or (
            no_ca and self.client_cert is None and not self.insecure
        ):
            return tls_context_for([self.server])
        if no_ca:
            context = ssl.create_default_context()
        else:
            try:
                if self.ca_file is not None:
                    context = ssl.create_default_context(cafile=self.ca_file)
                else:
                    assert self.ca_data is not None
                    context = ssl.create_default_context(cadata=self.ca_data.decode("ascii"))
            except (OSError, ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
                raise _problem(
                    "ca_file", f"cannot load the CA bundle ({type(exc).__name__})"
                ) from None
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert is not None:
            _load_client_cert(context, *self.client_cert)
        return context


def _load_client_cert(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl only loads key material from files: a private temporary directory,
    # removed as soon as the context holds the key.
    with tempfile.TemporaryDirectory(prefix="nadisc-k8s-") as folder:
        cert_path, key_path = Path(folder, "client.crt"), Path(folder, "client.key")
        for path, data in ((cert_path, cert), (key_path, key)):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
        try:
            context.load_cert_chain(str(cert_path), str(key_path))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                "kubeconfig users[].user.client-certificate",
                f"cannot load the client certificate and key ({type(exc).__name__})",
            ) from None


def resolve_access(
    settings: KubernetesSettings, environ: Mapping[str, str] | None = None
) -> ClusterAccess:
    """Resolve ``settings`` to a :class:`ClusterAccess` (reads files once)."""
    env = os.environ if environ is None else environ
    mode = settings.credentials
    if mode == "auto":
        mode = "in_cluster" if env.get("KUBERNETES_SERVICE_HOST") else "kubeconfig"
    access = _in_cluster(settings, env) if mode == "in_cluster" else _kubeconfig(settings, env)
    return access


def _host_port(host: str, port: str) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"{host}:{port}"


def _in_cluster(settings: KubernetesSettings, env: Mapping[str, str]) -> ClusterAccess:
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT_HTTPS") or env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise _problem(
            "credentials",
            "in_cluster needs KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT(_HTTPS) "
            "(a port in 1-65535) in the environment (they are set inside a pod)",
        )
    root = Path(settings.in_cluster_root)
    token_path = root / "token"
    if not token_path.is_file():
        raise _problem("in_cluster_root", f"no service-account token at {token_path}")
    tokens = TokenSource(path=str(token_path))
    tokens.current()
    ca = root / "ca.crt"
    namespace = settings.namespace
    if namespace is None:
        try:
            namespace = (root / "namespace").read_text(encoding="utf-8").strip() or "default"
        except OSError:
            namespace = "default"
    return ClusterAccess(
        server=f"https://{_host_port(host, port)}",
        namespace=namespace,
        tokens=tokens,
        ca_file=settings.ca_file or (str(ca) if ca.is_file() else None),
        tls_server_name=settings.tls_server_name,
        origin="in-cluster",
    )


def _kubeconfig_paths(settings: KubernetesSettings, env: Mapping[str, str]) -> list[Path]:
    if settings.kubeconfig is not None:
        return [Path(settings.kubeconfig).expanduser()]
    listed = [Path(e).expanduser() for e in env.get("KUBECONFIG", "").split(os.pathsep) if e]
    if listed:
        return listed
    return [Path(env.get("HOME", str(Path.home()))) / ".kube" / "config"]


def _read_document(path: Path) -> Mapping[str, Any]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _problem("kubeconfig", f"cannot read {path}: {exc.strerror}") from None
    except (yaml.YAMLError, RecursionError):
        raise _problem("kubeconfig", f"{path} is not valid YAML") from None
    except UnicodeDecodeError:
        raise _problem("kubeconfig", f"{path} is not UTF-8 text") from None
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise _problem("kubeconfig", f"{path} is not a kubeconfig mapping")
    return document


_Origins = dict[tuple[str, str], Path]


def _merged(
    paths: list[Path], explicit: bool
) -> tuple[dict[str, Any], dict[tuple[str, str], Path]]:
    """kubectl's merge of a ``KUBECONFIG`` list (client-go clientcmd loader):
    files that do not exist are skipped; for every named cluster, user and
    context, and for current-context, the first file that sets it wins.
    Returns the merged document and, per (section, name), the file it came
    from (relative paths resolve against that file's folder)."""
    merged: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    origin: _Origins = {}
    found = False
    for path in paths:
        if not explicit and len(paths) > 1 and not path.exists():
            continue
        document = _read_document(path)
        found = True
        if "current-context" not in merged and document.get("current-context"):
            merged["current-context"] = document["current-context"]
        for section in ("clusters", "users", "contexts"):
            entries = document.get(section)
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                    continue
                key = (section, entry["name"])
                if key not in origin:
                    origin[key] = path
                    merged[section].append(entry)
    if not found:
        raise _problem("kubeconfig", f"none of the KUBECONFIG files exist ({len(paths)} listed)")
    return merged, origin


def _named(entries: Any, name: str, what: str) -> Mapping[str, Any]:
    if isinstance(entries, list):
        for entry in entries:
            if isinstance(entry, Mapping) and entry.get("name") == name:
                body = entry.get(what)
                if isinstance(body, Mapping):
                    return body
                raise ConfigError(f"kubeconfig {what}s[{name}]", f"has no {what} mapping")
    raise ConfigError(f"kubeconfig {what}s", f"no {what} named {name!r}")


def _material(
    base: Path, block: Mapping[str, Any], key: str, where: str
) -> tuple[bytes | None, str | None]:
    """(inline data, file path) of ``key`` / ``key-data``; paths relative to the file."""
    data = block.get(f"{key}-data")
    if data is not None:
        try:
            return base64.b64decode(str(data), validate=True), None
        except (binascii.Error, ValueError):
            raise ConfigError(f"{where}.{key}-data", "is not valid base64") from None
    path = block.get(key)
    if path is None:
        return None, None
    resolved = Path(str(path)).expanduser()
    if not resolved.is_absolute():
        resolved = base / resolved
    return None, str(resolved)


def _read_bytes(path: str, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(where, f"cannot read {path}: {exc.strerror}") from None


def _check_server(server: Any, where: str) -> str:
    if not isinstance(server, str):
        raise ConfigError(f"{where}.server", "must be an http(s) URL")
    try:
        parts = urlsplit(server)
        port = parts.port  # raises for a port that is not a number
    except ValueError:
        raise ConfigError(f"{where}.server", "is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.server", "must be an http(s) URL")
    if port is None and empty_port(server):
        # ":" and nothing after it: the scheme's default port (443) would be
        # dialled silently.
        raise ConfigError(f"{where}.server", "has ':' after the host but no port")
    problem = undialable(parts.hostname, port)
    if problem is not None:
        raise ConfigError(f"{where}.server", problem)
    # Credentials in the URL would be shown wherever the URL is (reprs,
    # httpx's request log) and make httpx send Basic instead of the token.
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{where}.server",
            "must not carry credentials (user:password@): put them in the users entry",
        )
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{where}.server",
            "must not carry a query or fragment (a ?token= would be logged with every request)",
        )
    return server


def _exec_plugin(block: Any, where: str) -> ExecPlugin:
    where = f"{where}.exec"
    if not isinstance(block, Mapping):
        raise ConfigError(where, "must be a mapping")
    version = block.get("apiVersion")
    if version not in API_VERSIONS:
        raise ConfigError(
            f"{where}.apiVersion",
            f"must be one of {', '.join(API_VERSIONS)} (v1alpha1 was removed in Kubernetes 1.24)",
        )
    command = block.get("command")
    if not isinstance(command, str) or not command:
        raise ConfigError(f"{where}.command", "must be a non-empty string")
    args = block.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args", "must be a list of strings")
    env_entries = block.get("env") or []
    env: list[tuple[str, str]] = []
    if not isinstance(env_entries, list):
        raise ConfigError(f"{where}.env", "must be a list of {name, value}")
    for index, item in enumerate(env_entries):
        if (
            not isinstance(item, Mapping)
            or not isinstance(item.get("name"), str)
            or not isinstance(item.get("value"), str)
        ):
            raise ConfigError(f"{where}.env[{index}]", "must be {name: string, value: string}")
        env.append((item["name"], item["value"]))
    mode = block.get("interactiveMode")
    if version.endswith("/v1") and mode is None:
        raise ConfigError(f"{where}.interactiveMode", "is required by apiVersion v1")
    if mode not in (None, "Never", "IfAvailable", "Always"):
        raise ConfigError(f"{where}.interactiveMode", "must be Never, IfAvailable or Always")
    if mode == "Always":
        raise ConfigError(
            f"{where}.interactiveMode",
            "Always needs a terminal; a discovery client never runs a plugin interactively",
        )
    return ExecPlugin(version, command, tuple(args), tuple(env), where)


def _kubeconfig(settings: KubernetesSettings, env: Mapping[str, str]) -> ClusterAccess:
    paths = _kubeconfig_paths(settings, env)
    document, origin = _merged(paths, explicit=settings.kubeconfig is not None)
    path = paths[0] if len(paths) == 1 else Path(os.pathsep.join(str(p) for p in paths))
    context_name = settings.context or document.get("current-context")
    if not context_name:
        raise _problem("context", f"{path} has no current-context; name one with context")
    context = _named(document.get("contexts"), str(context_name), "context")
    cluster_name, user_name = context.get("cluster"), context.get("user")
    if not cluster_name:
        raise ConfigError(f"kubeconfig contexts[{context_name}]", "names no cluster")
    cluster = _named(document.get("clusters"), str(cluster_name), "cluster")
    user: Mapping[str, Any] = (
        _named(document.get("users"), str(user_name), "user") if user_name else {}
    )
    where_cluster = f"kubeconfig clusters[{cluster_name}]"
    where_user = f"kubeconfig users[{user_name}]"
    server = _check_server(cluster.get("server"), where_cluster)
    if "auth-provider" in user:
        raise ConfigError(
            f"{where_user}.auth-provider",
            "auth-provider plugins are not supported; use a token, a tokenFile, an exec "
            "plugin or a client certificate",
        )
    if "username" in user or "password" in user:
        raise ConfigError(f"{where_user}.username", "basic authentication is not supported")
    base = origin.get(("clusters", str(cluster_name)), paths[0]).parent
    user_base = origin.get(("users", str(user_name)), paths[0]).parent
    ca_data, ca_path = _material(base, cluster, "certificate-authority", where_cluster)
    cert_data, cert_path = _material(user_base, user, "client-certificate", where_user)
    key_data, key_path = _material(user_base, user, "client-key", where_user)
    client: tuple[bytes, bytes] | None = None
    if (cert_data or cert_path) and (key_data or key_path):
        cert = cert_data or _read_bytes(str(cert_path), f"{where_user}.client-certificate")
        key = key_data or _read_bytes(str(key_path), f"{where_user}.client-key")
        client = (cert, key)
    elif cert_data or cert_path or key_data or key_path:
        raise ConfigError(
            f"{where_user}.client-certificate", "a client certificate needs its client-key"
        )
    token = user.get("token")
    token_file = user.get("tokenFile")
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"{where_user}.token", "must be a string")
    if token_file is not None and not isinstance(token_file, str):
        raise ConfigError(f"{where_user}.tokenFile", "must be a string")
    tokens: TokenSource | ExecTokenSource
    if "exec" in user and not token and not token_file:
        plugin = _exec_plugin(user["exec"], where_user)
        command = plugin.command
        if os.sep in command and not os.path.isabs(command):
            # client-go resolves a relative command with a path against the file's folder
            plugin = ExecPlugin(
                plugin.api_version, str(user_base / command), plugin.args, plugin.env, plugin.where
            )
        cluster_info = (
            {
                "server": server,
                "insecure-skip-tls-verify": bool(cluster.get("insecure-skip-tls-verify")),
            }
            if user["exec"].get("provideClusterInfo")
            else None
        )
        tokens = ExecTokenSource(plugin, timeout=settings.exec_timeout, cluster=cluster_info)
    else:
        tokens = TokenSource(
            token=token or None,
            path=None if token or not token_file else str(_resolve(user_base, str(token_file))),
        )
        if tokens.path is not None:
            tokens.current()
    namespace = settings.namespace or context.get("namespace") or "default"
    return ClusterAccess(
        server=server.rstrip("/"),
        namespace=str(namespace),
        tokens=tokens,
        ca_file=settings.ca_file or ca_path,
        ca_data=None if settings.ca_file else ca_data,
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        client_cert=client,
        tls_server_name=settings.tls_server_name or cluster.get("tls-server-name"),
        origin=f"kubeconfig {path} context {context_name}",
    )


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path
