"""Consul wire decoding: bytes in, typed values out, no I/O.

Every function here is pure (the ``*_cooperatively`` variants only add
checkpoints), so the watch loop, the catalog and the benchmark share one
decoder and the tests can feed it bytes directly.

Classification of a ``/v1/health/service/<name>`` answer::

    not JSON / not an array / an entry without      -> IncompleteSnapshot
    Node+Service objects / Checks not a list /         (we could not read a
    Service.ID not a non-empty string / not UTF-8 /     complete listing)
    nested too deeply / NaN or Infinity

    more entries than max_instances_per_service     -> CapacityRejected (counted
                                                       before any entry is
                                                       examined)

    an entry whose values are impossible (port out  -> left out, recorded in
    of range, no address, Weights.Passing < 1,         ProviderSnapshot.invalid
    non-string tag/meta, another service's entry,      under "<node>/<service id>"
    a Service.ID already seen in this listing)

    every entry invalid (at least one)              -> InvalidSnapshot: the
                                                       registry confirmed only
                                                       bad candidates

    any check (node serfHealth included) not        -> not healthy: left out
    "passing"                                          silently (not invalid)

How a health answer is decoded (msgspec, typed; only the fields the
snapshot needs are built, the rest is skipped in C)::

    decode_health_service (one call)         decode_health_service_cooperatively
      list[_Entry] in one typed decode          split: list[Raw], one pass, ~3 ms
        ok -> count check, then column by        count check, before any entry
          column (HealthDecoder.columns);
          an entry it does not take ->
          entry by entry (same result)
        ValidationError / DecodeError ->        each element: typed decode
          element-by-element path  ------->       (types of a valid entry)
                                                  refused -> plain values ->
                                                  permissive checks naming
                                                  the exact defect
                                                checkpoint every ~2 ms of work

The typed schema admits only values of a valid entry's types, so anything
unusual takes the permissive path and gets the same classification and
message as a plain-``json`` decoder would give it; decoder errors are
chained as causes, and their text in our messages is bounded and never
carries field values. Tags and meta are kept as JSON text and decoded once
per distinct text. Cost for a 4,096-instance answer (~4.7 MB), ``Instance``
objects included: about a third of ``json.loads`` of the same bytes in one
call, about two fifths cooperatively (the split pass is the difference);
the cooperative path holds the loop for the split plus one slice at a time.
Given ``previous`` (the last snapshot of the service), unchanged instances
are reused rather than rebuilt, so an update allocates only what changed.
"""

from __future__ import annotations

import json
import operator
import re
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import eq
from types import MappingProxyType
from typing import Any, Final, Literal, cast

import anyio
import anyio.lowlevel
import msgspec

from nadisc import (
    CapacityRejected,
    EvidenceKind,
    IncompleteSnapshot,
    Instance,
    InvalidInstanceAddress,
    InvalidSnapshot,
    ProviderSnapshot,
)
from nadisc._instance import _TRUSTED

__all__ = [
    "HealthDecoder",
    "IdentityScope",
    "decode_catalog_services",
    "decode_health_service",
    "decode_health_service_cooperatively",
    "decode_health_state",
    "decode_health_state_cooperatively",
    "format_duration",
    "iter_json_array",
    "parse_duration",
    "parse_index",
    "split_json_array",
]

IdentityScope = Literal["service", "node"]

_MAX_UINT64: Final = 2**64 - 1
_STR_ONLY: Final = frozenset({str})
_NO_META: Final[Mapping[str, str]] = MappingProxyType({})
_UNROUTABLE: Final = ("0.0.0.0", "::")
_DETAIL_LIMIT: Final = 96
#: Consul weights are Go ints; anything larger is not a weight (and would
#: overflow a float).
_MAX_WEIGHT: Final = 2**63 - 1
_PASSING_ONLY: Final = frozenset({"passing"})
_STATUS: Final = operator.attrgetter("Status")
_NODE_META: Final = operator.attrgetter("Meta")
#: The node meta key read as the zone of a node's instances (``node_meta``
#: in the agent's configuration) when the service's own Meta has no zone.
NODE_ZONE_KEY: Final = "zone"
_ZONE_TEXT: Final = b'"zone"'

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS: Final[Mapping[str, float]] = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Parse a Go duration (``"30s"``, ``"5m"``, ``"1m30s"``, ``"250ms"``) to seconds.

    Raises ``ValueError`` for anything Go's ``time.ParseDuration`` would refuse
    (a bare number other than ``0`` included). Negative durations are refused.
    """
    if text == "0":
        return 0.0
    if not text:
        raise ValueError("empty duration")
    position = 0
    total = 0.0
    while position < len(text):
        match = _DURATION_PART.match(text, position)
        if match is None:
            raise ValueError(f"invalid duration {text!r}")
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    return total


def format_duration(seconds: float) -> str:
    """Seconds as a Go duration Consul accepts: whole seconds as ``"30s"``, else ms."""
    if seconds < 0:
        raise ValueError("duration must not be negative")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def parse_index(value: str | None, *, what: str) -> int:
    """The ``X-Consul-Index`` header as an unsigned integer.

    Missing, non-numeric or out-of-range values make the answer unusable for
    a blocking loop: :class:`IncompleteSnapshot`. Zero is returned as is (the
    blocking rules decide what to do with it).
    """
    if value is None:
        raise IncompleteSnapshot(f"{what}: response carries no X-Consul-Index header")
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        raise IncompleteSnapshot(
            f"{what}: X-Consul-Index {value[:32]!r} is not an unsigned integer"
        )
    index = int(text)
    if index > _MAX_UINT64:
        raise IncompleteSnapshot(f"{what}: X-Consul-Index is out of the uint64 range")
    return index


def _load(body: bytes, what: str) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        # Not chained: json's and the codec's errors hold the whole body
        # (``.doc``, ``.object``), and a body may carry credentials.
        raise IncompleteSnapshot(f"{what}: response body is not JSON ({_brief(exc)})") from None


def _brief(exc: Exception) -> str:
    """A decoder's message, bounded (it names types and offsets, never values)."""
    text = str(exc)
    return text if len(text) <= _DETAIL_LIMIT else text[: _DETAIL_LIMIT - 3] + "..."


def _require_utf8(body: bytes, what: str) -> None:
    """Refuse bodies that are not UTF-8.

    msgspec checks the encoding only of strings it decodes, not of the
    fields it skips; JSON text is UTF-8 throughout, so check it once.
    Consul answers are almost always ASCII: ``isascii`` settles that
    without copying (about 0.2 ms for 5 MB).
    """
    if body.isascii():
        return
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Not chained: the codec's error holds the whole body (``.object``).
        raise IncompleteSnapshot(
            f"{what}: response body is not UTF-8 JSON (byte {exc.start})"
        ) from None


def split_json_array(body: bytes, what: str) -> list[msgspec.Raw]:
    """The elements of the JSON array ``body``, each as undecoded JSON.

    One pass in C (about 3 ms for a 5 MB answer) that checks the whole
    document's syntax and cuts it into elements without building them, so
    the elements can be decoded in slices with checkpoints in between. Not
    UTF-8, not JSON, trailing data -> :class:`IncompleteSnapshot`; valid JSON
    that is not an array -> :class:`IncompleteSnapshot` too.
    """
    _require_utf8(body, what)
    try:
        return _ELEMENTS.decode(body)
    except msgspec.ValidationError as exc:
        raise IncompleteSnapshot(f"{what}: expected a JSON array ({_brief(exc)})") from exc
    except msgspec.DecodeError as exc:
        raise IncompleteSnapshot(f"{what}: response body is not JSON ({_brief(exc)})") from exc
    except RecursionError as exc:
        raise IncompleteSnapshot(f"{what}: response body is nested too deeply") from exc


def iter_json_array(text: str, what: str) -> Iterator[object]:
    """Yield the elements of the JSON array ``text`` as plain Python values.

    The whole text is checked first (see :func:`split_json_array`), then the
    elements are built one at a time, so a consumer may stop between them.
    """
    for position, raw in enumerate(split_json_array(text.encode("utf-8"), what)):
        try:
            value = json.loads(bytes(raw))
        except (ValueError, RecursionError) as exc:
            raise IncompleteSnapshot(
                f"{what}: entry {position} is not JSON ({_brief(exc)})"
            ) from None  # json's error holds the entry (``.doc``)
        yield value


def decode_catalog_services(body: bytes) -> dict[str, tuple[str, ...]]:
    """``/v1/catalog/services``: ``{"name": ["tag", ...]}`` (a null tag list is empty)."""
    what = "GET /v1/catalog/services"
    data = _load(body, what)
    if type(data) is not dict:
        raise IncompleteSnapshot(f"{what}: expected a JSON object, got {type(data).__name__}")
    services: dict[str, tuple[str, ...]] = {}
    for name, tags in data.items():
        if tags is None:
            services[name] = ()
            continue
        if type(tags) is not list or any(type(t) is not str for t in tags):
            raise IncompleteSnapshot(f"{what}: tags of {name!r} are not a list of strings")
        services[name] = tuple(tags)
    return services


# -- typed wire shapes --------------------------------------------------------
#
# Only the fields the snapshot needs; every other field is skipped by the
# decoder without being built. The types are exactly those of a *valid*
# entry: a value of any other type fails the typed decode and sends that
# element down the permissive path (HealthDecoder.add), which classifies it
# as the listing-level or the entry-level defect it is. gc=False: these
# objects hold no cycles, so the cyclic collector need not track them.


_NULL: Final = msgspec.Raw(b"null")
_astuple: Final = msgspec.structs.astuple
_PASSING: Final = operator.attrgetter("Passing")
_NO_INVALID: Final[Mapping[str, str]] = MappingProxyType({})
#: ``(new, old)[same]``: the old instance where it equals the new one.
_pick = cast("Callable[[tuple[Instance, Instance | None], bool], Instance]", operator.getitem)


class _Node(msgspec.Struct, gc=False):
    Node: str
    Address: str | None = None
    # The node's metadata (agent ``node_meta``), kept as JSON text: only its
    # zone is read (see node_zone), and most fleets repeat one text.
    Meta: msgspec.Raw = _NULL


class _Weights(msgspec.Struct, gc=False):
    Passing: int


class _Service(msgspec.Struct, gc=False):
    ID: str
    Service: str | None = None
    Address: str | None = None
    Port: int | None = None
    Weights: _Weights | None = None
    # Fleets repeat the same tags and meta on every instance: kept as JSON
    # text, decoded once per distinct text (HealthDecoder._shared_tags/_meta).
    Tags: msgspec.Raw = _NULL
    Meta: msgspec.Raw = _NULL


class _Check(msgspec.Struct, gc=False):
    Status: str


class _Entry(msgspec.Struct, gc=False):
    Node: _Node
    Service: _Service
    Checks: tuple[_Check, ...] | None = None


_ELEMENTS: Final = msgspec.json.Decoder(list[msgspec.Raw])
_ENTRIES: Final = msgspec.json.Decoder(list[_Entry])
_ENTRY: Final = msgspec.json.Decoder(_Entry)
_TAGS: Final = msgspec.json.Decoder(tuple[str, ...] | None)
_META: Final = msgspec.json.Decoder(dict[str, str] | None)
_CHECKS: Final = msgspec.json.Decoder(list[_Check])
_CHECK: Final = msgspec.json.Decoder(_Check)


def decode_health_state(body: bytes) -> int:
    """``/v1/health/state/<state>``: a flat array of checks. Returns the check count."""
    what = "GET /v1/health/state"
    _require_utf8(body, what)
    try:
        return len(_CHECKS.decode(body))
    except (msgspec.DecodeError, RecursionError):
        pass  # name the defect precisely, element by element
    for position, raw in enumerate(split_json_array(body, what)):
        _state_check(raw, position, what)
    raise IncompleteSnapshot(f"{what}: unexpected listing shape")  # defensive


def _state_check(raw: msgspec.Raw, position: int, what: str) -> None:
    try:
        _CHECK.decode(raw)
    except (msgspec.ValidationError, RecursionError) as exc:
        raise IncompleteSnapshot(f"{what}: entry {position} is not a check object") from exc


async def decode_health_state_cooperatively(body: bytes, slice_seconds: float = 0.002) -> int:
    """:func:`decode_health_state` one element at a time, yielding to the loop
    every ``slice_seconds`` of work."""
    what = "GET /v1/health/state"
    clock = time.perf_counter
    deadline = clock() + slice_seconds
    raws = split_json_array(body, what)
    for position, raw in enumerate(raws):
        _state_check(raw, position, what)
        if not position & 63 and clock() >= deadline:
            await anyio.lowlevel.checkpoint()
            deadline = clock() + slice_seconds
    return len(raws)


class HealthDecoder:
    """Incremental decoder of one ``/v1/health/service`` answer.

    Feed entries in listing order, then call :meth:`finish`. An entry comes
    either as undecoded JSON (:meth:`add_raw`: the typed fast path, falling
    back to :meth:`add` for an entry of unexpected types) or as an already
    parsed Python value (:meth:`add`: the permissive path that names every
    defect). Both front ends below share it: :func:`decode_health_service`
    (one call) and :func:`decode_health_service_cooperatively` (element by
    element, yielding to the event loop between slices).

    ``previous``, the last snapshot decoded for the same service, is
    optional: an instance equal to one in it is not built again, the
    existing (immutable) object is reused. The result is the same; an update
    that changes a few instances then allocates only those, which keeps
    a watch from feeding Python's full garbage collections.
    """

    __slots__ = (
        "_count",
        "_instances",
        "_invalid",
        "_max",
        "_meta_texts",
        "_metas",
        "_previous",
        "_scope",
        "_seen",
        "_service",
        "_tag",
        "_tag_texts",
        "_tags",
        "_wanted",
        "_zoned",
        "what",
    )

    def __init__(
        self,
        service: str,
        *,
        max_instances: int,
        tag: str | None = None,
        identity_scope: IdentityScope = "service",
        previous: ProviderSnapshot | None = None,
    ) -> None:
        self._service = service
        self._wanted = service.casefold()
        self._max = max_instances
        self._tag = tag
        self._scope = identity_scope
        self._instances: list[Instance] = []
        self._invalid: dict[str, str] = {}
        self._seen: dict[str, str] = {}
        self._count = 0
        self._metas: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {}
        self._tags: dict[tuple[str, ...], tuple[str, ...]] = {}
        # JSON text of Tags/Meta -> shared decoded value, or None if invalid
        self._tag_texts: dict[bytes, tuple[str, ...] | None] = {}
        self._meta_texts: dict[bytes, Mapping[str, str] | None] = {}
        # (service Meta text, node Meta text) -> the meta with the node's zone
        self._zoned: dict[tuple[bytes, bytes], Mapping[str, str]] = {}
        self._previous: dict[str, Instance] = {}
        if previous is not None:
            self._remember(previous)
        self.what = f"GET /v1/health/service/{service}"

    def _remember(self, previous: ProviderSnapshot) -> None:
        """Index ``previous`` for reuse; its shared tags/meta seed ours, so an
        unchanged instance compares by identity."""
        metas = {id(i.metadata): i.metadata for i in previous.instances if i.metadata}
        for meta in metas.values():
            self._metas.setdefault(tuple(meta.items()), meta)
        for instance in previous.instances:
            if instance.tags:
                self._tags.setdefault(instance.tags, instance.tags)
        self._previous = {instance.identity: instance for instance in previous.instances}

    def check_count(self, count: int) -> None:
        """:class:`CapacityRejected` when a listing of ``count`` entries is too long."""
        if count > self._max:
            raise CapacityRejected(
                f"{self.what}: {count} entries exceed max_instances_per_service={self._max}"
            )

    def split(self, body: bytes) -> list[msgspec.Raw]:
        """The answer's entries, undecoded; the count is checked against the
        limit before any entry is built (:func:`split_json_array`)."""
        raws = split_json_array(body, self.what)
        self.check_count(len(raws))
        return raws

    def add_raw(self, raw: msgspec.Raw | bytes) -> None:
        """Add one entry given as its JSON text (an element of :meth:`split`)."""
        try:
            entry = _ENTRY.decode(raw)
        except msgspec.ValidationError:
            # Unexpected types somewhere in the entry: build it as plain
            # values and let the permissive path say what is wrong with it
            # (the stdlib parser, so out-of-range numbers read as they always
            # did instead of failing the whole listing).
            try:
                value = json.loads(bytes(raw))
            except (ValueError, RecursionError) as exc:  # e.g. a 5,000-digit integer
                raise IncompleteSnapshot(
                    f"{self.what}: entry {self._count} is not JSON ({_brief(exc)})"
                ) from None  # json's error holds the entry (``.doc``)
            self.add(value)
            return
        except (msgspec.DecodeError, RecursionError) as exc:
            raise IncompleteSnapshot(
                f"{self.what}: entry {self._count} is not JSON ({_brief(exc)})"
            ) from exc
        self._add_entry(entry)

    def _add_entry(self, entry: _Entry) -> None:
        """The fast path: ``entry`` already has the types of a valid entry.

        The checks and messages are those of :func:`_entry_problem` and
        :meth:`_accept`, in the same order, written out inline: this runs
        once per instance of every large answer.
        """
        position = self._count
        self._count += 1
        if self._count > self._max:
            self.check_count(self._count)
        node = entry.Node
        svc = entry.Service
        service_id = svc.ID
        node_name = node.Node
        if not service_id:
            raise IncompleteSnapshot(f"{self.what}: entry {position} lacks Service.ID or Node.Node")
        name = svc.Service
        port = svc.Port
        host = svc.Address or node.Address
        weights = svc.Weights
        tag = self._tag
        tags: tuple[str, ...] | None
        meta: Mapping[str, str] | None
        problem: str | None = None
        if name != self._service and (name is None or name.casefold() != self._wanted):
            problem = f"entry belongs to service {name!r}"
        elif port is None or not 0 < port < 65536:
            problem = f"port {port!r} is out of range 1-65535"
        elif not host or host in _UNROUTABLE:
            problem = f"no usable address (service {svc.Address!r}, node {node.Address!r})"
        elif weights is not None and not 0 < weights.Passing <= _MAX_WEIGHT:
            problem = f"Weights.Passing {weights.Passing!r} is not a positive integer"
        elif (tags := self._shared_tags(svc.Tags)) is None:
            problem = "Tags is not a list of strings"
        elif tag is not None and tag not in tags:
            problem = f"entry lacks the requested tag {tag!r}"
        elif (meta := self._shared_meta(svc.Meta)) is None:
            problem = "Meta is not a map of strings"
        if problem is not None:
            self._invalid[f"{node_name}/{service_id}"] = problem
            return
        node_meta = bytes(node.Meta)
        if _ZONE_TEXT in node_meta:
            meta = self._node_zoned(bytes(svc.Meta), node_meta)
        # Health first: an unhealthy entry is left out before it can make a
        # healthy one with the same identity look like its duplicate.
        checks = entry.Checks
        if checks and not _PASSING_ONLY.issuperset(map(_STATUS, checks)):
            return
        identity = service_id if self._scope == "service" else f"{node_name}/{service_id}"
        first = self._seen.get(identity)
        if first is not None:
            self._invalid[f"{node_name}/{service_id}"] = (
                f"duplicate service ID {service_id!r} (first seen on node {first!r})"
            )
            return
        self._seen[identity] = node_name
        # narrowed by the checks above
        assert host is not None and port is not None and tags is not None and meta is not None
        weight = 1.0 if weights is None else float(weights.Passing)
        old = self._previous.get(identity)
        if (
            old is not None
            and old.host == host
            and old.port == port
            and old.weight == weight
            and (old.tags is tags or old.tags == tags)
            and (old.metadata is meta or old.metadata == meta)
        ):
            self._instances.append(old)
        else:
            try:
                self._instances.append(Instance(identity, host, port, weight, meta, tags))
            except InvalidInstanceAddress as exc:  # nadisc's shared address check
                del self._seen[identity]
                self._invalid[f"{node_name}/{service_id}"] = str(exc)

    def columns(self, entries: list[_Entry]) -> ProviderSnapshot | None:
        """The snapshot of typed ``entries`` decoded column by column, or None
        when some entry needs the entry-by-entry path (an invalid candidate,
        a duplicate, a missing field: it names each one; same result).

        Each step is one pass the interpreter runs in C (``astuple`` and a
        transposition to columns, ``set``/``min``/``max``/``list.count``
        checks over a whole column, one decode of each distinct Tags and
        Meta text, one ``map`` building the instances); no Python code runs
        per entry unless some entry is unhealthy (one comprehension then
        picks the healthy ones) or has no service address of its own. Only
        a fresh decoder (nothing added yet) takes this path."""
        if self._count or not entries:
            return None
        count = len(entries)
        nodes, services, checks = zip(*map(_astuple, entries), strict=True)
        ids, names, addresses, ports, weights, tags_raw, meta_raw = zip(
            *map(_astuple, services), strict=True
        )
        # The nodes' fields only when needed: node-scoped identities, or an
        # entry without a service address of its own.
        node_names: Sequence[str] = ()
        node_addresses: Sequence[str | None] = ()
        if self._scope != "service" or not all(addresses):
            node_names, node_addresses, _ = zip(*map(_astuple, nodes), strict=True)
        wanted = self._service
        if names.count(wanted) != count or not all(ids):
            return None  # another service's entry, or no Service.ID: named one by one
        if None in ports or not (min(ports) > 0 and max(ports) < 65536):
            return None
        hosts: Sequence[str | None] = addresses
        if not all(addresses):
            hosts = [a or n for a, n in zip(addresses, node_addresses, strict=True)]
        if not all(hosts) or _UNROUTABLE[0] in hosts or _UNROUTABLE[1] in hosts:
            return None
        if None in weights:
            return None  # a default weight somewhere: the entry path handles it
        passing = list(map(_PASSING, weights))
        if not (min(passing) > 0 and max(passing) <= _MAX_WEIGHT):
            return None
        # Tags and Meta: one decode of each distinct JSON text, shared. Hashable
        # copies of the texts from one join and one split (JSON holds no NUL).
        tag_texts = b"\0".join(tags_raw).split(b"\0")
        meta_texts = b"\0".join(meta_raw).split(b"\0")
        if len(tag_texts) != count or len(meta_texts) != count:
            return None
        for text in set(tag_texts):
            if self._shared_tags(msgspec.Raw(text)) is None:
                return None
        for text in set(meta_texts):
            if self._shared_meta(msgspec.Raw(text)) is None:
                return None
        tag_of = self._tag_texts.__getitem__
        metas: Mapping[Any, Mapping[str, str] | None] = self._meta_texts
        meta_keys: Sequence[Hashable] = meta_texts
        node_texts = b"\0".join(map(_NODE_META, nodes))
        if _ZONE_TEXT in node_texts:
            # Some node declares a zone: each instance's meta is keyed by
            # its service and node Meta texts (one merge per distinct pair).
            per_node = node_texts.split(b"\0")
            if len(per_node) != count:
                return None
            pairs = list(zip(meta_texts, per_node, strict=True))
            for pair in set(pairs):
                self._node_zoned(*pair)
            meta_keys = pairs
            metas = self._zoned
        meta_of = metas.__getitem__
        if self._tag is not None:
            tag = self._tag
            if not all(tag in self._tag_texts[t] for t in set(tag_texts)):  # type: ignore[operator]
                return None
        # Health: every check passing (one pass over all statuses), else the
        # healthy entries are picked (unhealthy ones are left out silently).
        statuses = set(map(_STATUS, chain.from_iterable(filter(None, checks))))
        columns: list[Sequence[Any]] = [
            ids,
            node_names or [""] * count,
            hosts,
            ports,
            passing,
            tag_texts,
            meta_keys,
        ]
        if not _PASSING_ONLY.issuperset(statuses):
            keep = [not c or _PASSING_ONLY.issuperset(map(_STATUS, c)) for c in checks]
            columns = [list(compress(column, keep)) for column in columns]
        kept_ids, kept_nodes, kept_hosts, kept_ports, kept_passing, kept_tags, kept_meta = columns
        if self._scope == "service":
            identities: Sequence[str] = kept_ids
        else:
            identities = list(map("{}/{}".format, kept_nodes, kept_ids))
        if len(set(identities)) != len(identities):
            return None  # a duplicate: the entry path keeps the first, names the rest
        instances = list(
            map(
                Instance,
                identities,
                kept_hosts,
                kept_ports,
                map(float, kept_passing),
                map(meta_of, kept_meta),
                map(tag_of, kept_tags),
                repeat(_TRUSTED),
            )
        )
        previous = self._previous
        if previous:
            matched = list(map(previous.get, identities))
            same = list(map(eq, matched, instances))
            if all(same):
                instances = cast("list[Instance]", matched)
            elif any(same):
                instances = list(map(_pick, zip(instances, matched, strict=True), same))
        self._count = count
        # ``ProviderSnapshot.approximate_bytes``, summed column by column:
        # each distinct tags/meta value is measured once.
        tag_size = {t: sum(map(len, v or ())) for t, v in self._tag_texts.items()}
        meta_size = {
            t: sum(map(len, v)) + sum(map(len, v.values())) if v else 0 for t, v in metas.items()
        }
        size = 64 * (len(instances) + 1) + sum(map(len, identities)) + sum(map(len, kept_hosts))
        size += sum(map(tag_size.__getitem__, kept_tags))
        size += sum(map(meta_size.__getitem__, kept_meta))
        # Identities are unique (checked above): no per-instance re-check.
        return ProviderSnapshot._checked(
            self._service, tuple(instances), EvidenceKind.REGISTRY_HEALTH, _NO_INVALID, size
        )

    def _shared_tags(self, raw: msgspec.Raw) -> tuple[str, ...] | None:
        """The tags in the JSON text ``raw`` (``null``: none), one shared tuple
        per distinct text; None if they are not a list of strings."""
        text = bytes(raw)
        try:
            return self._tag_texts[text]
        except KeyError:
            pass
        shared: tuple[str, ...] | None
        try:
            tags = _TAGS.decode(text)
        except msgspec.ValidationError:
            shared = None
        else:
            shared = self._tags.setdefault(tags, tags) if tags else ()
        self._tag_texts[text] = shared
        return shared

    def _shared_meta(self, raw: msgspec.Raw) -> Mapping[str, str] | None:
        """The meta in the JSON text ``raw`` (``null``: none), one shared
        read-only mapping per distinct content; None if it is not a map of
        strings."""
        text = bytes(raw)
        try:
            return self._meta_texts[text]
        except KeyError:
            pass
        try:
            meta = _META.decode(text)
        except msgspec.ValidationError:
            shared = None
        else:
            shared = self._share_meta(meta)
        self._meta_texts[text] = shared
        return shared

    def _node_zoned(self, service_text: bytes, node_text: bytes) -> Mapping[str, str]:
        """The service meta of ``service_text`` with the zone of the node meta
        ``node_text`` added (when the service declares none); shared per pair.
        A node meta that is not a map of strings adds nothing (Consul's agent
        accepts only strings there)."""
        key = (service_text, node_text)
        shared = self._zoned.get(key)
        if shared is not None:
            return shared
        meta = self._meta_texts[service_text] or _NO_META
        shared = meta
        try:
            node_meta = _META.decode(node_text)
        except msgspec.ValidationError:
            node_meta = None
        zone = None if node_meta is None else node_meta.get(NODE_ZONE_KEY)
        if zone and NODE_ZONE_KEY not in meta:
            shared = self._share_meta({**meta, NODE_ZONE_KEY: zone})
        self._zoned[key] = shared
        return shared

    def _share_meta(self, meta: dict[str, str] | None) -> Mapping[str, str]:
        if not meta:
            return _NO_META
        key = tuple(meta.items())
        shared = self._metas.get(key)
        if shared is None:
            shared = self._metas[key] = MappingProxyType(meta)
        return shared

    def add(self, entry: object) -> None:
        """Add one entry given as parsed JSON (the permissive path)."""
        what = self.what
        position = self._count
        self._count += 1
        if self._count > self._max:
            self.check_count(self._count)
        if type(entry) is not dict:
            raise IncompleteSnapshot(f"{what}: entry {position} is not an object")
        node = entry.get("Node")
        svc = entry.get("Service")
        checks = entry.get("Checks")
        if type(node) is not dict or type(svc) is not dict:
            raise IncompleteSnapshot(f"{what}: entry {position} lacks Node/Service objects")
        if checks is None:
            checks = []
        elif type(checks) is not list:
            raise IncompleteSnapshot(f"{what}: entry {position}: Checks is not an array")
        service_id = svc.get("ID")
        node_name = node.get("Node")
        if type(service_id) is not str or not service_id or type(node_name) is not str:
            raise IncompleteSnapshot(f"{what}: entry {position} lacks Service.ID or Node.Node")
        healthy = True
        for check in checks:
            if type(check) is not dict:
                raise IncompleteSnapshot(f"{what}: entry {position}: a check is not an object")
            status = check.get("Status")
            if type(status) is not str:
                raise IncompleteSnapshot(f"{what}: entry {position}: a check has no Status")
            if status != "passing":
                healthy = False
        problem = _entry_problem(node, svc, self._service, self._wanted, self._tag)
        if problem is not None:
            self._invalid[f"{node_name}/{service_id}"] = problem
            return
        weights = svc.get("Weights")
        tags = svc.get("Tags")
        self._accept(
            node_name,
            service_id,
            healthy,
            svc.get("Address") or node["Address"],
            svc["Port"],
            1.0 if weights is None else float(weights["Passing"]),
            _with_node_zone(svc.get("Meta"), node.get("Meta")),
            None if tags is None else tuple(tags),
        )

    def _accept(
        self,
        node_name: str,
        service_id: str,
        healthy: bool,
        host: str,
        port: int,
        weight: float,
        meta: dict[str, str] | None,
        tags: tuple[str, ...] | None,
    ) -> None:
        """Health, then identity and duplicates, then the :class:`Instance`."""
        if not healthy:
            return  # before de-duplication: never the "first" of a healthy entry
        identity = service_id if self._scope == "service" else f"{node_name}/{service_id}"
        first = self._seen.get(identity)
        if first is not None:
            self._invalid[f"{node_name}/{service_id}"] = (
                f"duplicate service ID {service_id!r} (first seen on node {first!r})"
            )
            return
        self._seen[identity] = node_name
        # Fleets repeat the same meta and tags on every instance: share one
        # immutable copy per distinct value (fewer objects for the collector).
        shared_meta = self._share_meta(meta)
        shared_tags = self._tags.setdefault(tags, tags) if tags else ()
        try:
            instance = Instance(identity, host, port, weight, shared_meta, shared_tags)
        except InvalidInstanceAddress as exc:  # nadisc's shared address check
            del self._seen[identity]
            self._invalid[f"{node_name}/{service_id}"] = str(exc)
            return
        old = self._previous.get(identity)
        self._instances.append(old if old is not None and old == instance else instance)

    def finish(self) -> ProviderSnapshot:
        """The complete snapshot (:class:`InvalidSnapshot` if every entry was invalid)."""
        invalid = self._invalid
        if invalid and not self._instances and len(invalid) == self._count:
            raise InvalidSnapshot(
                f"{self.what}: all {len(invalid)} entries are invalid candidates "
                f"(first: {next(iter(invalid.items()))})"
            )
        return ProviderSnapshot(
            service=self._service,
            instances=tuple(self._instances),
            evidence=EvidenceKind.REGISTRY_HEALTH,
            invalid=invalid,
        )


def decode_health_service(
    body: bytes,
    *,
    service: str,
    max_instances: int,
    tag: str | None = None,
    identity_scope: IdentityScope = "service",
    previous: ProviderSnapshot | None = None,
) -> ProviderSnapshot:
    """Decode ``/v1/health/service/<service>`` into a complete snapshot.

    See the module docstring for how each kind of defect is classified.
    O(entries); allocates one :class:`Instance` per healthy, valid entry.
    A well-formed answer is decoded by one typed msgspec call that builds
    only the fields the snapshot needs (about a quarter of the cost of
    ``json.loads`` on the same bytes); any surprise sends the answer through
    the element-by-element path, which names the defect. Runs to completion:
    for large bodies on an event loop use
    :func:`decode_health_service_cooperatively`. ``previous``: see
    :class:`HealthDecoder` (reuse of unchanged instances).
    """
    decoder = HealthDecoder(
        service,
        max_instances=max_instances,
        tag=tag,
        identity_scope=identity_scope,
        previous=previous,
    )
    _require_utf8(body, decoder.what)
    try:
        entries = _ENTRIES.decode(body)
    except (msgspec.DecodeError, RecursionError):  # ValidationError included
        add_raw = decoder.add_raw
        for raw in decoder.split(body):
            add_raw(raw)
        return decoder.finish()
    decoder.check_count(len(entries))
    snapshot = decoder.columns(entries)
    if snapshot is not None:
        return snapshot
    add_entry = decoder._add_entry
    for entry in entries:
        add_entry(entry)
    return decoder.finish()


async def decode_health_service_cooperatively(
    body: bytes,
    *,
    service: str,
    max_instances: int,
    tag: str | None = None,
    identity_scope: IdentityScope = "service",
    slice_seconds: float = 0.002,
    previous: ProviderSnapshot | None = None,
) -> ProviderSnapshot:
    """:func:`decode_health_service`, yielding to the event loop every
    ``slice_seconds`` of work. Same result, same classification.

    The body is first cut into undecoded elements in one pass
    (:func:`split_json_array`, ~3 ms for 4,096 instances), then the entries
    are decoded and typed in slices, so applying a 4,096-instance answer
    never holds the loop for more than a few milliseconds at a time."""
    decoder = HealthDecoder(
        service,
        max_instances=max_instances,
        tag=tag,
        identity_scope=identity_scope,
        previous=previous,
    )
    clock = time.perf_counter
    deadline = clock() + slice_seconds
    add_raw = decoder.add_raw
    for count, raw in enumerate(decoder.split(body), start=1):
        add_raw(raw)
        if not count & 31 and clock() >= deadline:
            await anyio.lowlevel.checkpoint()
            deadline = clock() + slice_seconds
    return decoder.finish()


def _entry_problem(
    node: dict[str, object], svc: dict[str, object], service: str, wanted: str, tag: str | None
) -> str | None:
    """Why a structurally sound entry is not a usable candidate (None: it is)."""
    name = svc.get("Service")
    if name != service and (type(name) is not str or name.casefold() != wanted):
        return f"entry belongs to service {name!r}"
    port = svc.get("Port")
    if type(port) is not int or not 0 < port < 65536:
        return f"port {port!r} is out of range 1-65535"
    address = svc.get("Address")
    if address is None or address == "":
        address = node.get("Address")
    if type(address) is not str or not address or address in _UNROUTABLE:
        return f"no usable address (service {svc.get('Address')!r}, node {node.get('Address')!r})"
    weights = svc.get("Weights")
    if weights is not None:
        if type(weights) is not dict:
            return "Weights is not an object"
        passing = weights.get("Passing")
        if type(passing) is not int or not 0 < passing <= _MAX_WEIGHT:
            return f"Weights.Passing {passing!r} is not a positive integer"
    tags = svc.get("Tags")
    if tags is not None:
        if type(tags) is not list or not _STR_ONLY.issuperset(map(type, tags)):
            return "Tags is not a list of strings"
        if tag is not None and tag not in tags:
            return f"entry lacks the requested tag {tag!r}"
    elif tag is not None:
        return f"entry lacks the requested tag {tag!r}"
    meta = svc.get("Meta")
    if meta is not None and (
        type(meta) is not dict or not _STR_ONLY.issuperset(map(type, meta.values()))
    ):
        return "Meta is not a map of strings"
    return None


def _with_node_zone(meta: dict[str, str] | None, node_meta: object) -> dict[str, str] | None:
    """``meta`` with the zone of ``node_meta`` (parsed JSON) when it has none."""
    if type(node_meta) is not dict:
        return meta
    zone = node_meta.get(NODE_ZONE_KEY)
    if type(zone) is not str or not zone or (meta is not None and NODE_ZONE_KEY in meta):
        return meta
    return {**(meta or {}), NODE_ZONE_KEY: zone}
