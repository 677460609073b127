"""Time and order rules of the watch loop, synchronous with the time passed in.

Contract: no I/O, no clock of its own; the provider asks these and acts.

* :func:`silence_limit`: how long a watch may stay silent, counted from the
  watch's start as well as from its last line. The API server's watch cache
  gives each watch that allows bookmarks a first bookmark about a minute
  after it starts and one about every minute after that
  (``bookmarkFrequency`` and ``nextBookmarkTime`` in
  staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go and
  cache_watcher.go), so ``bookmark_silence`` (80 s by default) bounds every
  silence, the first one included. What the silence *means* depends on what
  this server has shown (:func:`silence_is_failure`). Once a bookmark was
  seen, silence is a failure, and the stream lists again rather than
  watching again from the version it holds: a server whose storage was
  restored to an older version accepts a watch from the later version
  (HTTP 200) and sends nothing at all, bookmarks included, until its own
  version passes it (watch_cache.go ``getAllEventsSinceLocked`` finds no
  event, cache_watcher.go ``process`` drops every lower one), so only a list
  shows where it is. Before the first bookmark, silence is no proof of
  anything: the cacher sends no bookmark until it has processed one event of
  the resource (``lastProcessedResourceVersion == 0`` in ``dispatchEvents``),
  and a server without a watch cache never sends any. The watch is then
  reopened quietly (no failure, no relist) after a one-item list has shown
  that the server's version is not lower than the one held; a lower one is
  a restore, and the stream lists again.
* :func:`went_backwards`: resourceVersions are opaque and never ordered
  here, with one exception: when both are decimal (etcd revisions, what
  every API server sends) and the new one is *lower* than the one held, the
  server's storage was restored from a backup; the held state is void.
* :func:`retry_wait`: after a failure the next request waits the backoff
  delay, or what the server asked for (``Retry-After``) when that is
  longer, up to ``max_backoff``.
* :class:`RefreshGate`: a bookmark confirms the listing; at most one
  confirmation per ``every`` seconds reaches the sink, however many
  bookmarks arrive (a flood of them costs decoding, not sink work).
"""

from __future__ import annotations

__all__ = ["RefreshGate", "retry_wait", "silence_is_failure", "silence_limit", "went_backwards"]


def silence_limit(*, watch_timeout: float, watch_grace: float, bookmark_silence: float) -> float:
    """Seconds of silence (from the start or the last line) that end a watch."""
    return min(bookmark_silence, watch_timeout + watch_grace)


def silence_is_failure(*, bookmarks_seen: bool) -> bool:
    """Whether a silent watch is reported (True) or reopened quietly (False)."""
    return bookmarks_seen


def went_backwards(held: str, seen: str) -> bool:
    """Whether ``seen`` is a lower decimal version than ``held`` (a storage restore)."""
    if not (held.isdecimal() and seen.isdecimal() and held.isascii() and seen.isascii()):
        return False
    return int(seen) < int(held)


def retry_wait(backoff: float, server: float | None, cap: float) -> float:
    """Seconds before the next request after a failure: the backoff delay,
    or the server's delay (``server``, None when it gave none) when longer,
    never more than ``cap`` for the server's part."""
    if server is None:
        return backoff
    return max(backoff, min(server, cap))


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
