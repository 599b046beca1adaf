"""A stranger on the side channel: a process that knows a prefill's public addresses
(its bootstrap, the ranks its rank table lists, a transfer key) but not the instance's
registration token nor the shared secret, and tries the attacks of issue 37 on them.

Run as its own OS process by the hostile-peer tests:

    python tests/support/stranger.py ATTACK --bootstrap tcp://host:port [--key KEY] [--tokens N]

and prints one JSON object: what each step got back. Every wait is bounded (``WAIT_S``).

ATTACK:
  register      register cp rank 0 at the stranger's own address, without the token
  long          a map with a 5,000-character value to the bootstrap and to every rank
  big           a frame past the wire's limit to every rank
  read          a TransferRequest for KEY with the stranger's own memory, wrong prompt
                digest and wrong token count: does any byte land?
  release       a ReleaseTransfer for KEY without the prompt's digest
  flood         CONNS connections x PER TransferRequests for unknown keys asking to wait 3,600 s
  deputy        the confused deputy (issue 48): the stranger's own request (KEY, TOKENS,
                DIGEST), registered as Mooncake session SESSION with memory MEMORY (a
                victim's, or the prefill's own): does the prefill write there?
  junk          16 MiB frames of zeros behind the sealed frames' magic bytes, as fast as
                they go, on 2 connections to the address given (a rank's side channel, which
                the stranger cannot look up with a secret), for --seconds
  trickle       32 connections to an HTTP bootstrap (``--bootstrap http://host:port``), each
                sending one byte of a GET every 0.5 s and reconnecting when cut, for --seconds:
                how long the server let each connection live
  all           every attack above but ``read``, ``release``, ``deputy``, ``junk`` and ``trickle``

``--source ADDR``: the address its side-channel connections come from (another loopback
address, 127.0.0.2, stands for another host).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import msgpack
import numpy as np
import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.messages import (PROTOCOL_VERSION, Fingerprint, MessageError, QueryRanks, RankTable,
                                           RegisterConsumer, RegisterRank, ReleaseTransfer, Reply, TransferOutcome,
                                           TransferRequest, decode, encode)
from vllm_dcp2d.reshard.regions import KVRegions, Memory

WAIT_S = 5.0
SOURCE = ""  # where its side-channel connections come from (``--source``; "": where routing says)


def connect(sock: zmq.Socket, address: str) -> None:
    """Connect from ``SOURCE`` if set (ZMQ's ``tcp://source:0;host:port``)."""
    sock.connect(address.replace("tcp://", f"tcp://{SOURCE}:0;", 1) if SOURCE else address)


def local_address(address: str) -> str:
    """The address this host's connections to ``address`` come from."""
    if SOURCE:
        return SOURCE
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # no packet: the kernel picks the route and its address
        return s.getsockname()[0]


def ask(address: str, payload: bytes, wait_s: float = WAIT_S, first: bytes = b"") -> str:
    """Send one frame (after ``first``, if given) on a fresh DEALER; what came back: a
    reply's text, "silence" or "closed"."""
    sock = sockets.socket(zmq.DEALER)
    try:
        connect(sock, address)
        if first:
            sockets.send_nowait(sock, first)
        if not sockets.send_nowait(sock, payload):
            return "queue full"
        if not sock.poll(int(wait_s * 1000)):
            return "silence"
        frame = sock.recv()
        try:
            msg = decode(frame)
        except MessageError as e:
            return f"undecodable: {e}"
        return f"{type(msg).__name__}: " + (msg.reason if hasattr(msg, "reason") else "")
    finally:
        sock.close()


def table(bootstrap: str) -> RankTable | None:
    sock = sockets.socket(zmq.DEALER)
    try:
        sock.connect(bootstrap)
        sock.send(encode(QueryRanks("stranger", "stranger")))
        if not sock.poll(int(WAIT_S * 1000)):
            return None
        msg = decode(sock.recv(), (RankTable, Reply))
        return msg if isinstance(msg, RankTable) else None
    except MessageError:
        return None
    finally:
        sock.close()


def register(bootstrap: str, **_) -> dict:
    before = table(bootstrap)
    fp = before.fingerprint if before else Fingerprint("m", 1, 16, "uint8", 16, "x", "x")
    got = ask(bootstrap, encode(RegisterRank(before.engine_id if before else "P", 0,
                                             before.cp_size if before else 1, "tcp://127.0.0.1:9", fp)))
    after = table(bootstrap)
    return {"reply": got, "before": before and list(before.addresses), "after": after and list(after.addresses)}


def _long_map() -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": "RegisterRank", "engine_id": "x" * 5000})


def long(bootstrap: str, **_) -> dict:
    t = table(bootstrap)
    out = {"bootstrap": ask(bootstrap, _long_map())}
    for addr in (t.addresses if t else ()):
        out[addr] = ask(addr, msgpack.packb({"v": PROTOCOL_VERSION, "type": "TransferRequest",
                                             "transfer_key": "k" * 5000, "attempt_id": 1}))
    return out


def big(bootstrap: str, **_) -> dict:
    t = table(bootstrap)
    frame = b"\x80" * (sockets.MAX_FRAME + 1)
    return {addr: ask(addr, frame, 2.0) for addr in (t.addresses if t else ())}


def _request(t: RankTable, key: str, tokens: int, base: int, wait_s: float = 0.0, attempt: int = 1,
             digest: str = "0" * 32) -> TransferRequest:
    """A request for 4 pages whose layers lie one after the other from ``base``."""
    fp = t.fingerprint
    layers = np.arange(fp.num_layers)
    regions = KVRegions.uniform(layers, base + layers * fp.page_bytes * 4, fp.page_bytes)
    return TransferRequest.build(
        regions=regions, block_ids=np.arange(4),
        transfer_key=key, attempt_id=attempt, engine_id="stranger", consumer_rank=0, consumer_size=1,
        dcp_size=1, dcp_rank=0, num_tokens=tokens, first_page=0, num_blocks=4,
        fingerprint=fp, wait_s=wait_s, prompt_digest=digest)


def _own(t: RankTable, rank: str) -> tuple[bytes, int]:
    """The stranger's own registration for its links to ``rank`` (a session on its own host:
    taken without a secret) and the base address of its memory."""
    memory = np.zeros(t.fingerprint.num_layers * 4 * t.fingerprint.page_bytes, np.uint8)
    _KEEP.append(memory)
    reg = RegisterConsumer.of("stranger", f"{local_address(rank)}:9", Memory([memory.ctypes.data], [memory.nbytes]))
    return encode(reg), memory.ctypes.data


_KEEP: list = []


def read(bootstrap: str, key: str = "", tokens: int = 1, **_) -> dict:
    """A TransferRequest with the stranger's memory (no Mooncake engine behind the session:
    a write would fail, but the answer tells whether the rank tried)."""
    t = table(bootstrap)
    if t is None:
        return {"table": None}
    out = {}
    for addr in t.addresses:
        reg, base = _own(t, addr)
        out[addr] = ask(addr, encode(_request(t, key, tokens + 7, base)), first=reg)
    return out


def deputy(bootstrap: str, key: str = "", tokens: int = 1, digest: str = "", session: str = "",
           memory: str = "", **_) -> dict:
    """The stranger's own request, written to where it says: ``session`` and ``memory``
    ("ADDR:BYTES", decimal) are a victim's (or the prefill's own)."""
    t = table(bootstrap)
    if t is None:
        return {"table": None}
    addr, nbytes = map(int, memory.split(":"))
    reg = encode(RegisterConsumer.of("stranger", session, Memory([addr], [nbytes])))
    return {a: ask(a, encode(_request(t, key, tokens, addr, digest=digest)), first=reg) for a in t.addresses}


def release(bootstrap: str, key: str = "", tokens: int = 1, **_) -> dict:
    t = table(bootstrap)
    if t is None:
        return {"table": None}
    for addr in t.addresses:
        ask(addr, encode(ReleaseTransfer(key, "stranger", 0, 1, tokens)), 0.2)
    return {"sent": len(t.addresses)}


def flood(bootstrap: str, conns: int = 1, per: int = 300, **_) -> dict:
    """``conns`` connections, each registered, each sending ``per`` requests for unknown
    keys that ask to wait an hour; how many were answered, and refused as busy."""
    t = table(bootstrap)
    if t is None:
        return {"table": None}
    out = {}
    for addr in t.addresses:
        reg, base = _own(t, addr)
        socks = []
        for c in range(conns):
            sock = sockets.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, per + 1)
            connect(sock, addr)
            sockets.send_nowait(sock, reg)
            for i in range(per):
                req = _request(t, f"unknown-{c}-{i}", 1, base, wait_s=3600.0, attempt=i + 1)
                sockets.send_nowait(sock, encode(req))
            socks.append(sock)
        # Refusals come at once; the rest wait (an hour, cut to the rank's limit): done once
        # nothing came for a second after the first answer, or at the deadline. Not WAIT_S before
        # the first: under the whole suite as an AVX2 host the rank took longer than that to
        # read the 1,024 held ones, the stranger left, and the refusals found no one to answer.
        answers, deadline = [], time.monotonic() + 4 * WAIT_S
        quiet = deadline  # moved to a second after each answer
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while len(answers) < conns * per and time.monotonic() < min(deadline, quiet):
            for sock, _ in poller.poll(100):
                while sock.poll(0):
                    answers.append(decode(sock.recv(), (TransferOutcome, Reply)).reason)
                    quiet = time.monotonic() + 1.0
        for sock in socks:
            sock.close()
        out[addr] = {"answered": len(answers), "busy": sum("refuses the transfer request" in r for r in answers),
                     "held": conns * per - len(answers)}
    return out


JUNK = b"\xc1D2A" + bytes((16 << 20) - 4)  # the seal's magic, then 16 MiB of nothing


def junk(address: str, seconds: float = 5.0, **_) -> dict:
    """Two DEALERs sending ``JUNK`` to ``address`` until ``seconds`` pass; what they queued."""
    socks = [sockets.socket(zmq.DEALER) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.SNDHWM, 4)
        s.connect(address)
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for s in socks:
            sent += sockets.send_nowait(s, JUNK)
        time.sleep(0.001)
    for s in socks:
        s.close()
    return {"sent": sent}


def trickle(address: str, seconds: float = 5.0, **_) -> dict:
    """32 connections to ``http://host:port``, each a byte of ``GET /query`` every 0.5 s,
    replaced when the server cuts it; the longest any lived (s) and how many were cut."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    lives, end, lock = [], time.monotonic() + seconds, threading.Lock()
    request = b"GET /query HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"z" * 4096

    def one():
        while time.monotonic() < end:
            try:
                c = socket.create_connection((host, int(port)), timeout=WAIT_S)
            except OSError:
                time.sleep(0.1)
                continue
            born = time.monotonic()
            try:
                for b in request:
                    if time.monotonic() >= end:
                        break
                    c.sendall(bytes([b]))
                    c.settimeout(0.5)
                    try:
                        if c.recv(1) == b"":  # the server closed it
                            break
                    except TimeoutError:
                        pass
            except OSError:  # reset by the server
                pass
            finally:
                c.close()
            if time.monotonic() < end:
                with lock:
                    lives.append(time.monotonic() - born)
                time.sleep(0.1)  # then the next connection

    threads = [threading.Thread(target=one, daemon=True) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 2 * WAIT_S)
    return {"cut": len(lives), "longest_s": max(lives, default=0.0)}


ATTACKS = {"register": register, "long": long, "big": big, "read": read, "release": release, "flood": flood,
           "junk": junk, "trickle": trickle, "deputy": deputy}


def _args(attack: str, bootstrap: str, **kw) -> list[str]:
    args = [sys.executable, __file__, attack, "--bootstrap", bootstrap]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    return args


def run(attack: str, bootstrap: str, **kw) -> dict:
    """Run this file as its own process against ``bootstrap``; its JSON answer."""
    import subprocess

    out = subprocess.run(_args(attack, bootstrap, **kw), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def spawn(attack: str, bootstrap: str, **kw):
    """``run`` without waiting: the process; ``result(proc)`` waits for its JSON answer."""
    import subprocess

    return subprocess.Popen(_args(attack, bootstrap, **kw), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc, timeout_s: float = 120.0) -> dict:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("attack", choices=[*ATTACKS, "all"])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--key", default="")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--digest", default="")
    p.add_argument("--session", default="")
    p.add_argument("--memory", default="")
    p.add_argument("--conns", type=int, default=1)
    p.add_argument("--per", type=int, default=300)
    p.add_argument("--source", default="")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args(argv)
    global SOURCE
    SOURCE = a.source
    names = ["register", "long", "big", "flood"] if a.attack == "all" else [a.attack]
    kw = {k: getattr(a, k) for k in ("key", "tokens", "digest", "session", "memory", "conns", "per", "seconds")}
    print(json.dumps({n: ATTACKS[n](a.bootstrap, **kw) for n in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
