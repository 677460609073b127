"""Settings of one Kubernetes connection (the ``kubernetes:`` block of a connection).

Frozen and strict: unknown keys, wrong types and out-of-range values are
refused with the field named (through ``nadisc``'s provider-block
validation: ``discovery.connections.<name>.kubernetes.<field>``). Nothing
here reads a file or the environment; :mod:`nadisc_kubernetes._credentials`
does that when the provider is created. Durations are seconds.

::

    kubernetes:
      credentials: auto          # auto | in_cluster | kubeconfig
      kubeconfig: ~/.kube/config # kubeconfig mode: path (default $KUBECONFIG, then ~/.kube/config)
      context: staging           # kubeconfig context (default: current-context)
      namespace: shop            # default: the credentials' namespace, then "default"
      services:
        orders: {name: order-api, port: http}   # Service port name or number
        dns: {name: kube-dns, port: 53, protocol: UDP}
      ip_family: primary         # primary | ipv4 | ipv6 (dual-stack Services)
      trust_unowned_slices: false
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

__all__ = ["KubernetesSettings", "ServiceBinding"]

#: RFC 1123 label (namespaces) and DNS-1035 label (Service names).
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: Service port names: IANA_SVC_NAME (lower case letters, digits, '-').
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

IN_CLUSTER_ROOT = "/var/run/secrets/kubernetes.io/serviceaccount"


class ServiceBinding(BaseModel):
    """One alias: the Service name and which of its ports to call.

    ``port`` is a Service port *name* (resolved to the slice port of the same
    name) or a Service port *number* (whose port name is then looked up);
    omit it for a Service with a single port.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: StrictStr = Field(
        min_length=1,
        max_length=63,
        description="the Service's name in the connection's namespace; defaults to the alias",
    )
    port: StrictStr | Annotated[StrictInt, Field(ge=1, le=65535)] | None = Field(
        default=None,
        description=(
            "which Service port to call: a port name (matched to the EndpointSlice port "
            "of that name) or a port number (its name is looked up on the Service); "
            "omit for a Service with one port"
        ),
    )

    protocol: Literal["TCP", "UDP", "SCTP"] | None = Field(
        default=None,
        description=(
            "the protocol of a numeric port (a Service may serve one number on TCP and "
            "UDP, as DNS does); default: TCP when the number is on several protocols"
        ),
    )

    @field_validator("name")
    @classmethod
    def _service_name(cls, value: str) -> str:
        if not _SERVICE_NAME.match(value):
            raise ValueError(
                "a Service name is a DNS-1035 label: lower case letters, digits and '-', "
                "starting with a letter"
            )
        return value

    @field_validator("port")
    @classmethod
    def _port_name(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and (len(value) > 15 or not _PORT_NAME.match(value)):
            raise ValueError(
                "a Service port name has at most 15 lower case letters, digits and '-'"
            )
        return value


class KubernetesSettings(BaseModel):
    """Validated settings of a Kubernetes connection (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    #: The provider discovers only: config validation refuses a registration
    #: that names a kubernetes connection (nadisc reads this flag).
    discovery_only: ClassVar[bool] = True

    credentials: Literal["auto", "in_cluster", "kubeconfig"] = Field(
        default="auto",
        description=(
            "where the API server and identity come from: in_cluster (the pod's "
            "service-account files), kubeconfig, or auto: in_cluster when "
            "KUBERNETES_SERVICE_HOST is set, else kubeconfig"
        ),
    )
    kubeconfig: StrictStr | None = Field(
        default=None,
        min_length=1,
        description=(
            "kubeconfig mode: path of the kubeconfig file (~ expanded); default: every "
            "file listed in $KUBECONFIG, merged as kubectl merges them, else ~/.kube/config"
        ),
    )
    context: StrictStr | None = Field(
        default=None,
        min_length=1,
        description="kubeconfig mode: the context to use (default: the file's current-context)",
    )
    namespace: StrictStr | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description=(
            "namespace of the Services; default: the kubeconfig context's namespace or, "
            "in-cluster, the service account's namespace file; else 'default'"
        ),
    )
    in_cluster_root: StrictStr = Field(
        default=IN_CLUSTER_ROOT,
        min_length=1,
        description=(
            "in-cluster mode: the directory holding the service account's token, "
            "ca.crt and namespace files"
        ),
    )
    ca_file: StrictStr | None = Field(
        default=None,
        min_length=1,
        description="PEM bundle to trust for the API server instead of the credentials' CA",
    )
    tls_server_name: StrictStr | None = Field(
        default=None,
        min_length=1,
        description=(
            "name to check the API server's certificate against (default: the server URL's host)"
        ),
    )
    services: dict[StrictStr, ServiceBinding] = Field(
        default_factory=dict,
        description="service aliases: alias -> {name: Service name, port: name or number}",
    )
    watch_timeout: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=290.0,
        description=(
            "seconds sent as timeoutSeconds with every watch: the server ends the watch "
            "then and the provider watches again from the last resourceVersion it saw"
        ),
    )
    watch_grace: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0,
        description=(
            "seconds of silence allowed past watch_timeout before a stream counts as "
            "broken and is reopened"
        ),
    )
    page_size: Annotated[StrictInt, Field(ge=1, le=10_000)] = Field(
        default=500,
        description="objects per list page (the list's limit parameter)",
    )
    max_pages: Annotated[StrictInt, Field(ge=1, le=100_000)] = Field(
        default=1000,
        description="pages one list may take; a longer list is reported incomplete",
    )
    initial_backoff: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=1.0,
        description=(
            "seconds before the first retry of a failed list or watch; each further "
            "failure doubles it up to max_backoff (each wait jittered to 50-100 %), "
            "and a watch that stays open resets it"
        ),
    )
    max_backoff: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0,
        description=(
            "the longest wait between retries of a failed list or watch, in seconds; a "
            "server's Retry-After is obeyed up to this long"
        ),
    )
    bookmark_silence: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=80.0,
        description=(
            "a watch silent this many seconds (from its start or its last line) ends: "
            "once the server has sent a bookmark (it sends one about every minute to a "
            "watch that asks) the silence is a failure and the stream lists again; before "
            "that the watch is reopened from the version held once a one-item list showed "
            "the server is not behind it"
        ),
    )
    ip_family: Literal["primary", "ipv4", "ipv6"] = Field(
        default="primary",
        description=(
            "which addresses of a dual-stack Service to serve: its primary family (the "
            "first of spec.ipFamilies), or always ipv4 / ipv6"
        ),
    )
    trust_unowned_slices: StrictBool = Field(
        default=False,
        description=(
            "serve EndpointSlices that no controller owns (hand-written, with only the "
            "kubernetes.io/service-name label) for Services without a selector: a trust "
            "decision - anyone allowed to write slices in the namespace then steers traffic"
        ),
    )
    exec_timeout: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0,
        description=(
            "kubeconfig exec credential plugins: seconds one run may take before it is "
            "killed and the credential counts as unavailable"
        ),
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_LABEL.match(value):
            raise ValueError("a namespace is a DNS label: lower case letters, digits and '-'")
        return value

    @field_validator("services", mode="before")
    @classmethod
    def _name_defaults_to_alias(cls, value: object) -> object:
        if isinstance(value, dict):
            return {
                alias: {"name": alias, **item}
                if isinstance(item, dict) and "name" not in item
                else item
                for alias, item in value.items()
            }
        return value

    @field_validator("services")
    @classmethod
    def _one_port_per_service(cls, value: dict[str, ServiceBinding]) -> dict[str, ServiceBinding]:
        # The owner asks by remote (Service) name, so a Service name must lead
        # back to one port, and an alias must not be another binding's name.
        first: dict[str, tuple[str, str | int | None]] = {}
        for alias, binding in value.items():
            seen = first.setdefault(binding.name, (alias, binding.port))
            if seen[1] != binding.port:
                raise ValueError(
                    f"aliases {seen[0]!r} and {alias!r} bind Service {binding.name!r} with "
                    "different ports; give each Service one port"
                )
        for alias, binding in value.items():
            owner = first.get(alias)
            if owner is not None and binding.name != alias:
                raise ValueError(
                    f"alias {alias!r} is also the Service bound by alias {owner[0]!r}; "
                    "rename one of them"
                )
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> KubernetesSettings:
        if self.initial_backoff > self.max_backoff:
            raise ValueError("initial_backoff must not exceed max_backoff")
        if self.credentials == "in_cluster" and (self.kubeconfig or self.context):
            raise ValueError("kubeconfig and context do not apply to in_cluster credentials")
        return self

    def binding(self, service: str) -> ServiceBinding:
        """The binding whose Service name is ``service`` (the owner asks by
        remote name), else the alias ``service``, else the name itself."""
        for binding in self.services.values():
            if binding.name == service:
                return binding
        bound = self.services.get(service)
        return bound if bound is not None else ServiceBinding(name=service)
