"""Hosts for a multi-host test on one machine: Linux network namespaces joined
by veth pairs to one bridge.

Each host gets its own namespace with ``lo`` and ``eth0`` at
``198.18.0.<10+i>/24``; the bridge in the caller's namespace is
``198.18.0.1``, so the test process reaches every host, and hosts reach each
other, only through the bridge. 198.18.0.0/15 is the range RFC 2544 reserves
for benchmarking; nothing leaves the machine (no default route is set, and
only these addresses are used). Needs root (CAP_NET_ADMIN) and ``ip``.

    with Hosts(["prefill", "decode"]) as hosts:
        hosts["prefill"].addr, hosts["prefill"].netns
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

__all__ = ["Host", "Hosts", "unavailable"]

SUBNET = "198.18.0"


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
        self.hosts: dict[str, Host] = {}
        self._links: list[str] = []

    def __enter__(self) -> dict[str, Host]:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                host = Host(name, f"dcp2d-{self.tag}-{i}", f"{SUBNET}.{10 + i}")
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
