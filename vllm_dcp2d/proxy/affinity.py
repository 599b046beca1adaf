"""Which decode (and prefill) served a prompt's prefix: session affinity, bounded (no I/O).

An agent session's turn ``t + 1`` is turn ``t``'s prompt, its answer and a little
more. The decode that served turn ``t`` has the prompt's pages in its prefix
cache, so the next turn fetches only its new pages there (docs/connector.md,
"Request flow"); anywhere else it fetches the whole history again. So the proxy
remembers, per prompt prefix, where it went (``Place``), and sends a request whose
prompt starts with a remembered prefix back there (``routing.Router`` decides
whether it may: healthy, fits, not overloaded).

**Keys** (``Keys.of``). A prefix is named by a 63-bit hash of its token ids at each
page boundary: key ``k`` covers the first ``k`` pages. The hash is polynomial in
the ids with a base drawn per process, so all ``n / page`` keys of a prompt come
from one cumulative sum (numpy, no loop per page); a finaliser mixes in ``k``. A
client can craft two prompts with one key; that costs only where a request goes,
never what it gets (the decode fetches whatever pages it lacks). The token ids
come from the client (a token-id prompt) or from the prefill's answer
(``return_token_ids`` on the prefill hop, ``hops.PREFILL_HOP``). A client may also
name its session: a string ``session_id``, else ``user`` (OpenAI's field), hashed
to a negative key that no prefix key equals.

**What is remembered** (``Affinity.record``): for a prompt of ``p`` full pages, the
keys at every ``s`` pages and at ``p``, where ``s`` is the power of two with
``p / 16 < s <= p / 8`` (1 below 16 pages), plus its session key: at most 17
entries. The next turn of a session finds the whole previous prompt (key ``p``); a
request that shares part of an earlier prompt finds the shared part less at most
an eighth of the earlier prompt. ``lookup`` accepts a match only when it covers at
least ``match`` (a fraction, default 0.5) of the request's prompt, so a shared
system prompt does not pin every request to one decode (sglang's and
vllm-router's ``cache_threshold`` rule). Entries live in an LRU of at most
``capacity`` entries (measured ~125 bytes each: 65,536 entries, ~8 MB, remember the
last ~4,000 requests at least), touched by each lookup that finds them.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_U64 = np.uint64
_MASK63 = (1 << 63) - 1
# token ids hashed per prompt at most: more than any decode holds (a longer prompt is refused
# before it is hashed whenever the decodes' lengths are known)
MAX_HASHED_TOKENS = 1 << 22
_CACHED_POWERS = 1 << 20  # powers of the base kept (8 MB at most); beyond, computed per prompt


@dataclass(frozen=True)
class Place:
    """Where a prefix went: the decode's URL, and the prefill's (None: not known)."""

    decode: str
    prefill: str | None = None


def session_key(body: dict) -> int | None:
    """The client's own session name as a key: ``session_id``, else ``user`` (non-empty strings)."""
    for field in ("session_id", "user"):
        v = body.get(field)
        if isinstance(v, str) and v:
            h = int.from_bytes(hashlib.blake2b(f"{field}\0{v}".encode(), digest_size=8).digest(), "little")
            return -1 - (h & _MASK63)
    return None


class PrefixHasher:
    """Keys of a prompt's page-aligned prefixes. ``page`` tokens per key; the base is
    random per hasher (per proxy process), so keys mean nothing outside it."""

    def __init__(self, page: int, seed: int | None = None):
        if page < 1:
            raise ValueError(f"affinity page must be >= 1 token, got {page}")
        self.page = page
        rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
        self._base = _U64(int(rng.integers(1 << 62, dtype=np.uint64)) * 2 + 1)  # odd: invertible mod 2**64
        self._powers = np.ones(1, dtype=_U64)

    def _powers_to(self, n: int) -> np.ndarray:
        """base**0 .. base**(n - 1) mod 2**64; the first ``_CACHED_POWERS`` kept between prompts."""
        if len(self._powers) < n:
            out = np.empty(n, dtype=_U64)
            out[0] = 1
            out[1:] = self._base
            np.cumprod(out, out=out)  # wraps mod 2**64
            if n <= _CACHED_POWERS:
                self._powers = out
            return out
        return self._powers[:n]

    def keys(self, ids) -> list[int]:
        """Key ``k - 1`` names the first ``k`` pages of ``ids`` (a sequence of non-negative
        integers below 2**64), for every full page (at most ``MAX_HASHED_TOKENS`` tokens);
        raises ValueError, TypeError or OverflowError on anything else."""
        n = (min(len(ids), MAX_HASHED_TOKENS) // self.page) * self.page
        if n == 0:
            return []
        a = np.asarray(ids[:n] if n < len(ids) else ids, dtype=_U64)
        a += _U64(1)  # token 0 still counts
        a *= self._powers_to(n)
        np.cumsum(a, out=a)
        h = a[self.page - 1::self.page]
        k = np.arange(1, len(h) + 1, dtype=_U64)
        x = h ^ (k * _U64(0x9E3779B97F4A7C15))  # splitmix64's finaliser over (hash, pages)
        x ^= x >> _U64(30)
        x *= _U64(0xBF58476D1CE4E5B9)
        x ^= x >> _U64(27)
        x *= _U64(0x94D049BB133111EB)
        x ^= x >> _U64(31)
        return (x >> _U64(1)).tolist()  # 63 bits: non-negative, apart from session keys


@dataclass
class Keys:
    """A request's affinity keys: ``session`` (the client's, or None), ``prefix`` (key of the
    first ``k`` pages at index ``k - 1``), ``page`` tokens per prefix key, ``prompt`` tokens."""

    session: int | None
    prefix: list[int]
    page: int
    prompt: int

    def recorded(self) -> list[int]:
        """The keys ``Affinity.record`` keeps: the session's, every ``s`` pages and all pages."""
        out = [] if self.session is None else [self.session]
        p = len(self.prefix)
        step = 1 << max(p.bit_length() - 4, 0)
        out += self.prefix[step - 1::step]
        if p % step:
            out.append(self.prefix[-1])
        return out


class Affinity:
    """LRU map from ``Keys`` to the ``Place`` that served them, ``capacity`` entries at most."""

    def __init__(self, capacity: int, match: float = 0.5):
        if capacity < 1:
            raise ValueError(f"affinity capacity must be >= 1 entry, got {capacity}")
        if not 0.0 < match <= 1.0:
            raise ValueError(f"affinity match must be a fraction of the prompt in (0, 1], got {match}")
        self.capacity, self.match = capacity, match
        self._map: OrderedDict[int, Place] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def lookup(self, keys: Keys) -> Place | None:
        """The place of the session key, else of the longest remembered prefix covering at
        least ``match`` of the prompt; None when neither is remembered."""
        if keys.session is not None and (p := self._map.get(keys.session)) is not None:
            self._map.move_to_end(keys.session)
            return p
        shortest = max(1, -(-int(self.match * keys.prompt) // keys.page))  # pages a match must cover
        for k in range(len(keys.prefix), shortest - 1, -1):
            key = keys.prefix[k - 1]
            if (p := self._map.get(key)) is not None:
                self._map.move_to_end(key)
                return p
        return None

    def record(self, keys: Keys, place: Place) -> None:
        for key in keys.recorded():
            self._map[key] = place
            self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def places(self) -> list[Place]:
        """Every remembered place (tests; oldest first)."""
        return list(self._map.values())
