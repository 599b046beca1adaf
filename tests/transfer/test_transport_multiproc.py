"""2D reshard across real processes: a prefill instance of 2 CP ranks serves two
decode groups (DCP=2 and DCP=1) over bootstrap + Mooncake (loopback TCP).

Tests share one cluster (module fixture) and run in file order; fault tests
restart what they kill so the cluster is whole again afterwards.
"""

import os
import time

import numpy as np
import pytest
import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.messages import (PROTOCOL_VERSION, RegisterConsumer, Reply, TransferOutcome, TransferRequest,
                                           decode, encode)
from vllm_dcp2d.reshard.layout import cdiv

from tests.support.xfer_procs import PAGE_BYTES, DecodeRank, PrefillRank, Proc, expect_fetch, fingerprint, full_kv
from tests.support.transfer import PD

pytestmark = [pytest.mark.mooncake, pytest.mark.multiproc]
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

L, CP = 5, 2
PREFILL_BLOCKS, DECODE_BLOCKS = 4096, 2304
GROUPS = {"decA": 2, "decB": 1}


class Cluster:
    def __init__(self):
        self.full = full_kv(L, PREFILL_BLOCKS)
        self.prefill = [Proc(PrefillRank, cp_rank=0, cp_size=CP, num_layers=L, num_blocks=PREFILL_BLOCKS,
                             bootstrap=None, fp={})]
        self.bootstrap = self.prefill[0].call("info")["bootstrap"]
        self.prefill.append(self.spawn_prefill(1))
        self.decode = {(g, d): self.spawn_decode(g, d) for g, n in GROUPS.items() for d in range(n)}
        self.state = {k: p.call("dump") for k, p in self.decode.items()}
        self.rng = np.random.default_rng(7)
        self.next_block = {g: 0 for g in GROUPS}

    def spawn_prefill(self, rank):
        return Proc(PrefillRank, cp_rank=rank, cp_size=CP, num_layers=L, num_blocks=PREFILL_BLOCKS,
                    bootstrap=self.bootstrap, fp={})

    def spawn_decode(self, group, rank):
        return Proc(DecodeRank, engine_id=group, dcp_size=GROUPS[group], dcp_rank=rank, num_layers=L,
                    num_blocks=DECODE_BLOCKS, fp={})

    def add(self, rid, num_pages, ranks=range(CP), **kw):
        """Register a request on the prefill ranks; returns its shuffled producer block ids."""
        src = self.rng.permutation(PREFILL_BLOCKS)[:num_pages]
        for r in ranks:
            self.prefill[r].call("add", rid, src, None, kw.get("send_timeout_s"))
        return src

    def table(self, group, num_pages):
        """A fresh, shuffled decode block table (same ids on every rank of the group)."""
        n = cdiv(num_pages, GROUPS[group])
        ids = self.next_block[group] + self.rng.permutation(n)
        self.next_block[group] += n
        assert self.next_block[group] <= DECODE_BLOCKS
        return ids

    def fetch_all(self, jobs, **kw):
        """jobs: [(group, rid, src, dst, first_page)]; fetches concurrently, returns results by (group, rank)."""
        for g, rid, src, dst, first in jobs:
            for d in range(GROUPS[g]):
                self.decode[g, d].send("start", rid, self.bootstrap, dst, first, kw.get("timeout_s"),
                                       kw.get("wait_s"), len(src))
        for g, *_ in jobs:
            for d in range(GROUPS[g]):
                self.decode[g, d].result()  # start() returned
        out = {}
        for g, rid, *_ in jobs:
            for d in range(GROUPS[g]):
                out[g, d, rid] = self.decode[g, d].call("wait", rid)
        return out

    def verify(self, group, rid_jobs, ranks=None):
        """Byte-exact check of the ranks of ``group`` against the page-by-page reference."""
        for d in range(GROUPS[group]) if ranks is None else ranks:
            want = self.state[group, d]
            for src, dst, first in rid_jobs:
                want = expect_fetch(want, self.full, src, dst, GROUPS[group], d, first, len(src))
            got = self.decode[group, d].call("dump")
            assert np.array_equal(got, want), f"{group} rank {d}: {np.count_nonzero(got != want)} bytes differ"
            self.state[group, d] = got

    def close(self):
        left = [p.stop() for p in [*self.decode.values(), *self.prefill[::-1]]]
        return left


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        left = c.close()
    assert all(x == {} for x in left), f"registrations left after close: {left}"


@pytest.mark.timeout(120)
def test_two_dcp_groups_byte_exact(cluster):
    """Per-request topology: the same prefill ranks serve DCP=2 and DCP=1 groups."""
    jobs = []
    for i, (num_pages, first) in enumerate([(37, 0), (64, 0), (19, 5), (1, 0)]):
        for g in GROUPS:
            rid = f"{g}-r{i}"
            jobs.append((g, rid, cluster.add(rid, num_pages), cluster.table(g, num_pages), first))
    results = cluster.fetch_all(jobs)
    for (g, d, rid), res in results.items():
        assert res["ok"], res["error"]
    for g in GROUPS:
        cluster.verify(g, [(src, dst, first) for gg, _, src, dst, first in jobs if gg == g])

    # Bytes per path equal the plan: each page once per layer (1.0x in all), naive is dcp_size x.
    for g, rid, src, _, first in jobs:
        kv = (len(src) - first) * L * PAGE_BYTES
        per_rank = [results[g, d, rid] for d in range(GROUPS[g])]
        for d, res in enumerate(per_rank):
            pages = len(range(first + (d - first) % GROUPS[g], len(src), GROUPS[g]))
            assert res["nbytes"] == pages * L * PAGE_BYTES
            assert res["naive_bytes"] == kv
        assert sum(r["nbytes"] for r in per_rank) == kv
        assert sum(r["naive_bytes"] for r in per_rank) == GROUPS[g] * kv

    # Each prefill rank reports every request finished once all ranks of its consumer were served.
    # No attempt failed (a write that stalled and was retried leaves only the consumer's asks
    # whether it settled, which are no failure of the rank): the rank logged no refusal,
    # rejection or failure since it started, and no write raised.
    for p in cluster.prefill:
        assert p.call("stats") == {"warned": [], "failed_writes": []}
        assert p.call("finished") == {rid: "done" for _, rid, *_ in jobs}


@pytest.mark.timeout(60)
def test_fetch_before_prefill_done_waits(cluster):
    src = cluster.rng.permutation(PREFILL_BLOCKS)[:10]
    dst = cluster.table("decB", 10)
    cluster.decode["decB", 0].send("start", "early", cluster.bootstrap, dst, 0, 10.0, 5.0)
    cluster.decode["decB", 0].result()
    time.sleep(0.3)
    for p in cluster.prefill:
        p.call("add", "early", src, None, None)
    res = cluster.decode["decB", 0].call("wait", "early")
    assert res["ok"], res["error"]
    cluster.verify("decB", [(src, dst, 0)])


@pytest.mark.timeout(60)
def test_unknown_request_and_not_ready(cluster):
    res = cluster.decode["decB", 0].call("fetch", "ghost", cluster.bootstrap, [0, 1], 0, 10.0, 0.0)
    assert not res["ok"] and "no request 'ghost' for this prompt" in res["error"]
    assert res["cp_rank"] in (0, 1) and res["seconds"] < 2
    t0 = time.monotonic()
    res = cluster.decode["decB", 0].call("fetch", "ghost", cluster.bootstrap, [0, 1], 0, 10.0, 0.5)
    assert not res["ok"] and "not ready" in res["error"] and "after waiting 0.5s" in res["error"]
    assert 0.4 < time.monotonic() - t0 < 5
    cluster.verify("decB", [])  # nothing was written


@pytest.mark.timeout(60)
def test_fingerprint_mismatch(cluster):
    src = cluster.add("fp", 8)
    res = cluster.decode["decB", 0].call("fetch_with_fingerprint", {"kv_dtype": "bfloat16"}, "fp",
                                         cluster.bootstrap, cluster.table("decB", 8))
    assert not res["ok"]
    assert "kv_dtype: ours 'bfloat16', peer 'uint8'" in res["error"], res["error"]
    # The producer checks too (a consumer that skips the bootstrap check): direct request.
    regions, memory = _fake_regions()
    req = TransferRequest.build(regions=regions, num_blocks=8, transfer_key="fp", attempt_id=1,
                                engine_id="x", consumer_rank=0, consumer_size=1, dcp_size=1,
                                dcp_rank=0, block_ids=np.arange(8), num_tokens=8 * 16, first_page=0,
                                fingerprint=fingerprint(num_layers=6), wait_s=0.0, prompt_digest=PD)
    out = _registered_request(cluster.prefill[1].call("info")["address"], memory, req)
    assert isinstance(out, TransferOutcome) and not out.ok
    assert "num_layers: ours 5, peer 6" in out.reason and out.cp_rank == 1
    # ...and the same request id still serves a matching consumer.
    dst = cluster.table("decB", 8)
    assert cluster.fetch_all([("decB", "fp", src, dst, 0)])["decB", 0, "fp"]["ok"]
    cluster.verify("decB", [(src, dst, 0)])


_FAKE_KV = np.zeros((L, 8, 1024), np.uint8)  # never written: the request fails its fingerprint check


def _registered_request(address: str, memory, req):
    """``req`` on a fresh link registered as a session on this host with ``memory``; its answer."""
    sock = sockets.socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send(encode(RegisterConsumer.of("x", "127.0.0.1:1", memory)))
        sock.send(encode(req))
        assert sock.poll(5000), "no answer"
        return decode(sock.recv(), (TransferOutcome, Reply))
    finally:
        sock.close()


def _fake_regions():
    from tests.support.xfer_procs import regions

    from vllm_dcp2d.reshard.regions import Memory
    return regions(_FAKE_KV, range(L)), Memory([_FAKE_KV.ctypes.data], [_FAKE_KV.nbytes])


@pytest.mark.timeout(60)
def test_malformed_and_version_mismatch(cluster):
    address = cluster.prefill[0].call("info")["address"]
    good = encode(Reply(True, ""))
    other = good.replace(bytes([0xA1, ord("v"), PROTOCOL_VERSION]), bytes([0xA1, ord("v"), PROTOCOL_VERSION + 1]))
    for junk, match in [(b"\x00\xffjunk", "not a valid msgpack"), (other, f"unsupported protocol version {PROTOCOL_VERSION + 1}"),
                        (good, "expected RegisterConsumer/TransferRequest/CancelTransfer/ReleaseTransfer, got Reply")]:
        sock = sockets.socket(zmq.DEALER)
        sock.connect(address)
        sock.send(junk)
        assert sock.poll(5000), "no answer to a malformed message"
        reply = decode(sock.recv(), Reply)
        sock.close()
        # one answer per message, each the schema's rejection (what the rank counted as malformed)
        assert not reply.ok and "rejected message" in reply.reason and match in reply.reason
    src = cluster.add("after-junk", 12)
    dst = cluster.table("decA", 12)
    res = cluster.fetch_all([("decA", "after-junk", src, dst, 0)])
    assert all(r["ok"] for r in res.values())
    cluster.verify("decA", [(src, dst, 0)])


@pytest.mark.timeout(120)
def test_decode_rank_killed_mid_transfer(cluster):
    big = 4000  # ~40k descriptors: seconds of Mooncake TCP work, killed early
    src = cluster.add("big", big, send_timeout_s=4.0)
    dst = cluster.table("decA", big)
    for d in range(2):
        cluster.decode["decA", d].call("start", "big", cluster.bootstrap, dst, 0, 30.0, None)
    time.sleep(0.1)  # the kill lands before or during the writes to rank 0; both must fail cleanly
    cluster.decode["decA", 0].kill()
    t_kill = time.monotonic()
    res = cluster.decode["decA", 1].call("wait", "big", 60.0)
    assert res["ok"], res  # the other DCP rank is unaffected
    print("big fetch on the surviving rank:", res["seconds"], "s")
    cluster.verify("decA", [(src, dst, 0)], ranks=[1])
    # Every prefill rank notices: its write to the dead rank fails, nothing hangs.
    for p in cluster.prefill:
        while not any("failed with code -1" in e for e in p.call("stats")["failed_writes"]):
            assert time.monotonic() - t_kill < 20, "prefill never noticed the dead decode rank"
            time.sleep(0.1)
    # Half-served requests expire so the owner can free their blocks.
    deadline = time.monotonic() + 20
    for p in cluster.prefill:
        while (got := p.call("finished")).get("big") != "expired":
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert p.call("registered") and len(p.call("registered")) == 1  # only its KV buffer
    # The prefill side keeps serving: the other group, and a restarted decode rank.
    cluster.decode["decA", 0] = cluster.spawn_decode("decA", 0)
    cluster.state["decA", 0] = cluster.decode["decA", 0].call("dump")
    jobs = []
    for g in GROUPS:
        src2 = cluster.add(f"after-kill-{g}", 9)
        jobs.append((g, f"after-kill-{g}", src2, cluster.table(g, 9), 0))
    assert all(r["ok"] for r in cluster.fetch_all(jobs).values())
    for g in GROUPS:
        cluster.verify(g, [(s, d, f) for gg, _, s, d, f in jobs if gg == g])


@pytest.mark.timeout(120)
def test_prefill_rank_killed(cluster):
    cluster.add("orphan", 6, ranks=[0])  # rank 1 never gets it: the fetch waits on rank 1
    dst = cluster.table("decB", 6)
    dec = cluster.decode["decB", 0]
    dec.call("start", "orphan", cluster.bootstrap, dst, 0, 20.0, 15.0)
    time.sleep(0.5)
    cluster.prefill[1].kill()
    t_kill = time.monotonic()
    res = dec.call("wait", "orphan", 30.0)
    assert not res["ok"] and res["cp_rank"] == 1 and "connection lost" in res["error"], res
    # A lost link does not prove the rank stopped writing: it stays quarantined.
    assert res["quarantined"] == [1] and dec.call("lifted") == []
    assert time.monotonic() - t_kill < 5
    assert len(dec.call("registered")) == 1  # only its KV buffer
    cluster.state["decB", 0] = dec.call("dump")  # rank 0's pages landed: destination now undefined
    # A restarted rank re-registers; the decode side finds it and is served.
    cluster.prefill[1] = cluster.spawn_prefill(1)
    jobs = []
    for g in GROUPS:
        src2 = cluster.add(f"after-restart-{g}", 11)
        jobs.append((g, f"after-restart-{g}", src2, cluster.table(g, 11), 3))
    res = cluster.fetch_all(jobs)
    assert all(r["ok"] for r in res.values()), res
    for g in GROUPS:
        cluster.verify(g, [(s, d, f) for gg, _, s, d, f in jobs if gg == g])
    # The instance's new rank table lists rank 1 elsewhere while the old link is down:
    # the old process is gone, so the quarantine ends.
    assert dec.call("lifted") == ["orphan"]
