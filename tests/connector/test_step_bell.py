"""The step bell (``connector/step_bell.py``): an idle engine step ends when a worker
rings, also from another process, and sleeps its full time otherwise."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import sys
import threading
import time

from hypothesis import given, settings, strategies as st

from vllm_dcp2d.connector.step_bell import PREFIX, BellRope, StepBell

LONG_S = 30.0  # a sleep no test waits out: a ring must end it


def test_ring_from_another_thread_ends_the_sleep():
    bell = StepBell()
    rope = BellRope(bell.address)
    try:
        t = threading.Timer(0.05, rope.ring)
        t.start()
        t0 = time.monotonic()
        assert bell.sleep(LONG_S) is True
        assert time.monotonic() - t0 < LONG_S / 2
        t.join()
    finally:
        rope.close()
        bell.close()


def test_ring_from_another_process_ends_the_sleep():
    bell = StepBell()
    # The child rings once told to, after its start-up: the bound is on ring -> wake, not on an
    # interpreter's start (19 s once, under the whole suite run as an AVX2 host).
    code = ("import sys, time; from vllm_dcp2d.connector.step_bell import BellRope; "
            "r = BellRope(sys.argv[1]); print('ready', flush=True); sys.stdin.readline(); "
            "r.ring(); time.sleep(0.5); r.close()")
    p = subprocess.Popen([sys.executable, "-c", code, bell.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"  # bounded by the test's own timeout
        t0 = time.monotonic()
        p.stdin.write("ring\n")
        p.stdin.flush()
        assert bell.sleep(LONG_S) is True
        assert time.monotonic() - t0 < LONG_S / 2
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        bell.close()


def test_no_ring_sleeps_the_full_time():
    bell = StepBell()
    try:
        t0 = time.monotonic()
        assert bell.sleep(0.3) is False
        assert time.monotonic() - t0 >= 0.29
    finally:
        bell.close()


@settings(max_examples=10, deadline=None)
@given(rings=st.integers(1, 50))
def test_one_sleep_takes_every_queued_ring(rings):
    """Rings queued while a step ran wake the next sleep once, not once per ring
    (the idle polling rate stays bounded), and the sleep after it waits again."""
    bell = StepBell()
    rope = BellRope(bell.address)
    try:
        for _ in range(rings):
            rope.ring()
        time.sleep(1.0)  # every ring that was queued has reached the bell (ZMQ moves them on its I/O threads)
        assert bell.sleep(LONG_S) is True
        t0 = time.monotonic()
        assert bell.sleep(0.2) is False
        assert time.monotonic() - t0 >= 0.19
    finally:
        rope.close()
        bell.close()


def test_the_bell_lives_in_a_private_directory_removed_on_close():
    """Only this user's processes can ring it (issue 37, finding 9: an abstract socket
    could be rung by any local process); closing removes it, and a late ring is harmless."""
    bell = StepBell()
    path = bell.address.removeprefix("ipc://")
    d = os.path.dirname(path)
    info = os.stat(d)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert os.path.basename(d).startswith(f"{PREFIX}{os.getpid()}-")
    rope = BellRope(bell.address)
    rope.ring()
    assert bell.sleep(5.0)
    bell.close()
    assert not os.path.exists(d)
    rope.ring()
    rope.ring()  # nobody listens: dropped, never blocks
    rope.close()
    rope.ring()  # closed: nothing


def test_a_killed_engines_bell_directory_is_removed_by_the_next(tmp_path, monkeypatch):
    """A killed engine core runs no close(): the next bell removes the directories of
    processes that are gone, and only those."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone, live = tmp_path / f"{PREFIX}{dead.pid}-x", tmp_path / f"{PREFIX}{os.getpid()}-y"
    for d in (gone, live):
        d.mkdir(mode=0o700)
        (d / "bell").write_bytes(b"")
    bell = StepBell()
    try:
        assert not gone.exists() and live.exists()
    finally:
        bell.close()


def test_a_file_bell_is_removed_on_close(tmp_path):
    bell = StepBell(f"ipc://{tmp_path}/bell")
    assert (tmp_path / "bell").exists()
    bell.close()
    assert not (tmp_path / "bell").exists()


def test_an_address_that_cannot_be_bound_leaves_a_plain_sleep():
    bell = StepBell("ipc://@" + "d" * 200)  # longer than an ipc address may be
    assert bell.address == ""
    BellRope("").ring()
    t0 = time.monotonic()
    assert bell.sleep(0.2) is False and time.monotonic() - t0 >= 0.19
    bell.close()


def test_a_rope_aimed_at_another_bell_rings_that_one():
    """The worker hands ``rope.ring`` to its receiver once; each step's metadata may name
    another bell (a restarted scheduler side), and the rope follows it."""
    first, second = StepBell(), StepBell()
    rope = BellRope("")
    ring = rope.ring
    try:
        ring()  # aimed at nothing yet: nothing to ring
        rope.aim(first.address)
        ring()
        assert first.sleep(LONG_S) is True
        rope.aim(second.address)
        ring()
        assert second.sleep(LONG_S) is True
        assert first.sleep(0.05) is False  # the ring went to the second bell only
    finally:
        rope.close()
        first.close()
        second.close()
