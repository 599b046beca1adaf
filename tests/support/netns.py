"""Hosts for a multi-host test on one machine: Linux network namespaces joined
by veth pairs to one bridge.

Each ``Hosts`` takes a /24 of 198.18.0.0/15 that no interface here uses (the range
RFC 2544 reserves for benchmarking), ``198.18.<k>.0/24`` or ``198.19.<k>.0/24``. Each
host gets its own namespace with ``lo`` and ``eth0`` at ``<subnet>.<10+i>``; the bridge
in the caller's namespace is ``<subnet>.1``, so the test process reaches every host,
and hosts reach each other, only through the bridge. Nothing leaves the machine (no
default route is set, and only these addresses are used). Needs root (CAP_NET_ADMIN)
and ``ip``.

A run killed before its ``__exit__`` leaves its bridge, veths and namespaces behind.
Two bridges with one subnet would make the caller's routes ambiguous, so each
``Hosts`` takes an unused subnet, and removes what dead owners left: the bridge's
alias names the pid that made it.

    with Hosts(["prefill", "decode"]) as hosts:
        hosts["prefill"].addr, hosts["prefill"].netns
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass

__all__ = ["Host", "Hosts", "free_subnet", "remove_dead", "unavailable"]

SUBNETS = [f"198.{a}.{b}" for a in (18, 19) for b in range(256)]


@dataclass(frozen=True)
class Host:
    name: str
    netns: str   # for ``ip netns exec``
    addr: str    # its eth0 address


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns, "ip"] if netns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


def _run_ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    return r.stdout if r.returncode == 0 else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead() -> list[str]:
    """Remove the bridges, veths and namespaces of ``Hosts`` whose owner process is
    gone (a bridge without an owner alias counts as gone). Returns their tags."""
    tags = []
    for line in _run_ip("-o", "-d", "link", "show", "type", "bridge").splitlines():
        m = re.match(r"\d+: d2b([0-9a-f]{6})[:@]", line)
        if not m:
            continue
        owner = re.search(r"\balias dcp2d-pid-(\d+)", line)
        if owner and _alive(int(owner.group(1))):
            continue
        tags.append(m.group(1))
    for tag in tags:
        for ns in _run_ip("netns", "list").split():
            if ns.startswith(f"dcp2d-{tag}-"):
                _run_ip("netns", "del", ns)
        for link in re.findall(rf"^\d+: (d2v{tag}\d+)[:@]", _run_ip("-o", "link", "show"), re.M):
            _run_ip("link", "del", link)
        _run_ip("link", "del", f"d2b{tag}")
    return tags


def free_subnet() -> str:
    """A /24 of ``SUBNETS`` (as "a.b.c") on no interface here; random, so two runs
    starting at once rarely draw the same one."""
    used = set(re.findall(r"inet (198\.1[89]\.\d+)\.\d+/", _run_ip("-o", "-4", "addr", "show")))
    free = [s for s in SUBNETS if s not in used]
    if not free:
        raise RuntimeError(f"every /24 of 198.18.0.0/15 is on an interface here ({len(used)} in use)")
    return random.choice(free)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the suite as root"
    probe = f"dcp2d-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """Context manager: ``{name: Host}`` for ``names``; everything is removed on exit."""

    def __init__(self, names: list[str]):
        if len(names) > 200:
            raise ValueError(f"at most 200 hosts, got {len(names)}")
        self.names = list(names)
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"d2b{self.tag}"
        self.subnet = ""
        self.hosts: dict[str, Host] = {}
        self._links: list[str] = []

    def __enter__(self) -> dict[str, Host]:
        remove_dead()
        self.subnet = free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("link", "set", self.bridge, "alias", f"dcp2d-pid-{os.getpid()}")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                host = Host(name, f"dcp2d-{self.tag}-{i}", f"{self.subnet}.{10 + i}")
                _ip("netns", "add", host.netns)
                self.hosts[name] = host
                outer, inner = f"d2v{self.tag}{i}", f"d2p{self.tag}{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._links.append(outer)
                _ip("link", "set", inner, "netns", host.netns)
                _ip("link", "set", inner, "name", "eth0", netns=host.netns)
                _ip("addr", "add", f"{host.addr}/24", "dev", "eth0", netns=host.netns)
                _ip("link", "set", "eth0", "up", netns=host.netns)
                _ip("link", "set", "lo", "up", netns=host.netns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
        except BaseException:
            self.__exit__()
            raise
        return dict(self.hosts)

    def __exit__(self, *exc) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
        for link in reversed(self._links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self.hosts, self._links = {}, []
