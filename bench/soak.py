"""A soak: the agent workload through the proxy for ``--minutes``, with faults, watching for
what makes a PD deployment slowly stop (held blocks, leaked sessions, stuck transfers; issue 49,
item 6).

The fault cluster of ``tests/support/faults.py`` (prefill TP=2 = 2 layer-split CP ranks ->
decode TP=2 DCP=2, the PD proxy, tiny ``llama-mqa`` fp32, its short connector timeouts), sized
for the agent's prompts. ``--concurrency`` clients run agent sessions back to back (each
``--turns`` turns, every turn the previous prompt plus ``--step`` tokens from ``--base``),
streamed; every ``--hang-up-every``-th request hangs up after 2 chunks. After the warm-up
(``--warmup`` of the run) the decode is SIGKILLed and restarted on its port (at 35% of the run),
then the prefill is frozen (SIGSTOP) for ``transfer_timeout_s + 3`` s and resumed (at 65%, or
once the decode is back). Every completed answer is checked against the prefill's own (asked
directly, no ``kv_transfer_params``).

Every ``--sample-s``, per process (prefill, decode, proxy: each server's whole session, engine
core and workers included): RSS, threads, open fds; per instance: KV usage, blocks in
quarantine (``vllm:dcp2d_blocks_in_quarantine``), running and waiting requests. Printed: the
outcomes, and per process and quantity the median just after warm-up (before the first
fault) against the median of the load's last 15% (after both faults: the load goes on for a fifth of
the run after the prefill is resumed), with a verdict ("flat":
RSS at most ``--slack`` (2%) plus 16 MB above, threads and fds within 5% + 2; KV usage and quarantined
blocks back to 0 once the load ended and the cluster drained);
``--png``: every series over time, the faults marked; ``--json``: the samples.

``--direct`` is the control: the same clients send every turn to the prefill instance itself (no
proxy, no transfer, no faults; its layer-split storage and its reference answers as in the soak),
so a growth it shows too is vLLM's (and layer-split's), not the PD path's.

``--onednn-cache N`` sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` in every server, 0 by default:
vLLM's CPU GEMMs (oneDNN) keep a JIT-compiled kernel per batch shape, ~0.4 MiB each, up to 1,024 in
oneDNN's cache (its default) plus 32 per linear layer in vLLM's own handler; the prefill's
workers meet new shapes for many minutes and climb by ~200 MiB before that cache is full
(``bench/onednn_cache.py``; BENCHMARKS.md "Soak"). With 0 only vLLM's 32 per layer stay, filled
within the warm-up, so a growth the soak reports is not vLLM's kernel cache; ``-1`` leaves
oneDNN's default.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/soak.py --minutes 30 [--concurrency 4] \\
        [--png soak.png] [--json soak.json]

Exit status 1 if an answer differed from the prefill's, a failure gave no clear error, or a
quantity grew.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/support/ (tests/README.md)
from tests.support.faults import FaultCluster, FaultConfig  # noqa: E402
from vllm_dcp2d.reshard.layout import cdiv  # noqa: E402
from vllm_dcp2d.local.workload import Sampler, host_cpu, references, session_prompt, stream  # noqa: E402

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
METRICS = ("vllm:kv_cache_usage_perc", "vllm:dcp2d_blocks_in_quarantine", "vllm:num_requests_running",
           "vllm:num_requests_waiting")
# 2% + 16 MB: the proxy's affinity map fills to its cap (+8 MB of ~60); 10% let a prefill's +100 MB
# (vLLM's oneDNN kernel cache, before --onednn-cache) read as flat.
RSS_SLACK_MB = 16.0
WATCHED = (("rss_bytes", "RSS MB", 1e-6), ("threads", "threads", 1), ("fds", "open fds", 1),
           (METRICS[0], "KV usage", 1), (METRICS[1], "blocks in quarantine", 1))


class Clients:
    """``n`` client threads running agent sessions until ``stop``; outcomes in ``done``:
    ``(t_end, kind, detail)`` with kind ``equal``, ``wrong``, ``error`` (HTTP status or SSE error
    with a message), ``unclear`` (no answer at all) or ``hung_up``."""

    def __init__(self, c: FaultCluster, a, n: int):
        self.c, self.a, self.n = c, a, n
        self.done: list[tuple[float, str, str]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._next = [0, 0]  # sessions started, requests sent
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _count(self, i: int) -> int:
        with self._lock:
            self._next[i] += 1
            return self._next[i]

    def _run(self) -> None:
        a, model = self.a, self.c.model
        while not self.stop.is_set():
            session = self._count(0)
            for turn in range(a.turns):
                ids = session_prompt(session, turn, a.base, a.step)
                hang = 2 if self._count(1) % a.hang_up_every == 0 else None
                url = self.c.procs["prefill"].url if a.direct else self.c.url
                s = stream(url, model, ids, a.out_tokens, self.c.cfg.bound_s + 30, hang)
                if s.hung_up:
                    kind, detail = "hung_up", ""
                elif s.ok:
                    try:
                        ref = references(self.c.procs["prefill"].url, model, [ids], a.out_tokens, 120, 1)[0]
                        kind, detail = ("equal", "") if s.text == ref else ("wrong", f"{s.text!r} != {ref!r}")
                    except (OSError, RuntimeError) as e:  # the prefill frozen past the reference's timeout
                        kind, detail = "unverified", str(e)[:200]
                elif s.status and s.error:
                    kind, detail = "error", f"{s.status}: {s.error[:150]}"
                else:
                    kind, detail = "unclear", s.error[:200]
                with self._lock:
                    self.done.append((time.monotonic(), kind, detail))
                if kind in ("error", "unclear"):
                    time.sleep(0.5)  # a dead upstream fails fast: no busy loop
                    break
                if self.stop.is_set():
                    return

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.c.cfg.bound_s + 180)


def faults(c: FaultCluster, s: Sampler, t0: float, total_s: float, marks: list) -> None:
    """Kill and restart the decode at 35% of the run, freeze the prefill past its timeout at 65%."""
    time.sleep(max(0.0, t0 + 0.35 * total_s - time.monotonic()))
    marks.append((time.monotonic(), "decode SIGKILL"))
    print(f"  {(marks[-1][0] - t0) / 60:5.1f} min: decode SIGKILL, restarting it", flush=True)
    c.kill("decode")
    c.restart("decode")
    s.targets["decode"] = (c.procs["decode"].url, c.procs["decode"].proc.pid)
    marks.append((time.monotonic(), "decode back"))
    time.sleep(max(0.0, t0 + 0.65 * total_s - time.monotonic()))
    marks.append((time.monotonic(), "prefill SIGSTOP"))
    print(f"  {(marks[-1][0] - t0) / 60:5.1f} min: prefill SIGSTOP for {c.cfg.transfer_timeout_s + 3:.0f} s", flush=True)
    c.freeze("prefill")
    time.sleep(c.cfg.transfer_timeout_s + 3.0)
    c.thaw("prefill")
    marks.append((time.monotonic(), "prefill SIGCONT"))


def flatness(s: Sampler, early: tuple[float, float], late: tuple[float, float], drained: float,
             slack: float) -> list[tuple]:
    """Per (process, quantity): the median in ``early`` and in ``late`` (both under load), the
    max, and a verdict: RSS at most ``slack`` plus ``RSS_SLACK_MB`` above, threads and fds at most 5% + 2 above; KV
    usage and quarantined blocks: the last sample after ``drained`` must be 0."""
    out = []
    for name in ("prefill", "decode", "proxy"):
        for key, label, scale in WATCHED:
            pts = s.series(name, key)
            if not pts:  # not sampled for this process (the proxy has no KV)
                continue
            if key not in (METRICS[0], METRICS[1]):  # a session with no process is a dead server: not a sample
                pts = [(t, v) for t, v in pts if v > 0]
            e = [v * scale for t, v in pts if early[0] <= t < early[1]]
            lt = [v * scale for t, v in pts if late[0] <= t < late[1]]
            after = [v * scale for t, v in pts if t >= drained]
            if not e or not lt:
                out.append((name, label, float("nan"), float("nan"), float("nan"), "NO SAMPLES in a window"))
                continue
            em, lm, peak = float(np.median(e)), float(np.median(lt)), max(v * scale for _, v in pts)
            if key in (METRICS[0], METRICS[1]):
                end = after[-1] if after else float("nan")
                verdict = "back to 0" if end == 0 else f"HELD {end:g} after the drain"
            else:
                ok = lm <= em * (1 + slack) + RSS_SLACK_MB if key == "rss_bytes" else lm <= em * 1.05 + 2
                verdict = "flat" if ok else "GREW"
            out.append((name, label, em, lm, peak, verdict))
    return out


def plot(s: Sampler, marks: list, t0: float, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[bench]')"
    fig, axes = plt.subplots(len(WATCHED), 1, figsize=(10, 2.2 * len(WATCHED)), sharex=True)
    first_fault = marks[0][0] if marks else float("inf")
    for ax, (key, label, scale) in zip(axes, WATCHED):
        label = "RSS MB, change" if key == "rss_bytes" else label
        for name in ("prefill", "decode", "proxy"):
            pts = s.series(name, key)
            if key == "rss_bytes":
                # RSS against its own median from minute 1 to the first fault: a growth of tens of
                # MB is what matters, and it is invisible on a scale of GB. A dead server: no sample.
                pts = [(t, v) for t, v in pts if v > 0]
                base = [v for t, v in pts if t0 + 60 <= t < first_fault] or [v for _, v in pts[:1]]
                pts = [(t, v - float(np.median(base))) for t, v in pts]
            if pts:
                ax.plot([(t - t0) / 60 for t, _ in pts], [v * scale for _, v in pts], label=name)
        for t, what in marks:
            ax.axvline((t - t0) / 60, color="grey", ls="--", lw=0.8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left")
    for t, what in marks:
        axes[0].annotate(what, ((t - t0) / 60, axes[0].get_ylim()[1]), fontsize=7, rotation=90, va="top")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=0.15, help="share of the run before the baseline window")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--base", type=int, default=1500)
    ap.add_argument("--step", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--hang-up-every", type=int, default=7)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--slack", type=float, default=0.02, help="RSS growth allowed after warm-up, plus 16 MB")
    ap.add_argument("--direct", action="store_true",
                    help="the control: the load straight to the prefill instance, no PD and no faults")
    ap.add_argument("--onednn-cache", type=int, default=0, metavar="N",
                    help="ONEDNN_PRIMITIVE_CACHE_CAPACITY of the servers; -1: oneDNN's default (1024)")
    ap.add_argument("--work", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--replot", default="", metavar="JSON", help="only draw --png from an earlier run's --json")
    a = ap.parse_args(argv)
    if a.replot:
        old = json.loads(Path(a.replot).read_text())
        s = Sampler({}, ())
        s.rows = [tuple(r) for r in old["samples"]]
        print(plot(s, old["marks"], old["t0"], Path(a.png or "soak.png")))
        return 0
    if min(a.minutes, a.concurrency, a.turns, a.out_tokens, a.hang_up_every, a.sample_s) <= 0 or not 0 < a.warmup < 0.35:
        ap.error("expected positive durations and counts, and 0 < --warmup < 0.35 (the first fault)")
    if a.onednn_cache >= 0:  # the servers inherit this process's environment
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(a.onednn_cache)
    max_len = cdiv(a.base + a.step * (a.turns - 1) + a.out_tokens, 32) * 32 + 32
    cfg = FaultConfig(concurrency=a.concurrency, max_tokens=a.out_tokens, prompts=1, max_model_len=max_len,
                      kv_cache_bytes=256 << 20)
    work = Path(a.work or tempfile.mkdtemp(prefix="dcp2d-soak-"))
    total = 60 * a.minutes
    cache = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "oneDNN's default")
    print(f"{host_cpu()}; {cfg}; ONEDNN_PRIMITIVE_CACHE_CAPACITY {cache}; logs in {work}", flush=True)
    marks: list = []
    with FaultCluster(work, cfg) as c:
        targets = {n: (c.procs[n].url if n != "proxy" else None, c.procs[n].proc.pid)
                   for n in ("prefill", "decode", "proxy")}
        with Sampler(targets, METRICS, a.sample_s) as s:
            t0 = time.monotonic()
            with Clients(c, a, a.concurrency) as clients:
                f = threading.Thread(target=faults, args=(c, s, t0, total, marks), daemon=True)
                if not a.direct:
                    f.start()
                report = t0 + 60
                # the load goes on to the end of the run, and a fifth of the run after the last fault
                while f.is_alive() or time.monotonic() < max([t0 + total] + [m[0] + 0.2 * total for m in marks[-1:]]):
                    time.sleep(1.0)
                    if time.monotonic() >= report:
                        report += 60
                        kinds = [d[1] for d in list(clients.done)]
                        print(f"  {(time.monotonic() - t0) / 60:5.1f} min: " + ", ".join(
                            f"{k} {kinds.count(k)}" for k in sorted(set(kinds))), flush=True)
            marks.append((time.monotonic(), "load ends"))
            usage = c.wait_drained()
            time.sleep(2 * a.sample_s)  # samples of the drained cluster
    done = clients.done
    kinds = {k: sum(d[1] == k for d in done) for k in ("equal", "wrong", "error", "unclear", "hung_up", "unverified")}
    load_end = next(t for t, what in marks if what == "load ends")
    if a.direct:  # no faults: the same windows as the soak's (to 35%; the last 15%)
        early, late = (t0 + a.warmup * total, t0 + 0.35 * total), (load_end - 0.15 * (load_end - t0), load_end)
    else:
        recovered = next(t for t, what in marks if what == "prefill SIGCONT")
        early = (t0 + a.warmup * total, marks[0][0])
        late = (max(recovered, load_end - 0.15 * (load_end - t0)), load_end)
    rows = flatness(s, early, late, load_end, a.slack)
    print(f"\n{host_cpu()}; {(load_end - t0) / 60:.1f} min (--minutes {a.minutes:g}{', --direct' if a.direct else ''}) of agent sessions ({a.turns} turns from {a.base} tokens, +{a.step}; "
          f"{a.out_tokens} output tokens) from {a.concurrency} clients, every {a.hang_up_every}th hanging up\n")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in kinds.items()) + f"; KV usage after the drain {usage}")
    for t, what in marks:
        print(f"  {(t - t0) / 60:6.2f} min  {what}")
    print(f"\n{'process':<8} {'quantity':<22} {'after warm-up':>13} {'end':>10} {'max':>10}  verdict")
    for name, label, em, lm, peak, verdict in rows:
        print(f"{name:<8} {label:<22} {em:>13.2f} {lm:>10.2f} {peak:>10.2f}  {verdict}")
    print("after warm-up = median from the end of the warm-up to the first fault; end = median of the load's "
          "last 15% after the last fault; KV usage and quarantined blocks must be 0 once the load ended and the cluster drained")
    for d in [d for d in done if d[1] in ("wrong", "unclear")][:10]:
        print(f"  {d[1]}: {d[2]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"host": host_cpu(), "t0": t0, "marks": marks, "outcomes": kinds,
                                            "samples": s.rows}))
    if a.png:
        print(plot(s, marks, t0, Path(a.png)))
    grew = [r for r in rows if r[-1] not in ("flat", "back to 0")]
    return 1 if kinds["wrong"] or kinds["unclear"] or grew or any(usage.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
