"""Prefill CP layer-split storage inside vLLM (design §4).

layer_split  the worker's transient-slot fill, called before each layer's cache write
broadcast    the size-broadcast of one layer's prefix KV from its owner
dist         the CP group as torch.distributed sees it (gloo on CPU, NCCL on GPU)

The memory layout itself (owned layers + one transient slot per rank) is set
in the engine core by ``vllm_compat/kv_cache.py``.
"""
