"""The dns provider's outcomes without a DNS server (scripted resolvers, a closed port)."""

from __future__ import annotations

from importlib.metadata import entry_points

import anyio
import anyio.lowlevel
import dns.asyncresolver
import dns.name
import dns.rdata
import dns.resolver
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import (
    DnsConfig,
    EvidenceKind,
    IncompleteSnapshot,
    LifecycleError,
    ProviderFactory,
    ProviderSnapshot,
    RegistrationRecord,
    RegistrationRejected,
    UnknownService,
)
from nadisc.providers._dns import SRV_ZERO_WEIGHT, DnsProvider, factory

from ._support import WEB, context, provider_for, soon


async def test_unreachable_nameserver_is_incomplete_within_the_deadline(
    closed_port: int,
) -> None:
    provider = provider_for(f"127.0.0.1:{closed_port}", {"web": {"host": WEB, "port": 80}})
    start = anyio.current_time()
    with pytest.raises(IncompleteSnapshot):
        await provider.query("web", start + 0.1)
    # Measured 0.10 s; without the deadline the 3 s request timeout would
    # end it, so a bound 15x above what it measures still tells them apart.
    assert anyio.current_time() - start < 1.5


async def test_unknown_alias_and_closed_provider() -> None:
    provider = provider_for("127.0.0.1:53", {"web": {"host": WEB, "port": 80}})
    with pytest.raises(UnknownService, match="'nope'"):
        await provider.query("nope", soon())
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(LifecycleError):
        await provider.query("web", soon())


async def test_no_nameservers_is_incomplete() -> None:
    def empty(settings: DnsConfig) -> dns.asyncresolver.Resolver:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = []
        return resolver

    settings = DnsConfig.model_validate({"services": {"web": {"host": WEB, "port": 80}}})
    provider = DnsProvider(context(), settings, resolver_factory=empty)
    with pytest.raises(IncompleteSnapshot, match="no nameservers"):
        await provider.prepare(soon())
    with pytest.raises(IncompleteSnapshot, match="no nameservers"):
        await provider.query("web", soon())


async def test_discovery_only_capabilities() -> None:
    provider = provider_for("127.0.0.1:53", {"web": {"host": WEB, "port": 80}})
    caps = provider.capabilities
    assert caps.evidence is EvidenceKind.ADDRESS_ONLY
    assert (caps.registration, caps.watch_streams, caps.idempotent_renewal) == (False, 0, False)
    record = RegistrationRecord(
        registration="r", service="web", instance_id="i", host="10.0.0.1", port=80
    )
    with pytest.raises(RegistrationRejected):
        await provider.register(record, soon())
    await provider.prepare(soon())
    assert "edge" in repr(provider)


def test_factory_is_the_dns_entry_point() -> None:
    (entry,) = entry_points(group="nadisc.providers", name="dns")
    loaded = entry.load()
    assert loaded is factory
    typed: ProviderFactory = factory
    assert typed.name == "dns"
    assert typed.settings_model is DnsConfig
    settings = DnsConfig.model_validate({"services": {"web": {"host": WEB, "port": 80}}})
    created = factory.create(context(), settings)
    assert isinstance(created, DnsProvider)
    assert created.settings is settings
    with pytest.raises(TypeError):
        factory.create(context(), context())


# ----------------------------------------------------------------- outcomes without a server


class ScriptedResolver:
    """Answers A from a real-looking outcome and fails AAAA as scripted."""

    def __init__(self, failure: Exception) -> None:
        self.nameservers = ["127.0.0.1"]
        self.failure = failure
        self.calls: list[str] = []

    async def resolve(self, qname: object, rdtype: str, **kwargs: object) -> object:
        self.calls.append(rdtype)
        await anyio.lowlevel.checkpoint()
        raise self.failure


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (dns.resolver.LifetimeTimeout(timeout=1.0, errors=[]), "timed out"),
        (dns.resolver.NoNameservers(), "no nameserver gave a usable answer"),
        (dns.resolver.YXDOMAIN(), "YXDOMAIN"),
        (OSError("network is unreachable"), "OSError"),
    ],
)
async def test_failures_are_incomplete(failure: Exception, message: str) -> None:
    scripted = ScriptedResolver(failure)
    settings = DnsConfig.model_validate({"services": {"web": {"host": WEB, "port": 80}}})
    provider = DnsProvider(context(), settings, resolver_factory=lambda _: scripted)  # type: ignore[arg-type,return-value]
    with pytest.raises(IncompleteSnapshot, match=message) as info:
        await provider.query("web", soon())
    assert info.value.__cause__ is failure
    assert sorted(scripted.calls) == ["A", "AAAA"]
    assert provider.next_refresh("web") is None


async def test_a_query_never_outlives_the_request_timeout(autojump_clock: object) -> None:
    class Hanging:
        nameservers = ["127.0.0.1"]

        async def resolve(self, *args: object, **kwargs: object) -> object:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    settings = DnsConfig.model_validate({"services": {"web": {"host": WEB, "port": 80}}})
    provider = DnsProvider(
        context(timeout=2.0),
        settings,
        resolver_factory=lambda _: Hanging(),  # type: ignore[arg-type,return-value]
    )
    start = anyio.current_time()
    with pytest.raises(IncompleteSnapshot, match="not answered within"):
        await provider.query("web", start + 60)
    assert anyio.current_time() - start == pytest.approx(2.0)


# ----------------------------------------------------------------- SRV ordering as a property

srv_records = st.lists(
    st.tuples(
        st.integers(0, 3),  # priority
        st.integers(0, 5),  # weight
        st.integers(0, 3),  # port (0 is not a usable instance port)
        st.sampled_from(["a", "b", "c", "."]),
    ),
    max_size=12,
)


class FixedAnswer:
    """A resolver whose SRV answer is a fixed list of records."""

    nameservers = ["127.0.0.1"]

    def __init__(self, records: list[tuple[int, int, int, str]]) -> None:
        rdata = [
            dns.rdata.from_text(
                "IN", "SRV", f"{p} {w} {port} {t if t == '.' else t + '.example.test.'}"
            )
            for p, w, port, t in records
        ]
        self.rrset = (
            dns.rrset.from_rdata_list(dns.name.from_text("_s._tcp.example.test"), 30, rdata)
            if rdata
            else None
        )
        self.expiration = 0.0

    async def resolve(self, *args: object, **kwargs: object) -> object:
        await anyio.lowlevel.checkpoint()
        return self


@settings(max_examples=60, deadline=None)
@given(records=srv_records)
def test_srv_listing_rules(records: list[tuple[int, int, int, str]]) -> None:
    settings_ = DnsConfig.model_validate(
        {"services": {"s": {"host": "_s._tcp.example.test", "srv": True}}}
    )
    provider = DnsProvider(context(), settings_, resolver_factory=lambda _: FixedAnswer(records))  # type: ignore[arg-type,return-value]

    async def main() -> ProviderSnapshot:
        return await provider.query("s", anyio.current_time() + 5)

    snapshot = anyio.run(main, backend="trio")
    # the records dnspython keeps (an rrset holds each distinct record once)
    distinct = {(p, w, port, t) for p, w, port, t in records}
    real = {r for r in distinct if r[3] != "."}
    # RFC 2782: the lowest priority with a usable target (port 0 is not) is
    # published alone; the lower groups passed over report their records invalid.
    usable: dict[str, tuple[int, int]] = {}
    invalid: set[str] = set()
    for priority in sorted({r[0] for r in real}):
        best: dict[str, int] = {}
        for _, w, port, t in sorted(
            (r for r in real if r[0] == priority), key=lambda r: (-r[1], r[3], r[2])
        ):
            best.setdefault(f"{t}.example.test:{port}", w)
        invalid |= {k for k in best if k.endswith(":0")}
        usable = {k: (priority, w) for k, w in best.items() if not k.endswith(":0")}
        if usable:
            break
    assert set(snapshot.identities()) == set(usable)
    assert set(snapshot.invalid) == invalid
    assert len({i.metadata["dns.srv.priority"] for i in snapshot.instances}) <= 1
    weights = [-int(i.metadata["dns.srv.weight"]) for i in snapshot.instances]
    assert weights == sorted(weights)
    for instance in snapshot.instances:
        weight = int(instance.metadata["dns.srv.weight"])
        assert instance.weight == (weight if weight > 0 else SRV_ZERO_WEIGHT)
        assert (int(instance.metadata["dns.srv.priority"]), weight) == usable[instance.identity]
