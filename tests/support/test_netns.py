"""``tests/support/netns.py``: hosts in network namespaces; two sets at once, and what a
killed run left behind (real namespaces; skipped where they cannot be made)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from tests.support import netns
from tests.support.netns import Hosts

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))]


def _reach(host, addr: str, port: int) -> bool:
    """Whether a TCP connect from inside ``host`` to ``addr:port`` succeeds."""
    code = (f"import socket; socket.create_connection(({addr!r}, {port}), timeout=5).close()")
    r = subprocess.run(["ip", "netns", "exec", host.netns, sys.executable, "-c", code],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout


def test_two_sets_at_once_get_their_own_subnets():
    with Hosts(["a", "b"]) as one, Hosts(["a"]) as two, socket.socket() as listener:
        sub1, sub2 = one["a"].addr.rsplit(".", 1)[0], two["a"].addr.rsplit(".", 1)[0]
        assert sub1 != sub2
        listener.bind(("0.0.0.0", 0))  # the caller's side: reached through each bridge
        listener.listen(8)
        port = listener.getsockname()[1]
        assert _reach(one["a"], f"{sub1}.1", port) and _reach(one["b"], f"{sub1}.1", port)
        assert _reach(two["a"], f"{sub2}.1", port)
        assert not _reach(one["a"], f"{sub2}.1", port)  # no route from one set to the other
    assert one["a"].netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_what_a_killed_owner_left_is_removed_by_the_next_set():
    code = ("import sys, time\n"
            "from tests.support.netns import Hosts\n"
            "h = Hosts(['x', 'y']); h.__enter__()\n"
            "print(h.tag, h.subnet, flush=True); time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        tag, subnet = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert f"d2b{tag}" in _links()  # left behind: its __exit__ never ran
    alive = Hosts(["z"])
    with alive:
        assert f"d2b{tag}" not in _links() and f"d2v{tag}0" not in _links()
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"dcp2d-{tag}-" not in spaces
        # a live owner's set is kept
        assert netns.remove_dead() == [] and f"d2b{alive.tag}" in _links()
