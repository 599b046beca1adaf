"""``Directory`` driven directly, as the receiver's poll loop drives it: real ZMQ sockets,
a real bootstrap server and a fake prefill rank registered with it (threads, one process)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq
from tests.support.fake_rank import FakeRank

from vllm_dcp2d.transfer import directory as directory_mod
from vllm_dcp2d.transfer.auth import NO_AUTH, rank_name
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.directory import Directory, Link
from vllm_dcp2d.transfer.messages import Fingerprint, ReleaseTransfer

pytestmark = pytest.mark.timeout(60)
FP = Fingerprint("m", 2, 16, "uint8", 256, "test", "cfg")
NOBODY = "tcp://127.0.0.1:9"  # nothing listens there


@pytest.fixture
def d():
    poller = zmq.Poller()
    d = Directory(poller, b"dcp2d-test", "D", FP, range(FP.num_kv_heads), 0, 1, 0, 1, NO_AUTH)
    yield d
    d.close()


@pytest.fixture
def prefill():
    """A bootstrap server with engine "P"'s one CP rank registered: ``(server, rank)``."""
    with BootstrapServer() as server:
        rank = FakeRank(server.address, FP)
        yield server, rank
        rank.close()


def table_of(d: Directory, bootstrap: str, timeout_s: float = 10.0):
    """Ask for ``bootstrap``'s rank table and read answers as the poll loop does, until it came."""
    q = d.query(bootstrap)
    deadline = time.monotonic() + timeout_s
    while q.table is None:
        assert time.monotonic() < deadline, f"no rank table from {bootstrap}: {q.last_reason}"
        d.ask(bootstrap, time.monotonic())
        if dict(d.poller.poll(20)).get(q.sock):
            q.read()
    return q.table


def test_one_query_per_prefill_and_one_link_per_rank(d, prefill):
    server, rank = prefill
    table = table_of(d, server.address)
    assert d.query(server.address) is d.tables()[0] and len(d.tables()) == 1
    assert list(table.addresses) == [rank.address] and d.why_no_table(NOBODY) is None
    link = d.link(rank.address, table, 0)
    assert isinstance(link, Link) and d.link(rank.address, table, 0) is link
    assert link.to == rank_name("P", 0) and d.links() == [link] and d.link_at(rank.address) is link
    assert d.link_at(NOBODY) is None
    assert d.askers(table, 0) == (0, 1)  # the only decode TP rank fetching from it


def test_past_max_queries_a_new_instance_is_refused_by_name(d, monkeypatch):
    monkeypatch.setattr(directory_mod, "MAX_QUERIES", 2)
    d.query("tcp://127.0.0.1:9")
    d.query("tcp://127.0.0.1:10")
    assert d.full("tcp://127.0.0.1:11") and not d.full("tcp://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"talks to 2 prefill instances already \(at most 2\); "
                                         r"'tcp://127.0.0.1:11' is one more"):
        d.query("tcp://127.0.0.1:11")
    with pytest.raises(ValueError):
        d.query("not an address")


def test_collect_spares_what_is_in_use_busy_or_recent(d, prefill):
    server, rank = prefill
    table = table_of(d, server.address)
    d.link(rank.address, table, 0)
    assert d.collect({server.address}, lambda addr: True, idle_s=0.0) == []  # in use, busy
    assert d.collect(set(), lambda addr: False) == []  # used just now (IDLE_S)
    assert len(d.tables()) == len(d.links()) == 1
    assert d.collect(set(), lambda addr: False, idle_s=0.0) == [server.address]
    assert d.tables() == [] and d.links() == []


def test_a_release_waits_for_its_table_then_goes_to_the_rank(d, prefill):
    server, rank = prefill
    d.query(server.address)
    d.queue_release(("x", server.address, 40, time.monotonic() + 30, "P", "digest"))
    d.queue_release(("other-engine", server.address, 40, time.monotonic() + 30, "P-old", "digest"))
    d.send_releases()  # no table yet: kept
    assert d.collect(set(), lambda addr: False, idle_s=0.0) == []  # a release waits: the query stays
    table_of(d, server.address)
    d.send_releases()
    deadline = time.monotonic() + 10
    while not rank.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the release naming another engine would have arrived by now
    assert [(type(m), m.transfer_key, m.num_tokens, m.prompt_digest) for m in rank.seen] == [
        (ReleaseTransfer, "x", 40, "digest")]
    assert d.collect(set(), lambda addr: False, idle_s=0.0) == [server.address]  # nothing waits any more


def test_a_release_without_a_table_by_its_deadline_is_dropped(d):
    d.query(NOBODY)
    d.queue_release(("x", NOBODY, 40, time.monotonic() - 1.0, None, ""))
    d.send_releases()
    assert d.collect(set(), lambda addr: False, idle_s=0.0) == [NOBODY]


def test_links_down_and_gone_from_a_new_table_are_the_restarted_ones(d, prefill):
    server, rank = prefill
    table = table_of(d, server.address)
    link = d.link(rank.address, table, 0)
    assert d.restarted(table) == []
    link.down = True
    assert d.restarted(table) == []  # still listed: it may come back on the same address
    moved = dataclasses.replace(table, addresses=("tcp://127.0.0.1:1",))
    assert d.restarted(moved) == [rank.address]
    d.close_link(rank.address)
    assert d.links() == [] and d.restarted(moved) == []
