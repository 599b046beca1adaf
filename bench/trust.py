"""What the trust boundary costs (issue 37): sealing a side-channel message, and
``verify_kv``'s checksum of one path, against what the path costs anyway.

Part 1, per message: ``Auth.seal`` + ``Auth.open`` (two HMAC-SHA256 tags, the recipient
check, the nonce memory) of the messages one fetch sends, next to ``encode`` + ``decode``
of the same message, which every message already pays. Part 1b, per refused frame: what
``Auth.open`` costs to refuse a 16 MiB frame of junk behind the magic bytes, one sealed for
another rank, a replayed one, one past its socket's ceiling, against one HMAC over the
whole frame (what every open did before round 3, e1efa24), and what hashing the largest
TransferRequest a secret holder can send costs. Part 2, per path: the two checksums of
``verify_kv`` (the prefill's over its source pages, the decode's over its blocks, both
ordered by the destination address) against the Mooncake TCP write of the same path, in one process
over loopback, at 8K and 32K tokens, for the tiny test model in fp32 and for one path
of GLM-5.2 (78 layers, CP8 -> DCP4, 64-token pages, 576 B per token and layer).
Every write is checked byte for byte, every checksum pair compared.

    MC_LOG_LEVEL=ERROR .venv/bin/python bench/trust.py [--reps 30] [--messages-only]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

# (label, layers of one CP rank, page tokens, bytes per token and layer, DCP size)
MODELS = [("tiny llama-mqa fp32 (CP2 -> DCP2)", 2, 32, 256, 2), ("GLM-5.2 (CP8 -> DCP4)", 10, 64, 576, 4)]


def stats(xs: list[float]) -> str:
    a = np.array(xs) * 1e3
    return f"{np.percentile(a, 50):.3f} / {np.percentile(a, 99):.3f} / {a.max():.3f}"


def messages() -> list:
    from vllm_dcp2d.transfer.messages import Fingerprint, QueryRanks, TransferOutcome, TransferRequest
    from vllm_dcp2d.plan import KVRegions, Memory

    fp = Fingerprint("glm", 78, 64, "fp8_e4m3", 36864, "N64,C576:kv_c|k_pe", "sha256:x@main")
    regions = KVRegions.uniform(np.arange(78), (1 << 30) + np.arange(78) * (1 << 24), 36864)
    out = [("QueryRanks", QueryRanks("decode-engine", "tcp://10.0.0.1:17500 query 0123456789abcdef"))]
    for tokens in (8192, 32768):
        pages = -(-tokens // 64)
        req = TransferRequest.build(
            regions=regions, memory=Memory([1 << 30], [78 << 24]), block_ids=np.arange(-(-pages // 4)),
            transfer_key="cmpl-" + "x" * 40, attempt_id=7, engine_id="decode-engine", consumer_rank=1,
            consumer_size=4, session="10.0.0.2:15123", dcp_size=4, dcp_rank=1, num_tokens=tokens, first_page=0,
            num_blocks=455, fingerprint=fp, wait_s=30.0, prompt_digest="0" * 32)
        out.append((f"TransferRequest, {tokens // 1024}K tokens", req))
    out.append(("TransferOutcome", TransferOutcome("k", 7, 1, 8, True, "", 10, 20, 8192, 128, 1 << 24, 2, 1,
                                                   1 << 26, 0.001, 0.01, 0, True, 0, "0" * 32)))
    return out


def part1(reps: int) -> None:
    from vllm_dcp2d.transfer.auth import Auth, rank_name
    from vllm_dcp2d.transfer.messages import MAX_MESSAGE_BYTES, decode, encode

    a, b = Auth(b"s" * 32), Auth(b"s" * 32)
    to = rank_name("prefill-engine-0123456789abcdef", 3)
    print("| message | bytes | encode + decode p50 / p99 / max ms | seal + open p50 / p99 / max ms | seal + open / codec (p50) |")
    print("|---|---|---|---|---|")
    for label, msg in messages():
        codec, sealed = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            data = encode(msg)
            decode(data)
            t1 = time.perf_counter()
            b.open(a.seal(data, to=to), me=to, limit=MAX_MESSAGE_BYTES)
            t2 = time.perf_counter()
            codec.append(t1 - t0)
            sealed.append(t2 - t1)
        print(f"| {label} | {len(data)} | {stats(codec)} | {stats(sealed)} | "
              f"{np.median(sealed) / np.median(codec):.2f} |")


def part1b(reps: int) -> None:
    import hmac

    from vllm_dcp2d.transfer.auth import Auth, AuthError, rank_name
    from vllm_dcp2d.transfer.messages import MAX_BYTES, MAX_MESSAGE_BYTES, Reply, TransferOutcome, TransferRequest

    key = b"s" * 32
    me, other = rank_name("prefill-engine", 0), rank_name("prefill-engine", 1)
    body = bytes(16 << 20)
    sealer = Auth(key)
    good = sealer.seal(body, to=me)
    junk = good[:4] + bytes(len(good) - 4)
    decode_limit = max(MAX_BYTES[TransferOutcome], MAX_BYTES[Reply])

    def refusal(frame, who, limit, fresh=False):
        reader = Auth(key)
        if fresh:  # replay: the reader has read it once
            reader.open(frame, me=who, limit=limit)
        t0 = time.perf_counter()
        try:
            reader.open(frame, me=who, limit=limit)
        except AuthError:
            pass
        else:
            raise SystemExit("a frame that should be refused was opened")
        return time.perf_counter() - t0

    rows = [
        ("16 MiB of junk behind the magic bytes", len(junk), lambda: refusal(junk, me, MAX_MESSAGE_BYTES)),
        ("16 MiB sealed for another rank", len(good), lambda: refusal(good, other, MAX_MESSAGE_BYTES)),
        ("16 MiB replayed to its rank", len(good), lambda: refusal(good, me, MAX_MESSAGE_BYTES, fresh=True)),
        ("64 KiB at a decode rank's socket (ceiling %d B)" % decode_limit, 64 << 10,
         lambda: refusal(sealer.seal(bytes(64 << 10), to=me), me, decode_limit)),
        ("reference: one HMAC over 16 MiB (how every sealed frame was refused before)", len(junk),
         lambda: _timed(lambda: hmac.digest(key, junk, "sha256"))),
    ]
    big = bytes(MAX_BYTES[TransferRequest])
    big_frame = sealer.seal(big, to=me)
    rows.append((f"open the largest TransferRequest a secret holder can send ({len(big) >> 20} MiB)", len(big_frame),
                 lambda: _timed(lambda: Auth(key).open(big_frame, me=me, limit=MAX_MESSAGE_BYTES))))
    print()
    print("| frame | bytes | Auth.open p50 / p99 / max ms |")
    print("|---|---|---|")
    for label, n, run in rows:
        times = [run() for _ in range(reps)]
        print(f"| {label} | {n} | {stats(times)} |")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def part2(reps: int) -> None:
    from vllm_dcp2d.transfer.checksum import checksum, path_ranges
    from vllm_dcp2d.transfer.transport import MooncakeTransport
    from vllm_dcp2d.plan import KVRegions, Memory, plan_path

    print()
    print("| model | tokens | path bytes | descriptors | write p50 / p99 / max ms | prefill checksum p50 / p99 / max ms "
          "| decode checksum p50 / p99 / max ms | both / write (p50) |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    with MooncakeTransport() as ta, MooncakeTransport() as tb:
        for label, layers, page, per_token, dcp in MODELS:
            for tokens in (8192, 32768):
                pages = -(-tokens // page)
                page_bytes = page * per_token
                blocks = pages + 1
                src = rng.integers(0, 256, (layers, blocks, page_bytes), dtype=np.uint8)
                dst = np.zeros((layers, -(-pages // dcp) + 1, page_bytes), np.uint8)
                ta.register(src.ctypes.data, src.nbytes)
                tb.register(dst.ctypes.data, dst.nbytes)
                sr = KVRegions.uniform(np.arange(layers), src.ctypes.data + np.arange(layers) * src[0].nbytes,
                                       page_bytes)
                dr = KVRegions.uniform(np.arange(layers), dst.ctypes.data + np.arange(layers) * dst[0].nbytes,
                                       page_bytes)
                src_ids, dst_ids = rng.permutation(blocks)[:pages], np.arange(-(-pages // dcp))
                desc = plan_path(sr, src_ids, range(layers), dr, dst_ids, dcp, 1, 0, pages)
                ranges = path_ranges(dr, (dst_ids,), range(layers), dcp, 1, 0, pages)
                ms, md = Memory.of([(src.ctypes.data, src.nbytes)]), Memory.of([(dst.ctypes.data, dst.nbytes)])
                writes, sums, sumd = [], [], []
                for _ in range(reps):
                    dst[:] = 0
                    t0 = time.perf_counter()
                    ta.write(tb.session_id, desc)
                    t1 = time.perf_counter()
                    a = checksum(ms, desc.src, desc.length, desc.dst)
                    t2 = time.perf_counter()
                    b = checksum(md, ranges.dst, ranges.length, ranges.dst)
                    t3 = time.perf_counter()
                    if a != b:
                        raise SystemExit(f"{label} {tokens}: checksums differ: {a} {b}")
                    writes.append(t1 - t0)
                    sums.append(t2 - t1)
                    sumd.append(t3 - t2)
                ta.unregister(src.ctypes.data)
                tb.unregister(dst.ctypes.data)
                ratio = (np.median(sums) + np.median(sumd)) / np.median(writes)
                print(f"| {label} | {tokens // 1024}K | {desc.nbytes / 2**20:.1f} MiB | {len(desc)} | {stats(writes)} | "
                      f"{stats(sums)} | {stats(sumd)} | {ratio:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--messages-only", action="store_true", help="parts 1 and 1b only (no Mooncake)")
    args = ap.parse_args()
    reps = args.reps
    if reps < 1:
        raise SystemExit(f"--reps {reps}: expected at least 1")
    part1(max(reps, 200))
    part1b(reps)
    if not args.messages_only:
        part2(reps)


if __name__ == "__main__":
    main()
