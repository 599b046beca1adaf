"""Per-rank paged KV pool of prefill CP layer-split (design §4.1).

CP rank ``r`` stores KV only for its own layers ``cp_layer_range(L, N, r)``
plus one transient slot: while layer ``l`` is being computed, a rank that
does not own ``l`` keeps that layer's K/V (the prefix the owner broadcast and
the tokens gathered this step) in the transient slot, and the next layer
overwrites it. So a rank allocates ``owned + 1`` layer slots instead of ``L``.

Storage is one tensor ``kv[slot, 2, num_pages, page_size, num_kv_heads,
head_dim]`` (``2`` = K, V). A token slot ``s`` is the flat index
``page * page_size + offset``; the same token slots are used for every layer
slot, so a request's page table (``req_to_token``) is layer-independent.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dcp2d.layout import cp_layer_owner, cp_layer_range, local_layer_count

__all__ = ["LayerSplitKVPool"]


class LayerSplitKVPool:
    """The KV memory of one prefill CP rank: owned layers + 1 transient slot.

    num_layers:   ``L``, layers of the model.
    cp_size:      ``N``, prefill CP ranks.
    cp_rank:      this rank, ``0 <= cp_rank < N``.
    num_pages:    pages per layer slot.
    page_size:    tokens per page.
    num_kv_heads, head_dim: shape of one token's K (and V) in one layer.
    """

    def __init__(
        self,
        num_layers: int,
        cp_size: int,
        cp_rank: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.layers = cp_layer_range(num_layers, cp_size, cp_rank)  # validates L, N, r
        self.num_layers = int(num_layers)
        self.cp_size = int(cp_size)
        self.cp_rank = int(cp_rank)
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_slots = local_layer_count(num_layers, cp_size, cp_rank)
        self.transient_slot = self.num_slots - 1
        self.kv = torch.zeros(
            self.num_slots, 2, self.num_pages, self.page_size, int(num_kv_heads), int(head_dim),
            dtype=dtype, device=device,
        )

    @property
    def num_tokens(self) -> int:
        """Token slots per layer slot: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def owns(self, layer: int) -> bool:
        """Whether this rank keeps ``layer``'s KV across steps."""
        self._check_layer(layer)
        return layer in self.layers

    def owner(self, layer: int) -> int:
        """The CP rank that owns ``layer``."""
        return cp_layer_owner(layer, self.num_layers, self.cp_size)

    def slot_of(self, layer: int) -> int:
        """Layer slot holding ``layer`` now: ``layer - start`` if owned, else the transient slot."""
        if self.owns(layer):
            return int(layer) - self.layers.start
        return self.transient_slot

    def layer_kv(self, layer: int) -> torch.Tensor:
        """KV of ``layer`` addressed by token slot (a view, writable).

        Returns ``[2, num_tokens, num_kv_heads, head_dim]`` (pool dtype): the
        owned slot if this rank owns ``layer``, else the transient slot.
        """
        return self._flat(self.slot_of(layer))

    def transient_kv(self) -> torch.Tensor:
        """The transient slot, ``[2, num_tokens, num_kv_heads, head_dim]`` (a view)."""
        return self._flat(self.transient_slot)

    def page_view(self, layer: int) -> torch.Tensor:
        """``layer``'s slot by page: ``[2, num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv[self.slot_of(layer)]

    @property
    def nbytes(self) -> int:
        """Bytes this rank allocates: ``(owned + 1)`` layer slots."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def full_nbytes(self) -> int:
        """Bytes a pool holding all ``L`` layers (no layer split) would allocate."""
        return self.nbytes // self.num_slots * self.num_layers

    @property
    def saved_nbytes(self) -> int:
        """``full_nbytes - nbytes``: memory the layer split frees on this rank.

        Negative only when ``owned + 1 > L``, i.e. ``cp_size == 1``: the
        transient slot is then pure overhead.
        """
        return self.full_nbytes - self.nbytes

    def _flat(self, slot: int) -> torch.Tensor:
        s = self.kv[slot]
        return s.view(2, self.num_tokens, *s.shape[3:])

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, num_layers={self.num_layers}), got {layer!r}")

    def __repr__(self) -> str:
        return (
            f"LayerSplitKVPool(cp_rank={self.cp_rank}/{self.cp_size}, layers=[{self.layers.start}, "
            f"{self.layers.stop}) + 1 transient, kv={tuple(self.kv.shape)} {self.kv.dtype})"
        )
