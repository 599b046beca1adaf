"""Start-up settings a DCP2D instance needs, chosen for the user (vLLM 0.32.0, 0.33.0, 0.34.0).

Without these, serving an MLA model through the connector took three flags
that nothing pointed to (``--attention-backend CPU_MLA``, ``--block-size 16``,
``--cp-kv-cache-interleave-size 16``). Each patch below acts only when
``kv_connector`` is ``DCP2DConnector``, logs what it chose, and yields to an
explicit setting, unless that setting cannot work: then start-up fails with
an error that names the flag to change.

1. ``CpuPlatform.check_and_update_config``: on a CPU with AMX, vLLM picks
   ``AMX_MLA`` for MLA models. It returns no LSE, so DCP cannot merge its
   partials, its page format is its own (the other side of a transfer and the
   layer-split fill are checked with CPU_MLA's), and it fails on float32 weights. :func:`mla_backend`
   switches every DCP2D MLA instance to ``CPU_MLA`` (unless ``AMX_MLA`` was
   asked for where it can work) before the platform fixes the block size
   (16 for ``CPU_MLA``).
2. ``VllmConfig.adjust_dcp_kv_cache_interleave_size``: vLLM pins the DCP
   interleave to the block size for NIXL, once the block size is known (0.32:
   in each worker, from its ``KVCacheConfig``; 0.33: once in the engine core,
   from the global KV cache groups, and the workers get the value with their
   layout). The connector writes whole pages into the DCP layout, which needs
   the same, so DCP2DConnector gets it too (unless
   ``--cp-kv-cache-interleave-size`` was given; ``check_interleave`` then
   names the mismatch).

3. ``CpuPlatform.check_and_update_config`` again: vLLM's CPU platform makes every
   engine core and TP worker a spawned process, which imports vLLM anew (~7 CPU-s
   each, most of a CPU start-up). ``cpu_start_method="fork"`` (off by default) gives
   it vLLM's choice on GPU hosts, fork, and :func:`bind_forked_worker` binds each
   forked worker to the cores vLLM chose for it: vLLM binds them through OpenMP's
   variables, which a forked child's OpenMP runtime, loaded before the fork, never
   reads (unbound, two TP=2 workers on two cores answered 10x slower).

1 and 3 wrap one vLLM function, so they are one entry of the patch registry
(``patches.py``: ``cpu_platform_choices``); 2 is ``dcp_interleave``.
"""

from __future__ import annotations

import logging
import os

from vllm_dcp2d.config import parse_extra_config
from vllm_dcp2d.vllm_compat.instance import is_dcp2d, layer_split_may_apply

log = logging.getLogger(__name__)

__all__ = ["route_logs", "draft_backend", "install_cpu_choices", "install_interleave", "mla_backend",
           "start_method", "fork_workers", "omp_cpus", "bind_forked_worker",
           "resolve_interleave"]


class _ToVllm(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger as it is when the record comes (its
    handlers and level), not as it was when the plugin loaded."""

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if record.levelno >= theirs.getEffectiveLevel():
            theirs.handle(record)


def route_logs() -> None:
    """Send ``vllm_dcp2d``'s log records through vLLM's logger (idempotent).

    vLLM configures only its own ``vllm`` logger; without this, the plugin's INFO lines
    (which layers a rank stores and sends, a stalled write) would reach a user only at
    WARNING and above, unformatted. vLLM (0.32) configures that logger in each process
    it starts, after it loads the plugins there (``--log-level``, ``VLLM_LOGGING_LEVEL``),
    and a process forked from another (``cpu_start_method``) loads none: so each record
    goes to vLLM's logger as it is when the record is logged, at its level then.
    """
    ours = logging.getLogger("vllm_dcp2d")
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # _ToVllm.emit applies vLLM's level
    ours.propagate = False


def mla_backend(vllm_config, amx: bool) -> str | None:
    """The MLA backend a DCP2D instance must use on CPU, or None to leave vLLM's choice.

    amx: whether this CPU has AMX tiles (vLLM then prefers ``AMX_MLA``).
    On AMX every DCP2D MLA instance defaults to ``CPU_MLA``: a decode with
    DCP > 1 needs its LSE, a layer-split prefill fills transient slots from its
    cache write, and the two sides of a transfer must share one page format
    (``AMX_MLA`` packs its own, and it also refuses float32 weights, which
    vLLM does not check before it picks it). An explicit ``AMX_MLA`` is kept
    where it can work (a DCP=1 decode or a producer without layer-split, with
    the same backend on the other side); elsewhere it raises ``ValueError``.
    """
    mc = vllm_config.model_config
    if not (is_dcp2d(vllm_config) and mc is not None and mc.use_mla and amx):
        return None
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    why = ("decode_context_parallel_size > 1 needs the attention's LSE, which AMX_MLA does not return"
           if dcp > 1 else "layer-split storage is checked with CPU_MLA's pages only (AMX_MLA packs its own format)"
           if layer_split_may_apply(vllm_config) else None)
    chosen = vllm_config.attention_config.backend
    name = getattr(chosen, "name", chosen)
    if name == "AMX_MLA" and why is not None:
        extra = " or kv_connector_extra_config layer_split='off'" if dcp == 1 else ""
        raise ValueError(f"--attention-backend AMX_MLA cannot serve this DCP2D instance: {why}. "
                         f"Use --attention-backend CPU_MLA{extra}.")
    return "CPU_MLA" if name in (None, "CPU_MLA") else None


def draft_backend(vllm_config, backend: str | None) -> str | None:
    """The backend to give an MLA draft model when :func:`mla_backend` chose ``backend``
    for the target, or None to leave it. vLLM picks a draft's backend on its own
    (``llm_base_proposer``: never inherited), which on AMX is ``AMX_MLA`` again."""
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None)
    if backend is None or draft is None or not draft.use_mla or spec.attention_backend is not None:
        return None
    return backend


def resolve_interleave(vllm_config, block_size: int) -> None:
    """Set ``cp_kv_cache_interleave_size`` to ``block_size`` on a DCP2D decode with
    DCP > 1, unless the user set it (vLLM's ``_allow_auto_resolve_cp_interleave_size``)."""
    pc = vllm_config.parallel_config
    if not is_dcp2d(vllm_config) or pc.decode_context_parallel_size <= 1:
        return
    if not pc._allow_auto_resolve_cp_interleave_size or pc.cp_kv_cache_interleave_size == block_size:
        return
    log.info("DCP2DConnector writes whole pages into the DCP layout: cp_kv_cache_interleave_size %d -> "
             "block_size %d", pc.cp_kv_cache_interleave_size, block_size)
    pc.cp_kv_cache_interleave_size = block_size


# ---- 1 and 3. CpuPlatform.check_and_update_config (vLLM 0.32.0, 0.33.0) ----

_at_fork = []


def install_cpu_choices(version: str) -> None:
    import torch
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = type(current_platform)
    stock = cls.check_and_update_config.__func__
    if getattr(stock, "_dcp2d", False):
        return

    def check_and_update_config(klass, vllm_config) -> None:
        amx = klass.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
        backend = mla_backend(vllm_config, amx)
        if backend is not None and vllm_config.attention_config.backend is None:
            log.info("DCP2DConnector: MLA on an AMX CPU uses the CPU_MLA attention backend, not AMX_MLA "
                     "(it returns the LSE DCP merges with, fills layer-split transient slots, shares one "
                     "page format with the other side of a transfer, and takes float32)")
            vllm_config.attention_config.backend = AttentionBackendEnum[backend]
        if draft_backend(vllm_config, backend) is not None:
            log.info("DCP2DConnector: the MLA draft model uses %s too", backend)
            vllm_config.speculative_config.attention_backend = AttentionBackendEnum[backend]
        stock(klass, vllm_config)  # sets VLLM_WORKER_MULTIPROC_METHOD=spawn
        if start_method(vllm_config) == "fork":
            log.info("DCP2DConnector: cpu_start_method 'fork': vLLM forks the engine core and TP workers, "
                     "each bound to the cores VLLM_CPU_OMP_THREADS_BIND gives it")
            fork_workers()

    check_and_update_config._dcp2d, check_and_update_config._dcp2d_stock = True, stock
    cls.check_and_update_config = classmethod(check_and_update_config)


# ---- 2. VllmConfig.adjust_dcp_kv_cache_interleave_size (vLLM 0.32.0: a KVCacheConfig, 0.33.0: groups) ----

def install_interleave(version: str) -> None:
    from vllm.config import VllmConfig

    stock = VllmConfig.adjust_dcp_kv_cache_interleave_size
    if getattr(stock, "_dcp2d", False):
        return

    def adjust_dcp_kv_cache_interleave_size(self, kv_cache_config_or_groups) -> None:
        stock(self, kv_cache_config_or_groups)
        groups = getattr(kv_cache_config_or_groups, "kv_cache_groups", kv_cache_config_or_groups)
        if groups:
            resolve_interleave(self, min(g.kv_cache_spec.block_size for g in groups))

    adjust_dcp_kv_cache_interleave_size._dcp2d = True
    adjust_dcp_kv_cache_interleave_size._dcp2d_stock = stock
    VllmConfig.adjust_dcp_kv_cache_interleave_size = adjust_dcp_kv_cache_interleave_size


# ---- 3. the start method: what the wrapper of 1 decides, and the binding of a forked worker ----

def start_method(vllm_config) -> str:
    """``"fork"`` where this DCP2D instance asks for it (``cpu_start_method``), else
    ``"spawn"``, vLLM's choice on CPU. Raises ``ConfigError`` for a bad value."""
    if not is_dcp2d(vllm_config):
        return "spawn"
    return parse_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config).cpu_start_method


def fork_workers() -> None:
    """Have vLLM fork the processes it starts from now on, each bound by
    :func:`bind_forked_worker` (registered once per process). What ``cpu_start_method``
    "fork" does after vLLM's CPU platform chose spawn; the tests' engines without a
    connector call it the same way (``tests/support/vllm_engine.py``)."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    if not _at_fork:
        os.register_at_fork(after_in_child=bind_forked_worker)
        _at_fork.append(True)


def omp_cpus(environ) -> tuple[set[int] | None, int | None]:
    """The cores and thread count vLLM set in ``environ`` for the worker it starts
    (``OMPProcessManager.configure_omp_envs``: ``GOMP_CPU_AFFINITY="0 1"`` where libgomp
    is preloaded, ``KMP_AFFINITY=...proclist=[0,1]`` for Intel's runtime,
    ``OMP_PLACES="{0,1}"`` otherwise; ``OMP_NUM_THREADS``), or None for what it did not
    set (``VLLM_CPU_OMP_THREADS_BIND=nobind``; the engine core). Ranges may have a stride
    (``0-7:2``) and places may be listed one by one (``{0},{1}``). Raises ``ValueError``
    naming a value that is not a list of core ids."""
    def ids(text: str, var: str) -> set[int]:
        out = set()
        for part in text.replace("{", " ").replace("}", " ").replace(",", " ").split():
            span, colon, stride = part.partition(":")
            lo, dash, hi = span.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()) or (colon and not stride.isdigit()) or stride == "0":
                raise ValueError(f"{var}={environ[var]!r}: expected core ids such as '0 1', '0-3', '0-7:2'")
            out.update(range(int(lo), int(hi or lo) + 1, int(stride or 1)))
        return out

    cpus = None
    if environ.get("GOMP_CPU_AFFINITY"):
        cpus = ids(environ["GOMP_CPU_AFFINITY"], "GOMP_CPU_AFFINITY")
    elif "proclist=[" in environ.get("KMP_AFFINITY", ""):
        cpus = ids(environ["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]", 1)[0], "KMP_AFFINITY")
    elif environ.get("OMP_PLACES", "").startswith("{"):
        cpus = ids(environ["OMP_PLACES"], "OMP_PLACES")
    threads = environ.get("OMP_NUM_THREADS", "")
    return cpus or None, int(threads) if threads.isdigit() else None


def bind_forked_worker() -> None:
    """In a child just forked: restrict it to the cores vLLM set for it and give torch the
    thread count it set, which a spawned child's OpenMP runtime reads on load. The threads
    OpenMP creates later inherit the cores (it creates its pool on the first parallel
    region); unlike a spawned worker's, they are not pinned one per core within them (the
    same where a worker has one core, as in the tests). Runs after every ``os.fork`` of a
    process that chose fork; where vLLM set nothing (the engine core), it does nothing."""
    try:
        cpus, threads = omp_cpus(os.environ)
    except ValueError as e:
        log.warning("cpu_start_method 'fork': this worker runs unbound: %s", e)
        return
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:  # cores this process may not use: as a spawned worker's runtime, go on
            log.warning("cpu_start_method 'fork': cannot bind this worker to cores %s: %s", sorted(cpus), e)
    if threads:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# ---- end of fenced pieces ----
