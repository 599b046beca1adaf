"""Load and faults end to end (issue 14, item 2): streaming OpenAI clients (6 at
once) through the PD proxy to a real prefill (TP=2, 2 CP ranks) and a real decode
(TP=2, DCP=2) ``vllm serve``, with clients hanging up mid-stream, each instance
SIGKILLed while a fetch is in flight and restarted, and the prefill frozen
(SIGSTOP) past the decode's ``transfer_timeout_s``. After each fault
(``tests/support/faults.py``): every completed answer equals the colocated
one, every failure is an HTTP error with a status and a message, no request took
longer than the configured bound, the restarted instance serves again, and KV
usage returns to 0 on both instances. The long version is ``bench/load_faults.py``.
"""

from __future__ import annotations

import pytest

from tests.support.faults import FaultCluster, FaultConfig
from tests.support.shared import SharedCluster

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

REQUESTS = 12  # per fault: two waves of the 6 clients


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One cluster for the four faults (``tests/support/shared.py``): each fault restarts what
    it killed; if one leaves a server dead or frozen, the next starts on a new cluster."""
    with SharedCluster(lambda: FaultCluster(tmp_path_factory.mktemp("faults"), FaultConfig()),
                       servers=lambda c: c.procs.values()) as s:
        yield s


@pytest.fixture
def cluster(shared):
    return shared.get()


def report(r) -> str:
    kinds = {k: r.count(k) for k in ("ok", "error", "disconnected", "wrong")}
    errors = sorted({(o.status, o.message[:160]) for o in r.outcomes + r.after if o.kind == "error"})
    longest = max(o.seconds for o in r.outcomes + r.after)
    return (f"{r.fault}: {r.seconds:.0f} s, fetch in flight at the fault: {r.in_flight}, {kinds}, "
            f"longest request {longest:.1f} s, "
            f"KV usage {r.usage}, errors {errors}")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("fault", ["hang_up", "kill_decode", "kill_prefill", "freeze_prefill"])
def test_fault(cluster, fault):
    r = cluster.run_fault(fault, REQUESTS)
    print(report(r))
    # the fault must hit a decode fetch in flight (seen on the decode's /metrics before it)
    assert r.in_flight or fault == "hang_up", f"{fault} was injected with no fetch in flight: {report(r)}"
    assert not r.violations, "\n".join([report(r), *r.violations])
