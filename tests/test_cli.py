"""`vllm-dcp2d plan` on the seed's GLM-5.2 configuration (design §5.3, §6.1)."""

import json

import pytest

from tests.support.cli import run


def test_plan_json_matches_seed_numbers():
    p = run("plan", "--num-layers", "78", "--cp", "8", "--dcp", "4", "--tokens", "32768",
            "--page-size", "64", "--bytes-per-token-layer", "576", "--json")
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    assert len(m["paths"]) == 32
    kv = 78 * 576 * 32768
    assert m["total_bytes"] == kv and round(kv / 1e9, 2) == 1.47          # ~1.47 GB
    assert m["naive_bytes"] == 4 * kv and round(4 * kv / 1e9, 2) == 5.89  # seed: ~5.88 GB
    per_rank = {d: sum(p["bytes"] for p in m["paths"] if p["dcp_rank"] == d) for d in range(4)}
    assert all(round(b / 1e6) == 368 for b in per_rank.values())        # ~368 MB
    p0 = m["paths"][0]
    assert set(p0) == {"cp_rank", "dcp_rank", "layers", "pages", "bytes", "descriptors"}
    assert p0["layers"] == [0, 10] and p0["pages"] == 128 and p0["bytes"] == 10 * 128 * 64 * 576
    assert m["paths"][-1]["layers"] == [69, 78]


def test_plan_with_the_mtp_layer():
    """GLM-5.2 with its MTP layer (KV layer 78): the target's KV crosses the wire once, the
    MTP layer's once per DCP rank (its group is not sharded on decode)."""
    p = run("plan", "--num-layers", "79", "--draft-layers", "1", "--cp", "8", "--dcp", "4", "--tokens", "32768",
            "--page-size", "64", "--bytes-per-token-layer", "576", "--json")
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    layer = 576 * 32768
    assert (m["kv_bytes"], m["draft_kv_bytes"], m["draft_layers"]) == (79 * layer, layer, 1)
    assert m["total_bytes"] == 78 * layer + 4 * layer
    assert [p["bytes"] for p in m["paths"] if p["layers"][1] == 79] == [8 * 128 * 64 * 576 + layer] * 4  # layers [70, 79)


def test_plan_of_glm_5_2_with_sparse_mla():
    """GLM-5.2's DSA caches, both DCP-sharded on decode, each its own page format: the
    fp8_ds_mla latent (656 B per token and layer) and the indexer's keys (132 B). Every
    path moves both caches of its layers, one descriptor per (layer, cache, page); the
    wire carries the KV once."""
    p = run("plan", "--num-layers", "78", "--cp", "8", "--dcp", "4", "--tokens", "32768", "--page-size", "64",
            "--cache", "latent:656", "--cache", "indexer:132", "--json")
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    assert m["caches"] == [{"name": "latent", "bytes_per_token_layer": 656, "page_bytes": 41984, "layers": 78,
                            "kv_bytes": 78 * 656 * 32768},
                           {"name": "indexer", "bytes_per_token_layer": 132, "page_bytes": 8448, "layers": 78,
                            "kv_bytes": 78 * 132 * 32768}]
    assert m["total_bytes"] == m["kv_bytes"] == 78 * (656 + 132) * 32768 and m["page_bytes"] == 64 * 788
    p0 = m["paths"][0]
    assert p0["bytes"] == 10 * 128 * 64 * (656 + 132) and p0["descriptors"] == 10 * 2 * 128
    table = run("plan", "--num-layers", "78", "--cp", "8", "--dcp", "4", "--tokens", "32768", "--page-size", "64",
                "--cache", "latent:656", "--cache", "indexer:132").stdout
    assert "latent cache: 656 B per token and layer, its own page format (41984 B per page), in every layer, " \
           "DCP-sharded" in table
    assert "indexer cache: 132 B per token and layer, its own page format (8448 B per page), in every layer, " \
           "DCP-sharded" in table
    both = run("plan", "--cache", "latent:656", "--bytes-per-token-layer", "576")
    assert both.returncode == 2 and "give --cache or --bytes-per-token-layer, not both" in both.stderr


def test_plan_of_glm_5_2_with_and_without_shared_indexers():
    """GLM-5.2 with its MTP layer (79 layers, the last a draft's) with an indexer in every
    layer, and with vLLM's index_topk_freq=4 (``indexer:132:FF(SSSF)``: layers 0, 1, 5, 9,
    ..., 77 run their own indexer, the others reuse its top-k and have no indexer cache; the
    MTP layer always has one): each path moves the latent of all its layers and the indexer
    keys of exactly the layers that hold them, one descriptor per (target layer, cache, page)."""
    common = ("plan", "--num-layers", "79", "--draft-layers", "1", "--cp", "8", "--dcp", "4", "--tokens", "32768",
              "--page-size", "64", "--cache", "latent:656")
    full = json.loads(run(*common, "--cache", "indexer:132", "--json").stdout)
    shared = json.loads(run(*common, "--cache", "indexer:132:FF(SSSF)", "--json").stdout)
    indexer = {0, 1, 78} | set(range(5, 78, 4))  # vLLM: max(i - 2 + 1, 0) % 4 == 0, and the MTP layer
    assert len(indexer) == 22 and [c["layers"] for c in shared["caches"]] == [79, 22]
    assert [c["layers"] for c in full["caches"]] == [79, 79]
    pages = 512
    for m, has in ((full, set(range(79))), (shared, indexer)):
        for p in m["paths"]:
            layers = range(*p["layers"])
            target = [i for i in layers if i < 78]
            per_page = {i: 656 + (132 if i in has else 0) for i in layers}
            rank_pages = len(range(p["dcp_rank"], pages, 4))
            want = sum(per_page[i] * 64 * rank_pages for i in target) + sum(per_page[i] * 64 * pages
                                                                             for i in layers if i == 78)
            # the target's pages are every 4th on the prefill (one descriptor each); the draft's
            # all, contiguous on both sides here (one descriptor per cache)
            planes = sum(1 + (i in has) for i in target) * rank_pages + sum(1 + (i in has) for i in layers
                                                                            if i == 78)
            assert (p["bytes"], p["descriptors"]) == (want, planes), (p, m is shared)
    assert shared["kv_bytes"] == 79 * 656 * 32768 + 22 * 132 * 32768
    table = run(*common, "--cache", "indexer:132:FF(SSSF)").stdout
    assert "indexer cache: 132 B per token and layer, its own page format (8448 B per page), in 22 of the 79 " \
           "layers" in table
    bad = run(*common, "--cache", "indexer:132:FFS")
    assert bad.returncode == 2 and "layer pattern 'FFS' names 3 layers, the model has 78" in bad.stderr
    bad = run(*common, "--cache", "indexer:132:FX")
    assert bad.returncode == 2 and "expected letters F (holds the cache) and S (does not)" in bad.stderr


def test_plan_table_is_readable():
    p = run("plan", "--num-layers", "4", "--cp", "2", "--dcp", "2", "--tokens", "100", "--page-size", "16",
            "--bytes-per-token-layer", "64")
    assert p.returncode == 0, p.stderr
    assert "CP=2 -> DCP=2" in p.stdout and "1.00x the KV" in p.stdout and "2.00x the KV" in p.stdout
    assert p.stdout.count("\n      0        ") + p.stdout.count("\n      1        ") == 4  # 4 paths


@pytest.mark.parametrize("args, msg", [
    (["--dcp", "0"], "dcp_size must be >= 1, got 0"),
    (["--tokens", "-5"], "need tokens >= 0"),
    (["--num-layers", "4", "--draft-layers", "5"], "0 <= draft_layers <= num_layers; got 32768, 64, 36864, 5 of 4"),
    (["--cache", "latent:0"], "--cache 'latent:0': expected NAME:BYTES[:PATTERN] with BYTES >= 1"),
    (["--cache", "656"], "--cache '656': expected NAME:BYTES"),
])
def test_plan_bad_input_names_the_value(args, msg):
    p = run("plan", *args)
    assert p.returncode == 2 and msg in p.stderr


def test_unknown_command():
    p = run("bogus")
    assert p.returncode == 2 and "vllm-dcp2d plan" in p.stdout


def test_compat_names_every_patch_and_every_dcp2d_instance():
    """`vllm-dcp2d compat` on the installed vLLM (0.32.0, CPU): each patch with its state,
    then each kind of DCP2D instance, all of which start here; exit 0."""
    from vllm_dcp2d.vllm_compat.patches import PATCHES
    from vllm_dcp2d.vllm_compat.registry import ROLES

    p = run("compat")
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("vLLM 0.32.0 (CPU); vllm_dcp2d supports 0.32.0, 0.33.0, 0.34.0 (on CPU: 0.32.0, 0.33.0)")
    for patch in PATCHES:
        assert f"\n{patch.name} " in p.stdout
    assert "draft_dcp_size          not needed on vLLM 0.32.0: the V1 runner has no draft DCP size" in p.stdout
    roles = p.stdout.split("DCP2DConnector instances on this vLLM:\n", 1)[1].splitlines()
    assert [line.split("  ")[1].strip() for line in roles] == list(ROLES)
    assert all(line.endswith("  starts") for line in roles), roles
