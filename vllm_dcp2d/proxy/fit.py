"""What a decode instance holds and what a request needs of it (no I/O).

A decode says what it is on its own ``/metrics``, which the health poller reads
(``upstreams.HealthChecker``): DCP2DConnector's ``vllm:dcp2d_instance_info`` gauge
(``connector/prom.py``) carries its DCP size, page size, ``max_model_len``, KV
capacity in tokens and ``max_num_seqs`` as labels, and vLLM's own
``vllm:kv_cache_usage_perc`` how full its KV is. Nothing is configured on the
proxy, so nothing can disagree with the instance.

A request *fits* a decode when its whole answer does there: prompt + ``max_tokens``
<= ``max_model_len``. vLLM 0.32 *admits* more: it refuses (400, "maximum context
length is N tokens") only a prompt of ``max_model_len`` tokens or more, or
``max_tokens`` above ``max_model_len``, and clamps ``max_tokens`` to what is left
(``get_max_tokens``), so the same request answers shorter on a decode of a smaller
``max_model_len``. A request *fits with room* when the
decode also has a free sequence slot (the proxy's calls in flight to it below
``max_num_seqs``) and ``kv_tokens(need) <= kv_fraction x free KV tokens``. Free
KV is the capacity less what others use (vLLM's usage at the last poll less what
this proxy's calls held then) and less what this proxy's calls in flight now may
hold: the poll lags by up to its interval (a session's next turn would otherwise
find its own previous turn still counted), the proxy's own count does not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

INFO = "vllm:dcp2d_instance_info"
USAGE = "vllm:kv_cache_usage_perc"
MAX_METRICS_BYTES = 8 << 20  # a decode's /metrics read per poll at most (vLLM's is ~0.1-1 MB)
_MAX_INT = 1 << 40           # any figure above is not a real instance's: the answer is refused
_INFO_RE = re.compile(r"^" + re.escape(INFO) + r"\{([^}\n]*)\}\s+1(?:\.0)?\s*$", re.M)
_USAGE_RE = re.compile(r"^" + re.escape(USAGE) + r"(?:\{[^}\n]*\})?\s+(\S+)\s*$", re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class DecodeInfo:
    """One decode instance, as its ``vllm:dcp2d_instance_info`` says."""

    dcp_size: int
    block_size: int
    max_model_len: int
    kv_tokens: int
    max_num_seqs: int


def parse_metrics(text: str) -> tuple[DecodeInfo | None, float | None]:
    """``(info, KV usage 0..1)`` from an instance's ``/metrics`` text; each None when absent
    or malformed (a figure that is not a positive integer below 2**40, a usage outside
    0..1). Several engines (vLLM data parallel): the first info line, the highest usage."""
    info = None
    m = _INFO_RE.search(text)
    if m is not None:
        labels = dict(_LABEL_RE.findall(m.group(1)))
        try:
            vals = {k: int(labels[k]) for k in ("dcp_size", "block_size", "max_model_len", "kv_cache_tokens",
                                                  "max_num_seqs")}
        except (KeyError, ValueError):
            vals = None
        if vals is not None and all(0 < v < _MAX_INT for v in vals.values()):
            info = DecodeInfo(vals["dcp_size"], vals["block_size"], vals["max_model_len"], vals["kv_cache_tokens"],
                              vals["max_num_seqs"])
    usage = None
    for u in _USAGE_RE.findall(text):
        try:
            v = float(u)
        except ValueError:
            continue
        if math.isfinite(v) and 0.0 <= v <= 1.0:
            usage = v if usage is None else max(usage, v)
    return info, usage


def _count(value) -> int | None:
    """A client's token count field: an int >= 0 (bools are not), else None (the decode judges it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class Need:
    """What one PD pair asks of a decode: ``prompt`` tokens (exact: the prefill's count or the
    client's token ids), ``max_tokens`` (None: not asked, vLLM then allows up to
    ``max_model_len``), ``n`` sequences sharing the prompt's KV."""

    prompt: int
    max_tokens: int | None
    n: int = 1

    @classmethod
    def of(cls, body: dict, prompt: int) -> Need:
        """The need of a client ``body`` whose prompt is ``prompt`` tokens. A field vLLM would
        refuse (a negative or non-integer ``max_tokens``) counts as not asked: the decode
        refuses it with its own 400, as it did before routing."""
        asked = _count(body.get("max_completion_tokens"))
        asked = asked if asked is not None else _count(body.get("max_tokens"))
        n = _count(body.get("n"))
        return cls(prompt, asked, n if n else 1)

    @property
    def length(self) -> int:
        """Prompt + output tokens vLLM checks against ``max_model_len`` (at least one output token)."""
        return self.prompt + max(self.max_tokens or 0, 1)

    def fits(self, info: DecodeInfo) -> bool:
        """The whole answer fits there (nothing clamped)."""
        return self.length <= info.max_model_len

    def admitted(self, info: DecodeInfo) -> bool:
        """vLLM takes it there (maybe with ``max_tokens`` clamped) rather than answering 400."""
        return self.prompt < info.max_model_len and (self.max_tokens or 0) <= info.max_model_len

    def kv_tokens(self, info: DecodeInfo) -> int:
        """KV tokens the request may hold there: the prompt once, each sequence's output (as
        vLLM clamps it)."""
        left = max(info.max_model_len - self.prompt, 1)
        out = left if self.max_tokens is None else min(self.max_tokens, left)
        return self.prompt + self.n * out


def free_tokens(info: DecodeInfo, usage: float | None, in_flight_tokens: int, in_flight_at_poll: int = 0) -> int:
    """KV tokens free on a decode: capacity less others' use (vLLM's ``usage`` at the last poll
    less ``in_flight_at_poll``, the tokens this proxy's calls there held then) and less the
    tokens this proxy's calls there hold now (``in_flight_tokens``)."""
    others = max(round((usage or 0.0) * info.kv_tokens) - in_flight_at_poll, 0)
    return max(info.kv_tokens - others - in_flight_tokens, 0)
