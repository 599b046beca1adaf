"""Start-up choices for DCP2D instances (``vllm_compat.startup``) and the layer-split
KV layout (``vllm_compat.kv_cache``), on config stand-ins: exact decisions and
exact placements, without starting vLLM."""

from __future__ import annotations

import re
from types import SimpleNamespace as NS

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_dcp2d.config import ConfigError
from vllm_dcp2d.reshard.layout import cp_layer_range
from vllm_dcp2d.vllm_compat.startup import (bind_forked_worker, draft_backend, mla_backend, omp_cpus,
                                            resolve_interleave, route_logs, start_method)
from vllm_dcp2d.vllm_compat.kv_cache import StoragePlan, split_tensors, storage_plan


def _cc(mode="NONE", splitting=None, partition=False, **passes):
    """A compilation config: ``mode`` a ``CUDAGraphMode`` name (CPU: NONE)."""
    from vllm.config import CUDAGraphMode

    return NS(cudagraph_mode=CUDAGraphMode[mode], splitting_ops=splitting, use_inductor_graph_partition=partition,
              pass_config=NS(**passes))


def _vc(role="kv_consumer", dcp=1, tp=2, mla=True, backend=None, extra=None, connector="DCP2DConnector",
        heads=1, interleave=1, auto=True, draft=None, cc=None, sparse=False):
    spec = None if draft is None else NS(method=draft, uses_draft_kv_cache=lambda: draft != "ngram")
    return NS(compilation_config=cc or _cc(),
              kv_transfer_config=NS(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra or {}),
              speculative_config=spec,
              model_config=NS(use_mla=mla, model="m", get_total_num_kv_heads=lambda: heads,
                              hf_text_config=NS(index_topk=2048 if sparse else None)),
              attention_config=NS(backend=backend),
              parallel_config=NS(decode_context_parallel_size=dcp, tensor_parallel_size=tp, pipeline_parallel_size=1,
                                 cp_kv_cache_interleave_size=interleave,
                                 _allow_auto_resolve_cp_interleave_size=auto))


def test_mla_backend_on_amx():
    assert mla_backend(_vc(dcp=2), amx=True) == "CPU_MLA"
    assert mla_backend(_vc(role="kv_producer"), amx=True) == "CPU_MLA"  # layer-split may apply
    # no LSE or layer-split needed: still CPU_MLA by default (one page format on both sides, float32)
    assert mla_backend(_vc(role="kv_producer", extra={"layer_split": "off"}), amx=True) == "CPU_MLA"
    assert mla_backend(_vc(role="kv_producer", tp=1), amx=True) == "CPU_MLA"
    assert mla_backend(_vc(dcp=1), amx=True) == "CPU_MLA"
    # ... but an explicit AMX_MLA is kept where it can work
    assert mla_backend(_vc(dcp=1, backend=NS(name="AMX_MLA")), amx=True) is None
    assert mla_backend(_vc(role="kv_producer", extra={"layer_split": "off"}, backend=NS(name="AMX_MLA")),
                       amx=True) is None
    assert mla_backend(_vc(dcp=2), amx=False) is None  # vLLM already picks CPU_MLA
    assert mla_backend(_vc(dcp=2, mla=False), amx=True) is None
    assert mla_backend(_vc(dcp=2, connector="NixlConnector"), amx=True) is None
    with pytest.raises(ValueError, match="Use --attention-backend CPU_MLA"):
        mla_backend(_vc(dcp=2, backend=NS(name="AMX_MLA")), amx=True)
    with pytest.raises(ValueError, match="layer_split='off'"):
        mla_backend(_vc(role="kv_producer", backend=NS(name="AMX_MLA")), amx=True)


def test_mla_draft_follows_the_targets_backend():
    def vc(draft_mla=True, chosen=None, spec=True):
        return NS(speculative_config=NS(draft_model_config=NS(use_mla=draft_mla), attention_backend=chosen)
                  if spec else None)

    assert draft_backend(vc(), "CPU_MLA") == "CPU_MLA"
    assert draft_backend(vc(), None) is None                        # the target keeps vLLM's choice
    assert draft_backend(vc(draft_mla=False), "CPU_MLA") is None    # a non-MLA draft (EAGLE head)
    assert draft_backend(vc(chosen="AMX_MLA"), "CPU_MLA") is None   # the user's explicit draft backend
    assert draft_backend(vc(spec=False), "CPU_MLA") is None


def test_interleave_follows_block_size_unless_set():
    vc = _vc(dcp=2)
    resolve_interleave(vc, 16)
    assert vc.parallel_config.cp_kv_cache_interleave_size == 16
    vc = _vc(dcp=2, interleave=8, auto=False)  # the user's choice stays (and check_interleave names it)
    resolve_interleave(vc, 16)
    assert vc.parallel_config.cp_kv_cache_interleave_size == 8
    vc = _vc(dcp=1)
    resolve_interleave(vc, 16)
    assert vc.parallel_config.cp_kv_cache_interleave_size == 1


def test_start_method_is_spawn_unless_a_dcp2d_instance_asks_for_fork():
    assert start_method(_vc()) == "spawn"
    assert start_method(_vc(extra={"cpu_start_method": "fork"})) == "fork"
    assert start_method(_vc(extra={"cpu_start_method": "fork"}, connector="NixlConnector")) == "spawn"
    with pytest.raises(ConfigError, match=re.escape("['cpu_start_method'] = 'forkserver'")):
        start_method(_vc(extra={"cpu_start_method": "forkserver"}))


@pytest.mark.parametrize("env, cpus, threads", [
    ({"GOMP_CPU_AFFINITY": "1", "OMP_NUM_THREADS": "1"}, {1}, 1),        # libgomp preloaded (vLLM's CPU image)
    ({"GOMP_CPU_AFFINITY": "0 2-4"}, {0, 2, 3, 4}, None),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,5]", "OMP_NUM_THREADS": "2"}, {3, 5}, 2),
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "2"}, {0, 1}, 2),
    ({"OMP_PLACES": "{0},{1}"}, {0, 1}, None),                               # places listed one by one
    ({"GOMP_CPU_AFFINITY": "0-7:2"}, {0, 2, 4, 6}, None),                    # a range with a stride
    ({"OMP_NUM_THREADS": "2"}, None, 2),                                   # the engine core: threads only
    ({}, None, None),                                                      # VLLM_CPU_OMP_THREADS_BIND=nobind
])
def test_omp_cpus_reads_what_vllm_set_for_the_worker(env, cpus, threads):
    assert omp_cpus(env) == (cpus, threads)


@pytest.mark.parametrize("var, value", [("GOMP_CPU_AFFINITY", "0 x"), ("OMP_PLACES", "{0,a}"),
                                        ("KMP_AFFINITY", "explicit,proclist=[1-]"), ("GOMP_CPU_AFFINITY", "0-4:0")])
def test_omp_cpus_names_a_value_that_is_not_core_ids(var, value):
    with pytest.raises(ValueError, match=re.escape(f"{var}={value!r}")):
        omp_cpus({var: value})


def test_a_forked_worker_binds_to_its_cores():
    """A real fork: the child runs the at-fork handler with the variables vLLM sets around a
    worker's start, and reports its affinity and torch's thread count; the parent keeps its own."""
    import os

    import torch

    core = sorted(os.sched_getaffinity(0))[-1]
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    threads = before[1] + 1  # a count the child must set, whatever the parent has
    read, write = os.pipe()
    os.environ.update(GOMP_CPU_AFFINITY=str(core), OMP_NUM_THREADS=str(threads))
    try:
        pid = os.fork()
        if pid == 0:  # the child: what bind_forked_worker left, then exit without pytest's teardown
            try:
                bind_forked_worker()
                os.write(write, repr((sorted(os.sched_getaffinity(0)), torch.get_num_threads())).encode())
            finally:
                os._exit(0)
    finally:
        del os.environ["GOMP_CPU_AFFINITY"], os.environ["OMP_NUM_THREADS"]
    os.close(write)
    with os.fdopen(read) as f:
        got = f.read()
    os.waitpid(pid, 0)
    assert got == repr(([core], threads))
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


def test_the_plugins_records_reach_the_handlers_vllm_has_when_they_are_logged(monkeypatch):
    """vLLM configures its logger in each process after loading the plugins there, and a
    forked process loads none: a handler vLLM adds after the routing still gets the
    plugin's INFO lines, at vLLM's level."""
    import logging

    ours, theirs = logging.getLogger("vllm_dcp2d"), logging.getLogger("vllm")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(theirs, "handlers", [])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    monkeypatch.setattr(theirs, "propagate", False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "chatty")  # not a level: read by vLLM only, never raises here
    route_logs()
    route_logs()
    assert len(ours.handlers) == 1 and not ours.propagate

    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append((record.name, record.levelname, record.getMessage()))

    theirs.addHandler(Keep())  # what vLLM's configure_logging does later in each process
    log = logging.getLogger("vllm_dcp2d.connector.producer")
    log.info("stores layers [%d, %d)", 0, 2)
    log.debug("not at vLLM's INFO")
    assert got == [("vllm_dcp2d.connector.producer", "INFO", "stores layers [0, 2)")]
    theirs.setLevel(logging.DEBUG)  # vllm serve --log-level debug: vLLM's configure_logging sets it
    log.debug("at vLLM's DEBUG")
    assert got[1:] == [("vllm_dcp2d.connector.producer", "DEBUG", "at vLLM's DEBUG")]


def test_storage_plan_decisions(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *a: True)
    plan = storage_plan(_vc(role="kv_producer"), 8)
    assert plan == StoragePlan(8, 2) and plan.slots == 5
    assert storage_plan(_vc(role="kv_producer", extra={"cp_size": 1}), 8) is None
    assert storage_plan(_vc(role="kv_consumer"), 8) is None
    assert storage_plan(_vc(role="kv_producer", extra={"layer_split": "off"}), 8) is None
    assert storage_plan(_vc(role="kv_producer", mla=False, heads=2), 8) is None  # sharded KV: "auto" skips
    # Sparse MLA (DSA): an indexer cache beside each layer's latent, two placements per layer.
    assert storage_plan(_vc(role="kv_producer", sparse=True), 8) is None
    with pytest.raises(ConfigError, match="uses sparse MLA: each layer keeps an indexer cache"):
        storage_plan(_vc(role="kv_producer", sparse=True, extra={"layer_split": "on"}), 8)
    # KV heads sharded over TP: the default cp_size is 1 (issue 39), and the reason is named
    with pytest.raises(ConfigError, match="cp_size is 1: nothing to split \\(2 KV heads sharded over "
                                          "tensor_parallel_size=2"):
        storage_plan(_vc(role="kv_producer", mla=False, heads=2, extra={"layer_split": "on"}), 8)
    with pytest.raises(ConfigError, match="kv_role is 'kv_consumer'"):
        storage_plan(_vc(extra={"layer_split": "on"}), 8)
    with pytest.raises(ConfigError, match="expected one of"):
        storage_plan(_vc(role="kv_producer", extra={"layer_split": "yes"}), 8)
    # A draft's KV is written outside the target's forward: every rank stores every layer.
    assert storage_plan(_vc(role="kv_producer", draft="eagle"), 9) is None
    assert storage_plan(_vc(role="kv_producer", draft="ngram"), 8) == StoragePlan(8, 2)  # no draft KV
    with pytest.raises(ConfigError, match="speculative draft \\(method='draft_model'\\) keeps its own KV"):
        storage_plan(_vc(role="kv_producer", draft="draft_model", extra={"layer_split": "on"}), 8)
    # GPU: one mechanism (the per-layer hook), as long as no graph replays the cache write without it.
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *a: False)
    kvu = ["vllm::unified_attention_with_output", "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    assert storage_plan(_vc(role="kv_producer", cc=_cc("PIECEWISE", kvu)), 8) == StoragePlan(8, 2)
    assert storage_plan(_vc(role="kv_producer", cc=_cc("FULL_AND_PIECEWISE", kvu)), 8) is None  # "auto" skips
    with pytest.raises(ConfigError, match="cudagraph_mode=FULL_AND_PIECEWISE.*-cc.cudagraph_mode=PIECEWISE"):
        storage_plan(_vc(role="kv_producer", extra={"layer_split": "on"}, cc=_cc("FULL_AND_PIECEWISE", kvu)), 8)
    with pytest.raises(ConfigError, match="captured inside piecewise graphs"):
        storage_plan(_vc(role="kv_producer", extra={"layer_split": "on"}, cc=_cc("PIECEWISE", kvu[:1])), 8)
    with pytest.raises(ConfigError, match="captured inside piecewise graphs"):
        storage_plan(_vc(role="kv_producer", extra={"layer_split": "on"}, cc=_cc("PIECEWISE", kvu, True)), 8)
    with pytest.raises(ConfigError, match="fuse_rope_kvcache"):
        storage_plan(_vc(role="kv_producer", extra={"layer_split": "on"}, cc=_cc("NONE", fuse_rope_kvcache=True)), 8)


def test_the_connector_asks_vllm_for_piecewise_graphs_when_layer_split_is_on():
    from vllm_dcp2d.connector.connector import DCP2DConnector

    assert DCP2DConnector.requires_piecewise_for_cudagraph({"layer_split": "on"})
    assert not DCP2DConnector.requires_piecewise_for_cudagraph({})  # auto: a decode keeps its FULL graphs
    assert DCP2DConnector.supports_sleep_mode(None) is False


@given(layers=st.integers(1, 40), cp=st.integers(2, 8), blocks=st.integers(1, 64), page=st.integers(1, 512))
def test_split_tensors_places_owned_layers_apart_and_others_on_one_slot(layers, cp, blocks, page):
    """For every rank: owned layers at their own offsets, every other layer at the
    one transient offset, all inside an allocation of (owned + 1) layer regions."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    cp = min(cp, layers) if layers > 1 else 2
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    stride = blocks * page
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_groups=[NS(layer_names=names)],
                        kv_cache_tensors=[KVCacheTensor(size=layers * stride, layers=names, layer_stride=stride,
                                                        block_stride=page)])
    plan = StoragePlan(layers, cp)
    index = lambda n: int(n.split(".")[2])  # noqa: E731
    for rank in range(cp):
        out = split_tensors(cfg, plan, rank, index)
        owned = list(cp_layer_range(layers, cp, rank))
        start = {}
        for t in out.kv_cache_tensors:
            assert t.size == (len(owned) + 1) * stride and t.block_stride == page
            for i, n in enumerate(t.layers):
                start[index(n)] = t.offset + i * t.layer_stride
        assert sorted(start) == list(range(layers))
        assert [start[i] for i in owned] == [k * stride for k in range(len(owned))]
        assert {start[i] for i in range(layers) if i not in owned} <= {len(owned) * stride}
        assert out.num_blocks == blocks


def test_split_tensors_refuses_block_outermost_layouts():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    cfg = KVCacheConfig(num_blocks=4, kv_cache_groups=[NS(layer_names=names)],
                        kv_cache_tensors=[KVCacheTensor(size=8 * 64, layers=names, layer_stride=64, block_stride=128)])
    with pytest.raises(ValueError, match="layer-outermost"):
        split_tensors(cfg, StoragePlan(2, 2), 0, lambda n: int(n.split(".")[2]))
