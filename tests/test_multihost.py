"""The end-to-end checks with every instance on its own host.

Hosts are Linux network namespaces joined by a bridge (``vllm_dcp2d/testing/
netns.py``): prefill at 198.18.0.10, decode (DCP=2) at .11, decode1 (DCP=1) at .12,
the proxies at .13; the test talks to them from the bridge, 198.18.0.1. Nothing
is reachable over another host's loopback, so every address that travels
(``remote_bootstrap_addr`` in ``kv_transfer_params``, the CP ranks' side
channels in the rank table, Mooncake session ids) must be the host's own.
Skipped, with the reason, where namespaces cannot be made (not root / no
CAP_NET_ADMIN / no ``ip``).
"""

from __future__ import annotations

import pytest
from _pd_cluster import DCP, PROMPTS, bootstrap_addr, check_proxy, complete, pd_cluster, tokens

from vllm_dcp2d.connector import bootstrap as bs
from vllm_dcp2d.connector.messages import QueryRanks, RankTable
from vllm_dcp2d.testing.netns import Hosts, unavailable

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

WHY_NOT = unavailable()
HOSTS = ["prefill", "decode", "decode1", "proxy"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if WHY_NOT:
        pytest.skip(f"multi-host suite needs network namespaces: {WHY_NOT}")
    with Hosts(HOSTS) as hosts:
        def place(name):
            return hosts[name].addr, hosts[name].netns

        with pd_cluster(tmp_path_factory.mktemp("multihost"), place) as c:
            yield {**c, "hosts": hosts}


@pytest.mark.timeout(1200)
def test_addresses_are_the_hosts(cluster):
    """What a decode host is told: the prefill host's bootstrap address, and CP rank
    side channels on the prefill host, not loopback."""
    c = cluster
    prefill = c["hosts"]["prefill"].addr
    out = complete(c["prefill"].url, c["model"], PROMPTS["short"], max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True})
    assert out["kv_transfer_params"]["remote_bootstrap_addr"] == bootstrap_addr(c)
    assert bootstrap_addr(c).startswith(f"tcp://{prefill}:")
    table = bs.request(bootstrap_addr(c), QueryRanks("test"), RankTable, 30.0)
    assert table.cp_size == 2 and all(a.startswith(f"tcp://{prefill}:") for a in table.addresses), table


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("which,tp,dcp", [("proxy", 2, DCP), ("proxy1", 2, 1)])
def test_proxy_across_hosts(cluster, which, tp, dcp):
    """Greedy tokens equal the non-disaggregated answer and the bytes of every
    (cp_rank, dcp_rank) path equal the plan, with prefill, decode and proxy on
    different hosts."""
    check_proxy(cluster, which, tp, dcp, salt=0)


@pytest.mark.timeout(600)
def test_pipelined_across_hosts(cluster):
    """The pipelined proxy (decode asks first) across hosts: same tokens."""
    c = cluster
    for prompt in PROMPTS.values():
        assert tokens(complete(c["proxyp"].url, c["model"], prompt)) == \
            tokens(complete(c["prefill"].url, c["model"], prompt))
