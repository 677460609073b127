"""Time and order rules of the watch loop, synchronous with the time passed in.

Contract: no I/O, no clock of its own; the provider asks these and acts.

* :func:`silence_limit`: how long a watch may stay silent. The API server's
  watch cache sends a BOOKMARK to every watch that asked for them about
  once a minute (``bookmarkFrequency`` in
  staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go), so once this
  server has sent one, ``bookmark_silence`` (80 s by default) of silence
  means the stream is dead; before that - a server without a watch cache
  sends none - only ``watch_timeout + watch_grace`` does.
* :func:`went_backwards`: resourceVersions are opaque and never ordered
  here, with one exception: when both are decimal (etcd revisions, what
  every API server sends) and the new one is *lower* than the one held, the
  server's storage was restored from a backup; the held state is void.
* :class:`RefreshGate`: a bookmark confirms the listing; at most one
  confirmation per ``every`` seconds reaches the sink, however many
  bookmarks arrive (a flood of them costs decoding, not sink work).
"""

from __future__ import annotations

__all__ = ["RefreshGate", "silence_limit", "went_backwards"]


def silence_limit(
    *, watch_timeout: float, watch_grace: float, bookmark_silence: float, bookmarks_seen: bool
) -> float:
    """Seconds of silence after which a watch counts as broken."""
    longest = watch_timeout + watch_grace
    return min(bookmark_silence, longest) if bookmarks_seen else longest


def went_backwards(held: str, seen: str) -> bool:
    """Whether ``seen`` is a lower decimal version than ``held`` (a storage restore)."""
    if not (held.isdecimal() and seen.isdecimal() and held.isascii() and seen.isascii()):
        return False
    return int(seen) < int(held)


class RefreshGate:
    """At most one confirmation per ``every`` seconds (see the module docstring)."""

    __slots__ = ("_last", "every")

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._last: float | None = None

    def due(self, now: float) -> bool:
        """Whether a confirmation may pass at ``now`` (and note it if so)."""
        if self._last is not None and now - self._last < self.every:
            return False
        self._last = now
        return True
