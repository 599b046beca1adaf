"""Wire schema: round trips, and every malformed input raises MessageError (fuzzed)."""

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dcp2d.transfer import messages as m
from vllm_dcp2d.transfer.messages import (CancelTransfer, Fingerprint, FingerprintMismatch, MessageError, QueryRanks, RankTable,
                                           RegisterConsumer, RegisterRank, ReleaseTransfer, Reply, TransferOutcome, TransferRequest,
                                           decode, encode)
from vllm_dcp2d.reshard.regions import KVRegions, Memory

pytestmark = pytest.mark.timeout(120)
FP = Fingerprint("glm-5.2@abc", 8, 64, "float8_e4m3fn", 36864, "cpu:[blocks,heads,block,2*head]",
                 "sha256:0123@main")
MEMORY = Memory([4096], [16 << 20])  # holds 10 blocks of every region below


def _request(**kw):
    regions = KVRegions(np.arange(8), np.arange(16).reshape(8, 2) * (1 << 20) + 4096,
                        np.array([1024, 2048]), np.array([512, 2048]))
    args = dict(transfer_key="req-1", attempt_id=7, engine_id="decode-0", consumer_rank=1, consumer_size=2,
                dcp_size=2, dcp_rank=1, block_ids=np.array([5, 3, 9]),
                num_tokens=300, first_page=1, fingerprint=FP, wait_s=0.5, num_blocks=10)
    args.update(kw)
    return TransferRequest.build(regions=regions, **args)


def _outcome(**kw):
    args = dict(transfer_key="req-1", attempt_id=7, cp_rank=1, cp_size=2, ok=False, reason="boom", layer_start=4,
                layer_end=8, num_tokens=0, num_pages=3, nbytes=0, descriptors=0, batches=0, naive_bytes=0,
                plan_s=0.001, write_s=0.0, early_layers=0, settled=True)
    args.update(kw)
    return TransferOutcome(**args)


SAMPLES = [
    _request(),
    # Two KV cache groups: a replicated draft (layers 6-7) and the DCP-sharded target.
    TransferRequest.build(
        regions=KVRegions(np.arange(8), np.arange(16).reshape(8, 2) * (1 << 20) + 4096, np.array([1024, 2048]),
                          np.array([512, 2048]), np.array([1] * 6 + [0] * 2), np.array([False, True])),
        transfer_key="req-2", attempt_id=8, engine_id="decode-0", consumer_rank=0, consumer_size=2,
        dcp_size=2, dcp_rank=0, block_ids=([4, 8, 1, 2, 6], [5, 3, 9]),
        num_tokens=300, first_page=0, fingerprint=dataclasses.replace(FP, draft_layers=2), wait_s=0.5,
        num_blocks=10),
    _outcome(),
    _outcome(ok=True, reason="", num_tokens=130, nbytes=1 << 40, descriptors=3, batches=1, naive_bytes=1 << 41),
    _outcome(settled=False),
    RegisterRank("prefill-0", 1, 2, "tcp://127.0.0.1:5555", FP),
    RegisterConsumer.of("decode-0", "10.0.0.2:15001", MEMORY),
    _outcome(ok=True, reason="", nbytes=5, descriptors=1, batches=1, naive_bytes=10, early_layers=4),
    CancelTransfer("req-1", 7),
    ReleaseTransfer("req-1", "decode-0", 1, 2, 300),
    ReleaseTransfer("k" * 512, "d" * 512, (1 << 16) - 1, 1 << 16, m.MAX_COUNT),
    QueryRanks("decode-0", "tcp://127.0.0.1:1 query 0123456789abcdef"),
    RankTable("prefill-0", 2, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), FP),
    Reply(True, ""),
    Reply(False, "x" * 4096),
]


def _same(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and y.dtype == np.int64
        else:
            assert x == y, f.name


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    _same(decode(encode(msg)), msg)
    _same(decode(encode(msg), type(msg)), msg)


def test_regions_round_trip():
    req = decode(encode(_request()), TransferRequest)
    r = req.regions()
    assert r.base.shape == (8, 2) and r.base[3, 1] == 7 * (1 << 20) + 4096
    assert r.page_stride.tolist() == [1024, 2048] and r.page_bytes.tolist() == [512, 2048]


def test_expect_other_type():
    with pytest.raises(MessageError, match="expected TransferOutcome/Reply, got TransferRequest"):
        decode(encode(_request()), (TransferOutcome, Reply))


def test_fingerprint_check_names_both_values():
    FP.check(Fingerprint(*dataclasses.astuple(FP)))
    other = dataclasses.replace(FP, num_layers=6, kv_dtype="bfloat16")
    with pytest.raises(FingerprintMismatch) as e:
        FP.check(other)
    assert "num_layers: ours 8, peer 6" in str(e.value)
    assert "kv_dtype: ours 'float8_e4m3fn', peer 'bfloat16'" in str(e.value)


def _wire(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(d) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(v=1), "unsupported protocol version 1"),
    (lambda d: d.update(v=2), "unsupported protocol version 2"),
    (lambda d: d.update(v=5), "unsupported protocol version 5"),
    (lambda d: d.update(v=m.PROTOCOL_VERSION + 1), f"unsupported protocol version {m.PROTOCOL_VERSION + 1}"),
    (lambda d: d.update(v=True), "unsupported protocol version True"),
    (lambda d: d.pop("v"), "unsupported protocol version None"),
    (lambda d: d.update(type="Nope"), "unknown message type 'Nope'"),
    (lambda d: d.pop("dcp_rank"), r"missing fields \['dcp_rank'\]"),
    (lambda d: d.update(extra=1), r"unknown fields \[\"'extra'\"\]"),
    (lambda d: d.update(dcp_rank=2), r"dcp_rank must be in \[0, dcp_size=2\)"),
    (lambda d: d.update(dcp_size=0), "dcp_size must be in"),
    (lambda d: d.update(attempt_id=-1), "attempt_id must be in"),
    (lambda d: d.update(first_page=1.0), "first_page must be an int, got float"),
    (lambda d: d.update(consumer_rank=True), "consumer_rank must be an int, got bool"),
    (lambda d: d.update(consumer_rank=2), "consumer_rank must be in"),
    (lambda d: d.update(transfer_key=""), "transfer_key must have 1..512 characters"),
    (lambda d: d.update(transfer_key=b"x"), "transfer_key must be a string, got bytes"),
    (lambda d: d.update(block_ids=np.array([1, -3]).tobytes()), "block_ids entries must be in"),
    (lambda d: d.update(block_ids=b"\x01\x02\x03"), "not a multiple of 8"),
    (lambda d: d.update(block_ids=[1, 2]), "block_ids must be bin"),
    (lambda d: d.update(group_sizes=np.array([2]).tobytes()), "group_sizes sum to 2, block_ids has 3 entries"),
    (lambda d: d.update(group_sharded=np.array([1, 0]).tobytes()), "group_sharded has 2 groups, group_sizes 1"),
    (lambda d: d.update(group_sharded=np.array([2]).tobytes()), "group_sharded entries must be in"),
    (lambda d: d.update(layer_group=np.array([0] * 7 + [1]).tobytes()), r"layer_group must be in \[0, 1\)"),
    (lambda d: d.update(base=b"\x00" * 8), "base has 1 entries, expected layers x regions = 8 x 2"),
    (lambda d: d.update(layer_ids=np.array([0, 0, 1, 2, 3, 4, 5, 6]).tobytes()), "layer_ids must be distinct"),
    (lambda d: d.update(page_bytes=np.array([4096, 1]).tobytes()), "page_bytes <= page_stride"),
    (lambda d: d.update(wait_s=float("nan")), "wait_s must be a float"),
    (lambda d: d.update(wait_s=-1.0), "wait_s must be a float"),
    (lambda d: d["fingerprint"].pop("layout"), r"fingerprint \(Fingerprint\): missing fields \['layout'\]"),
    (lambda d: d.update(fingerprint=[1, 2]), "fingerprint must be a map, got list"),
])
def test_malformed_request(edit, match):
    d = _wire(_request())
    edit(d)
    with pytest.raises(MessageError, match=match):
        decode(_pack(d))


@pytest.mark.parametrize("data, match", [
    (b"", "not a valid msgpack"),
    (b"\xc1", "not a valid msgpack"),
    (_pack([1, 2]), "must be a map, got list"),
    (_pack({1: 2}), "not a valid msgpack"),                       # non-str map key
    (b"\xdd\xff\xff\xff\xff", "not a valid msgpack"),             # array32 claiming 4G entries
    (b"\xc6\xff\xff\xff\xff" + b"\0" * 10, "not a valid msgpack"),  # bin32 claiming 4 GiB
    (b"\x91" * 100000, "not a valid msgpack"),                    # nested too deep
    (encode(Reply(True, "")) + b"\x00", "not a valid msgpack"),    # trailing data
    ("text", "must be bytes"),
    (b"\0" * (m.MAX_MESSAGE_BYTES + 1), "exceeds MAX_MESSAGE_BYTES"),
])
def test_hostile_bytes(data, match):
    with pytest.raises(MessageError, match=match):
        decode(data)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(v=3), rf"unsupported protocol version 3 \(this side speaks {m.PROTOCOL_VERSION}\)"),
    (lambda d: d.pop("num_tokens"), r"missing fields \['num_tokens'\]"),
    (lambda d: d.update(attempt_id=1), r"unknown fields \[\"'attempt_id'\"\]"),
    (lambda d: d.update(consumer_rank=2), r"consumer_rank must be in \[0, consumer_size=2\)"),
    (lambda d: d.update(consumer_rank=-1), "consumer_rank must be in"),
    (lambda d: d.update(consumer_size=0), "consumer_size must be in"),
    (lambda d: d.update(num_tokens=-1), "num_tokens must be in"),
    (lambda d: d.update(num_tokens=m.MAX_COUNT + 1), "num_tokens must be in"),
    (lambda d: d.update(num_tokens=3.0), "num_tokens must be an int, got float"),
    (lambda d: d.update(transfer_key=""), "transfer_key must have 1..512 characters"),
    (lambda d: d.update(transfer_key="k" * 513), "transfer_key must have 1..512 characters"),
    (lambda d: d.update(engine_id=None), "engine_id must be a string, got NoneType"),
])
def test_malformed_release(edit, match):
    d = _wire(ReleaseTransfer("req-1", "decode-0", 1, 2, 300))
    edit(d)
    with pytest.raises(MessageError, match=match):
        decode(_pack(d))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(session="10.0.0.2"), "session must be 'host:port'"),
    (lambda d: d.update(session="10.0.0.2:0"), "session must be 'host:port'"),
    (lambda d: d.update(session=":15001"), "session must be 'host:port'"),
    (lambda d: d.update(session="10.0.0.2:99999"), "session must be 'host:port'"),
    (lambda d: d.update(memory_bytes=np.array([1, 2]).tobytes()), "memory_addr has 1 ranges, memory_bytes 2"),
    (lambda d: d.update(memory_addr=np.array([4096, 8192]).tobytes(), memory_bytes=np.array([8192, 8]).tobytes()),
     "registered ranges overlap"),
    (lambda d: d.update(memory_addr=np.array([0]).tobytes()), "memory_addr entries must be in"),
    (lambda d: d.pop("session"), r"missing fields \['session'\]"),
])
def test_malformed_consumer_registration(edit, match):
    d = _wire(RegisterConsumer.of("decode-0", "10.0.0.2:15001", MEMORY))
    edit(d)
    with pytest.raises(MessageError, match=match):
        decode(_pack(d))


def test_a_request_must_lie_inside_its_connections_memory():
    """The regions a request names are checked against what its connection registered
    (``RegisterConsumer``), not against memory the request itself claims (protocol 9)."""
    req = _request()
    req.check_inside(MEMORY)
    with pytest.raises(MessageError, match=r"layer 7 region 1: \[0x.*\) \(10 blocks of page_stride 2048\) is not "
                                           r"inside the memory this connection registered"):
        req.check_inside(Memory([4096], [15 << 20]))
    assert "memory_addr" not in _wire(req) and "session" not in _wire(req)


def test_release_is_not_accepted_where_a_request_is_expected():
    with pytest.raises(MessageError, match="expected TransferRequest/CancelTransfer, got ReleaseTransfer"):
        decode(encode(ReleaseTransfer("req-1", "decode-0", 0, 1, 3)), (TransferRequest, CancelTransfer))


def test_every_truncation_rejected():
    for msg in SAMPLES:
        data = encode(msg)
        for n in range(len(data)):
            with pytest.raises(MessageError):
                decode(data[:n])


def test_big_block_table():
    req = _request(block_ids=np.arange(1 << 16) * 3, num_blocks=3 << 16)
    data = encode(req)
    assert len(data) < (1 << 16) * 8 + 4096
    assert np.array_equal(decode(data).block_ids, np.arange(1 << 16) * 3)


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    try:
        decode(data)
    except MessageError:
        pass


@_FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_byte_flips(msg, data):
    buf = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(buf))
    except MessageError:
        return
    assert type(out).__name__ in ("RegisterConsumer", "TransferRequest", "TransferOutcome", "CancelTransfer", "ReleaseTransfer",
                                  "RegisterRank", "QueryRanks", "RankTable", "Reply")


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12)


@_FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_field_values(msg, data):
    """Replace fields (or nested fingerprint fields) with arbitrary msgpack values."""
    d = _wire(msg)
    keys = sorted(d)
    for k in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
        if k == "fingerprint" and isinstance(d[k], dict) and d[k] and data.draw(st.booleans()):
            d[k][data.draw(st.sampled_from(sorted(d[k])))] = data.draw(_values)
        else:
            d[k] = data.draw(_values)
    try:
        decode(_pack(d))
    except MessageError:
        pass


@_FUZZ
@given(st.dictionaries(st.text(max_size=12), _values, max_size=8))
def test_fuzz_random_maps(d):
    d.setdefault("v", m.PROTOCOL_VERSION)
    d.setdefault("type", "TransferRequest")
    with pytest.raises(MessageError):
        decode(_pack(d))


def test_a_draft_on_one_side_only_is_a_fingerprint_mismatch():
    """A decode with a speculative draft needs the draft's KV from its prefill."""
    with pytest.raises(FingerprintMismatch, match="draft_layers: ours 0, peer 4"):
        FP.check(dataclasses.replace(FP, num_layers=12, draft_layers=4))


def test_request_tables_split_per_group():
    req = decode(encode(SAMPLES[1]), TransferRequest)
    assert [t.tolist() for t in req.tables()] == [[4, 8, 1, 2, 6], [5, 3, 9]]
    r = req.regions()
    assert r.layer_group.tolist() == [1] * 6 + [0] * 2 and r.group_sharded.tolist() == [False, True]


@settings(max_examples=50, deadline=None)
@given(ch=st.characters(exclude_categories=("Cs",)), big=st.integers(0, 1))
def test_every_message_fits_its_bound(ch, big):
    """``MAX_BYTES``, each type's largest encoding from its schema, is what a socket taking
    it reads at most before hashing (``auth``): each string at its longest, of one drawn
    character (up to 4 UTF-8 bytes), each int at its largest, still fits."""
    def text(n):
        return ch * n

    top = (1 << 48) if big else 0
    fp = Fingerprint(text(m.MAX_NAME), 1 << 16, 1 << 24, text(64), 1 << 40, text(256), text(256), 1 << 16,
                     text(64), m.MAX_HEADS)
    msgs = [Reply(False, text(m.MAX_REASON)), CancelTransfer(text(m.MAX_NAME), (1 << 63) - 1),
            ReleaseTransfer(text(m.MAX_NAME), text(m.MAX_NAME), (1 << 16) - 1, 1 << 16, top, "f" * 64),
            QueryRanks(text(m.MAX_NAME), text(1024)),
            RegisterRank(text(m.MAX_NAME), 4095, 4096, text(256), fp, 0, 1, 0, 1),
            _outcome(transfer_key=text(m.MAX_NAME), reason=text(m.MAX_REASON), checksum="f" * 64, nbytes=top),
            RankTable(text(m.MAX_NAME), 64, tuple(text(256) for _ in range(64)), fp)]
    for msg in msgs:
        assert len(encode(msg)) <= m.MAX_BYTES[type(msg)], type(msg).__name__
    small = [m.MAX_BYTES[c] for c in (Reply, CancelTransfer, ReleaseTransfer, QueryRanks, RegisterRank,
                                      TransferOutcome)]
    assert max(small) < 20 << 10, small  # what a bootstrap and a decode rank's side channel read
