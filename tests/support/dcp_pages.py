"""The DCP interleave by its definition (design §5.1), the reference tests check the plan and
DCP attention against: sequence page ``p`` lives on DCP rank ``p % dcp_size`` at local slot
``p // dcp_size``. Serving never asks page by page: the plan takes a rank's pages at once
(``reshard.layout.dcp_pages_for_rank``) and vLLM's CP slot mapping places the tokens."""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.reshard.layout import check_size

__all__ = ["dcp_page_owner", "dcp_local_slot"]


def _pages(pages) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"pages must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"pages must be >= 0, got min {arr.min()}")
    return arr


def dcp_page_owner(pages, dcp_size: int):
    """DCP rank holding page(s) ``pages``: ``pages % dcp_size`` (an int for an int, else an
    int array of ``pages``' shape)."""
    dcp_size = check_size("dcp_size", dcp_size)
    out = _pages(pages) % dcp_size
    return int(out) if np.ndim(pages) == 0 else out


def dcp_local_slot(pages, dcp_size: int):
    """Local slot of page(s) ``pages`` on its owner: ``pages // dcp_size`` (an int for an
    int, else an int array of ``pages``' shape)."""
    dcp_size = check_size("dcp_size", dcp_size)
    out = _pages(pages) // dcp_size
    return int(out) if np.ndim(pages) == 0 else out
