"""Rank functions for the size-broadcast tests: each runs inside a spawned gloo
rank (see ``prefill_group.run_group``) and returns a picklable dict."""

from __future__ import annotations

import torch

from vllm_dcp2d.prefill.broadcast import Scratch, broadcast_owner_layer_prefix

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, as an int tensor of the same element size."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def page_values(case: int, layer: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The owner's KV of ``layer`` in case ``case``: distinct per block, layer and case."""
    g = torch.Generator().manual_seed(case * 1000 + layer)
    return torch.randn(shape, generator=g).to(dtype)


def cases(cp, cases: list[dict], scratch_max: int | None = None) -> dict:
    """Each case: ``num_blocks``, ``page`` (a page's shape), ``dtype``, ``layers``
    (owner per layer) and ``blocks`` (the step's context blocks). For every layer,
    the owner's region holds :func:`page_values`; the others' transient slot starts
    as a sentinel. After the broadcast, a non-owner's slot must equal the owner's
    at ``blocks`` bit for bit and keep the sentinel elsewhere. With ``scratch_max``,
    every layer of every case goes through one ``Scratch`` of that cap (the serving
    path's reuse across sizes and dtypes; a cap below a prefix takes the one-off path)."""
    scratch = None if scratch_max is None else Scratch(cp.device, max_bytes=scratch_max)
    bad = []
    sent = 0
    for i, c in enumerate(cases):
        dtype = DTYPES[c["dtype"]]
        shape = (c["num_blocks"], *c["page"])
        blocks = torch.tensor(c["blocks"], dtype=torch.int64)
        transient = torch.full(shape, -7.0, dtype=dtype)
        for layer, owner in enumerate(c["layers"]):
            own = page_values(i, layer, shape, dtype)
            kv = own if cp.rank == owner else transient
            before = kv.clone()
            sent += broadcast_owner_layer_prefix(kv, blocks, owner, cp, what=f"layer {layer}", scratch=scratch)
            if cp.rank == owner:
                if not torch.equal(kv, before):
                    bad.append((i, layer, "owner's region changed"))
                continue
            rest = torch.ones(shape[0], dtype=torch.bool)
            rest[blocks] = False
            if not torch.equal(_bits(kv[blocks]), _bits(own[blocks])):
                bad.append((i, layer, "blocks differ from the owner's"))
            if not torch.equal(kv[rest], before[rest]):
                bad.append((i, layer, "a block outside the list changed"))
    return {"bad": bad, "bytes": sent}


def mismatch(cp) -> dict:
    """Rank 1 lists one block more than the owner (rank 0): it must raise a
    RuntimeError naming both counts, rank 0 must finish, and the group must still
    work for the next layer's broadcast."""
    kv = torch.arange(8 * 4, dtype=torch.float32).view(8, 4) * (cp.rank == 0)
    blocks = torch.tensor([1, 3] if cp.rank == 0 else [1, 3, 5])
    error = ""
    try:
        broadcast_owner_layer_prefix(kv, blocks, 0, cp, what="layer 0")
    except RuntimeError as e:
        error = str(e)
    untouched = bool((kv == 0).all()) if cp.rank == 1 else True  # nothing committed on mismatch
    follow = torch.full((8, 4), float(cp.rank == 0))
    broadcast_owner_layer_prefix(follow, torch.tensor([2]), 0, cp, what="layer 1")
    return {"error": error, "untouched": untouched, "follow": bool((follow[2] == 1).all())}
