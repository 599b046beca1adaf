"""Wire schema of the 2D reshard: msgpack messages between prefill and decode
(design §6.3, §6.7). No I/O; ``bootstrap``, ``sender`` and ``receiver`` move them.
This module holds the message types, the protocol version and ``encode`` /
``decode``; ``codec`` the field codecs a ``SCHEMA`` is made of and
``MessageError`` (re-exported here).

Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "type": <name>, <fields>}``.
Integer arrays (block ids, addresses) travel as little-endian int64 ``bin``.
``decode`` checks the version, the type, the exact field set, every field's type
and range, and the size of every string, list and array; any malformed or
hostile input raises :class:`MessageError` (and nothing else), with memory
bounded by ``MAX_MESSAGE_BYTES``.

The message types: ``RegisterConsumer`` (where a decode rank's side channel gets its
writes), ``TransferRequest`` (a decode rank's attempt at one prefill rank) and its one
``TransferOutcome``, ``CancelTransfer``, ``ReleaseTransfer``; the
bootstrap's ``RegisterRank``, ``QueryRanks``, ``RankTable``, ``Reply``; and the
``Fingerprint`` both sides compare. Over ~400 lines on purpose: this is the whole
wire schema, every type beside the version history that names its changes, read
as one when the protocol moves.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, fields

import msgpack
import numpy as np

from vllm_dcp2d.transfer.codec import (MAX_ADDR, Bool, Float, FingerprintMismatch, Ids, Int, MessageError, Nested,
                                        Str, StrList, fields_from_wire, fields_to_wire, schema_bound)
from vllm_dcp2d.reshard.layout import cp_layer_range, per_head_layout
from vllm_dcp2d.reshard.plan import block_tables
from vllm_dcp2d.reshard.regions import KVRegions, Memory, region_ends

__all__ = [
    "PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "MessageError", "FingerprintMismatch", "Fingerprint",
    "RegisterConsumer", "TransferRequest", "TransferOutcome", "CancelTransfer", "ReleaseTransfer", "RegisterRank",
    "QueryRanks", "RankTable", "Reply",
    "encode", "decode", "attempt_of", "clip", "prompt_digest", "max_bytes", "MAX_BYTES", "MAX_NAME", "MAX_REASON",
]

# History: 1 = first release. 2 = the transfer key and the per-attempt id are
# ``transfer_key`` / ``attempt_id`` (renamed from the vLLM request id and a per-attempt id);
# TransferRequest/TransferOutcome carry num_tokens (a length mismatch fails the
# fetch); TransferOutcome.settled; Fingerprint.model_config. 3 = KV cache
# groups: TransferRequest.block_ids holds one table per group (group_sizes),
# layer_group and group_sharded say which table and sharding each layer uses;
# Fingerprint.draft_layers; TransferOutcome.replicated_bytes. 4 = ReleaseTransfer
# (a decode rank that will not fetch a request tells the prefill to free it).
# 5 = TransferRequest.num_blocks and memory_addr/memory_bytes (the consumer's
# registered memory: a request that would write outside it is refused); a
# rejected message is answered with a TransferOutcome for its attempt when the
# attempt id can be read. 6 = Fingerprint.kv_scales (an fp8 cache's per-layer scales) and
# kv_dtype naming the fp8 encoding. 7 = the trust boundary (issue 37): frames may be sealed
# (``auth``, outside the msgpack map); RegisterRank.token (the instance's own ranks only) and
# each rank's layers and KV heads, listed per rank in RankTable.layers/heads;
# Fingerprint.num_kv_heads; TransferRequest.head_start/head_end (the decode rank's heads),
# prompt_digest (the prompt it expects: a key reused or a prompt tokenized otherwise is
# refused) and verify; TransferOutcome.checksum; ReleaseTransfer.prompt_digest. 8 = the 3D
# reshard (issue 39): TransferRequest.head_count/head_runs (where heads sit in the consumer's
# pages); a producer serves a request whose heads intersect its own (was: equal), writing
# only the common heads; Fingerprint.page_bytes and layout are compared per KV head when
# the two ranks' pages hold different head counts. 9 = the trust boundary, round 3 (issue 48): writes
# only where the asking decode registered: ``RegisterConsumer`` carries a side channel's Mooncake
# session and registered memory, once per connection; TransferRequest loses session/memory_addr/
# memory_bytes and gains not_after_ns (the fence: the producer starts no write of the attempt after
# it); prompt_digest covers what vLLM keys KV on besides the token ids (multimodal items with their
# positions, prompt embeds' bytes, the LoRA adapter's name, cache_salt), each input length-prefixed,
# and is never "" for a prompt (was: the token ids and multimodal identifiers, "" for prompt embeds);
# TransferOutcome.checksum is ``checksum.py``'s 16-lane linear checksum, computed with torch where the
# KV is (was: xxh3-128 of host memory); a sealed frame names its recipient and carries a tag of its
# head besides the tag of the whole (``auth``); RegisterRank.token is gone (a registration is sealed
# with a key made from the token, which never travels); QueryRanks.reply_to (what the answer is
# sealed for).
PROTOCOL_VERSION = 9
MAX_MESSAGE_BYTES = 32 << 20
MAX_IDS = 1 << 21          # entries of one int64 array field (16 MiB)
MAX_COUNT = 1 << 48        # pages, bytes, descriptors
MAX_GROUPS = 256           # KV cache groups of one request
MAX_NAME = 512             # characters of a transfer key or engine id
MAX_RANGES = 1 << 16       # registered memory ranges of one consumer rank
MAX_HEADS = 1 << 16        # KV heads of a model
MAX_REASON = 4096          # characters of a reason in a TransferOutcome or Reply


_NAME = Str(MAX_NAME)
_SECONDS = Float(1e7)
_DIGEST = Str(64, min_len=0)   # hex; "" = none given (only equal to none)
_REASON = Str(MAX_REASON, min_len=0)


def prompt_digest(token_ids, mm=(), *, embeds=None, is_token_ids=None, lora: str = "",
                  cache_salt: str | None = None) -> str:
    """32 hex digits naming what a prompt's KV is computed from: equal digests, equal KV.
    Both sides compute it (``vllm_compat.connector_api.prompt_inputs`` reads a vLLM request's).

    token_ids:    its token ids (any int sequence or int array; None: prompt embeds only).
    mm:           ``(modality, identifier, offset, length)`` of each multimodal item, in
                  prompt order: the item's hash and where its placeholder tokens sit.
    embeds:       ``(dtype name, shape, data)`` of its prompt embeddings (``data``: the
                  C-order bytes, any buffer), or None.
    is_token_ids: a mixed prompt's per-position flags (token id or embedding), or None.
    lora:         the LoRA adapter's name ("" for the base model); cache_salt: vLLM's
                  ``cache_salt`` (None: none).

    What vLLM's own prefix cache keys a block on, so two requests whose KV vLLM would share
    here share a digest, and no others. Left out on purpose: the adapter's path (local to
    each instance; the name is what both are asked for) and the KV cache dtype (the
    instance's, not the request's: ``Fingerprint.kv_dtype`` already refuses a pair that
    differs, before any write, with a message that says so). Every input goes in as a
    tagged, length-prefixed field, so no two different inputs hash the same bytes
    ("ab" + "c" is not "a" + "bc"). Raises ValueError for a prompt of neither token ids
    nor embeds: there is nothing to name, and "" matches "" (the key alone would do)."""
    if token_ids is None and embeds is None:
        raise ValueError("prompt_digest needs token ids or prompt embeds")
    h = hashlib.blake2b(digest_size=16, person=b"dcp2d-prompt-v9")

    def field(tag: bytes, data) -> None:
        data = memoryview(data).cast("B")
        h.update(tag + len(data).to_bytes(8, "little"))
        h.update(data)

    if token_ids is not None:
        field(b"t", np.ascontiguousarray(np.asarray(token_ids, dtype="<i8")))
    if is_token_ids is not None:
        field(b"m", np.ascontiguousarray(np.asarray(is_token_ids, dtype=np.bool_)).view(np.uint8))
    if embeds is not None:
        dtype, shape, data = embeds
        field(b"e", str(dtype).encode())
        field(b"s", np.asarray(shape, dtype="<i8"))
        field(b"d", data)
    mm = list(mm)
    field(b"n", len(mm).to_bytes(8, "little"))
    for modality, identifier, offset, length in mm:
        field(b"k", str(modality).encode())
        field(b"i", str(identifier).encode())
        field(b"p", np.asarray([offset, length], dtype="<i8"))
    if lora:
        field(b"l", lora.encode())
    if cache_salt is not None:
        field(b"c", cache_salt.encode())
    return h.hexdigest()


def clip(text: str, limit: int = MAX_REASON) -> str:
    """``text`` cut to ``limit`` characters (a reason, a peer's text in a log line):
    what goes on the wire must fit its field, and a peer must not fill our logs."""
    text = str(text)
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} chars)"
    return text[:max(0, limit - len(tail))] + tail[:limit]


@dataclass(frozen=True)
class _Message:
    SCHEMA = {}

    def validate(self) -> None:
        """Cross-field checks; raises MessageError."""


@dataclass(frozen=True)
class Fingerprint(_Message):
    """What both sides must agree on before KV bytes can move.

    model:        model name or path.
    num_layers:   KV layers of the model.
    page_size:    tokens per transfer page (vLLM block_size).
    kv_dtype:     KV cache element type, e.g. "bfloat16", "fp8_e4m3" (``page_format.kv_dtype_name``).
    page_bytes:   bytes of one page of one layer (all regions together).
    layout:       page format (``vllm_dcp2d.reshard.page_format``): the page's axes in memory
                  order without the block count or device, then what the backend
                  packs per head and token, e.g. "N16,H8,C512:k|v", "N64,C1152:kv_c|k_pe".
    model_config: hash of the model's config plus its revision, e.g. "sha256:1f2e...@main".
    draft_layers: KV layers of a speculative draft (EAGLE, MTP, draft model), numbered
                  after the target's; ``num_layers`` counts them too.
    kv_scales:    "none", or for an fp8 cache a digest of every layer's K and V scales
                  (``vllm_compat.connector_api.kv_scales``): the same bytes mean the same
                  values only under the same scales.
    num_kv_heads: KV heads of the model (1 for MLA's latent); which of them a rank holds
                  travels beside the fingerprint (``RegisterRank``, ``TransferRequest``).
    """

    model: str
    num_layers: int
    page_size: int
    kv_dtype: str
    page_bytes: int
    layout: str
    model_config: str
    draft_layers: int = 0
    kv_scales: str = "none"
    num_kv_heads: int = 1

    SCHEMA = {"model": _NAME, "num_layers": Int(1, 1 << 16), "page_size": Int(1, 1 << 24),
              "kv_dtype": Str(64), "page_bytes": Int(1, 1 << 40), "layout": Str(256),
              "model_config": Str(256), "draft_layers": Int(0, 1 << 16), "kv_scales": Str(64),
              "num_kv_heads": Int(1, MAX_HEADS)}

    def check(self, other: Fingerprint, heads: int = 0, other_heads: int = 0) -> None:
        """Raise ``FingerprintMismatch`` naming every differing field with both values.

        heads, other_heads: KV heads one page of each side's rank holds (0: the same on
        both). Where they differ, a page is compared per head: ``page_bytes`` per head, and
        ``layout`` without its head axis (``layout.per_head_layout``): the plan then moves a
        part of each page (``head_split``)."""
        heads, other_heads = heads or 1, other_heads or heads or 1
        split = heads != other_heads
        keys = [k for k in self.SCHEMA if not (split and k in ("page_bytes", "layout"))]
        diff = [f"{k}: ours {getattr(self, k)!r}, peer {getattr(other, k)!r}"
                for k in keys if getattr(self, k) != getattr(other, k)]
        if split and self.page_bytes * other_heads != other.page_bytes * heads:
            diff.append(f"bytes per KV head of a page: ours {self.page_bytes / heads:g} ({self.page_bytes} B over "
                        f"{heads} heads), peer {other.page_bytes / other_heads:g} ({other.page_bytes} B over "
                        f"{other_heads}): start both with the same head_size, block size and KV dtype")
        layout, other_layout = ((per_head_layout(self.layout), per_head_layout(other.layout)) if split
                                else (self.layout, other.layout))
        if layout != other_layout:
            if split:
                diff.append(f"layout of one KV head: ours {layout!r}, peer {other_layout!r} (the ranks hold "
                            f"{heads} and {other_heads} heads)")
            diff.append("start both instances with the same VLLM_KV_CACHE_LAYOUT, block size and attention "
                        "backend family (docs/connector.md, \"GPU layouts\")")
        if diff:
            where = (f" (KV heads per rank: ours {heads}, peer {other_heads} of {self.num_kv_heads})"
                     if split else "")
            raise FingerprintMismatch("KV fingerprint mismatch: " + "; ".join(diff) + where)


@dataclass(frozen=True, eq=False)
class RegisterConsumer(_Message):
    """Decode rank -> prefill CP rank, first on each side channel (again when its Mooncake
    session changes, and every ``directory.REGISTER_EVERY_S``): where the ``TransferRequest``s of
    this connection are written. The producer writes only there: a request cannot name
    another session or memory (docs/security.md). Without a secret the producer takes only a
    session whose host is the address the connection comes from, and never one of its own.

    engine_id:     the consumer (decode instance); with a secret it names the source whose
                   open attempts and bytes are capped (else the connection's address does).
    session:       the consumer's Mooncake session ``host:rpc_port``.
    memory_addr, memory_bytes: int64 ``[m]`` the ranges the consumer registered with
                   Mooncake; every request's regions (``num_blocks`` blocks each) must lie
                   inside one of them (``TransferRequest.check_inside``).
    """

    engine_id: str
    session: str
    memory_addr: np.ndarray
    memory_bytes: np.ndarray

    SCHEMA = {"engine_id": _NAME, "session": Str(256), "memory_addr": Ids(MAX_RANGES, lo=1, min_n=1),
              "memory_bytes": Ids(MAX_RANGES, lo=1, min_n=1)}

    @classmethod
    def of(cls, engine_id: str, session: str, memory: Memory) -> RegisterConsumer:
        return cls(engine_id, session, memory.addr, memory.nbytes)

    def memory(self) -> Memory:
        return Memory(self.memory_addr, self.memory_bytes)

    def host(self) -> str:
        """The host part of ``session`` (``host:port``; an IPv6 host may be bracketed)."""
        return self.session.rpartition(":")[0].strip("[]")

    def validate(self) -> None:
        host, _, port = self.session.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or port != str(int(port)):
            raise MessageError(f"session must be 'host:port' with a port in [1, 65535] written without leading "
                               f"zeros, got {self.session!r}")
        try:  # one spelling per session: an address in its canonical form, so sessions compare as strings
            ip = ipaddress.ip_address(self.host())
        except ValueError:
            ip = None
        if ip is not None and str(ip) != self.host():
            raise MessageError(f"session {self.session!r}: write its address as {str(ip)!r}")
        if self.memory_addr.size != self.memory_bytes.size:
            raise MessageError(f"memory_addr has {self.memory_addr.size} ranges, memory_bytes "
                               f"{self.memory_bytes.size}")
        try:
            self.memory()
        except ValueError as e:
            raise MessageError(f"memory_addr/memory_bytes: {e}") from None


@dataclass(frozen=True, eq=False)
class TransferRequest(_Message):
    """Decode DCP rank -> one prefill CP rank: "write your layers of my pages".

    transfer_key:  the request's transfer key (``kv_transfer_params["remote_request_id"]``):
                   the client's ``kv_transfer_params["transfer_id"]``, or the prefill's vLLM request id.
    attempt_id:    this request to this rank, unique per consumer rank; echoed in the outcome.
    engine_id:     consumer (decode instance) identity.
    consumer_rank, consumer_size: this worker and how many workers of the consumer
                   fetch the request (e.g. decode TP size); the producer frees the
                   request once all of them got their pages.
    dcp_size, dcp_rank: the consumer's DCP topology, per request (design §6.7).
    block_ids:     int64 ``[n]`` the consumer's block tables, one per KV cache group,
                   concatenated (``group_sizes``). In a DCP-sharded group page ``i``
                   lands in ``[i // dcp_size]`` on rank ``i % dcp_size``; in a
                   replicated group (``group_sharded`` 0) in ``[i]`` on every rank.
    group_sizes:   int64 ``[G]`` entries of each group's table in ``block_ids``.
    num_tokens:    prompt tokens the consumer expects; the producer fails the
                   fetch if its request holds another count.
    first_page:    first sequence page to send (earlier ones are cached on decode).
    num_blocks:    blocks of each of the consumer's regions; every block id is below it, and
                   every region's ``num_blocks`` blocks lie inside the memory the connection
                   registered (``RegisterConsumer``; ``check_inside``).
    layer_ids:     int64 ``[L]``; base: int64 ``[L*R]`` row-major ``[L, R]``;
    page_stride, page_bytes: int64 ``[R]``; layer_group: int64 ``[L]``;
    group_sharded: int64 ``[G]`` (1 or 0): the consumer's ``KVRegions``.
    fingerprint:   the consumer's KV format.
    wait_s:        how long the producer may wait for the request if it does not know
                   ``transfer_key`` yet (prefill still running); 0 = answer at once. The
                   producer cuts it to its own ``max_prefill_wait_s``.
    head_start, head_end: the KV heads ``[head_start, head_end)`` of ``fingerprint.num_kv_heads``
                   this consumer rank holds (default: all); the producer sends only
                   what it holds of them.
    prompt_digest: ``prompt_digest`` of the prompt the consumer expects; the producer
                   refuses a request whose prompt differs, before any write.
    verify:        ask for the checksum of what is written (``TransferOutcome.checksum``).
    not_after_ns:  the fence (docs/security.md, "The fence"): wall-clock ns (``time.time_ns``,
                   the consumer's clock) after which the producer starts no write of this
                   attempt; 0 = the producer's own bound (arrival + its longest wait + its expiry).
    budget_ns:     the same deadline as the time left when it was sent (0: none); the producer
                   stops at whichever of the two comes first by its own clock, so a clock that
                   lags the consumer's moves its fence only as far as the message was late.
    head_count, head_runs: int64 ``[R]``: the consumer's ``KVRegions.head_count/head_runs``
                   (where its heads sit in a page; default 1 each). Each head count is at most
                   the rank's ``head_end - head_start``, each run count at most the page's tokens.
    """

    transfer_key: str
    attempt_id: int
    engine_id: str
    consumer_rank: int
    consumer_size: int
    dcp_size: int
    dcp_rank: int
    block_ids: np.ndarray
    group_sizes: np.ndarray
    num_tokens: int
    first_page: int
    num_blocks: int
    layer_ids: np.ndarray
    base: np.ndarray
    page_stride: np.ndarray
    page_bytes: np.ndarray
    layer_group: np.ndarray
    group_sharded: np.ndarray
    fingerprint: Fingerprint
    wait_s: float
    head_start: int = 0
    head_end: int = 0
    prompt_digest: str = ""
    verify: bool = False
    not_after_ns: int = 0
    budget_ns: int = 0
    head_count: np.ndarray | None = None
    head_runs: np.ndarray | None = None

    SCHEMA = {"transfer_key": _NAME, "attempt_id": Int(0, MAX_ADDR), "engine_id": _NAME,
              "consumer_rank": Int(0, 1 << 16), "consumer_size": Int(1, 1 << 16),
              "dcp_size": Int(1, 1 << 12), "dcp_rank": Int(0, 1 << 12), "block_ids": Ids(MAX_IDS, hi=MAX_COUNT),
              "num_tokens": Int(0, MAX_COUNT), "first_page": Int(0, MAX_COUNT), "num_blocks": Int(1, MAX_IDS),
              "not_after_ns": Int(0, MAX_ADDR), "budget_ns": Int(0, MAX_ADDR), "layer_ids": Ids(1 << 16, hi=1 << 16, min_n=1),
              "base": Ids(1 << 20, min_n=1), "page_stride": Ids(64, lo=1, min_n=1),
              "page_bytes": Ids(64, lo=1, min_n=1), "fingerprint": Nested(Fingerprint),
              "wait_s": Float(3600.0), "group_sizes": Ids(MAX_GROUPS, hi=MAX_IDS, min_n=1),
              "layer_group": Ids(1 << 16, hi=MAX_GROUPS - 1, min_n=1), "group_sharded": Ids(MAX_GROUPS, hi=1, min_n=1),
              "head_start": Int(0, MAX_HEADS), "head_end": Int(0, MAX_HEADS), "prompt_digest": _DIGEST,
              "verify": Bool(), "head_count": Ids(64, lo=1, hi=MAX_HEADS),
              "head_runs": Ids(64, lo=1, hi=1 << 24)}

    def __post_init__(self):
        if self.head_end == 0:  # default: every head of the model
            object.__setattr__(self, "head_end", self.fingerprint.num_kv_heads)
        for name in ("head_count", "head_runs"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.ones(np.asarray(self.page_stride).size, dtype=np.int64))

    @classmethod
    def build(cls, *, regions: KVRegions, block_ids, **kw) -> TransferRequest:
        """Fill the KV fields from ``regions``; ``block_ids``: an int sequence (one group)
        or a tuple of them, one per group of ``regions``."""
        tables = block_tables("block_ids", block_ids, regions.num_groups)
        return cls(layer_ids=regions.layer_ids, base=regions.base.reshape(-1), page_stride=regions.page_stride,
                   page_bytes=regions.page_bytes, layer_group=regions.layer_group,
                   group_sharded=regions.group_sharded.astype(np.int64), head_count=regions.head_count,
                   head_runs=regions.head_runs, block_ids=np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64),
                   group_sizes=np.array([t.size for t in tables], dtype=np.int64), **kw)

    def regions(self) -> KVRegions:
        return KVRegions(self.layer_ids, self.base.reshape(self.layer_ids.size, self.page_stride.size),
                         self.page_stride, self.page_bytes, self.layer_group, self.group_sharded.astype(bool),
                         self.head_count, self.head_runs)

    def tables(self) -> tuple[np.ndarray, ...]:
        """The consumer's block table of each group (views into ``block_ids``)."""
        return tuple(np.split(self.block_ids, np.cumsum(self.group_sizes)[:-1]))

    def validate(self) -> None:
        if self.consumer_rank >= self.consumer_size:
            raise MessageError(f"consumer_rank must be in [0, consumer_size={self.consumer_size}), "
                               f"got {self.consumer_rank}")
        if not 0 <= self.head_start < self.head_end <= self.fingerprint.num_kv_heads:
            raise MessageError(f"heads [{self.head_start}, {self.head_end}) must be a non-empty range within the "
                               f"model's num_kv_heads={self.fingerprint.num_kv_heads}")
        if self.dcp_rank >= self.dcp_size:
            raise MessageError(f"dcp_rank must be in [0, dcp_size={self.dcp_size}), got {self.dcp_rank}")
        if not self.page_bytes.size == self.page_stride.size == self.head_count.size == self.head_runs.size:
            raise MessageError(f"page_bytes has {self.page_bytes.size} regions, page_stride "
                               f"{self.page_stride.size}, head_count {self.head_count.size}, head_runs "
                               f"{self.head_runs.size}")
        if int(self.head_count.max()) > self.head_end - self.head_start:
            raise MessageError(f"head_count {self.head_count.tolist()}: a page cannot hold more heads than the "
                               f"rank's [{self.head_start}, {self.head_end})")
        if int(self.head_runs.max()) > self.fingerprint.page_size:  # bounds the pieces a plan cuts a page into
            raise MessageError(f"head_runs {self.head_runs.tolist()}: a head cannot be cut into more runs than the "
                               f"page's page_size={self.fingerprint.page_size} tokens")
        if self.base.size != self.layer_ids.size * self.page_stride.size:
            raise MessageError(f"base has {self.base.size} entries, expected layers x regions = "
                               f"{self.layer_ids.size} x {self.page_stride.size}")
        if int(self.group_sizes.sum()) != self.block_ids.size:
            raise MessageError(f"group_sizes sum to {int(self.group_sizes.sum())}, block_ids has "
                               f"{self.block_ids.size} entries")
        if self.group_sharded.size != self.group_sizes.size:
            raise MessageError(f"group_sharded has {self.group_sharded.size} groups, group_sizes "
                               f"{self.group_sizes.size}")
        try:
            regions = self.regions()
        except ValueError as e:
            raise MessageError(f"bad KV regions: {e}") from None
        if self.block_ids.size and int(self.block_ids.max()) >= self.num_blocks:
            raise MessageError(f"block_ids must be < num_blocks={self.num_blocks}, got {int(self.block_ids.max())}")
        try:
            region_ends(regions, self.num_blocks)
        except ValueError as e:
            raise MessageError(f"base, page_stride, num_blocks: {e}") from None

    def check_inside(self, memory: Memory) -> None:
        """Raise ``MessageError`` unless every region's ``num_blocks`` blocks lie inside
        ``memory`` (what the connection registered): then no planned write can land outside."""
        regions = self.regions()
        ends = region_ends(regions, self.num_blocks)
        inside = memory.holds(regions.base.reshape(-1), (ends - regions.base).reshape(-1)).reshape(ends.shape)
        if not inside.all():
            k, j = map(int, np.argwhere(~inside)[0])
            raise MessageError(f"layer {int(regions.layer_ids[k])} region {j}: [{int(regions.base[k, j]):#x}, "
                               f"{int(ends[k, j]):#x}) ({self.num_blocks} blocks of page_stride "
                               f"{int(regions.page_stride[j])}) is not inside the memory this connection "
                               f"registered (RegisterConsumer)")


@dataclass(frozen=True)
class TransferOutcome(_Message):
    """Prefill CP rank -> decode rank: the result of one ``TransferRequest``.

    ok / reason:       done, or failed with a human-readable reason.
    cp_rank, cp_size:  the producer; layer_start/layer_end: the layers it sent.
    num_tokens, num_pages: the request's prompt tokens and pages on the producer
                       (num_tokens is 0 when failed).
    nbytes, descriptors, batches: what was written (0 when failed before writing).
    naive_bytes:       what a full-sequence send to this rank would have moved.
    plan_s, write_s:   seconds spent planning and in Mooncake writes.
    early_layers:      layers written while the prefill was still running (layer pipelining).
    replicated_bytes:  the part of ``nbytes`` that went to replicated groups (a
                       draft's KV: every page, to every decode rank).
    settled:           no write of this fetch can still land. False when a write
                       timed out: Mooncake may deliver its queued bytes later, so
                       the consumer must keep those blocks out of use (quarantine).
    checksum:          with ``TransferRequest.verify``: ``checksum.checksum`` of the bytes
                       this rank wrote, in the consumer's address order; "" otherwise.
    """

    transfer_key: str
    attempt_id: int
    cp_rank: int
    cp_size: int
    ok: bool
    reason: str
    layer_start: int
    layer_end: int
    num_tokens: int
    num_pages: int
    nbytes: int
    descriptors: int
    batches: int
    naive_bytes: int
    plan_s: float
    write_s: float
    early_layers: int
    settled: bool
    replicated_bytes: int = 0
    checksum: str = ""

    SCHEMA = {"transfer_key": _NAME, "attempt_id": Int(0, MAX_ADDR), "cp_rank": Int(0, 1 << 12),
              "cp_size": Int(1, 1 << 12), "ok": Bool(), "reason": _REASON, "checksum": _DIGEST,
              "layer_start": Int(0, 1 << 16), "layer_end": Int(0, 1 << 16),
              "num_tokens": Int(0, MAX_COUNT), "num_pages": Int(0, MAX_COUNT), "nbytes": Int(0, MAX_COUNT),
              "descriptors": Int(0, MAX_COUNT), "batches": Int(0, MAX_COUNT),
              "naive_bytes": Int(0, MAX_COUNT), "plan_s": _SECONDS, "write_s": _SECONDS,
              "early_layers": Int(0, 1 << 16), "settled": Bool(), "replicated_bytes": Int(0, MAX_COUNT)}

    def validate(self) -> None:
        if self.early_layers > self.layer_end - self.layer_start:
            raise MessageError(f"early_layers {self.early_layers} > layers sent "
                               f"[{self.layer_start}, {self.layer_end})")
        if self.cp_rank >= self.cp_size:
            raise MessageError(f"cp_rank must be in [0, cp_size={self.cp_size}), got {self.cp_rank}")
        if self.layer_end < self.layer_start:
            raise MessageError(f"layer_end {self.layer_end} < layer_start {self.layer_start}")
        if self.replicated_bytes > self.nbytes:
            raise MessageError(f"replicated_bytes {self.replicated_bytes} > nbytes {self.nbytes}")


@dataclass(frozen=True)
class RegisterRank(_Message):
    """Prefill CP rank -> bootstrap server: "rank ``cp_rank`` serves at ``address``".

    It travels sealed with a key made from the instance's registration token (TP rank 0
    draws it and hands it to its ranks over the TP group; ``Auth.registration``), never
    with the token itself: without the token nobody can take a rank's place in the table.
    layer_start, layer_end: the KV layers the rank sends (default its ``cp_layer_range``).
    head_start, head_end: the KV heads it holds of ``fingerprint.num_kv_heads`` (default all).
    """

    engine_id: str
    cp_rank: int
    cp_size: int
    address: str
    fingerprint: Fingerprint
    layer_start: int = 0
    layer_end: int = 0
    head_start: int = 0
    head_end: int = 0

    SCHEMA = {"engine_id": _NAME, "cp_rank": Int(0, 1 << 12), "cp_size": Int(1, 1 << 12),
              "address": Str(256), "fingerprint": Nested(Fingerprint),
              "layer_start": Int(0, 1 << 16), "layer_end": Int(0, 1 << 16), "head_start": Int(0, MAX_HEADS),
              "head_end": Int(0, MAX_HEADS)}

    def __post_init__(self):
        if self.layer_end == 0 and 0 <= self.cp_rank < self.cp_size:
            r = cp_layer_range(self.fingerprint.num_layers, self.cp_size, self.cp_rank)
            object.__setattr__(self, "layer_start", r.start)
            object.__setattr__(self, "layer_end", r.stop)
        if self.head_end == 0:
            object.__setattr__(self, "head_end", self.fingerprint.num_kv_heads)

    def validate(self) -> None:
        if self.cp_rank >= self.cp_size:
            raise MessageError(f"cp_rank must be in [0, cp_size={self.cp_size}), got {self.cp_rank}")
        if not 0 <= self.layer_start < self.layer_end <= self.fingerprint.num_layers:
            raise MessageError(f"layers [{self.layer_start}, {self.layer_end}) must be a non-empty range within "
                               f"num_layers={self.fingerprint.num_layers}")
        if not 0 <= self.head_start < self.head_end <= self.fingerprint.num_kv_heads:
            raise MessageError(f"heads [{self.head_start}, {self.head_end}) must be a non-empty range within "
                               f"num_kv_heads={self.fingerprint.num_kv_heads}")


@dataclass(frozen=True)
class CancelTransfer(_Message):
    """Decode rank -> prefill CP rank: the request ``attempt_id`` of ``transfer_key``
    failed; write nothing more for it. The rank answers with a ``TransferOutcome``
    (ok=False, "cancelled") once no write of it is in flight, at once if it has
    none (also for a fetch it does not know). May be sent again: each one is answered."""

    transfer_key: str
    attempt_id: int

    SCHEMA = {"transfer_key": _NAME, "attempt_id": Int(0, MAX_ADDR)}


@dataclass(frozen=True)
class ReleaseTransfer(_Message):
    """Decode rank -> every prefill CP rank of a request: consumer rank
    ``consumer_rank`` of ``consumer_size`` (engine ``engine_id``) will never fetch
    ``transfer_key`` (its prompt was cached, it was aborted before fetching, or its
    fetch failed). Not answered. The rank counts it like a served consumer rank;
    once every rank of that engine is served or released (and no other engine has
    a fetch of it open) the request is freed, when no write reads its blocks any
    more. Idempotent; one for a request the rank does not hold (any more) is
    ignored. ``num_tokens``: the decode's prompt length; a release naming another
    count than the request has is ignored (the key was reused by another request), and so
    is one whose ``prompt_digest`` differs: freeing a request takes knowing its prompt."""

    transfer_key: str
    engine_id: str
    consumer_rank: int
    consumer_size: int
    num_tokens: int
    prompt_digest: str = ""

    SCHEMA = {"transfer_key": _NAME, "engine_id": _NAME, "consumer_rank": Int(0, 1 << 16),
              "consumer_size": Int(1, 1 << 16), "num_tokens": Int(0, MAX_COUNT), "prompt_digest": _DIGEST}

    def validate(self) -> None:
        if self.consumer_rank >= self.consumer_size:
            raise MessageError(f"consumer_rank must be in [0, consumer_size={self.consumer_size}), "
                               f"got {self.consumer_rank}")


@dataclass(frozen=True)
class QueryRanks(_Message):
    """Decode rank -> bootstrap server: "where are your CP ranks?".

    reply_to: what the answer is sealed for (``auth``): the bootstrap address the decode
              rank asked and a random query id (``RankTableQuery``), so the answer opens only
              as the answer to this query, not to one sent to another instance or by
              another rank."""

    engine_id: str
    reply_to: str

    SCHEMA = {"engine_id": _NAME, "reply_to": Str(1024)}


@dataclass(frozen=True, eq=False)
class RankTable(_Message):
    """Bootstrap server -> decode rank: ``addresses[r]`` serves CP rank ``r``, which sends
    the layers ``[layers[2r], layers[2r+1])`` of the KV heads ``[heads[2r], heads[2r+1])``
    (int64 ``[2 * cp_size]`` each; default: ``cp_layer_range`` of every head)."""

    engine_id: str
    cp_size: int
    addresses: tuple
    fingerprint: Fingerprint
    layers: np.ndarray | None = None
    heads: np.ndarray | None = None

    SCHEMA = {"engine_id": _NAME, "cp_size": Int(1, 1 << 12), "addresses": StrList(1 << 12, Str(256)),
              "fingerprint": Nested(Fingerprint), "layers": Ids(1 << 13, hi=1 << 16),
              "heads": Ids(1 << 13, hi=MAX_HEADS)}

    def __post_init__(self):
        if self.layers is None:
            r = [cp_layer_range(self.fingerprint.num_layers, self.cp_size, i) for i in range(self.cp_size)]
            object.__setattr__(self, "layers", np.array([(x.start, x.stop) for x in r], np.int64).reshape(-1))
        if self.heads is None:
            object.__setattr__(self, "heads", np.tile(np.array([0, self.fingerprint.num_kv_heads], np.int64),
                                                      self.cp_size))

    def __eq__(self, other):
        return isinstance(other, RankTable) and all(
            np.array_equal(getattr(self, k), getattr(other, k)) if k in ("layers", "heads")
            else getattr(self, k) == getattr(other, k) for k in self.SCHEMA)

    def shard(self, cp_rank: int) -> tuple[range, range]:
        """(layers, KV heads) CP rank ``cp_rank`` sends."""
        a, b = self.layers[2 * cp_rank: 2 * cp_rank + 2]
        h, g = self.heads[2 * cp_rank: 2 * cp_rank + 2]
        return range(int(a), int(b)), range(int(h), int(g))

    def validate(self) -> None:
        if len(self.addresses) != self.cp_size:
            raise MessageError(f"addresses has {len(self.addresses)} entries, expected cp_size={self.cp_size}")
        for name, arr, hi in (("layers", self.layers, self.fingerprint.num_layers),
                              ("heads", self.heads, self.fingerprint.num_kv_heads)):
            if arr.size != 2 * self.cp_size:
                raise MessageError(f"{name} has {arr.size} entries, expected 2 x cp_size={2 * self.cp_size}")
            lo, up = arr[0::2], arr[1::2]
            if (lo >= up).any() or (up > hi).any():
                raise MessageError(f"{name} must be non-empty ranges within [0, {hi}], got {arr.tolist()}")


@dataclass(frozen=True)
class Reply(_Message):
    """Generic answer: an acknowledgement (``ok``) or an error with a reason (clipped to
    ``MAX_REASON``: a reason may quote a peer's input of any length)."""

    ok: bool
    reason: str

    SCHEMA = {"ok": Bool(), "reason": _REASON}

    def __post_init__(self):
        object.__setattr__(self, "reason", clip(self.reason))


_TYPES = {c.__name__: c for c in (RegisterConsumer, TransferRequest, TransferOutcome, CancelTransfer, ReleaseTransfer, RegisterRank,
                                   QueryRanks, RankTable, Reply)}
# The largest encoding of each message type (its schema's ``codec.schema_bound`` plus the
# version and type entries, at most MAX_MESSAGE_BYTES): what a socket that takes only some
# types reads at most (``auth.Auth.open``'s ceiling, before it hashes a byte).
MAX_BYTES = {c: min(MAX_MESSAGE_BYTES, schema_bound(c) + 2 * (5 + 4) + 9 + 5 + len(c.__name__))
             for c in _TYPES.values()}


def max_bytes(expect) -> int:
    """The largest encoding of any of ``expect`` (a message class or a tuple of them)."""
    return max(MAX_BYTES[c] for c in (expect if isinstance(expect, tuple) else (expect,)))


def encode(msg) -> bytes:
    """Pack ``msg`` (one of the message classes) as msgpack bytes. Raises
    ``MessageError`` for a field ``decode`` would refuse (a key over ``MAX_NAME``
    characters, say): the sender learns it, not the peer."""
    name = type(msg).__name__
    if name not in _TYPES or not isinstance(msg, _TYPES[name]):
        raise TypeError(f"not a message: {name}")
    try:
        fields_ = fields_to_wire(msg)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"{name}: a field cannot be encoded: {e}") from None
    fields_from_wire(type(msg), dict(fields_), name)  # the peer's checks, here
    data = msgpack.packb({"v": PROTOCOL_VERSION, "type": name, **fields_}, use_bin_type=True)
    if len(data) > MAX_BYTES[type(msg)]:  # cannot happen once the checks passed: a bound that is wrong
        raise MessageError(f"{name}: {len(data)} bytes, over its bound MAX_BYTES = {MAX_BYTES[type(msg)]}")
    return data


def attempt_of(data: bytes) -> tuple[str, int] | None:
    """``(transfer_key, attempt_id)`` of a message ``decode`` refused, if both can
    still be read (so its sender can be answered for that attempt only); else None."""
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, max_str_len=1 << 16, max_bin_len=MAX_MESSAGE_BYTES,
                              max_array_len=1 << 12, max_map_len=64, max_ext_len=0)
    except Exception:  # msgpack raises a zoo of types for bad input
        return None
    if type(raw) is not dict:
        return None
    key, attempt = raw.get("transfer_key"), raw.get("attempt_id")
    if type(attempt) is not int or not 0 <= attempt <= MAX_ADDR:
        return None
    if type(key) is not str or not 1 <= len(key) <= MAX_NAME:
        key = "?"  # the answer still names the attempt; the consumer matches by attempt id
    return key, attempt


def decode(data: bytes, expect=None):
    """Unpack and validate one message; raises ``MessageError`` for anything malformed.

    data:   the raw bytes (at most ``MAX_MESSAGE_BYTES``).
    expect: a message class or tuple of classes; another type raises MessageError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              max_str_len=1 << 16, max_bin_len=MAX_MESSAGE_BYTES, max_array_len=1 << 12,
                              max_map_len=64, max_ext_len=0)
    except Exception as e:  # msgpack raises a zoo of types for bad input
        raise MessageError(f"not a valid msgpack message: {type(e).__name__}: {e}") from None
    if type(raw) is not dict:
        raise MessageError(f"message must be a map, got {type(raw).__name__}")
    version = raw.pop("v", None)
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise MessageError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    name = raw.pop("type", None)
    cls = _TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise MessageError(f"unknown message type {name!r}")
    if expect is not None:
        want = expect if isinstance(expect, tuple) else (expect,)
        if cls not in want:
            raise MessageError(f"expected {'/'.join(c.__name__ for c in want)}, got {name}")
    return fields_from_wire(cls, raw, name)


assert all(set(c.SCHEMA) == {f.name for f in fields(c)} for c in (*_TYPES.values(), Fingerprint))
