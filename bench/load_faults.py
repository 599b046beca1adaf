"""Load and faults, long version of tests/e2e/test_load_faults.py (issue 14, item 2).

One cluster (``tests/support/faults.py``: prefill TP=2 = 2 CP ranks, decode
TP=2 DCP=2, the PD proxy, tiny ``llama-mqa`` in fp32, short connector timeouts),
``--concurrency`` streaming OpenAI clients through the proxy. First a baseline
without faults, then ``--repeat`` rounds of every fault (clients hanging up
mid-stream, decode SIGKILLed and restarted, prefill SIGKILLed and restarted,
prefill frozen with SIGSTOP past ``transfer_timeout_s``), ``--requests`` requests
each. Prints one row per fault run and a total:

* ``req/s``: answers completed right per second of load (the rate held through the fault);
* ``ok`` / ``lost`` (failed with a clear HTTP error) / ``wrong`` (any other end:
  different text, a silent truncation, a failure without an HTTP error; must be 0)
  / ``hung up`` (clients that left on purpose), over the load and the load after it;
* ``in flight``: a decode fetch was seen in flight when the fault hit;
* ``survived``: every check passed (answers, errors, bound, restart, KV usage back to 0);
* p50 / p99 / max seconds of the completed requests; ``max any s``: the longest request
  of any outcome, to compare with the bound per request printed first.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/load_faults.py [--requests 60] [--repeat 3]

Exit status 1 if any run had a violation (each is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/support/ (tests/README.md)
from tests.support.faults import FAULTS, FaultCluster, FaultConfig  # noqa: E402
from tests.support.load import latency_summary  # noqa: E402

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

HEAD = (f"{'fault':<15}{'req/s':>7}{'ok':>5}{'lost':>6}{'wrong':>7}{'hung up':>9}{'in flight':>11}"
        f"{'survived':>10}{'p50 s':>8}{'p99 s':>8}{'max s':>8}{'max any s':>11}")


def row(name: str, results: list) -> str:
    outs = [o for r in results for o in r.outcomes + r.after]
    during = [o for r in results for o in r.outcomes]
    ok_during = sum(o.kind == "ok" for o in during)
    rate = ok_during / max(1e-9, sum(r.load_s for r in results))
    lat = latency_summary(outs)
    n = {k: sum(o.kind == k for o in outs) for k in ("ok", "error", "wrong", "disconnected")}
    flight = f"{sum(r.in_flight for r in results)}/{len(results)}"
    survived = f"{sum(not r.violations for r in results)}/{len(results)}"
    return (f"{name:<15}{rate:>7.2f}{n['ok']:>5}{n['error']:>6}{n['wrong']:>7}{n['disconnected']:>9}"
            f"{flight:>11}{survived:>10}{lat['p50']:>8.2f}{lat['p99']:>8.2f}{lat['max']:>8.2f}"
            f"{max((o.seconds for o in outs), default=0.0):>11.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="requests per fault run")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every fault")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--work", default="", help="directory for logs and the model (default: a temporary one)")
    args = ap.parse_args(argv)
    cfg = FaultConfig(concurrency=args.concurrency, prompts=max(24, args.requests))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="load_faults_"))
    print(f"work dir {work}; {cfg}; bound per request {cfg.bound_s:.0f} s", flush=True)
    results: dict[str, list] = {}
    with FaultCluster(work, cfg) as c:
        plan = ["none"] + [f for _ in range(args.repeat) for f in args.faults]
        for fault in plan:
            r = c.run_fault(fault, args.requests)
            results.setdefault(fault, []).append(r)
            print(row(fault, [r]) + f"  ({r.seconds:.0f} s)", flush=True)
            for v in r.violations:
                print(f"  VIOLATION {v}", flush=True)
    print("\n" + HEAD)
    for fault, rs in results.items():
        print(row(fault, rs))
    allr = [r for rs in results.values() for r in rs]
    print(row("all", allr))
    print(f"faults injected {sum(r.fault != 'none' for r in allr)}, survived "
          f"{sum(r.fault != 'none' and not r.violations for r in allr)}")
    return 1 if any(r.violations for r in allr) else 0


if __name__ == "__main__":
    sys.exit(main())
