"""Size-broadcast and consensus prefix across real processes (gloo, loopback).

Each test spawns one group and runs all its steps inside it; every rank's
collectives are bounded by a gloo timeout and the group by a join deadline.
"""

from __future__ import annotations

import pytest

from _prefill_group import run_group

pytestmark = pytest.mark.multiproc


def _ok(results):
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors


@pytest.mark.timeout(150)
def test_divergent_prefixes_never_hang_and_match_reference():
    """300 steps, 4 ranks, 7 layers (owners 2/2/2/1): per-rank prefix matches,
    page tables, ``None`` prefixes and batch sizes all diverge; every commit
    flag is the protocol's, consensus is the MIN, and every committed
    attention input equals the owner's K/V bit for bit. Invalid local views
    raise without breaking the lockstep."""
    steps, layers = 300, 7
    results = run_group("_prefill_workers:divergence", 4, dict(num_layers=layers, steps=steps, seed=2024),
                        timeout_s=120, gloo_timeout_s=20)
    _ok(results)
    for rank, r in enumerate(results):
        assert r["errors"] == [], (rank, r["errors"][:5])
        assert r["steps"] == steps
        assert r["committed"] + r["not_committed"] == steps * layers
        # The run exercised every branch: skips, commits, and refusals.
        assert r["skipped"] > 0 and r["not_committed"] > 0 and r["checked"] > steps
    assert len({r["skipped"] for r in results}) == 1  # n == 0 is a group-wide decision
    # A rank with an invalid view raises after joining; an invalid owner makes all raise.
    assert [r["invalid"] for r in results] == [[False, True], [True, True], [False, True], [False, True]]


@pytest.mark.timeout(90)
def test_naive_early_return_desynchronizes_and_protocol_does_not():
    """Rank 1 lost its cached prefix (``[0, 0]``) while rank 0, the owner of
    layer 0, has ``[5, 3]``. The naive variant returns early on rank 1 and the
    two ranks wait on collectives the other never joins, until the 2 s gloo
    timeout; the size-broadcast completes and refuses the commit on rank 1."""
    good = run_group("_prefill_workers:evicted_prefix", 2, dict(naive=False), timeout_s=40, gloo_timeout_s=2)
    _ok(good)
    assert [r["committed"] for r in good] == [[True, False], [False, True]]

    bad = run_group("_prefill_workers:evicted_prefix", 2, dict(naive=True), timeout_s=40, gloo_timeout_s=2)
    failures = [r.get("error", "") for r in bad]
    assert all(failures), bad  # no rank got through
    assert any("Timed out" in e or "hung" in e for e in failures), failures
