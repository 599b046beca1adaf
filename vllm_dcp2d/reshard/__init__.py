"""The math of the 2D (and 3D) KV reshard (design §4-§6): which ranks own which layers,
pages and heads, where a rank's paged KV lives, and the ``(src, dst, length)``
descriptors one prefill rank writes to one decode rank. A reusable transfer-plan
library: import the module you need (``from vllm_dcp2d.reshard.plan import
plan_request``); this file re-exports nothing.

layout        sharding: layers over prefill CP ranks, pages over decode DCP ranks, KV heads over TP
regions       where a rank's paged KV sits in its address space (``KVRegions``) and the memory
              a transport registered (``Memory``)
head_split    which bytes of a page carry which KV heads on each side
plan          the transfer plan: descriptors of one path, vectorized, runs merged
page_format   the byte layout of a vLLM paged KV view: the regions to move, the format both
              sides must share (the one module that needs torch: it reads tensors' strides
              and names torch's fp8 dtypes)
report        the 2D reshard matrix of one request, for people (``vllm-dcp2d plan``)
report_heads  the 3D (layer x head x page) matrix (``vllm-dcp2d plan --kv-heads``)
capacity      KV capacity per DCP size, arithmetic only (``vllm-dcp2d plan --capacity``)

Nothing here imports vLLM, the connector or the transfer, and nothing does I/O; only
``page_format`` imports torch (tests/reshard/test_boundaries.py checks all three).
"""
