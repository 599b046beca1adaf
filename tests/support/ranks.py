"""Ranks of a DCP group as threads of one process, for in-process tests of collectives."""

from __future__ import annotations

import threading

import torch


class ThreadGroup:
    """Rank ``rank`` of ``n`` threads sharing ``slots``: all_gather like vLLM's
    GroupCoordinator. A rank that skips a collective breaks the barrier (timeout)."""

    def __init__(self, rank, n, slots, barrier):
        self.world_size, self.rank_in_group = n, rank
        self.slots, self.barrier = slots, barrier
        self.calls = 0

    def all_gather(self, x, dim=-1):
        self.calls += 1
        self.slots[self.rank_in_group] = x.clone()
        self.barrier.wait()
        out = torch.cat(list(self.slots), dim=dim)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


def run_ranks(fn, inputs):
    """``fn(x, group)`` on one thread per entry of ``inputs``; returns (results, errors, calls)."""
    n = len(inputs)
    slots, barrier = [None] * n, threading.Barrier(n, timeout=10)
    groups = [ThreadGroup(r, n, slots, barrier) for r in range(n)]
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(inputs[r], groups[r])
        except Exception as e:  # noqa: BLE001 - reported per rank
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors, [g.calls for g in groups]
