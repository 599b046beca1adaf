"""Connector pieces without an engine: stats, KV regions of vLLM layouts, start-up checks."""

from __future__ import annotations

import ctypes
import pickle
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_dcp2d.reshard.plan import plan_path  # noqa: E402
from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile  # noqa: E402
from vllm_dcp2d.vllm_compat import connector_api as compat  # noqa: E402


def test_stats_aggregate_reduce_pickle():
    a, b = DCP2DStats(), DCP2DStats()
    a.record_path(0, 1, 100, 2, 0.5, replicated_bytes=40)
    b.record_path(0, 1, 50, 1, 0.25)
    b.record_path(1, 0, 7, 1, 0.0)
    b.count("failed")
    b.count("expired", 2)
    a.aggregate(pickle.loads(pickle.dumps(b)))
    assert a.data["paths"]["0,1"] == {"transfers": 2, "bytes": 150, "replicated_bytes": 40, "descriptors": 3,
                                      "seconds": 0.75, "write_seconds": [0.5, 0.25]}
    r = a.reduce()
    assert (r["bytes"], r["transfers"], r["failed"], r["expired"]) == (157, 3, 1, 2)
    assert r["path(0,1) bytes"] == 150 and r["path(1,0) ms"] == 0.0
    assert r["replicated_bytes"] == r["path(0,1) replicated bytes"] == 40 and "path(1,0) replicated bytes" not in r
    snap = a.clone_and_reset()
    assert a.is_empty() and not snap.is_empty() and snap.data["paths"]["1,0"]["bytes"] == 7
    assert DCP2DStats(data=snap.to_dict()).reduce() == r
    with pytest.raises(TypeError):
        a.aggregate(object())


def test_stats_file(tmp_path):
    f = StatsFile(str(tmp_path / "s.jsonl"), "consumer", "e")
    f.write(a=1)
    f.write(a=2)
    StatsFile("", "consumer", "e").write(a=3)  # disabled: no-op
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"a": 2' in lines[1] and '"side": "consumer"' in lines[0]


def test_regions_cpu_layout_byte_exact():
    """Planned descriptors on the CPU layout move exactly pages(d) of each layer."""
    nb, h, bs, d = 8, 1, 4, 2
    src = {f"model.layers.{i}.self_attn.attn": torch.arange(nb * h * bs * 2 * d, dtype=torch.int16).view(
        nb, h, bs, 2 * d) + 1000 * i for i in range(3)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    sreg, smem = compat.kv_regions(src, nb)
    dreg, _ = compat.kv_regions(dst, nb)
    assert len(smem) == 3 and sreg.page_bytes.tolist() == [h * bs * 2 * d * 2]
    src_blocks, dst_blocks = np.array([5, 1, 6, 2, 7]), np.array([3, 0, 4])
    desc = plan_path(sreg, src_blocks, [1, 2], dreg, dst_blocks, dcp_size=2, dcp_rank=0)
    for s, t, n in zip(desc.src, desc.dst, desc.length):  # memmove stands in for Mooncake
        ctypes.memmove(int(t), int(s), int(n))
    names = list(src)
    expect = {k: torch.zeros_like(v) for k, v in src.items()}
    for layer in (1, 2):
        for page in (0, 2, 4):  # the pages of DCP rank 0 land in local block page // 2
            expect[names[layer]][dst_blocks[page // 2]] = src[names[layer]][src_blocks[page]]
    for name in names:  # layer 0 is not this CP rank's; nothing else was touched
        assert torch.equal(dst[name], expect[name]), name


def test_regions_per_head_layout():
    """A layout whose pages are one run per head (LHBNC: ``[H, blocks, ...]`` in memory) gives one region per head."""
    t = torch.zeros(2, 6, 16, 8, dtype=torch.bfloat16).permute(1, 0, 2, 3)  # [blocks, heads, block, content]
    reg, mem = compat.kv_regions({"layers.0.attn": t}, 6)
    assert reg.num_regions == 2 and reg.page_stride.tolist() == [16 * 8 * 2] * 2 == reg.page_bytes.tolist()
    assert reg.base[0, 1] - reg.base[0, 0] == 6 * 16 * 8 * 2 and mem == [(t.data_ptr(), t.numel() * 2)]
    assert compat.page_layout(t, 6) == "H2/N16,C16"
    with pytest.raises(ValueError, match="expected vLLM 0.32's \\[num_blocks=5"):
        compat.kv_regions({"layers.0.attn": t}, 5)


def test_interleave_check_says_what_to_set():
    vc = NS(parallel_config=NS(decode_context_parallel_size=2, cp_kv_cache_interleave_size=1,
                               _allow_auto_resolve_cp_interleave_size=False),
            cache_config=NS(block_size=32))
    with pytest.raises(ValueError, match="or set it to 32"):
        compat.check_interleave(vc)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=1, block_size=32"):
        compat.check_interleave(vc, resolved=False)  # set by the user: the engine core refuses it too
    vc.parallel_config._allow_auto_resolve_cp_interleave_size = True
    compat.check_interleave(vc, resolved=False)  # left unset: each worker resolves it
    with pytest.raises(ValueError):
        compat.check_interleave(vc)  # a worker must see it resolved
    vc.parallel_config.cp_kv_cache_interleave_size = 32
    compat.check_interleave(vc)
    vc.parallel_config.decode_context_parallel_size = 1
    vc.parallel_config.cp_kv_cache_interleave_size = 1
    compat.check_interleave(vc)


def test_kv_replicated():
    mc = lambda mla, heads: NS(model_config=NS(use_mla=mla, get_total_num_kv_heads=lambda: heads))  # noqa: E731
    assert compat.kv_replicated(mc(True, 4)) and compat.kv_replicated(mc(False, 1))
    assert not compat.kv_replicated(mc(False, 2))


@pytest.mark.timeout(240)
def test_shm_polls_sleep_instead_of_spinning():
    """cpu_poll_sleep_us: a vLLM shm-queue reader waiting within its busy window
    sleeps ``sleep_us`` per poll instead of spinning, and still gets every message.
    Checked by its count of polls (at most one per ``sleep_us`` of the wait), not by
    CPU seconds: on a loaded machine the spinning reader itself gets little CPU
    (a clean-clone run measured 10 ms of spin beside 38 ms of naps)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    child = Path(__file__).parents[1] / "support" / "shm_poll.py"
    p = subprocess.run([sys.executable, str(child), "500"], capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    spin, nap = json.loads(p.stdout.strip().splitlines()[-1])
    assert (spin["installed"], nap["installed"]) == (False, True)
    for r in (spin, nap):
        assert r["first"] == "first" and r["second"] == {"second": [2]}
        assert r["wall_s"] >= 0.5, r  # the wait stayed within the busy window: every wakeup was a poll
    assert spin["polls"] > 0, spin  # vLLM's own busy loop ran
    assert nap["polls"] <= nap["wall_s"] / 500e-6 + 1, (nap, spin)  # each poll slept 500 us


def test_page_layout_leaves_out_the_block_count():
    """Two instances with different memory (num_blocks) agree on the page layout."""
    for shape, blocks in (((100, 1, 32, 128), 100), ((100, 2, 32, 64), 100)):
        t = torch.empty(shape)
        other = torch.empty(tuple(7 if s == blocks else s for s in shape))
        assert compat.page_layout(t, blocks) == compat.page_layout(other, 7)
    assert compat.page_layout(torch.empty(100, 1, 32, 128), 100) == "N32,C512"
    assert compat.page_layout(torch.empty(100, 2, 32, 64), 100) == "H2,N32,C256"


def _order(monkeypatch, isa: str, dtype=torch.bfloat16) -> str:
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: isa)
    vc = NS(compilation_config=NS(static_forward_context={}), cache_config=NS(cache_dtype="auto"),
            model_config=NS(dtype=dtype))
    return compat.kv_element_order(vc, "model.layers.0.self_attn.attn", torch.empty(4, 1, 32, 128, dtype=dtype))


def test_element_order_names_the_cpu_packing(monkeypatch):
    """CPU pages are packed per ISA: the fingerprint's layout carries the ISA and a digest
    of the element permutation vLLM's own writer produces, so an AMX prefill and a
    non-AMX decode (same dtype and shape) fail the check naming both layouts."""
    from vllm_dcp2d.transfer.messages import Fingerprint, FingerprintMismatch
    from vllm_dcp2d.vllm_compat.attention import cpu_kv_layout

    vec = _order(monkeypatch, "vec")
    k, v = cpu_kv_layout("vec", torch.bfloat16, 32, 64)
    assert vec.startswith("unknown:isa=vec:order=") and not torch.equal(k, v)  # K is transposed, V is not
    assert _order(monkeypatch, "vec") == vec  # deterministic
    vec16 = _order(monkeypatch, "vec16")
    assert vec16 != vec
    a = Fingerprint("m", 2, 32, "bfloat16", 8192, f"N32,C512:{vec}", "sha256:0@main")
    b = Fingerprint("m", 2, 32, "bfloat16", 8192, f"N32,C512:{vec16}", "sha256:0@main")
    with pytest.raises(FingerprintMismatch) as e:
        a.check(b)
    assert repr(a.layout) in str(e.value) and repr(b.layout) in str(e.value)


def test_model_config_id_ignores_the_path_not_the_config():
    from transformers import LlamaConfig

    def vc(path, revision=None, **kw):
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, **kw)
        cfg._name_or_path = path
        return NS(model_config=NS(hf_config=cfg, revision=revision))

    here = compat.model_config_id(vc("/models/a"))
    assert here == compat.model_config_id(vc("/mnt/other/a"))  # same model, another host's path
    assert here.endswith("@unknown") and here.startswith("sha256:")
    assert compat.model_config_id(vc("/models/a", num_key_value_heads=1)) != here
    assert compat.model_config_id(vc("/models/a", revision="v2")).endswith("@v2")


def test_kv_layer_ids_number_a_draft_after_the_target():
    spec = NS(speculative_config=object(), model_config=NS(get_total_num_hidden_layers=lambda: 4))
    target = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    draft = [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2)]  # vLLM's draft_model
    ids = compat.kv_layer_ids(spec, (target + draft)[::-1])
    assert [ids[n] for n in target + draft] == list(range(6))
    eagle = "model.layers.4.self_attn.attn"  # EAGLE/MTP: numbered after the target's layers
    assert compat.kv_layer_ids(spec, [eagle] + target) == {**{n: i for i, n in enumerate(target)}, eagle: 4}
    assert [compat.is_draft_layer(spec, n) for n in (target[3], draft[0], eagle)] == [False, True, True]
    plain = NS(speculative_config=None, model_config=spec.model_config)
    assert compat.kv_layer_ids(plain, target[::-1]) == {n: i for i, n in enumerate(target)}


def test_regions_carry_each_layer_group_and_its_sharding():
    kv = {n: torch.zeros(4, 1, 16, 64) for n in ("draft_model.model.layers.0.attn", "model.layers.0.attn")}
    spec = NS(speculative_config=object(), model_config=NS(get_total_num_hidden_layers=lambda: 1))
    groups = {"draft_model.model.layers.0.attn": 0, "model.layers.0.attn": 1}
    regions, _ = compat.kv_regions(kv, 4, compat.kv_layer_ids(spec, kv), groups, [False, True])
    assert regions.layer_ids.tolist() == [1, 0] and regions.layer_group.tolist() == [0, 1]
    assert regions.group_sharded.tolist() == [False, True]


def _layer(**kw):
    class Impl:
        attn_type = kw.get("attn_type", "decoder")

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            writes.append(kv_cache)

    writes: list = []
    layer = NS(impl=Impl(), kv_sharing_target_layer_name=kw.get("shares"),
               attn_backend=NS(forward_includes_kv_cache_update=kw.get("in_forward", False), get_name=lambda: "B"))
    return layer, writes


def test_cache_write_hook_runs_before_the_write_on_that_layer_only():
    from vllm_dcp2d.vllm_compat.kv_cache import hook_cache_writes, unhook_cache_writes

    """The layer-split fill's hook (vllm_compat/kv_cache.py): set on the layer's
    own impl, called with the tensor vLLM's KV-update op is about to write, before it."""
    (a, writes_a), (b, writes_b) = _layer(), _layer()
    vc = NS(compilation_config=NS(static_forward_context={"a": a, "b": b}))
    seen = []
    hook_cache_writes(vc, ["a"], lambda name, kv: seen.append((name, kv, len(writes_a))))
    t = torch.zeros(2)
    a.impl.do_kv_cache_update(a, None, None, t, None)  # as vLLM's unified_kv_cache_update calls it
    b.impl.do_kv_cache_update(b, None, None, t, None)
    assert seen == [("a", t, 0)] and writes_a == [t] and writes_b == [t]
    unhook_cache_writes(vc, ["a"])
    a.impl.do_kv_cache_update(a, None, None, t, None)
    assert len(seen) == 1 and writes_a == [t, t]


@pytest.mark.parametrize("kw,why", [({"shares": "model.layers.0.attn"}, "shares layer"),
                                    ({"in_forward": True}, "writes the cache inside forward"),
                                    ({"attn_type": "encoder_only"}, "encoder_only attention")])
def test_cache_write_hook_refuses_a_layer_it_cannot_fill(kw, why):
    layer, _ = _layer(**kw)
    from vllm_dcp2d.vllm_compat.kv_cache import hook_cache_writes

    vc = NS(compilation_config=NS(static_forward_context={"x": layer}))
    with pytest.raises(RuntimeError, match=f"cannot fill layer 'x'.*{why}.*layer_split='off'"):
        hook_cache_writes(vc, ["x"], lambda *a: None)


def test_kv_scales_name_every_layers_scales_for_an_fp8_cache():
    """The fingerprint's ``kv_scales``: "none" unquantized; for fp8 a digest over every
    layer's K and V scales in KV layer order, so two instances whose checkpoints (or
    defaults) scale any layer differently are refused, naming both digests."""
    from vllm_dcp2d.config import ConfigError
    from vllm_dcp2d.transfer.messages import Fingerprint, FingerprintMismatch

    def vc(cache_dtype, scales):
        ctx = {f"model.layers.{i}.attn": NS(_k_scale_float=k, _v_scale_float=v) for i, (k, v) in enumerate(scales)}
        return NS(cache_config=NS(cache_dtype=cache_dtype), compilation_config=NS(static_forward_context=ctx))

    ids = {f"model.layers.{i}.attn": i for i in range(3)}
    ones = [(1.0, 1.0)] * 3
    assert compat.kv_scales(vc("auto", ones), ids) == "none"
    a = compat.kv_scales(vc("fp8", ones), ids)
    assert a.startswith("sha256:") and a == compat.kv_scales(vc("fp8_e4m3", ones), ids)
    b = compat.kv_scales(vc("fp8", [(1.0, 1.0), (1.0, 0.5), (1.0, 1.0)]), ids)
    swapped = compat.kv_scales(vc("fp8", [(1.0, 1.0), (0.5, 1.0), (1.0, 1.0)]), ids)
    assert len({a, b, swapped}) == 3
    fp = lambda s: Fingerprint("m", 3, 32, "fp8_e4m3", 4096, "N32,C64:k|v", "sha256:0@main", kv_scales=s)  # noqa: E731
    fp(a).check(fp(a))
    with pytest.raises(FingerprintMismatch, match=f"kv_scales: ours '{a}', peer '{b}'"):
        fp(a).check(fp(b))
    with pytest.raises(RuntimeError, match="no attention layer for the KV caches \\['model.layers.3.attn'\\]"):
        compat.kv_scales(vc("fp8", ones), {**ids, "model.layers.3.attn": 3})
    per_head = vc("fp8", ones)
    per_head.compilation_config.static_forward_context["model.layers.1.attn"]._v_scale = torch.ones(4)
    with pytest.raises(ConfigError, match="model.layers.1.attn._v_scale has 4 \\(per-head scales\\)"):
        compat.kv_scales(per_head, ids)
