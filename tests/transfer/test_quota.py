"""Caps per source, not per connection (issue 48, finding 3), ``transfer/quota.py``.

On e1efa24 the open attempts were capped per connection: 16 connections x 256 waiting
attempts for keys that do not exist filled a rank's 4,096 in 14 s, and every legitimate
fetch was then refused "busy", again and again; and the releases a rank remembers for
keys it does not hold were kept without a byte cap (+1.47 GiB RSS from messages anyone
can send). Here the review's flood runs from its own process on another loopback address
(127.0.0.2 and on, standing for other hosts) against a real Sender, and a legitimate
decode on 127.0.0.1 fetches on time."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.stranger import run as stranger
from tests.support.pair import request
from tests.support.pair import TOKENS
from tests.support.one_rank import DIGEST, Decode, Prefill, attempt
from vllm_dcp2d.transfer import send_ledger
from vllm_dcp2d.transfer.messages import ReleaseTransfer, TransferOutcome, decode, encode
from vllm_dcp2d.transfer.quota import Quota
from vllm_dcp2d.transfer.send_ledger import Attempt, SendLedger


# ---- the quota on its own ----

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3000), st.booleans()), max_size=300))
def test_a_quota_never_lets_a_source_or_all_pass_their_caps(ops):
    """Drawn takes and gives from 6 sources: per source and in all, items and bytes stay
    within their caps; the reserve is taken only by sources holding little; what is
    given back is exactly what was taken."""
    q = Quota("x", per_source=20, total=64, per_source_bytes=20_000, total_bytes=64_000, reserve=1 / 4, small=4,
              small_bytes=4000)
    held: dict[int, list[int]] = {}
    for src, nbytes, give in ops:
        mine = held.setdefault(src, [])
        if give and mine:
            q.give(f"s{src}", mine.pop())
        elif not give:
            before = q.held(f"s{src}")
            why = q.take(f"s{src}", nbytes)
            if not why:
                mine.append(nbytes)
                if q.count > 48 or q.nbytes > 48_000:  # in the reserve: only a small source got there
                    assert before[0] < 4 and before[1] < 4000, (before, q.count, q.nbytes)
        for s, items in held.items():
            assert q.held(f"s{s}") == (len(items), sum(items))
            assert len(items) <= 20 and sum(items) <= 20_000
        assert q.count == sum(map(len, held.values())) <= 64
        assert q.nbytes == sum(map(sum, held.values())) <= 64_000


def test_a_refusal_names_the_source_and_the_cap():
    q = Quota("open transfer requests", 2, 100, 1 << 20, 1 << 30)
    assert q.take("address 10.0.0.2") == q.take("address 10.0.0.2") == ""
    assert q.take("address 10.0.0.2") == ("open transfer requests: this source (address 10.0.0.2) holds 2 (at most "
                                          "2) and 0 KiB (at most 1024)")
    assert q.take("address 10.0.0.3") == ""


def test_releases_for_unknown_keys_are_capped_per_source_and_count_bytes():
    """Releases for keys a rank does not hold are remembered (the decode may drop a
    request before its prefill finished), but at most ``MAX_EARLY_PER_SOURCE`` per source,
    their bytes against the source's byte cap; another source's are still taken."""
    ledger = SendLedger("cp rank 0")
    size = len(encode(ReleaseTransfer("k" * 500, "D", 0, 1, 40, "0" * 32)))
    for i in range(5000):
        ledger.release(ReleaseTransfer(f"{i:0>500}", "D", 0, 1, 40, "0" * 32), "address 10.0.0.2", size)
    assert sum(len(m) for _, m in ledger._early.values()) == send_ledger.MAX_EARLY_PER_SOURCE
    assert ledger._quota.held("address 10.0.0.2") == (0, send_ledger.MAX_EARLY_PER_SOURCE * size)
    ledger.release(ReleaseTransfer("legit", "E", 0, 1, 40, "0" * 32), "address 10.0.0.3", size)
    assert "legit" in ledger._early
    ledger.expire(time.monotonic() + send_ledger.RELEASE_MEMORY_S + 1)  # forgotten: what they held comes back
    assert ledger._early == {} and ledger._quota.held("address 10.0.0.2") == (0, 0)
    assert ledger._early_quota.count == 0 and ledger._quota.nbytes == 0


def test_attempts_are_capped_per_source_with_room_kept_for_small_sources(monkeypatch):
    monkeypatch.setattr(send_ledger, "MAX_OPEN_PER_SOURCE", 20)
    monkeypatch.setattr(send_ledger, "MAX_OPEN", 64)  # the last 8 kept for sources holding under 16
    ledger = SendLedger("cp rank 0")
    n = 0

    def arrive(source: str, identity: bytes = b"c") -> str:
        nonlocal n
        n += 1
        return ledger.arrive(Attempt(identity, request(key=f"k{n}", attempt=n), deadline=1e18, size=100,
                                     source=source))

    # one source over many connections: capped at 20 in all
    assert [arrive("address 10.0.0.2", b"c%d" % i) for i in range(22)] == ["wait"] * 20 + ["busy"] * 2
    assert "this source (address 10.0.0.2) holds 20 (at most 20)" in ledger.busy_reason(
        Attempt(b"z", request(attempt=10 ** 6), deadline=1e18, source="address 10.0.0.2"))
    assert [arrive("address 10.0.0.3") for _ in range(20)] == ["wait"] * 20
    got = [arrive("address 10.0.0.4") for _ in range(20)]  # stops where the reserve starts: 64 - 8
    assert got == ["wait"] * 16 + ["busy"] * 4 and len(ledger._open) == 56
    assert [arrive("address 10.0.0.9") for _ in range(17)] == ["wait"] * 8 + ["busy"] * 9  # a small source gets in


# ---- the review's flood, through the real transport ----

@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


@pytest.mark.mooncake
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_flood_from_other_hosts_leaves_a_legit_fetch_on_time(stack):
    """16 connections x 256 waiting attempts for made-up keys from one host fill only that
    host's share (1,024); three more hosts flooding the same way stop short of the reserve;
    then a decode on 127.0.0.1 gets its KV at once, and again while the flood still waits.
    The held attempts outlive the test (a wait past its 240 s): at 60 s, the whole suite run as
    an AVX2 host took longer than that from the first flood to the fifth, the first host's
    attempts expired, and the fifth found room."""
    p = Prefill(stack, max_prefill_wait_s=600.0)
    got = stranger("flood", p.boot.address, conns=16, per=256, source="127.0.0.2")["flood"][p.sender.address]
    assert got == {"answered": 4096 - 1024, "busy": 4096 - 1024, "held": 1024}, got
    for host in (3, 4):
        got = stranger("flood", p.boot.address, conns=4, per=300, source=f"127.0.0.{host}")["flood"]
        assert got[p.sender.address]["held"] == 1024, got
    got = stranger("flood", p.boot.address, conns=4, per=300, source="127.0.0.5")["flood"][p.sender.address]
    assert got["held"] == send_ledger.MAX_OPEN - send_ledger.MAX_OPEN // 8 - 3 * 1024, got  # stopped at the reserve
    d = Decode(stack)
    for key in ("x", "y"):
        p.add(key)
        t0 = time.monotonic()
        f = d.fetch(p.boot.address, key)
        assert f.ok and time.monotonic() - t0 < 2.0, (f.error, time.monotonic() - t0)
        assert np.array_equal(d.dst, d.expected(p.src))


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_a_source_whose_sessions_fail_their_handshake_gets_no_more_probes(stack):
    """A review named 1,000 silent sessions from one host (each new spelling or port a new
    session), each probe holding a writer for its bound, and another decode's fetch waited
    28 s. A source whose new sessions failed their handshake 8 times in 10 s is refused new
    ones at once, without a probe; a session already open is not, and neither is another
    source."""
    from tests.support.bad_peers import closed_session

    p = Prefill(stack)
    for i in range(10):
        p.add(f"k{i}")
    sessions: list[str] = []
    while len(sessions) < 10:  # ten different ones: a port drawn twice would be refused by its back-off instead
        if (s := closed_session()) not in sessions:
            sessions.append(s)
    answers = []
    for i, session in enumerate(sessions):
        t0 = time.monotonic()
        got, _ = attempt(p, f"k{i}", TOKENS, DIGEST, 0.0, i, session=session)
        answers.append((decode(got, TransferOutcome).reason, time.monotonic() - t0))
    other = [r for r, _ in answers[:8] if "did not answer its handshake" not in r]
    assert not other, other  # whole, not cut short as a long list's repr is
    for reason, seconds in answers[8:]:
        assert "Mooncake sessions that failed their handshake: this source (address 127.0.0.1) had 8" in reason
    d = Decode(stack)  # its session is new too, but its own: the probe answers
    p.add("legit")
    assert not d.fetch(p.boot.address, "legit").ok  # same source: refused its new session for now
    time.sleep(10.5)  # the window passes
    p.add("later")
    f = d.fetch(p.boot.address, "later")
    assert f.ok and np.array_equal(d.dst, d.expected(p.src)), f.error
