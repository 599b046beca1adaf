"""What tests of ``vllm_dcp2d.transfer`` ask that serving never does: wait for one fetch
(serving polls: ``Receiver.poll``), ask a bootstrap server for its rank table in one
blocking call (serving asks with ``TableQuery``), count a sender's writes in flight, count
the bytes ``auth`` hashes (``CountingHmac``)."""

from __future__ import annotations

import time
import weakref

from vllm_dcp2d.transfer import bootstrap as bs
from vllm_dcp2d.transfer.auth import NO_AUTH, Auth
from vllm_dcp2d.transfer.fetch_ledger import Fetch
from vllm_dcp2d.transfer.messages import QueryRanks, RankTable, Reply, prompt_digest
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.send_ledger import SendLedger

# The prompt digest of the tests' requests: without a secret a prefill rank serves only a
# request naming one (issue 48), and both sides of a test name the same.
PD = prompt_digest([1, 2, 3])

# fetches a wait took off a receiver's poll that were not the one it waited for
_others: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_fetch(receiver: Receiver, transfer_key: str, timeout_s: float) -> Fetch:
    """Block until the fetch of ``transfer_key`` ended and return it; the other fetches
    that ended meanwhile stay for a later ``wait_fetch``."""
    others = _others.setdefault(receiver, [])
    deadline = time.monotonic() + timeout_s
    while True:
        others.extend(receiver.poll())
        mine = [f for f in others if f.transfer_key == transfer_key]
        if mine:
            others.remove(mine[0])
            return mine[0]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"fetch of {transfer_key!r} not finished within {timeout_s}s")
        time.sleep(0.005)


def query_ranks(server: str, engine_id: str, timeout_s: float = 10.0, auth: Auth = NO_AUTH) -> RankTable:
    """The rank table of the prefill instance behind ``server``; asked again (as
    ``register_rank`` registers) until every CP rank has registered or ``timeout_s``
    passes (``BootstrapError``)."""
    return bs._retry("querying the rank table", server, timeout_s,
                     lambda t: bs.request(server, QueryRanks(engine_id, "query_ranks"), (RankTable, Reply), t, auth,
                                          me="query_ranks"))


def writes_in_flight(ledger: SendLedger) -> int:
    """Writes of ``ledger``'s rank running now, all requests: each is counted on its
    attempt, which stays open until answered."""
    with ledger._lock:
        return sum(a.writes for a in ledger._open.values())


class CountingHmac:
    """``hmac`` as ``transfer.auth`` uses it (put it in its place with monkeypatch),
    keeping the length of what each ``digest`` hashes in ``hashed``."""

    def __init__(self, real):
        self.real, self.hashed = real, []

    def digest(self, key, msg, name):
        self.hashed.append(len(msg))
        return self.real.digest(key, msg, name)

    def __getattr__(self, name):
        return getattr(self.real, name)
