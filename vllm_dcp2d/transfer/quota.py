"""What one source may make a prefill rank hold (docs/security.md, "Bounded resources").

A source is where messages come from: the address a side-channel connection comes
from, or, when frames are sealed with the shared secret, the decode engine id they
name. Counting per connection is not enough: one host opens as many connections as it
likes (a review filled a rank's 4,096 open attempts from 16 connections in 14 s, and
every legitimate fetch was then refused "busy"). A ``Quota`` caps what each source
holds and what all hold, and keeps the last ``reserve`` of both for sources that hold
little, so a few sources flooding it cannot fill it for the others.

``Quota`` has no lock: each owner calls it under its own (``SendLedger``'s, or the sender's
I/O thread). ``Strikes`` counts failures per source in a window.
"""

from __future__ import annotations

import threading

__all__ = ["Quota", "Strikes"]


class Quota:
    """Items and bytes held per source.

    per_source, total:             items one source / all sources may hold.
    per_source_bytes, total_bytes: bytes one source / all sources may hold.
    reserve:   the fraction of ``total`` and ``total_bytes`` only a source holding fewer than
               ``small`` items and ``small_bytes`` bytes may take.
    """

    def __init__(self, what: str, per_source: int, total: int, per_source_bytes: int, total_bytes: int,
                 reserve: float = 1 / 8, small: int = 16, small_bytes: int = 1 << 20):
        self.what = what
        self.per_source, self.total, self.per_source_bytes, self.total_bytes = (per_source, total, per_source_bytes,
                                                                                 total_bytes)
        self._free_count = total - int(total * reserve)  # what sources that hold much may fill
        self._free_bytes = total_bytes - int(total_bytes * reserve)
        self.small, self.small_bytes = small, small_bytes
        self._held: dict[str, list[int]] = {}  # source -> [items, bytes]
        self.count = 0
        self.nbytes = 0

    def refuses(self, source: str, nbytes: int = 0, items: int = 1) -> str:
        """Why ``source`` may not take ``items`` more holding ``nbytes`` ("" if it may)."""
        n, b = self._held.get(source, (0, 0))
        if n + items > self.per_source or b + nbytes > self.per_source_bytes:
            return (f"{self.what}: this source ({source}) holds {n} (at most {self.per_source}) and "
                    f"{b >> 10} KiB (at most {self.per_source_bytes >> 10})")
        if self.count + items > self.total or self.nbytes + nbytes > self.total_bytes:
            return f"{self.what}: {self.count} held in all (at most {self.total}), {self.nbytes >> 20} MiB"
        large = n >= self.small or b >= self.small_bytes
        if large and (self.count + items > self._free_count or self.nbytes + nbytes > self._free_bytes):
            return (f"{self.what}: {self.count} held in all; the rest is kept for sources holding less than "
                    f"{self.small} (this one ({source}) holds {n})")
        return ""

    def take(self, source: str, nbytes: int = 0, items: int = 1) -> str:
        """Count ``items`` and ``nbytes`` for ``source`` unless ``refuses`` says why not
        (then returns that reason and counts nothing)."""
        why = self.refuses(source, nbytes, items)
        if not why and (items or nbytes):
            held = self._held.setdefault(source, [0, 0])
            held[0] += items
            held[1] += nbytes
            self.count += items
            self.nbytes += nbytes
        return why

    def give(self, source: str, nbytes: int = 0, items: int = 1) -> None:
        """Give back what ``take`` counted."""
        if not (items or nbytes):
            return
        held = self._held[source]
        held[0] -= items
        held[1] -= nbytes
        self.count -= items
        self.nbytes -= nbytes
        if held[0] <= 0 and held[1] <= 0:
            del self._held[source]

    def held(self, source: str) -> tuple[int, int]:
        """``(items, bytes)`` ``source`` holds."""
        n, b = self._held.get(source, (0, 0))
        return n, b


class Strikes:
    """Failures per source in a sliding window (thread-safe): a source with ``limit`` of them
    in the last ``window_s`` is refused what costs the rank to try (a new Mooncake session's
    handshake probe: a review named 1,000 silent sessions from one host, each probe holding a
    writer for its bound). Remembers at most ``max_sources`` sources, the oldest forgotten."""

    def __init__(self, what: str, limit: int = 8, window_s: float = 10.0, max_sources: int = 4096):
        self.what, self.limit, self.window_s, self.max_sources = what, limit, window_s, max_sources
        self._lock = threading.Lock()
        self._times: dict[str, list[float]] = {}  # source -> failure times, oldest first

    def strike(self, source: str, now: float) -> None:
        with self._lock:
            times = self._times.pop(source, [])
            self._times[source] = ([t for t in times if now - t < self.window_s] + [now])[-self.limit:]
            while len(self._times) > self.max_sources:
                del self._times[next(iter(self._times))]

    def refuses(self, source: str, now: float) -> str:
        """Why ``source`` is refused now ("" if it is not)."""
        with self._lock:
            times = [t for t in self._times.get(source, ()) if now - t < self.window_s]
        if len(times) < self.limit:
            return ""
        return (f"{self.what}: this source ({source}) had {len(times)} in the last {self.window_s:g} s; refused "
                f"for another {self.window_s - (now - times[0]):.1f} s")
