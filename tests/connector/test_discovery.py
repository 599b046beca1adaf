"""``connector/discovery.py``: an instance joins and leaves vLLM's router by the router's
ZMQ service discovery. The registration against a ROUTER socket (exact messages, sent
only while ``/health`` answers), then the real ``vllm-router`` binary with fake
instances: it routes to what registered, hands the prefill's ``kv_transfer_params`` to
the decode verbatim, drops a decode that fell silent, and takes one that joined."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import pytest
import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.connector.discovery import Registration
from vllm_dcp2d.local.servers import free_port, router_server

pytestmark = pytest.mark.timeout(120)


class Fake:
    """A fake vLLM instance: ``/health`` answers ``health``; a prefill answers completions
    with ``kv_transfer_params`` naming its port, a decode echoes the ones it was given."""

    def __init__(self, kind: str):
        self.kind, self.health, self.calls = kind, 200, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(fake.health if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append(body)
                params = {"from": fake.port} if fake.kind == "P" else body.get("kv_transfer_params")
                data = json.dumps({"choices": [{"index": 0, "text": "x"}], "served_by": fake.port,
                                   "kv_transfer_params": params}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(kind):
        made.append(Fake(kind))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _received(router: zmq.Socket, timeout_s: float) -> list[dict]:
    out, deadline = [], time.monotonic() + timeout_s
    while router.poll(max(0, int(1000 * (deadline - time.monotonic())))):
        _, payload = router.recv_multipart()
        out.append(msgpack.unpackb(payload))
    return out


def test_registers_exactly_while_health_answers(fakes):
    inst = fakes("P")
    router = sockets.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reg = Registration(f"127.0.0.1:{port}", inst.address, ("P", "D"), "10.0.0.1:17500", ping_s=0.1)
    try:
        got = _received(router, 0.5)
        assert len(got) >= 4 and got[:2] == [
            {"type": "P", "http_address": inst.address, "zmq_address": "10.0.0.1:17500"},
            {"type": "D", "http_address": inst.address, "zmq_address": "10.0.0.1:17500"}], got
        skipped = reg.skipped
        inst.health = 503  # the API server is not serving: silent once a ping has seen it
        _until("a ping saw the 503", lambda: reg.skipped > skipped, 10)
        _received(router, 0.3)  # what was sent before it
        assert _received(router, 0.5) == [] and reg.skipped > skipped
        inst.health = 200
        assert router.poll(5000)  # registering again
    finally:
        reg.close()
        router.close()
    assert not reg._thread.is_alive()
    sent = reg.sent
    time.sleep(0.3)
    assert reg.sent == sent  # closed: silent


def test_nothing_queued_while_the_router_is_away(fakes):
    """With no router listening, registrations are dropped, not queued to arrive stale."""
    inst, port = fakes("D"), free_port()
    reg = Registration(f"127.0.0.1:{port}", inst.address, ("D",), inst.address, ping_s=0.05)
    time.sleep(0.5)
    reg.close()
    assert reg.sent == 0 and not reg._thread.is_alive()


def test_bad_kinds_and_addresses_are_refused_by_name():
    with pytest.raises(ValueError, match=r"kinds \('X',\): expected one or both of 'P', 'D'"):
        Registration("127.0.0.1:1", "127.0.0.1:2", ("X",), "")
    with pytest.raises(ValueError, match=r"router_discovery_address 'no such host:1': ZMQ cannot connect"):
        Registration("no such host:1", "127.0.0.1:2", ("D",), "")


def test_health_is_asked_directly_not_through_a_proxy(fakes):
    """A fresh process with ``http_proxy`` set (urllib's default opener would use it)."""
    inst = fakes("D")
    code = f"from vllm_dcp2d.connector.discovery import healthy; print(healthy({inst.address!r}))"
    env = {**os.environ, "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}  # nothing listens on :9
    for health, want in ((200, "True"), (503, "False")):
        inst.health = health
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == want, out


def _complete(url: str) -> tuple[int, dict | str]:
    req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def _until(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        out = check()
        if out:
            return out
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def test_vllm_router_follows_registrations(fakes, tmp_path):
    p, d1, d2 = fakes("P"), fakes("D"), fakes("D")
    disc = f"127.0.0.1:{free_port()}"
    router = router_server(free_port(), [], [], tmp_path, discovery=disc).start()
    regs = [Registration(disc, p.address, ("P",), "127.0.0.1:17500", ping_s=0.5),
            Registration(disc, d1.address, ("D",), d1.address, ping_s=0.5)]
    try:
        status, out = _until("the router serves", lambda: (r := _complete(router.url))[0] == 200 and r, 60)
        # the prefill was asked for the KV (the nixl protocol), the decode got its params verbatim
        assert p.calls[-1]["max_tokens"] == 1 and p.calls[-1]["kv_transfer_params"]["do_remote_decode"] is True
        assert out["served_by"] == d1.port and out["kv_transfer_params"] == {"from": p.port}
        # d1 falls silent: the router drops it (5 s after its last registration)
        regs.pop().close()
        t0 = time.monotonic()
        status, out = _until("d1 dropped", lambda: (r := _complete(router.url))[0] == 503 and r, 15)
        assert "No eligible P/D pair" in out, out
        assert time.monotonic() - t0 < 7.5
        # d2 joins: served by it, and never by d1 again
        regs.append(Registration(disc, d2.address, ("D",), d2.address, ping_s=0.5))
        _until("d2 serves", lambda: (r := _complete(router.url))[0] == 200 and r[1]["served_by"] == d2.port, 15)
        for _ in range(3):
            status, out = _complete(router.url)
            assert status == 200 and out["served_by"] == d2.port
    finally:
        for r in regs:
            r.close()
        router.stop()
