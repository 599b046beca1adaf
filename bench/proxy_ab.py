"""The proxy's own cost, A/B on one PD cluster: the same prompts by hand (the proxy's two hops
made from here), through this tree's proxy with several flags, and through an older tree's
proxy (``--old DIR``: its ``vllm_dcp2d`` on ``PYTHONPATH``), each way in turn, the order rotated
per round so no way always follows another. Prefill TP=2 layer-split -> decode TP=2 DCP=2, tiny
``llama-mqa`` fp32, prefix caching off; p50 / p99 / max / mean ms per way.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/proxy_ab.py [--requests 25] [--length 100] [--old DIR]
"""
import argparse
import statistics as st
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches
import pd_latency as pl  # noqa: E402
from vllm_dcp2d.local.servers import free_port, proxy_server, vllm_server, wait_all  # noqa: E402
from vllm_dcp2d.proxy.app import decode_body, prefill_body  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--requests", type=int, default=25)
ap.add_argument("--length", type=int, default=100, help="prompt tokens")
ap.add_argument("--old", default="", help="a tree whose proxy to compare (e.g. a checkout of e1efa24)")
a = ap.parse_args()
n, length = a.requests, a.length
with tempfile.TemporaryDirectory() as d:
    work = Path(d)
    model = pl.long_model(work / "model", 16384)
    common = dict(block_size=pl.PAGE, dtype="float32", kv_cache_bytes=256 << 20, max_model_len=pl.MAX_LEN,
                  args=("--no-enable-prefix-caching",))
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2,
                          extra_config={"bootstrap_port": free_port()}, **common)
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2,
                         extra_config={"transfer_timeout_s": 120.0}, **common)
    def proxy(name, args=()):
        return proxy_server(free_port(), [prefill.url], [decode.url], work, name=name, args=args)

    proxies = {"this proxy": proxy("new"), "--routing least-loaded": proxy("new-ll", ("--routing", "least-loaded")),
               "--health-interval 0": proxy("new-nohealth", ("--health-interval", "0")),
               "--keepalive 15": proxy("new-ka15", ("--keepalive", "15"))}
    if a.old:
        proxies[f"proxy of {a.old}"] = proxy("old")
        proxies[f"proxy of {a.old}"].env = {"PYTHONPATH": str(Path(a.old).resolve())}
    procs = [prefill, decode, *proxies.values()]
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        ways = ["by hand", *proxies]
        dt = {w: [] for w in ways}
        for i in range(n + 1):
            ids = pl.prompt(length, 1000 * length + i)
            for w in ways[i % len(ways):] + ways[:i % len(ways)]:
                if w == "by hand":
                    t_pre, pre = pl.timed(prefill.url + "/v1/completions",
                                          prefill_body(pl.body(model, ids), f"k-{i}"))
                    t_dec, _ = pl.timed(decode.url + "/v1/completions",
                                        decode_body(pl.body(model, ids), pre["kv_transfer_params"]))
                    t = t_pre + t_dec
                else:
                    t, _ = pl.timed(proxies[w].url + "/v1/completions", pl.body(model, ids))
                if i:
                    dt[w].append(t)
        for w in ways:
            v = sorted(dt[w])
            p99 = v[min(len(v) - 1, int(0.99 * len(v)))]
            print(f"{w:24s} p50 {1000 * st.median(v):7.1f} ms  p99 {1000 * p99:7.1f}  max {1000 * v[-1]:7.1f}  "
                  f"mean {1000 * st.mean(v):7.1f}")
    finally:
        for p in reversed(procs):
            p.stop()
