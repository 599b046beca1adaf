"""A prefill rank's write jobs, one thread per decode rank writing (issue 37, finding 5).

A Mooncake write to a frozen or slow decode can take ``STALL_S`` per batch, and a
cancel does not interrupt it. With a fixed pool of writer threads shared by every
decode, two such writes held the whole pool and another decode's fetch never
started. Here each peer (a decode rank's Mooncake session) with jobs holds a thread of
its own until its queue is empty, so a peer's writes run in order and only that peer's
jobs wait behind them. At most ``max_threads`` peers hold one at once; a peer past that
waits for the first thread to free. One source (``quota.py``: the address the decode's
links come from) holds at most ``max_per_source`` of them: a review named 1,000 silent
sessions from one host, each holding a writer for its handshake's bound, and another
decode's fetch waited 28 s.

A thread whose peer has no job left gives the peer up and waits ``IDLE_S`` for another
peer's job before it ends (issue 52): under steady load a thread per request was created
and destroyed, and the soak's prefill workers grew (BENCHMARKS.md, "Soak"). An idle
thread holds no peer, so it counts against neither cap: the caps bound the peers whose
writes hold threads (a black hole holds one by blocking inside a job, never while idle),
and an idle thread takes the next peer of any source at once. Threads alive, idle ones
included, stay at most ``max_threads``: a thread is started only when none is idle.

Each job returns whether it left an outcome for the owner (the ``SendLedger``'s answers);
the writer then rings ``done`` (the owner's I/O thread's ``sockets.Waker``), which takes
it. Nothing here calls into the owner.

Public API
----------
``Writers(name, done=None, max_threads=MAX_THREADS, max_per_source=MAX_PER_SOURCE)``
    ``.submit(peer: str, job: Callable[[], bool | None], source="")``  run ``job`` after ``peer``'s earlier jobs.
    ``.close(timeout_s)``                              stop taking jobs; end the idle threads, join all.
    ``.alive() -> bool``                               whether a thread still runs.
    ``.failed -> str``                                 why a thread died ("" while all run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["Writers", "MAX_THREADS", "MAX_PER_SOURCE", "IDLE_S"]

log = logging.getLogger(__name__)
MAX_THREADS = 64  # writer threads of one prefill rank at once (one per decode rank writing)
MAX_PER_SOURCE = 16  # ... of them for the peers of one source
IDLE_S = 5.0  # how long a thread with no job waits for one before it ends


class Writers:
    """Jobs by peer, each peer's in order on one thread at a time (see the module doc).

    done: what a job that returns True wakes (``.wake()``, any thread), or None.
    """

    def __init__(self, name: str, done=None, max_threads: int = MAX_THREADS, max_per_source: int = MAX_PER_SOURCE):
        self.name, self.done, self.max_threads, self.max_per_source = name, done, max_threads, max_per_source
        self.failed = ""
        self._lock = threading.Condition()  # idle threads wait on it for a peer handed to them
        self._queues: dict[str, deque] = {}   # peer -> jobs not started
        self._running: set[str] = set()       # peers holding a thread
        self._source: dict[str, str] = {}     # peer -> its source, while it has jobs or a thread
        self._per_source: dict[str, int] = {}  # source -> its peers holding a thread
        self._threads: set[threading.Thread] = set()
        self._idle = 0                         # idle threads no peer was handed to yet
        self._handed: deque[str] = deque()     # peers handed to an idle thread, not taken yet
        self._closed = False

    def submit(self, peer: str, job: Callable[[], bool | None], source: str = "") -> None:
        with self._lock:
            if self._closed:
                return
            self._queues.setdefault(peer, deque()).append(job)
            self._source.setdefault(peer, source)
            if peer in self._running or not self._may_run(peer):
                return  # its thread takes it, or the first thread to free does
            self._run_as(peer)
            if self._idle:
                self._idle -= 1
                self._handed.append(peer)
                self._lock.notify()
            else:
                self._start(peer)

    def _may_run(self, peer: str) -> bool:
        """Under ``_lock``: a thread is free for ``peer``, and its source may have one more."""
        return (len(self._running) < self.max_threads
                and self._per_source.get(self._source[peer], 0) < self.max_per_source)

    def _run_as(self, peer: str) -> None:
        """Under ``_lock``: ``peer`` takes a thread."""
        self._running.add(peer)
        src = self._source[peer]
        self._per_source[src] = self._per_source.get(src, 0) + 1

    def _done(self, peer: str) -> None:
        """Under ``_lock``: ``peer`` has no jobs left and gives its thread up."""
        self._queues.pop(peer, None)
        self._running.discard(peer)
        src = self._source.pop(peer)
        left = self._per_source[src] - 1
        if left:
            self._per_source[src] = left
        else:
            del self._per_source[src]

    def _start(self, peer: str) -> None:
        """Under ``_lock``: a new thread for ``peer`` (which holds it already)."""
        t = threading.Thread(target=self._run, args=(peer,), name=f"dcp2d-write-{self.name}", daemon=True)
        self._threads.add(t)
        t.start()

    def _next(self, peer: str):
        """``(peer, job)`` this thread runs next: its peer's next job, else a waiting peer's
        (one that found every thread busy), else one handed to it within ``IDLE_S``, else
        ``(None, None)``: the thread ends."""
        with self._lock:
            q = self._queues.get(peer)
            if q and not self._closed:
                return peer, q.popleft()
            self._done(peer)
            for other, jobs in self._queues.items():
                if jobs and other not in self._running and not self._closed and self._may_run(other):
                    self._run_as(other)
                    return other, jobs.popleft()
            self._idle += 1
            until = time.monotonic() + IDLE_S
            while not self._handed and not self._closed and (left := until - time.monotonic()) > 0:
                self._lock.wait(left)
            if self._handed and not self._closed:
                other = self._handed.popleft()
                return other, self._queues[other].popleft()
            if not self._handed:  # else the peer handed out counted this thread already
                self._idle -= 1
            self._threads.discard(threading.current_thread())
            return None, None

    def _run(self, peer: str) -> None:
        try:
            while True:
                peer, job = self._next(peer)
                if job is None:
                    return
                try:
                    wake = job()
                except Exception:  # the jobs answer their own failures; this is a bug in one of them
                    log.exception("%s: a write job failed", self.name)
                    wake = True
                if wake and self.done is not None:
                    self.done.wake()
        except Exception as e:  # outside every job: the owner fails the engine on it
            self.failed = f"a writer of {self.name} died: {type(e).__name__}: {e}"
            log.exception("%s", self.failed)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()  # the idle threads end now, not after IDLE_S
            threads = list(self._threads)
        for t in threads:
            t.join(timeout_s)

    def alive(self) -> bool:
        """Whether a writer thread still runs (a write may still read a staging slot)."""
        with self._lock:
            return any(t.is_alive() for t in self._threads)
