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
Every write is checked byte for byte, every checksum pair compared. Part 3, per path and
without the write: ``verify_kv``'s checksum (``checksum.py``, torch on the device holding the
KV; one thread on a host), against the xxh3-128 of host memory it replaced (a numpy
gather of 32 MiB at a time, then xxh3, as protocol 8 did), for one decode rank's path of the
tiny test model (4 layers, 2 KV heads of 64 bf16, 32-token pages, DCP 2) and of GLM-5.2 (78
layers of a 656 B latent and a 132 B indexer key per token, 64-token pages, DCP 4), at 8K and
32K tokens; ``--device cuda`` runs the torch column on a GPU (no xxh3 column there).

    MC_LOG_LEVEL=ERROR .venv/bin/python bench/trust.py [--reps 30] [--part 1|1b|2|3|4|all] [--device cpu]
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
    from vllm_dcp2d.reshard.regions import KVRegions

    fp = Fingerprint("glm", 78, 64, "fp8_e4m3", 36864, "N64,C576:kv_c|k_pe", "sha256:x@main")
    regions = KVRegions.uniform(np.arange(78), (1 << 30) + np.arange(78) * (1 << 24), 36864)
    out = [("QueryRanks", QueryRanks("decode-engine", "tcp://10.0.0.1:17500 query 0123456789abcdef"))]
    for tokens in (8192, 32768):
        pages = -(-tokens // 64)
        req = TransferRequest.build(
            regions=regions, block_ids=np.arange(-(-pages // 4)),
            transfer_key="cmpl-" + "x" * 40, attempt_id=7, engine_id="decode-engine", consumer_rank=1,
            consumer_size=4, dcp_size=4, dcp_rank=1, num_tokens=tokens, first_page=0,
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


def part4(reps: int) -> None:
    """What the checks of issue 48 cost per message, on a prefill rank's I/O thread: a link's
    registration (decode + the host and own-session checks + the quota), and what a
    TransferRequest pays besides decoding (the registration lookup, ``check_inside``, the
    per-source quota in ``SendLedger.arrive``), for the GLM-5.2 requests of ``messages()``."""
    from vllm_dcp2d.reshard.regions import Memory
    from vllm_dcp2d.transfer.consumers import Consumers
    from vllm_dcp2d.transfer.messages import RegisterConsumer, decode, encode
    from vllm_dcp2d.transfer.send_ledger import Attempt, SendLedger

    memory = Memory([1 << 30], [78 << 24])
    reg = encode(RegisterConsumer.of("decode-engine", "10.0.0.2:15123", memory))
    consumers = Consumers("cp rank 0", lambda: {"10.0.0.1:15000"}, sealed=False)

    def register():
        t0 = time.perf_counter()
        consumers.register(b"link", decode(reg, RegisterConsumer), "10.0.0.2")
        return time.perf_counter() - t0

    rows = [("RegisterConsumer: decode + checks + quota (once per link and minute)", len(reg), register)]
    for label, req in messages()[1:3]:
        ledger = SendLedger("cp rank 0")
        def request(req=req):
            t0 = time.perf_counter()
            r = consumers.get(b"link")
            req.check_inside(r.memory)
            a = Attempt(b"link", req, time.monotonic() + 30, 1000, source=r.source, session=r.session,
                        memory=r.memory)
            ledger.arrive(a)
            ledger.cancel(b"link", req.attempt_id, "bench")  # answered: its quota is given back
            ledger.take_answers()
            return time.perf_counter() - t0

        rows.append((f"{label}: lookup + check_inside + quota + arrive/cancel", len(encode(req)), request))
    print()
    print("| message | bytes | p50 / p99 / max ms |")
    print("|---|---|---|")
    for label, nbytes, run in rows:
        times = [run() for _ in range(reps)]
        print(f"| {label} | {nbytes} | {stats(times)} |")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def part2(reps: int) -> None:
    from vllm_dcp2d.transfer.checksum import checksum, path_ranges
    from vllm_dcp2d.transfer.transport import MooncakeTransport
    from vllm_dcp2d.reshard.plan import plan_path
    from vllm_dcp2d.reshard.regions import KVRegions, Memory

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


# (label, layers, page tokens, bytes per token and layer of each region, DCP size)
LAYOUTS = [("tiny llama (4 layers, 2 KV heads x 64 bf16)", 4, 32, (256,), 2),
           ("GLM-5.2 (78 layers, latent 656 + indexer 132 B)", 78, 64, (656, 132), 4)]


def xxh3_checksum(memory, src, length, order) -> str:
    """Protocol 8's checksum: xxh3-128 of host memory, gathered 32 MiB at a time (for comparison)."""
    import xxhash

    from vllm_dcp2d.transfer.hostmem import gather

    idx = np.argsort(order, kind="stable")
    src, length = src[idx], length[idx]
    h, end, start = xxhash.xxh3_128(), np.cumsum(length), 0
    while start < src.size:
        stop = max(start + 1, int(np.searchsorted(end, end[start] - length[start] + (32 << 20), side="right")))
        buf = np.empty(int(length[start:stop].sum()), dtype=np.uint8)
        gather(memory, src[start:stop], length[start:stop], buf)
        h.update(buf)
        start = stop
    return h.hexdigest()


def part3(reps: int, device: str) -> None:
    import torch

    from vllm_dcp2d.transfer.checksum import KVBytes, checksum, path_ranges
    from vllm_dcp2d.reshard.plan import plan_path
    from vllm_dcp2d.reshard.regions import KVRegions

    host = device == "cpu"
    print()
    print(f"verify_kv's checksum per path, KV on {device}" + (" (one thread: checksum._one_host_thread), against "
                                                            "protocol 8's xxh3-128 of host memory" if host else ""))
    print()
    print("| layout | tokens | path MiB | ranges prefill / decode | " + ("xxh3 prefill / decode ms p50 | " if host else "")
          + "checksum prefill / decode ms p50 | checksum GB/s (decode) |")
    print("|---|---|---|---|" + ("---|" if host else "") + "---|---|")
    gen = torch.Generator().manual_seed(0)
    for label, layers, page, per_token, dcp in LAYOUTS:
        for tokens in (8192, 32768):
            pages = -(-tokens // page)
            mine = len(range(1, pages, dcp))  # decode rank 1's pages
            sizes = [page * b for b in per_token]
            src = [torch.randint(0, 256, (layers, mine + 1, n), dtype=torch.uint8, generator=gen).to(device)
                   for n in sizes]
            dst = [torch.zeros((layers, mine + 1, n), dtype=torch.uint8, device=device) for n in sizes]

            def regions(bufs):
                base = np.stack([b.data_ptr() + np.arange(layers) * b[0].numel() for b in bufs], axis=1)
                return KVRegions(np.arange(layers), base, np.array(sizes), np.array(sizes))

            src_ids = np.zeros(pages, dtype=np.int64)
            src_ids[1::dcp] = np.random.default_rng(0).permutation(mine + 1)[:mine]  # its blocks, shuffled
            dst_ids = np.arange(mine)
            desc = plan_path(regions(src), src_ids, range(layers), regions(dst), dst_ids, dcp, 1, 0, pages)
            for s_, d_, n in zip(desc.src, desc.dst, desc.length):  # the write: every descriptor's bytes
                _view(dst, int(d_), int(n)).copy_(_view(src, int(s_), int(n)))
            ranges = path_ranges(regions(dst), (dst_ids,), range(layers), dcp, 1, 0, pages)
            sides = ((KVBytes.of_tensors(src), desc.src, desc.length, desc.dst),
                     (KVBytes.of_tensors(dst), ranges.dst, ranges.length, ranges.dst))
            cols = []
            for kind in ("xxh3", "checksum") if host else ("checksum",):
                times, sums = ([], []), set()
                for rep in range(reps + 1):  # the first round warms up (oneDNN builds its GEMM) and is not counted
                    for side, (kv, s_, n_, o_) in enumerate(sides):
                        t0 = time.perf_counter()
                        sums.add(xxh3_checksum(kv.memory, s_, n_, o_) if kind == "xxh3" else checksum(kv, s_, n_, o_))
                        if rep:
                            times[side].append(time.perf_counter() - t0)
                if len(sums) != 1:
                    raise SystemExit(f"{label} {tokens}: {kind}: prefill and decode differ: {sums}")
                cols.append(f"{np.median(times[0]) * 1e3:.2f} / {np.median(times[1]) * 1e3:.2f}")
            rate = desc.nbytes / np.median(times[1]) / 1e9
            print(f"| {label} | {tokens // 1024}K | {desc.nbytes / 2**20:.1f} | {len(desc)} / {len(ranges)} | "
                  + " | ".join(cols) + f" | {rate:.2f} |")
            del src, dst, sides


def _view(bufs, addr: int, nbytes: int):
    """uint8 ``[nbytes]`` at ``addr`` inside one of the tensors ``bufs``."""
    for b in bufs:
        off = addr - b.data_ptr()
        if 0 <= off and off + nbytes <= b.numel():
            return b.view(-1)[off:off + nbytes]
    raise ValueError(f"{addr:#x} is in none of the buffers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--part", choices=["1", "1b", "2", "3", "4", "all"], default="all")
    ap.add_argument("--device", default="cpu", help="where part 3 keeps the KV (cpu, cuda)")
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: expected at least 1")
    if args.part in ("1", "all"):
        part1(max(args.reps, 200))
    if args.part in ("1b", "all"):
        part1b(args.reps)
    if args.part in ("2", "all"):
        part2(args.reps)
    if args.part in ("3", "all"):
        part3(args.reps, args.device)
    if args.part in ("4", "all"):
        part4(max(args.reps, 1000))


if __name__ == "__main__":
    main()
