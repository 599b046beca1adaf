"""``attention/shm_gather.py``: the DCP group's all-gather through shared memory, between
real processes (spawned gloo ranks, ``tests/support/shm_gather_ranks.py``), byte for byte
against gloo's, and what a rank sees when its peer dies, leaves, stalls or disagrees."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.prefill_group import run_group
from tests.support.shm_gather_ranks import BACKEND_CASES, DTYPES

from vllm_dcp2d.attention.shm_gather import LIVENESS_S, SLOT_BYTES

RANKS = "tests.support.shm_gather_ranks"


@pytest.mark.timeout(300)
def test_backend_shapes_match_gloo_byte_for_byte():
    """Every shape the DCP backends gather, float32 and bfloat16, at the default slot
    size (a prefill chunk's [O|LSE] takes 17 rounds); the segment is gone from /dev/shm
    once the group is set up."""
    cases = [(shape, name) for shape, _ in BACKEND_CASES for name in DTYPES]
    results = run_group(f"{RANKS}:gather_vs_gloo", 2, {"cases": cases, "slot_bytes": SLOT_BYTES},
                        timeout_s=240, gloo_timeout_s=60)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r}"
        assert all(r["same_as_gloo"]), f"rank {rank}: differs from gloo in {cases}: {r['same_as_gloo']}"
        assert all(r["as_expected"]), f"rank {rank}: {r['as_expected']}"
        assert not r["segment_left_in_dev_shm"], f"rank {rank}: the segment's name outlived set-up"
        assert r["rounds"] > len(cases), r["rounds"]  # some gathers took several rounds


@st.composite
def _groups(draw):
    """A slot size and gathers sized from it: up to 4 rounds, sizes that end on, just
    before and just after a slot boundary, empty ones, several ranks."""
    slot = draw(st.integers(1, 4096))
    cases = []
    for _ in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from(sorted(DTYPES)))
        size = DTYPES[name].itemsize
        per_rank = draw(st.one_of(st.integers(0, 4 * slot // size),
                                  st.sampled_from([slot // size, slot // size + 1, max(0, slot // size - 1)])))
        inner = draw(st.sampled_from([d for d in (1, 2, 3, 5) if per_rank % d == 0]))
        cases.append(((per_rank // inner, inner), name))
    return draw(st.integers(2, 3)), slot, cases


@pytest.mark.timeout(600)
@settings(max_examples=4, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group=_groups())
def test_any_size_matches_gloo_byte_for_byte(group):
    world, slot, cases = group
    results = run_group(f"{RANKS}:gather_vs_gloo", world, {"cases": cases, "slot_bytes": slot},
                        timeout_s=120, gloo_timeout_s=60)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r}"
        assert all(r["same_as_gloo"]) and all(r["as_expected"]), (rank, cases, r)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, expect", [
    ("killed", "rank 1 (pid {pid}) exited while rank 0 waited for it in all-gather round 1"),
    ("exits", "rank 1 (pid {pid}) exited while rank 0 waited for it in all-gather round 1"),
    ("closes", "rank 1 closed shared-memory all-gather"),
    ("other_size", "ranks gather different sizes (bytes per rank: [16512, 20640]"),
])
def test_a_peer_that_dies_or_leaves_fails_the_gather_at_once(how, expect):
    """Rank 0 is told which rank and why well within its 60 s timeout, and the group
    refuses further gathers instead of mixing rounds."""
    results = run_group(f"{RANKS}:peer_fails", 2, {"how": how, "timeout_s": 60.0}, timeout_s=90, gloo_timeout_s=30)
    r = results[0]
    assert r.get("error"), r
    assert expect.format(pid=r["pids"][1]) in r["error"], r["error"]
    assert r["elapsed"] < 10 * LIVENESS_S + 2, r
    assert "is unusable" in r["again"], r["again"]
    if how in ("killed", "exits"):
        assert "error" in results[1] or results[1] == {}, results[1]  # it never reported


@pytest.mark.timeout(120)
def test_a_peer_that_never_gathers_times_out_with_a_clear_error():
    timeout = 3.0
    results = run_group(f"{RANKS}:peer_fails", 2, {"how": "stalls", "timeout_s": timeout}, timeout_s=90,
                        gloo_timeout_s=30)
    r = results[0]
    assert r.get("error") and "alive but not gathering" in r["error"] and "rank(s) [1]" in r["error"], r
    assert timeout <= r["elapsed"] < timeout + 1.0, r


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_open_the_segment_makes_every_rank_keep_its_transport(tmp_path):
    """As a rank on another host: set-up fails on every rank alike (so every rank keeps
    gloo), naming the rank, and rank 0's segment is unlinked."""
    results = run_group(f"{RANKS}:other_dev_shm", 2, {"directory": str(tmp_path)}, timeout_s=90, gloo_timeout_s=30)
    for rank, r in enumerate(results):
        assert r.get("unavailable") and "rank 1 could not open" in r["unavailable"], (rank, r)
        assert r["left"] == [], (rank, r)


@pytest.mark.timeout(120)
def test_a_segment_left_by_a_rank_killed_in_set_up_is_removed_once_unheld():
    """The one way a segment outlives its group: rank 0 killed between making it and
    unlinking it. The suite's sweep at start (``tests/support/shm.py``) removes it once no
    process maps it, and leaves a segment a live rank holds."""
    import glob
    import multiprocessing
    import time

    from tests.support.shm import remove_stale_vllm_shm
    from tests.support.shm_gather_ranks import stuck_in_set_up

    from vllm_dcp2d.attention.shm_gather import PREFIX

    proc = multiprocessing.get_context("spawn").Process(target=stuck_in_set_up, daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not (left := glob.glob(f"/dev/shm/{PREFIX}{proc.pid}-*")):
            assert time.monotonic() < deadline and proc.is_alive(), "rank 0 made no segment"
            time.sleep(0.05)
        remove_stale_vllm_shm()
        assert glob.glob(f"/dev/shm/{PREFIX}{proc.pid}-*") == left, "a held segment was removed"
    finally:
        proc.kill()
        proc.join(10)
    assert glob.glob(f"/dev/shm/{PREFIX}{proc.pid}-*") == left  # the kill left it behind
    remove_stale_vllm_shm()
    assert glob.glob(f"/dev/shm/{PREFIX}{proc.pid}-*") == []
