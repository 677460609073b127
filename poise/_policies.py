"""Selection policies: which ready endpoint takes the next call.

Every policy implements :class:`~poise.Policy`: ``pick(ready, context, now)``
returns an index into ``ready``, the endpoints that currently hold a
readiness reservation. The balance never asks with an empty sequence; if it
did, the policy raises :class:`SelectionError`. Policies keep at most a
little state keyed by endpoint key (never the endpoints themselves) and are
synchronous, deterministic given their inputs (and, for
:class:`PowerOfTwoChoices`, the random generator), and read no clock.

=====================  =====================  ===========================  ==========
policy                 reads                  rule                         cost/pick
=====================  =====================  ===========================  ==========
RoundRobin             key                    least recently picked        O(1)(*) or O(n)
WeightedRoundRobin     key, weight            smooth WRR (nginx)           O(n)
PowerOfTwoChoices      load(now)              best of two random samples   O(1)
LeastLoaded            load(now)              full scan, ties rotate       O(n)
WeightedRendezvous     key, weight, context   highest random weight        O(n) hashes
=====================  =====================  ===========================  ==========

(*) O(1) Python work while a :class:`RoundRobin` is handed the same ready list
as at its last pick (a stable set of always-ready endpoints), O(n) when the
list changed.

The turn-taking policies (:class:`RoundRobin`, :class:`WeightedRoundRobin`,
:class:`LeastLoaded`) and :class:`WeightedRendezvous` also have
``peek(ready, context, now, avoid=())``: the index ``pick`` would return if
the endpoints keyed in ``avoid`` were not ready, with the policy's state
left as it is. The balance uses it for the extra attempts of a hedged call
(see :func:`~poise.hedged_call`), so that a hedge, a copy of an attempt that
already had its turn, takes no turn of its own (the next call's first pick
is where it would have been without it) and goes to another endpoint than
the attempts before it (for rendezvous, the context's next-ranked one).

None of them allocates per pick except :class:`WeightedRendezvous` (one hash
object per candidate), the first sighting of a key by the keyed policies, and
their sweep of forgotten keys once every ``horizon`` picks.

Weights: a weight must be finite and >= 0 (:class:`InvalidInput` otherwise;
endpoints normally reject bad weights before a policy sees them). Weight 0
means "last resort": such an endpoint is chosen only when every ready
endpoint has weight 0, and then they are treated as equal.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Container, Hashable, Sequence

from ._errors import InvalidInput, SelectionError
from ._protocols import Weighted

__all__ = [
    "LeastLoaded",
    "PowerOfTwoChoices",
    "RoundRobin",
    "WeightedRendezvous",
    "WeightedRoundRobin",
]

_INF = math.inf


def _nothing_ready(policy: str) -> SelectionError:
    return SelectionError(f"{policy}: no ready endpoint to pick from")


def _all_avoided(policy: str) -> SelectionError:
    return SelectionError(f"{policy}: every ready endpoint is to be avoided")


def _bad_weight(policy: str, endpoint: Weighted, weight: object) -> InvalidInput:
    return InvalidInput(
        f"{policy}: endpoint {endpoint.key!r} has weight {weight!r}; "
        "a weight must be finite and >= 0"
    )


class RoundRobin:
    """Take turns over the ready endpoints, ignoring weight and load.

    Rule: pick the ready endpoint whose last pick is the oldest (never picked
    counts as oldest); ties go to the first in ``ready`` order. With a stable
    ready set this is plain rotation in ``ready`` order, each endpoint once
    per ``len(ready)`` picks. When readiness changes (an endpoint busy, in
    quarantine, or just added) nobody is skipped or repeated: whoever has
    waited longest goes next, so every endpoint's share stays equal to its
    share of the time it was ready. (A cursor modulo ``len(ready)`` is not
    fair here: it skips the endpoints that follow one that is often busy.)

    State is one pick number per endpoint key; keys not picked within the
    last ``max(horizon, 2 x len(ready))`` picks are forgotten (a forgotten key
    counts as never picked), so the state stays bounded.

    Cost: O(n) per pick while the ready list changes between picks (one dict
    lookup per ready endpoint, and a C-level copy of the list). Handed the
    same list with the same endpoints again (a stable set of always-ready
    endpoints), a pick is one C-level comparison of the list with that copy
    (pointer by pointer) and O(1) Python work: the pick numbers are kept in
    pick order, so the oldest ready one is found at the front. The copy keeps
    the endpoints of the last pick referenced until the next pick.

    :meth:`peek` answers the same rule among the endpoints not avoided and
    stamps nothing: the extra attempt of a hedged call goes to the endpoint
    whose turn is next, and that endpoint keeps its turn.
    """

    __slots__ = ("_fresh", "_horizon", "_positions", "_seen", "_stamps", "_sweep_at", "_tick")

    def __init__(self, *, horizon: int = 1024) -> None:
        self._horizon = _check_horizon("RoundRobin", horizon)
        #: Key -> pick number, in pick order (a pick moves its key to the
        #: end), so the oldest pick comes first.
        self._stamps: dict[Hashable, int] = {}
        self._tick = 0
        self._sweep_at = horizon
        #: A copy of the ready list of the last pick (a list only).
        self._seen: list[Weighted] | None = None
        #: Key -> position in that list, once it came twice in a row (None:
        #: not built, or made stale by a sweep).
        self._positions: dict[Hashable, int] | None = None
        #: Positions of that list's never-picked keys, the first one last.
        self._fresh: list[int] = []

    @property
    def tracked_keys(self) -> int:
        """How many endpoint keys the policy currently remembers."""
        return len(self._stamps)

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        n = len(ready)
        if n == 0:
            raise _nothing_ready("RoundRobin")
        stamps = self._stamps
        best = -1
        if type(ready) is list and ready == self._seen:
            # The same endpoints as at the last pick, in the same places.
            positions = self._positions
            if positions is None:
                positions = self._index(ready)
            if positions is not None:
                fresh = self._fresh
                if fresh:
                    best = fresh.pop()  # never picked: the first in ready order
                else:
                    # Every one was picked: the oldest pick among them is
                    # the first of theirs in pick order.
                    for key in stamps:
                        best = positions.get(key, -1)
                        if best >= 0:
                            break
        if best < 0:
            get = stamps.get
            best = 0
            oldest = get(ready[0].key, 0)
            if oldest:
                for index in range(1, n):
                    stamp = get(ready[index].key, 0)
                    if stamp < oldest:
                        oldest = stamp
                        best = index
                        if not stamp:
                            break
            # This pick's stamp is not in the positions' never-picked list.
            self._seen = ready.copy() if type(ready) is list else None
            self._positions = None
        tick = self._tick + 1
        self._tick = tick
        key = ready[best].key
        stamps.pop(key, None)
        stamps[key] = tick
        if tick >= self._sweep_at:
            # The forgotten keys are the oldest picks: a prefix in pick order.
            cutoff = tick - max(self._horizon, 2 * n)
            for key in [key for key, stamp in stamps.items() if stamp <= cutoff]:
                del stamps[key]
            self._sweep_at = tick + self._horizon
            self._positions = None  # a forgotten key counts as never picked
        return best

    def _index(self, ready: list[Weighted]) -> dict[Hashable, int] | None:
        """Positions of ``ready``'s keys and its never-picked ones (None: a key repeats)."""
        keys = [endpoint.key for endpoint in ready]
        positions = dict(zip(keys, range(len(keys)), strict=True))
        if len(positions) != len(keys):
            self._seen = None
            return None
        stamps = self._stamps
        self._fresh = [at for at in range(len(keys) - 1, -1, -1) if keys[at] not in stamps]
        self._positions = positions
        return positions

    def peek(
        self,
        ready: Sequence[Weighted],
        context: object,
        now: float,
        avoid: Container[Hashable] = (),
    ) -> int:
        """The index :meth:`pick` would return without the ``avoid`` keys; no state changes.

        The least recently picked endpoint whose key is not in ``avoid``
        (the first in ``ready`` order on a tie). Raises
        :class:`~poise.SelectionError` when nothing is left to pick.
        """
        get = self._stamps.get
        best = -1
        oldest = 0
        for index in range(len(ready)):
            key = ready[index].key
            if key in avoid:
                continue
            stamp = get(key, 0)
            if best < 0 or stamp < oldest:
                best = index
                oldest = stamp
                if not stamp:
                    break
        if best < 0:
            raise _nothing_ready("RoundRobin") if not ready else _all_avoided("RoundRobin")
        return best

    def __repr__(self) -> str:
        return f"<RoundRobin tracked_keys={len(self._stamps)}>"


def _check_horizon(policy: str, horizon: object) -> int:
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise InvalidInput(f"{policy} horizon must be an int >= 1, got {horizon!r}")
    return horizon


class WeightedRoundRobin:
    """Smooth weighted round robin (the nginx rule), deterministic.

    Each pick adds every ready endpoint's weight to its *current* value, picks
    the largest current value (the first one in ``ready`` order on a tie) and
    subtracts the total weight from the winner. Over any ``sum(weights)``
    consecutive picks of an unchanged set with integer weights each endpoint
    is picked exactly ``weight`` times, interleaved rather than in bursts
    (weights 5, 1, 1 give ``a a b a c a a``).

    State is one small record per endpoint key, so it survives reordering of
    ``ready`` and an endpoint being briefly not ready. Keys that have not been
    ready for a while are forgotten: every ``horizon`` picks the policy drops
    the keys it has not seen since the previous sweep, so the state stays
    bounded by the endpoints seen in the last ``2 x horizon`` picks.

    Cost: O(n) per pick, no allocation except for a key seen for the first time.

    :meth:`peek` answers what :meth:`pick` would choose among the endpoints
    not avoided, and adds and subtracts nothing: the extra attempt of a
    hedged call goes to the endpoint whose turn is next, and each
    endpoint's share of the picks stays its weight.
    """

    __slots__ = ("_horizon", "_state", "_sweep_at", "_tick")

    def __init__(self, *, horizon: int = 1024) -> None:
        self._horizon = _check_horizon("WeightedRoundRobin", horizon)
        # key -> [current, last pick number that saw the key]
        self._state: dict[Hashable, list[float]] = {}
        self._tick = 0
        self._sweep_at = horizon

    @property
    def tracked_keys(self) -> int:
        """How many endpoint keys the policy currently keeps state for."""
        return len(self._state)

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        n = len(ready)
        if n == 0:
            raise _nothing_ready("WeightedRoundRobin")
        tick = self._tick + 1
        self._tick = tick
        state = self._state
        total = 0.0
        best = 0
        best_current = -_INF
        best_cell: list[float] | None = None
        for index in range(n):
            endpoint = ready[index]
            weight = endpoint.weight
            if not 0.0 <= weight < _INF:
                raise _bad_weight("WeightedRoundRobin", endpoint, weight)
            key = endpoint.key
            cell = state.get(key)
            if cell is None:
                cell = state[key] = [0.0, tick]
            current = cell[0] + weight
            cell[0] = current
            cell[1] = tick
            total += weight
            if current > best_current:
                best_current = current
                best = index
                best_cell = cell
        if total == 0.0:
            # Every ready endpoint has weight 0: share equally among them.
            best_current = -_INF
            for index in range(n):
                cell = state[ready[index].key]
                current = cell[0] + 1.0
                cell[0] = current
                if current > best_current:
                    best_current = current
                    best = index
                    best_cell = cell
            total = float(n)
        assert best_cell is not None
        best_cell[0] -= total
        if tick >= self._sweep_at:
            self._sweep(tick)
        return best

    def peek(
        self,
        ready: Sequence[Weighted],
        context: object,
        now: float,
        avoid: Container[Hashable] = (),
    ) -> int:
        """The index :meth:`pick` would return without the ``avoid`` keys; no state changes.

        The largest ``current + weight`` among the endpoints not avoided
        (the first in ``ready`` order on a tie); when all of those have
        weight 0, the largest ``current``. Raises
        :class:`~poise.SelectionError` when nothing is left to pick.
        """
        state = self._state
        total = 0.0
        best = -1
        best_current = -_INF
        for index in range(len(ready)):
            endpoint = ready[index]
            weight = endpoint.weight
            if not 0.0 <= weight < _INF:
                raise _bad_weight("WeightedRoundRobin", endpoint, weight)
            key = endpoint.key
            if key in avoid:
                continue
            cell = state.get(key)
            current = (0.0 if cell is None else cell[0]) + weight
            total += weight
            if current > best_current or best < 0:
                best_current = current
                best = index
        if best < 0:
            raise (
                _nothing_ready("WeightedRoundRobin")
                if not ready
                else _all_avoided("WeightedRoundRobin")
            )
        if total == 0.0:
            # Only zero weights among the candidates: pick() shares equally.
            best = -1
            for index in range(len(ready)):
                key = ready[index].key
                if key in avoid:
                    continue
                cell = state.get(key)
                current = 0.0 if cell is None else cell[0]
                if current > best_current or best < 0:
                    best_current = current
                    best = index
        return best

    def _sweep(self, tick: int) -> None:
        cutoff = tick - self._horizon
        stale = [key for key, cell in self._state.items() if cell[1] <= cutoff]
        for key in stale:
            del self._state[key]
        self._sweep_at = tick + self._horizon

    def __repr__(self) -> str:
        return f"<WeightedRoundRobin tracked_keys={len(self._state)}>"


class PowerOfTwoChoices:
    """Sample two distinct ready endpoints at random; pick the one with lower load.

    With :class:`~poise.PeakEwma` trackers this is the Finagle / Tower /
    Linkerd balancer; with :class:`~poise.InFlight` it is "P2C least loaded".
    Sampling avoids the herd behaviour of always choosing the global minimum
    (every client piling onto the same endpoint) while still steering away
    from slow or busy endpoints, and it costs two ``load`` reads per pick.

    Ties go to the first sample, which is itself uniformly random, so equal
    loads share traffic evenly; given the generator's state the choice is
    deterministic. Pass ``rng=random.Random(seed)`` for reproducible runs. With
    one ready endpoint it is picked without consulting the generator.

    Cost: O(1), two random draws, two ``load(now)`` calls, no allocation.
    """

    __slots__ = ("_random",)

    def __init__(self, rng: random.Random | None = None) -> None:
        if rng is None:
            rng = random.Random()
        elif not isinstance(rng, random.Random):
            raise InvalidInput(
                f"PowerOfTwoChoices rng must be a random.Random, got {type(rng).__name__}"
            )
        self._random = rng.random

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        n = len(ready)
        if n <= 1:
            if n == 1:
                return 0
            raise _nothing_ready("PowerOfTwoChoices")
        draw = self._random
        first = int(draw() * n)
        second = int(draw() * (n - 1))
        if second >= first:
            second += 1
        if ready[second].load(now) < ready[first].load(now):
            return second
        return first

    def __repr__(self) -> str:
        return "<PowerOfTwoChoices>"


class LeastLoaded:
    """Scan every ready endpoint and pick the lowest ``load(now)``.

    Ties rotate: the scan starts one past the previous winner and keeps the
    first minimum it meets, so endpoints with equal load take turns instead
    of the first one taking everything. Prefer :class:`PowerOfTwoChoices`
    when many clients share the endpoints (all of them seeing the same
    minimum at once leads to herding) or when ``n`` is large.

    Cost: O(n) ``load(now)`` calls, no allocation.

    :meth:`peek` scans the same way, skipping the endpoints to avoid, and
    leaves the rotation where it is.
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        n = len(ready)
        if n == 0:
            raise _nothing_ready("LeastLoaded")
        start = self._next
        if start >= n:
            start %= n
        best = start
        best_load = ready[start].load(now)
        for index in range(start + 1, n):
            load = ready[index].load(now)
            if load < best_load:
                best_load = load
                best = index
        for index in range(start):
            load = ready[index].load(now)
            if load < best_load:
                best_load = load
                best = index
        self._next = best + 1
        return best

    def peek(
        self,
        ready: Sequence[Weighted],
        context: object,
        now: float,
        avoid: Container[Hashable] = (),
    ) -> int:
        """The index :meth:`pick` would return without the ``avoid`` keys; no state changes.

        The lowest load among the endpoints not avoided, the first one met
        scanning from the rotation's start (and wrapping around). Raises
        :class:`~poise.SelectionError` when nothing is left to pick.
        """
        n = len(ready)
        if n == 0:
            raise _nothing_ready("LeastLoaded")
        start = self._next
        if start >= n:
            start %= n
        best = -1
        best_load = _INF
        for offset in range(n):
            index = start + offset
            if index >= n:
                index -= n
            endpoint = ready[index]
            if endpoint.key in avoid:
                continue
            load = endpoint.load(now)
            if best < 0 or load < best_load:
                best_load = load
                best = index
        if best < 0:
            raise _all_avoided("LeastLoaded")
        return best

    def __repr__(self) -> str:
        return f"<LeastLoaded next={self._next}>"


# -- stable encoding for rendezvous hashing -----------------------------------------


def _encode(value: object) -> bytes:
    """Bytes that identify ``value`` across processes (never Python's ``hash()``).

    str, bytes, int, float, bool, None and tuples of these are encoded by
    type and value; anything else by its ``repr()``, which must then be
    value-based and stable (true for dataclasses and most value objects).
    Every part is length-prefixed so no two distinct values concatenate alike.
    """
    if isinstance(value, str):
        tag, body = b"s", value.encode("utf-8", "surrogatepass")
    elif isinstance(value, bytes | bytearray | memoryview):
        tag, body = b"b", bytes(value)
    elif isinstance(value, bool):
        tag, body = b"?", b"1" if value else b"0"
    elif isinstance(value, int):
        tag, body = b"i", str(value).encode("ascii")
    elif isinstance(value, float):
        tag, body = b"f", struct.pack(">d", value)
    elif value is None:
        tag, body = b"n", b""
    elif isinstance(value, tuple):
        tag, body = b"t", b"".join(_encode(item) for item in value)
    else:
        tag, body = b"r", repr(value).encode("utf-8", "surrogatepass")
    return tag + len(body).to_bytes(4, "big") + body


_UNIT = 2.0**-52


class WeightedRendezvous:
    """Affinity by weighted rendezvous hashing (highest random weight).

    For a context ``c`` (the affinity key: a user id, a shard key, the whole
    request with ``UseRequest``) every ready endpoint ``e`` gets the score::

        h = blake2b(encode(c), encode(e.key)) mapped into (0, 1)
        score = -weight / ln(h)

    and the highest score wins. Because ``ready`` holds only the endpoints
    that are ready, the winner is the best-ranked *ready* endpoint: when the
    preferred endpoint is not ready the context falls back to its next-ranked
    one, and returns when the preferred one is ready again.

    Properties: the same context maps to the same endpoint in every process
    and in any order of ``ready``; adding or removing one endpoint moves only
    the contexts that it wins or held; an endpoint's share of contexts is
    proportional to its weight.

    ``context=None`` is refused with :class:`SelectionError`: a rendezvous
    policy without an affinity key would send everything to one endpoint.
    Configure the balance to pass the request (or a field of it) as context.

    Cost: O(n) per pick, one 8-byte blake2b per candidate; encoded keys are
    cached (the cache is cleared when it outgrows ``4 x len(ready) + 1024``).

    :meth:`peek` ranks the same way among the endpoints not avoided: the
    extra attempt of a hedged call goes to the context's next-ranked ready
    endpoint, never again to the one the first attempt took while another
    is ready, and the same one for every hedge of that context.
    """

    __slots__ = ("_keys",)

    _PERSON = b"poise-hrw-v1"

    def __init__(self) -> None:
        self._keys: dict[Hashable, bytes] = {}

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        keys = self._keys
        if len(keys) > 4 * len(ready) + 1024:
            keys.clear()  # bound the cache of encoded keys as the pool changes
        return self.peek(ready, context, now)

    def peek(
        self,
        ready: Sequence[Weighted],
        context: object,
        now: float,
        avoid: Container[Hashable] = (),
    ) -> int:
        """The index :meth:`pick` would return without the ``avoid`` keys; no state changes.

        The highest score among the endpoints not avoided: with the first
        pick avoided, the context's second-ranked ready endpoint, the one it
        falls back to when its first is not ready. When every candidate left
        has weight 0 they rank as equal, as in :meth:`pick`. Raises
        :class:`~poise.SelectionError` when nothing is left to pick (and,
        as :meth:`pick` does, for ``context=None``).
        """
        n = len(ready)
        if n == 0:
            raise _nothing_ready("WeightedRendezvous")
        if context is None:
            raise SelectionError(
                "WeightedRendezvous needs an affinity context (got None); "
                "configure the balance to pass the request or a field of it"
            )
        base = hashlib.blake2b(_encode(context), digest_size=8, person=self._PERSON)
        keys = self._keys
        log = math.log
        best = -1
        best_score = -1.0
        candidates = 0
        for equal in (False, True):
            for index in range(n):
                endpoint = ready[index]
                weight = endpoint.weight
                if not 0.0 <= weight < _INF:
                    raise _bad_weight("WeightedRendezvous", endpoint, weight)
                key = endpoint.key
                if key in avoid:
                    continue
                candidates += 1
                if equal:
                    weight = 1.0
                elif weight == 0.0:
                    continue
                encoded = keys.get(key)
                if encoded is None:
                    encoded = keys[key] = _encode(key)
                hasher = base.copy()
                hasher.update(encoded)
                bits = int.from_bytes(hasher.digest(), "little") >> 12
                score = weight / -log((bits + 0.5) * _UNIT)
                if score > best_score:
                    best_score = score
                    best = index
            if best >= 0 or not candidates:
                break
        if best < 0:
            raise _all_avoided("WeightedRendezvous")
        return best

    def __repr__(self) -> str:
        return f"<WeightedRendezvous cached_keys={len(self._keys)}>"
