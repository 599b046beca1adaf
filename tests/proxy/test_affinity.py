"""Session affinity's memory (``proxy/affinity.py``): prefix keys, what is remembered, the
LRU's bound, and the session keys a client names."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_dcp2d.proxy.affinity import Affinity, Keys, Place, PrefixHasher, session_key


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(0, 2**31 - 1), max_size=400), st.integers(0, 2**32))
def test_prefix_keys_name_prefixes(page, ids, seed):
    """Key k - 1 depends on the first k pages only: a prompt's keys are its prefixes' keys, one per
    full page, non-negative, and a change in page j changes every key from j on (no 64-bit
    collision is expected at these sizes)."""
    h = PrefixHasher(page, seed)
    keys = h.keys(ids)
    assert len(keys) == len(ids) // page and all(0 <= k < 2**63 for k in keys)
    for cut in range(0, len(ids) + 1, max(page, len(ids) // 5 or 1)):
        assert h.keys(ids[:cut]) == keys[:cut // page]
    if keys:
        j = len(ids) // 2 // page * page
        changed = h.keys(ids[:j] + [ids[j] + 1] + ids[j + 1:])
        assert changed[:j // page] == keys[:j // page]
        assert all(a != b for a, b in zip(changed[j // page:], keys[j // page:]))


def test_prefix_keys_refuse_what_is_not_token_ids_and_are_per_hasher():
    h = PrefixHasher(4, seed=1)
    with pytest.raises((ValueError, TypeError)):
        h.keys(["a"] * 8)
    assert h.keys([1] * 8) != PrefixHasher(4, seed=2).keys([1] * 8)  # a base per proxy process
    assert h.keys(np.arange(8).tolist()) == h.keys(list(range(8)))
    with pytest.raises(ValueError, match="page"):
        PrefixHasher(0)


def test_session_keys():
    """``session_id`` first, then ``user``; non-empty strings only; negative, so never a prefix key."""
    a = session_key({"session_id": "s", "user": "u"})
    assert a == session_key({"session_id": "s"}) != session_key({"user": "s"})
    assert a < 0 and session_key({"user": "u"}) < 0
    assert session_key({"session_id": "", "user": 3}) is None and session_key({}) is None
    assert session_key({"session_id": ["x"], "user": "u"}) == session_key({"user": "u"})


def keys_of(h: PrefixHasher, ids: list[int], session: int | None = None) -> Keys:
    return Keys(session, h.keys(ids), h.page, len(ids))


def test_what_is_remembered_and_what_it_matches():
    """For p full pages: every s pages (p / 16 < s <= p / 8) and p. The next turn finds the whole
    previous prompt; a branch finds what it shares less at most p / 8 pages; a match under
    ``match`` of the prompt is none."""
    h = PrefixHasher(32, seed=3)
    aff = Affinity(1000, match=0.5)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 1000, 600).tolist()  # 18 full pages
    k = keys_of(h, first)
    assert k.recorded() == [k.prefix[i - 1] for i in range(2, 19, 2)]
    assert len(Keys(None, list(range(3125)), 32, 100_000).recorded()) == 13  # 100K tokens: every 256 pages
    assert Keys(7, list(range(5)), 32, 170).recorded() == [7, 0, 1, 2, 3, 4]
    aff.record(k, Place("d0", "p0"))
    turn2 = first + rng.integers(0, 1000, 72).tolist()
    assert aff.lookup(keys_of(h, turn2)) == Place("d0", "p0")
    branch = first[:400] + rng.integers(0, 1000, 200).tolist()  # shares 12 full pages: all found
    assert aff.lookup(keys_of(h, branch)) == Place("d0", "p0")
    far = first[:300] + rng.integers(0, 1000, 700).tolist()  # shares 9 pages of 1,000 tokens: under half
    assert aff.lookup(keys_of(h, far)) is None
    assert aff.lookup(keys_of(h, rng.integers(0, 1000, 600).tolist())) is None
    assert aff.lookup(keys_of(h, first[:20])) is None  # no full page: no key


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 30), st.integers(1, 300), st.booleans()),
                                    min_size=1, max_size=120))
# found unseeded: the third request's lookup touches the first's 17-page key, which it does not
# record (it records every 4 pages), so a key "used" only by a lookup must count as used
@example(9, [(0, 136, False), (0, 8, False), (0, 256, False)])
def test_memory_is_bounded_and_least_recently_used_goes(capacity, requests):
    """Whatever is recorded, at most ``capacity`` entries; the last request's keys are there (when
    they fit) and a key that fell out is one used less recently than every one kept (a lookup that
    finds a key uses it)."""
    h = PrefixHasher(8, seed=5)
    aff = Affinity(capacity)
    used: dict[int, int] = {}  # key -> when last used
    for t, (seed, n, with_session) in enumerate(requests):
        ids = np.random.default_rng(seed).integers(0, 50, n).tolist()
        k = keys_of(h, ids, session_key({"session_id": str(seed)}) if with_session else None)
        if aff.lookup(k) is not None:  # the entry it found is touched: the newest now
            used[next(reversed(aff._map))] = t
        aff.record(k, Place(f"d{seed % 3}"))
        for key in k.recorded():
            used[key] = t
        assert len(aff) <= capacity
    kept = set(aff._map)
    last = keys_of(h, np.random.default_rng(requests[-1][0]).integers(0, 50, requests[-1][1]).tolist(),
                   session_key({"session_id": str(requests[-1][0])}) if requests[-1][2] else None).recorded()
    if len(set(last)) <= capacity:
        assert set(last) <= kept
    dropped = set(used) - kept
    if dropped and kept:
        assert max(used[k] for k in dropped) <= min(used[k] for k in kept)


def test_affinity_arguments():
    with pytest.raises(ValueError, match="capacity"):
        Affinity(0)
    with pytest.raises(ValueError, match="match"):
        Affinity(10, match=0.0)
