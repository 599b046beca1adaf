"""Long query runs (prefill chunks) through torch's CPU flash-attention kernel.

A decode step has one query token per request, and :mod:`.paged`'s online
softmax over pages is the faster route there. A prefill chunk has thousands:
the online softmax then rescales ``[M, D]`` running outputs once per page, and
a batch that mixes it with decodes pads every request to its length. torch's
fused kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which also
returns the LSE) does neither. Measured by ``bench/dcp_decode.py`` (one thread,
8 query heads on 1 KV head, head dim 128, 4,096 local tokens per request):

=====================  ===========  =========
case                   online ms    flash ms
=====================  ===========  =========
decode, 4 x 1 query    6.7          7.5
prefill, 1 x 2,048     1,345        424
2,048 + 3 x 1 mixed    6,334        406
causal, 1 x 2,048      390          129
=====================  ===========  =========

So requests with more than :data:`LONG_QUERY` query tokens take this route,
one request per kernel call, and the others stay batched on the online softmax.

Memory, whatever the context length: the kernel works in blocks of queries and
keys, and keys reach it in chunks of at most ``chunk`` tokens, so a request holds
its folded queries, the running and the new partial output, and one chunk of K
and V as read and as copied: at most ``6 * Q * H * (D + 1) * a + 4 * Hkv * chunk
* D * a`` bytes (``a`` the accumulation dtype's size; measured 5.6 ``Q * H *
(D + 1) * a`` for a 512-token chunk over 4K and over 16K tokens,
``tests/attention/test_paged.py::test_long_query_peak_memory_is_bounded_by_one_chunk``).
"""

from __future__ import annotations

import torch

__all__ = ["LONG_QUERY", "attend", "merge_into", "long_requests"]

# Query tokens above which a request takes this route (decode and draft verify
# stay on the paged online softmax: k + 1 <= 16 draft tokens).
LONG_QUERY = 16

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def long_requests(q_lens: torch.Tensor) -> list[int]:
    """Indices of the requests with more than :data:`LONG_QUERY` query tokens.

    q_lens: ``[R]`` int. Reads it on the host (one sync per call, not per request).
    """
    return torch.nonzero(q_lens > LONG_QUERY).flatten().tolist()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with LSE of already-scaled queries; GQA by views, not copies.

    q: ``[H, M, D]`` (pre-scaled); k, v: ``[Hkv, L, D]``, ``H % Hkv == 0``, ``L >= 1``,
    all in one float dtype (float32 or float64), any strides (a head dim with a
    stride other than 1 is copied first).
    causal: query ``i`` sees keys ``j <= L - M + i`` (queries are the last ``M``
    tokens); then the query heads of each KV head go in one kernel call each, since
    a causal mask cannot follow folded rows. Otherwise ``H`` must equal ``Hkv``
    (callers fold the query heads of a KV head into ``M``).
    Returns ``(o [H, M, D], lse [H, M])`` in q's dtype, natural log.
    """
    # torch 2.13's CPU flash kernel reads the head dim as if its stride were 1 (a
    # transposed K gave wrong results, silently): K read from a single column-major
    # page is such a view.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    h, hkv = q.shape[0], k.shape[0]
    if not causal:
        if h != hkv:
            raise ValueError(f"non-causal attend takes folded queries: {h} query heads for {hkv} KV heads")
        o, lse = _flash(q[None], k[None], v[None], 0.0, False, scale=1.0)
        return o[0], lse[0]
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"causal attend needs as many keys as queries, got {k.shape[1]} and {q.shape[1]}")
    g = h // hkv
    outs = [_flash(q[None, j * g:(j + 1) * g], k[None, j:j + 1].expand(1, g, -1, -1),
                   v[None, j:j + 1].expand(1, g, -1, -1), 0.0, True, scale=1.0) for j in range(hkv)]
    return torch.cat([o[0] for o, _ in outs]), torch.cat([lse[0] for _, lse in outs])


def merge_into(acc: tuple[torch.Tensor, torch.Tensor] | None, o: torch.Tensor,
               lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial ``(o [..., D], lse [...])`` into the running ``acc`` (or
    start it), in place: both outputs are the caller's to overwrite. Both partials
    must have seen at least one key per row. (:func:`.merge.merge_lse` would stack
    the two partials: two more output-sized copies against the bound above.)"""
    if acc is None:
        return o, lse
    o0, lse0 = acc
    mx = torch.maximum(lse0, lse)
    a, b = torch.exp(lse0 - mx), torch.exp(lse - mx)
    total = a + b
    o0.mul_(a[..., None]).add_(o.mul_(b[..., None])).div_(total[..., None])
    return o0, mx.add_(torch.log(total))
