"""Wake an idle engine step when a fetch ends (issue 29).

A decode engine waiting for remote KV keeps stepping with nothing to compute, and
each such step sleeps ``IDLE_POLL_S`` (``scheduler.py``) so that the polling does
not starve the API server on a small machine. A fetch that ended during the sleep
waited out the rest of it before a worker reported it in ``finished_recving``, and
the request was scheduled once that step's output was processed: 10 ms on average,
20 ms at worst, added to every PD request.

The scheduler side binds a ``StepBell`` (an ipc PULL socket in the engine-core
process, in a directory of its own with mode 0700, so only this user's processes
can ring it: an abstract-namespace socket, which it was, could be rung by any local
process, each ring cutting an idle step's sleep short) and sends its address to the workers in every step's metadata
(``DCP2DMetadata.bell``); a worker's ``BellRope`` rings it whenever its receiver
ends a fetch (or lifts a quarantine). The idle sleep waits on the bell, so it ends
as soon as a worker has something to report.

Why this keeps the starvation fix: a ring comes only from a finished fetch, so the
idle steps still run at most once per ``IDLE_POLL_S`` plus once per fetch. No ring
is needed for correctness: a ring that is lost (a worker on another host, where
the ipc path does not exist; a bell that could not bind) costs what the sleep
costs and nothing else. The ring is sent after the fetch's result is visible to
``Receiver.poll`` and the bell is drained before the step that polls it, so a ring
is never consumed by a step that cannot see its fetch. Under async scheduling (two
steps in flight) the step after a rung one would sleep again before the rung step's
output is processed, so the scheduler lets the idle step after a ring run unslept
too: still a bounded number of steps per finished fetch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time

import zmq

from vllm_dcp2d.transfer.sockets import socket

__all__ = ["StepBell", "BellRope", "PREFIX"]

log = logging.getLogger(__name__)
PREFIX = "dcp2d-bell-"


class StepBell:
    """Scheduler side: ``sleep(timeout_s)`` returns early when a worker rings.

    address: where to bind; default a socket file in a fresh directory of mode 0700
    (``PREFIX``-pid-random in the temporary directory; removed on close, and those of
    processes that are gone are removed when the next bell starts). ``.address`` is
    ``""`` when it could not be bound (a name too long for an ipc address, no file
    descriptors left); ``sleep`` then sleeps the whole time.
    """

    def __init__(self, address: str | None = None):
        self._dir = None
        if address is None:
            _remove_stale()
            try:
                self._dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")  # mode 0700
                address = f"ipc://{os.path.join(self._dir, 'bell')}"
            except OSError as e:
                log.warning("DCP2D: no step bell (%s): idle steps sleep their full time", e)
                address = ""
        self._sock = _open(zmq.PULL, address, "no step bell", "idle steps sleep their full time") if address else None
        self.address = address if self._sock is not None else ""

    def sleep(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a ring; True if one came. Drains every
        ring queued so far (one step reports every fetch that ended before it)."""
        if self._sock is None:
            time.sleep(timeout_s)
            return False
        if not self._sock.poll(max(0, int(timeout_s * 1000))):
            return False
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            path = self.address.removeprefix("ipc://")
            if not path.startswith("@"):  # ZMQ removes the file too, but later, on its I/O thread
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class BellRope:
    """Worker side: ``ring()`` from any thread; never blocks and never raises.

    ``address``: a ``StepBell.address`` (``""``: ringing does nothing); ``aim`` moves
    the rope to another bell (a step names the scheduler's), so whoever holds ``ring``
    keeps ringing the current one."""

    def __init__(self, address: str):
        self.address = ""
        self._lock = threading.Lock()
        self._sock = None
        self.aim(address)

    def aim(self, address: str) -> None:
        """Ring the bell at ``address`` from now on (no-op if it is the current one)."""
        with self._lock:
            if address == self.address:  # also after a bell that could not be opened: not again each step
                return
            if self._sock is not None:
                self._sock.close()
            self.address = address
            self._sock = _open(zmq.PUSH, address, "cannot ring the step bell",
                               "fetches wait for the idle sleep") if address else None

    def ring(self) -> None:
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # a ring already queued (Again), or the bell is gone: the sleep ends anyway
                pass

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _remove_stale() -> None:
    """Remove the bell directories of this user's engine processes that are gone (killed:
    nothing ran their ``close``). Another user's are not ours to touch, nor can we."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _open(kind: int, address: str, what: str, then: str) -> zmq.Socket | None:
    """A PULL socket bound to ``address``, or a PUSH socket connected to it; None (logged:
    ``what`` failed, so ``then``) if ZMQ refuses (a name too long for ipc, no file
    descriptors left)."""
    sock = None
    try:
        sock = socket(kind)
        if kind == zmq.PULL:
            sock.bind(address)
        else:
            sock.setsockopt(zmq.SNDHWM, 1)  # more rings only fill queues: StepBell.sleep drains them at once
            sock.connect(address)
        return sock
    except zmq.ZMQError as e:
        if sock is not None:
            sock.close()
        log.warning("DCP2D: %s at %s (%s): %s", what, address, e, then)
        return None
