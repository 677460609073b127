"""kubeconfig exec credential plugins (``client.authentication.k8s.io/v1``).

Managed clusters (EKS ``aws eks get-token``, GKE ``gke-gcloud-auth-plugin``,
AKS ``kubelogin``) hand out short-lived bearer tokens through a command the
kubeconfig names under ``users[].user.exec``. Contract, as the Kubernetes
documentation describes the protocol ("client-go credential plugins")::

    run      command + args, environment = ours + exec.env + KUBERNETES_EXEC_INFO
             (an ExecCredential whose spec says interactive: false)
    bounded  killed after ``exec_timeout`` seconds; stdout read up to 1 MiB;
             stderr read and thrown away (plugins print diagnostics - and
             sometimes secrets - there: it is never logged or quoted)
    answer   stdout: {"apiVersion": <the requested version>, "kind": "ExecCredential",
                      "status": {"token": ..., "expirationTimestamp"?: RFC 3339}}
    cache    the token until ``expirationTimestamp`` (minus a margin); without
             one, until the server answers 401 (then the plugin runs once more)

Only bearer tokens are taken from a plugin: an answer with a client
certificate only is refused (IdentityRevoked naming why). Decision logic
(:func:`credential_fresh`) is synchronous with the time passed in.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
from anyio.abc import Process

from nadisc import IdentityRevoked, IncompleteSnapshot, redacted_excerpt

__all__ = ["API_VERSIONS", "ExecPlugin", "ExecTokenSource", "credential_fresh", "parse_answer"]

logger = logging.getLogger(__name__)

#: Versions this client speaks (v1alpha1 was removed in Kubernetes 1.24).
API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
#: A token is renewed this long before its expirationTimestamp.
EXPIRY_MARGIN = 30.0
_MAX_STDOUT = 1 << 20


def credential_fresh(
    expires_at: float | None, now: float, *, margin: float = EXPIRY_MARGIN
) -> bool:
    """Whether a token that expires at ``expires_at`` (epoch seconds; None:
    no expiry given) may still be sent at ``now``."""
    if expires_at is None:
        return True
    return now < expires_at - margin


@dataclass(frozen=True, slots=True)
class ExecPlugin:
    """The validated ``exec`` block of one kubeconfig user."""

    api_version: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    #: Where the plugin came from, for messages: ``kubeconfig users[<name>].exec``.
    where: str = "exec"

    def __repr__(self) -> str:  # env values may be secrets: the command only
        return f"<ExecPlugin {os.path.basename(self.command)!r} {self.api_version}>"


def parse_answer(plugin: ExecPlugin, stdout: bytes) -> tuple[str, float | None]:
    """(token, expiry in epoch seconds or None) from a plugin's stdout."""
    name = os.path.basename(plugin.command)
    try:
        document: Any = json.loads(stdout)
    except (ValueError, RecursionError):
        raise IdentityRevoked(
            f"{plugin.where}: the credential plugin {name!r} did not print an ExecCredential"
        ) from None
    if not isinstance(document, Mapping) or document.get("kind") != "ExecCredential":
        raise IdentityRevoked(
            f"{plugin.where}: the credential plugin {name!r} did not print an ExecCredential"
        )
    if document.get("apiVersion") != plugin.api_version:
        raise IdentityRevoked(
            f"{plugin.where}: the credential plugin {name!r} answered apiVersion "
            f"{redacted_excerpt(str(document.get('apiVersion')), limit=64)!r}, not the "
            f"requested {plugin.api_version}"
        )
    status = document.get("status")
    token = status.get("token") if isinstance(status, Mapping) else None
    if not isinstance(token, str) or not token:
        what = (
            "only a client certificate (not supported: give the plugin a token mode)"
            if isinstance(status, Mapping) and status.get("clientCertificateData")
            else "no token"
        )
        raise IdentityRevoked(f"{plugin.where}: the credential plugin {name!r} returned {what}")
    expiry = status.get("expirationTimestamp") if isinstance(status, Mapping) else None
    if expiry is None:
        return token, None
    try:
        moment = datetime.fromisoformat(str(expiry))
        if moment.tzinfo is None:
            raise ValueError("no time zone")
        expires_at = moment.timestamp()
    except (ValueError, OverflowError):
        raise IdentityRevoked(
            f"{plugin.where}: the credential plugin {name!r} returned an expirationTimestamp "
            "that is not an RFC 3339 time"
        ) from None
    if not math.isfinite(expires_at):  # pragma: no cover - fromisoformat bounds it
        raise IdentityRevoked(f"{plugin.where}: unusable expirationTimestamp")
    return token, expires_at


async def _read_limited(stream: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total <= limit:
            chunks.append(chunk)
    if total > limit:
        raise IdentityRevoked(f"the credential plugin printed more than {limit} bytes")
    return b"".join(chunks)


async def _drain(stream: Any) -> None:
    async for _chunk in stream:  # stderr: read so the plugin never blocks, then dropped
        pass


class ExecTokenSource:
    """A bearer token from an exec plugin, cached (see the module docstring).

    Same interface as :class:`~nadisc_kubernetes._credentials.TokenSource`
    for the HTTP shell: ``await fetch()`` and ``await refetch()``."""

    def __init__(
        self,
        plugin: ExecPlugin,
        *,
        timeout: float,
        cluster: Mapping[str, Any] | None = None,
        wall_clock: Any = time.time,
    ) -> None:
        self._plugin = plugin
        self._timeout = timeout
        self._cluster = dict(cluster) if cluster is not None else None
        self._wall = wall_clock
        self._token: str | None = None
        self._expires_at: float | None = None
        self._lock: anyio.Lock | None = None
        #: How many times the plugin ran.
        self.runs = 0

    def __repr__(self) -> str:
        return f"<ExecTokenSource {self._plugin!r}>"

    @property
    def path(self) -> str | None:
        return None

    def current(self) -> str | None:
        """The cached token, if it is still fresh (no plugin run)."""
        if self._token is not None and credential_fresh(self._expires_at, self._wall()):
            return self._token
        return None

    def reload(self) -> bool:
        """Forget the cached token (after a 401): the next fetch runs the plugin."""
        self._token = None
        return True

    async def fetch(self) -> str | None:
        token = self.current()
        if token is not None:
            return token
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            token = self.current()  # another stream may have run it meanwhile
            if token is None:
                self._token, self._expires_at = await self._run()
                token = self._token
        return token

    async def refetch(self) -> bool:
        self.reload()
        await self.fetch()
        return True

    def _environment(self) -> dict[str, str]:
        spec: dict[str, Any] = {"interactive": False}
        if self._cluster is not None:
            spec["cluster"] = self._cluster
        info = {"apiVersion": self._plugin.api_version, "kind": "ExecCredential", "spec": spec}
        env = dict(os.environ)
        env.update(dict(self._plugin.env))
        env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
        return env

    async def _run(self) -> tuple[str, float | None]:
        plugin = self._plugin
        name = os.path.basename(plugin.command)
        command: Sequence[str] = [plugin.command, *plugin.args]
        self.runs += 1
        try:
            process: Process = await anyio.open_process(
                command,
                stdin=None,
                env=self._environment(),
            )
        except OSError as exc:
            raise IdentityRevoked(
                f"{plugin.where}: cannot run the credential plugin {name!r} ({exc.strerror})"
            ) from None
        stdout = b""
        try:
            with anyio.fail_after(self._timeout):
                async with anyio.create_task_group() as group:
                    assert process.stderr is not None and process.stdout is not None
                    group.start_soon(_drain, process.stderr)
                    stdout = await _read_limited(process.stdout, _MAX_STDOUT)
                    code = await process.wait()
        except TimeoutError:
            raise IncompleteSnapshot(
                f"{plugin.where}: the credential plugin {name!r} did not finish within "
                f"{self._timeout:g}s (exec_timeout)"
            ) from None
        finally:
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + 5.0
                if process.returncode is None:
                    process.kill()
                await process.aclose()
        if code != 0:
            raise IdentityRevoked(
                f"{plugin.where}: the credential plugin {name!r} exited with status {code} "
                "(its stderr is not shown: it may hold secrets)"
            )
        token, expires_at = parse_answer(plugin, stdout)
        left = "no expiry" if expires_at is None else f"expires in {expires_at - self._wall():.0f}s"
        logger.info("%s: the credential plugin %r gave a token (%s)", plugin.where, name, left)
        return token, expires_at
