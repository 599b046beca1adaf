"""The ``/dev/shm`` files a stopped server leaves behind, and their removal.

vLLM 0.32's CPU shared-memory communicator (``torch.ops._C.init_shm_manager``:
one file per rank and group, ``vllm_dist_<id>-tp:0-[0-1]-cpushm_<rank>``, 4 MiB
each, written) never unlinks its files, not even on a clean shutdown, and an
engine killed with SIGKILL also leaves Python's ``psm_*`` segments (up to
240 MiB) and ``sem.mp-*`` semaphores. ``/dev/shm`` is RAM: one run of
``tests/e2e/test_e2e_spec.py`` left 15 files, a day of suite runs 408 cpushm files, and
a machine that runs the suite again and again fills it. ``servers.py`` therefore notes
which files a server's processes map while it runs and removes the ones no live
process holds once it is stopped.

A file is removed only when no process on the machine maps it or holds it open
(``/proc/*/maps``, ``/proc/*/fd``), so another server's live segment is never
touched.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["held_by_session", "wait_session_gone", "held_anywhere", "remove_unheld"]

SHM = Path("/dev/shm")


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def _session(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])  # after "(comm)": state ppid pgrp session


def _held(pid: str) -> set[Path]:
    held = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5:] or [""]
            if path[0].startswith("/dev/shm/"):
                held.add(Path(path[0].removesuffix(" (deleted)")))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/dev/shm/"):
                held.add(Path(target))
    except OSError:  # the process exited while we read it
        pass
    return held


def held_by_session(sid: int) -> set[Path]:
    """``/dev/shm`` files mapped or open in any process of session ``sid`` (a server
    started with ``start_new_session=True`` leads a session of its own pid)."""
    return set().union(*(_held(p) for p in _pids() if _session(p) == sid))


def wait_session_gone(sid: int, timeout_s: float) -> bool:
    """Wait until no process of session ``sid`` holds a ``/dev/shm`` file; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while held_by_session(sid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def held_anywhere() -> set[Path]:
    """``/dev/shm`` files mapped or open in any process on the machine."""
    return set().union(*(_held(p) for p in _pids()))


def remove_unheld(paths: set[Path]) -> int:
    """Unlink those of ``paths`` that still exist and that no process holds; returns how many."""
    held, removed = held_anywhere(), 0
    for path in paths - held:
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
