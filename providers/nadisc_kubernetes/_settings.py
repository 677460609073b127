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
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
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

    name: StrictStr = Field(min_length=1, max_length=63)
    port: StrictStr | Annotated[StrictInt, Field(ge=1, le=65535)] | None = None

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

    #: ``auto``: in-cluster when ``KUBERNETES_SERVICE_HOST`` is set, else kubeconfig.
    credentials: Literal["auto", "in_cluster", "kubeconfig"] = "auto"
    kubeconfig: StrictStr | None = Field(default=None, min_length=1)
    context: StrictStr | None = Field(default=None, min_length=1)
    namespace: StrictStr | None = Field(default=None, min_length=1, max_length=63)
    #: Where the service-account files live (in-cluster mode).
    in_cluster_root: StrictStr = Field(default=IN_CLUSTER_ROOT, min_length=1)
    #: PEM bundle to trust instead of the credentials' CA.
    ca_file: StrictStr | None = Field(default=None, min_length=1)
    #: Name to check the server certificate against (default: the URL's host).
    tls_server_name: StrictStr | None = Field(default=None, min_length=1)
    services: dict[StrictStr, ServiceBinding] = Field(default_factory=dict)
    #: ``timeoutSeconds`` sent with every watch: the server ends it then and
    #: the provider re-watches from the last version it saw.
    watch_timeout: Annotated[float, Field(gt=0, le=3600)] = 290.0
    #: Slack after ``watch_timeout`` before a silent stream counts as broken.
    watch_grace: Annotated[float, Field(gt=0, le=600)] = 30.0
    #: ``limit`` of one list page.
    page_size: Annotated[StrictInt, Field(ge=1, le=10_000)] = 500
    #: Pages one list may take before it is reported incomplete.
    max_pages: Annotated[StrictInt, Field(ge=1, le=100_000)] = 1000
    initial_backoff: Annotated[float, Field(gt=0, le=3600)] = 1.0
    max_backoff: Annotated[float, Field(gt=0, le=3600)] = 30.0

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
