"""Adaptations to vLLM 0.32.0's internals that make DCP attention run on CPU.

vLLM's DCP needs (a) attention impls that return the softmax LSE during decode
and (b) a slot mapping that sends each token's KV to the DCP rank owning it.
On CPU vLLM has neither. The patches below install both; the plugin's patch
registry (``registry.py``, the patch table in ``patches.py``) installs each one where its
target fits the installed vLLM. Each says what it replaces and why:

1. ``register_backend(CPU_ATTN, DCPCPUAttentionBackend)``. The CPU platform
   only ever selects CPU_ATTN / CPU_MLA / AMX_MLA (any other choice is logged
   as "Cannot use ... backend on CPU" and ignored), so the DCP-capable backend
   must take over the CPU_ATTN name. It subclasses the stock backend and
   delegates to it unchanged when ``dcp_world_size == 1``.
2. ``vllm.utils.cpu_triton_utils._compute_slot_mapping_kernel_impl``. The
   C++ fallback that replaces ``ComputeSlotMappingKernel.kernel`` on CPU
   asserts "Context Parallelism is not supported on CPU." We rebind the module
   attribute to :func:`cp_slot_mapping`, a torch port of the Triton kernel's
   CP branch that delegates to the stock op when CP is off. The platform
   installs its fallbacks (``register_triton_kernel_overrides``) right after
   the general plugins load in each worker and reads this attribute then, so
   rebinding it here is enough; no vLLM object is wrapped twice.
3. :func:`cpu_kv_layout`. vLLM's CPU kernels store each (page, KV head) in an
   ISA-specific packed order (K transposed for ``vec``, VNNI pairs for
   ``amx``), not the row-major ``[block_size, head_size]`` the tensor shape
   suggests. DCP attention reads pages in torch, so it asks vLLM's own writer,
   ``cpu_attn_reshape_and_cache``, where each element lands (bit by bit) and
   reads pages through that map. Pages keep vLLM's layout, so KV written by a
   DCP=1 prefill instance is read correctly by a DCP>1 decode instance.
4. ``register_backend(CPU_MLA, DCPCPUMLABackend)`` (as 1, for MLA models). The
   CPU platform picks AMX_MLA on AMX CPUs unless CPU_MLA is requested, so DCP
   with MLA needs ``attention_config={"backend": "CPU_MLA"}`` there.
5. :func:`install_mla_dcp_combine`: ``MLADCPManager._init_combine``. vLLM's
   MLA layer merges DCP partials with ``cp_lse_ag_out_rs``, a Triton kernel
   (Triton has no CPU backend here); the replacement all-gathers and merges
   in torch. Installed lazily by the DCP MLA impl, only when DCP > 1.
6. :func:`install_dcp_shm`: ``CpuCommunicator.__init__``. vLLM gives only its
   "tp" and "pp" groups the shared-memory collectives (``_CPUSHMDistributed``);
   the "dcp" group falls back to gloo over loopback TCP, whose two all-gathers
   per layer took about a third of a DCP=2 decode step (py-spy of a worker,
   BENCHMARKS.md "DCP decode"). A DCP group is a subset of one instance's TP
   ranks, so it passes the same check vLLM applies to TP (every rank agrees on
   the shared-memory group name) and gets the same collectives. vLLM's AVX2
   build (``vllm._C_AVX2``, x86 hosts without AVX-512) has none of them
   (no ``torch.ops._C.init_shm_manager``); there the group's all-gathers go
   through the plugin's own segment (``attention/shm_gather.py``) instead.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

__all__ = ["install_backends", "install_slot_mapping", "cp_slot_mapping", "cpu_kv_layout", "local_context_lens",
           "install_mla_dcp_combine", "cp_lse_combine_torch", "install_dcp_shm", "GATHER_ENV", "GATHER_CHOICES"]

_stock_slot_mapping = None  # vLLM's, once install_slot_mapping ran
GATHER_ENV = "DCP2D_DCP_GATHER"  # the DCP group's all-gather transport, see _dcp_shared_memory
GATHER_CHOICES = ("auto", "vllm", "dcp2d", "gloo")


def install_backends(version: str) -> None:
    """Patches 1 and 4 (registry: ``cpu_attention_backends``): the DCP-capable backends
    take the CPU_ATTN and CPU_MLA names. Idempotent (the registry may be asked twice)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_dcp2d.vllm_compat.cpu_attn.DCPCPUAttentionBackend")
    register_backend(AttentionBackendEnum.CPU_MLA, "vllm_dcp2d.vllm_compat.cpu_mla.DCPCPUMLABackend")
    logger.debug("vllm_dcp2d: CPU_ATTN and CPU_MLA overridden (vLLM %s)", version)


def install_slot_mapping(version: str) -> None:
    """Patch 2 (registry: ``cp_slot_mapping``): the CP branch of the slot mapping on CPU."""
    from vllm.utils import cpu_triton_utils  # only vLLM 0.32.0, 0.33.0

    global _stock_slot_mapping
    stock = cpu_triton_utils._compute_slot_mapping_kernel_impl
    if getattr(stock, "_dcp2d", False):
        return
    _stock_slot_mapping = stock
    cp_slot_mapping._dcp2d, cp_slot_mapping._dcp2d_stock = True, stock
    cpu_triton_utils._compute_slot_mapping_kernel_impl = cp_slot_mapping


def install_dcp_shm(version: str = "") -> None:
    """Patch 6 (registry: ``dcp_shm_collectives``): DCP groups of more than one rank gather over
    shared memory instead of gloo (idempotent; the choice is made by every rank of the
    group as it builds the group, see :func:`_dcp_shared_memory`)."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    stock = cc.CpuCommunicator.__init__
    if getattr(stock, "_vllm_dcp2d", False):
        return

    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        if self.unique_name.startswith("dcp") and self.world_size > 1 and self.dist_module is torch.distributed:
            _dcp_shared_memory(self, cc._CPUSHMDistributed)

    __init__._vllm_dcp2d = True
    __init__._dcp2d_stock = stock
    cc.CpuCommunicator.__init__ = __init__


def _dcp_shared_memory(comm, vllm_shm: type) -> None:
    """Give the DCP group ``comm`` (a ``CpuCommunicator``) shared-memory all-gathers.

    ``DCP2D_DCP_GATHER`` (the same for every rank of an instance, as its environment is)
    picks the transport: ``auto`` (the default) vLLM's ``_CPUSHMDistributed`` where its
    build has ``torch.ops._C.init_shm_manager``, else, on x86-64, the plugin's
    ``ShmAllGather``; ``vllm`` or ``dcp2d`` one of them (``vllm`` refuses a build without
    it); ``gloo`` leaves the group as vLLM made it. The ranks first agree over gloo (one
    ``all_gather_object``: vLLM's shared-memory group name, the choice, whether the build
    has the op), so every rank decides the same; a group they disagree on keeps gloo.
    """
    import platform

    from vllm_dcp2d.attention.shm_gather import GatherUnavailable, open_group

    def exchange(obj) -> list:
        out = [None] * comm.world_size
        torch.distributed.all_gather_object(out, obj, group=comm.device_group)
        return out

    choice, has_op = os.environ.get(GATHER_ENV, "auto"), hasattr(torch.ops._C, "init_shm_manager")
    views = exchange((vllm_shm.make_group_name(comm), choice, has_op))  # every rank takes part, whatever it chose
    where = f"DCP group {comm.unique_name} (ranks {comm.ranks})"
    if choice not in GATHER_CHOICES:
        raise ValueError(f"{GATHER_ENV}={choice!r}: expected one of {', '.join(GATHER_CHOICES)}")
    if len(set(views)) != 1:
        logger.warning("vllm_dcp2d: %s keeps gloo: its ranks disagree on (shared-memory group, %s, "
                       "init_shm_manager): %s", where, GATHER_ENV, views)
        return
    if choice == "gloo":
        logger.info("vllm_dcp2d: %s keeps gloo (%s=gloo)", where, GATHER_ENV)
        return
    if choice == "vllm" and not has_op:
        raise RuntimeError(f"{GATHER_ENV}=vllm, but this vLLM build has no torch.ops._C.init_shm_manager "
                           f"(the AVX2 build, vllm._C_AVX2, lacks it); use auto or dcp2d")
    if has_op and choice != "dcp2d":
        comm.dist_module, comm.supports_tensor_dict = vllm_shm(comm), True
        how = "vLLM's shm_all_gather"
    elif platform.machine() not in ("x86_64", "AMD64"):
        logger.info("vllm_dcp2d: %s keeps gloo: vllm_dcp2d's ShmAllGather publishes under x86-64 store "
                    "order, this is %s", where, platform.machine())
        return
    else:
        try:
            gather = open_group(comm.world_size, comm.rank_in_group, exchange)
        except GatherUnavailable as e:
            logger.warning("vllm_dcp2d: %s keeps gloo: %s", where, e)
            return
        comm.dist_module = _ShmGatherDistributed(gather)
        how = ("vllm_dcp2d's ShmAllGather: " + (f"{GATHER_ENV}=dcp2d" if has_op else
               "this vLLM build has no torch.ops._C.init_shm_manager"))
    logger.info("vllm_dcp2d: %s gathers over shared memory (%s)", where, how)


class _ShmGatherDistributed:
    """A DCP group's ``dist_module`` (what ``CpuCommunicator`` calls collectives on):
    ``all_gather_into_tensor`` through ``ShmAllGather``, everything else through
    ``torch.distributed`` (gloo) as before. No tensor-dict send/recv
    (``supports_tensor_dict`` stays False, as for any gloo group)."""

    def __init__(self, gather) -> None:
        self.gather = gather
        self.all_gather_into_tensor = gather.all_gather_into_tensor

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)


def cp_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    slot_mapping: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """CPU slot mapping with context parallelism (replaces vLLM's CPU fallback).

    Same signature as ``vllm.utils.cpu_triton_utils._compute_slot_mapping_kernel_impl``
    (called positionally by vLLM's kernel-override wrapper each step, from
    ``BlockTable.compute_slot_mapping``). Same math as the CP branch of the Triton
    ``ComputeSlotMappingKernel``: a request's block-table row lists *virtual*
    blocks of ``block_size * cp`` tokens; in a virtual block, runs of
    ``interleave`` tokens go round-robin to the CP ranks, and this rank keeps its
    tokens, in order, in its physical block. Tokens of other ranks get ``PAD_ID``
    (the KV writer skips them).

    query_start_loc: ``[R + 1]`` int32; positions: ``[num_tokens]`` int64;
    block_table: ``[max_reqs, block_table_stride]`` int32; slot_mapping:
    ``[max_num_tokens]`` int64, written in place (padding past ``num_tokens``).
    """
    if TOTAL_CP_WORLD_SIZE == 1:
        assert _stock_slot_mapping is not None, "cp_slot_mapping used before install_slot_mapping()"
        return _stock_slot_mapping(
            num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_table_stride,
            slot_mapping, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
            CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE,
        )
    cp, rank, inter, bs = TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, KV_CACHE_BLOCK_SIZE
    qsl = query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    tok = torch.arange(num_tokens, device=positions.device)
    req = torch.searchsorted(qsl[1:num_reqs + 1], tok, right=True)
    pos = positions[:num_tokens].long()
    vblock, voff = pos // (bs * cp), pos % (bs * cp)
    is_local = (voff // inter) % cp == rank
    local_off = (voff // (cp * inter)) * inter + voff % inter
    blocks = block_table.view(-1)[req * block_table_stride + vblock].long()
    slots = torch.where(is_local, blocks * bs + local_off, PAD_ID)
    slot_mapping[:num_tokens] = slots
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


def local_context_lens(context_lens: torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int) -> torch.Tensor:
    """Tokens of each request's first ``context_lens`` positions held by ``dcp_rank``.

    ``[R]`` int -> ``[R]`` int32; vLLM's ``get_dcp_local_seq_lens`` (the split the
    slot mapping above produces).
    """
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    return get_dcp_local_seq_lens(context_lens, dcp_size, dcp_rank, interleave)


@functools.lru_cache(maxsize=None)
def cpu_kv_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                  cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU KV writer puts each element of a page, for ``isa``.

    The CPU cache ``[num_blocks, Hkv, block_size, 2 * head_size]`` holds, per
    (page, head), ``block_size * head_size`` K elements then as many V elements.
    dtype: the model's (the writer's input); cache_dtype: ``--kv-cache-dtype``
    ("auto": pages of ``dtype``; "fp8", "fp8_e4m3", "fp8_e5m2": one byte each).
    Returns ``(k_layout, v_layout)``, each ``[block_size, head_size]`` int64: the
    flat position, inside the K (resp. V) half, of token ``t``'s element ``d``.
    Found by writing index bits through ``cpu_attn_reshape_and_cache`` itself
    (values 1 and 2 are exact in every float and fp8 dtype), so it follows the kernel.
    """
    from vllm import _custom_ops as ops

    from vllm_dcp2d.reshard.page_format import FP8_DTYPES, kv_dtype_name

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"DCP on CPU reads float KV caches only, got {dtype}")
    fp8 = FP8_DTYPES.get(kv_dtype_name(cache_dtype, dtype))
    n = block_size * head_size
    kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=torch.uint8 if fp8 else dtype)
    key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    idx = torch.arange(n).view(block_size, 1, head_size)
    slots = torch.arange(block_size, dtype=torch.long)
    k_where = torch.zeros(n, dtype=torch.long)
    v_where = torch.zeros(n, dtype=torch.long)
    for b in range(max(1, math.ceil(math.log2(n)))):
        bit = (1 + ((idx >> b) & 1)).to(dtype)
        kv.zero_()
        ops.cpu_attn_reshape_and_cache(bit, bit, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype)
        flat = (kv.view(fp8) if fp8 else kv).view(2 * n).float()
        if not bool(((flat == 1) | (flat == 2)).all()):
            raise RuntimeError(f"cpu_attn_reshape_and_cache (isa={isa}, kv_cache_dtype={cache_dtype}) does not "
                               f"fill a page one-to-one")
        k_where |= (flat[:n] == 2).long() << b
        v_where |= (flat[n:] == 2).long() << b
    k_layout = torch.empty(n, dtype=torch.long)
    v_layout = torch.empty(n, dtype=torch.long)
    k_layout[k_where] = torch.arange(n)
    v_layout[v_where] = torch.arange(n)
    for name, where in (("K", k_where), ("V", v_where)):
        if torch.unique(where).numel() != n:
            raise RuntimeError(f"{name} layout of isa={isa} is not a permutation of the page")
    return k_layout.view(block_size, head_size), v_layout.view(block_size, head_size)


def cp_lse_combine_torch(partial_output: torch.Tensor, partial_lse: torch.Tensor, cp_group, is_lse_base_on_e: bool = True,
                         seq_lens=None, query_start_loc=None) -> torch.Tensor:
    """Torch stand-in for vLLM's ``cp_lse_ag_out_rs`` (same call signature).

    partial_output: ``[B, Hg, D]``, partial_lse: ``[B, Hg]``, this rank's attention
    over its pages for all ``Hg = H * N`` heads of the DCP group. Returns
    ``[B, H, D]`` in partial_output.dtype: the merged result for this rank's heads
    (what the all-gather + reduce-scatter of the original returns). ``seq_lens`` /
    ``query_start_loc`` only serve vLLM's empty-shard masking; an empty shard
    already has LSE -inf here.
    """
    from vllm_dcp2d.attention.dcp import dcp_merge

    n, rank = cp_group.world_size, cp_group.rank_in_group
    h = partial_output.shape[1] // n
    out, _ = dcp_merge(partial_output, partial_lse, cp_group, heads=slice(rank * h, (rank + 1) * h),
                       base_e=is_lse_base_on_e)
    return out.to(partial_output.dtype)


def install_mla_dcp_combine() -> None:
    """Make ``MLADCPManager`` combine DCP partials with :func:`cp_lse_combine_torch`
    (idempotent; called by ``DCPCPUMLAImpl.__init__`` before vLLM's ``MLAAttention``
    builds its ``MLADCPManager``)."""
    from vllm.v1.attention.ops import dcp as vllm_dcp

    from vllm_dcp2d.vllm_compat import registry

    stock = vllm_dcp.MLADCPManager._init_combine
    if getattr(stock, "_dcp2d", False):
        return
    registry.check("mla_dcp_combine")

    def _init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
        if use_pcp or self.use_a2a:
            raise NotImplementedError("vllm_dcp2d's CPU MLA DCP combine supports dcp_comm_backend='ag_rs' without PCP")
        return functools.partial(cp_lse_combine_torch, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e)

    _init_combine._dcp2d, _init_combine._dcp2d_stock = True, stock
    vllm_dcp.MLADCPManager._init_combine = _init_combine
