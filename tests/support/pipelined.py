"""The KV layout of the layer-pipelined transfer tests: 4 layers, a prefill rank of 7 blocks
and a decode rank (DCP rank 1 of 2) of 8, 5 pages of 16 tokens (the last one partly filled)."""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.transfer.messages import Fingerprint

L, PAGE_BYTES, SRC_BLOCKS, DST_BLOCKS = 4, 256, 7, 8
FP = Fingerprint("m", L, 16, "uint8", PAGE_BYTES, "test", "cfg")
SRC_IDS = np.array([5, 0, 6, 2, 3])          # producer block of each of the 5 pages
DST_IDS = np.array([7, 1, 4])                # decode DCP rank 1 of 2: pages 1, 3 -> blocks 7, 1
NUM_PAGES = 5
NUM_TOKENS = 16 * NUM_PAGES - 7           # the last page is partly filled


def regions(kv: np.ndarray) -> KVRegions:
    return KVRegions.uniform(np.arange(L), kv.ctypes.data + np.arange(L) * kv[0].nbytes, PAGE_BYTES)


def expected_layer(src, layer: int) -> np.ndarray:
    """Decode rank 1's blocks of ``layer`` after the transfer: pages 1 and 3."""
    want = np.zeros((DST_BLOCKS, PAGE_BYTES), np.uint8)
    for page in (1, 3):
        want[DST_IDS[page // 2]] = src[layer, SRC_IDS[page]]
    return want
