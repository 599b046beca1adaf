"""Test- and bench-only: this process sees the host as an x86 CPU with AVX2 and without
AVX-512, AVX-512 BF16, VNNI or AMX (the 2-core AMD EPYC of notes/vllm-on-cpu.md §10).

Python imports this module at start-up in the processes whose ``PYTHONPATH`` lists this
folder (``tests.support.avx2_host.env()``): engines and ranks a test or bench starts to run vLLM's AVX2
path on an AVX-512 host. vLLM then decides as on such a host, from the same calls:
``CpuPlatform.import_kernels`` loads ``vllm._C_AVX2`` (the AVX2 build, which lacks the
shared-memory collectives, ``torch.ops._C.init_shm_manager``; its kernels run here), the
CPU attention picks its ``vec`` ISA instead of ``amx``, the MLA backend CPU_MLA. torch's
own kernels dispatch at AVX2 (``ATEN_CPU_CAPABILITY``), oneDNN's at AVX2
(``ONEDNN_MAX_CPU_ISA``), both read when torch loads, and inductor (vLLM's
``torch.compile`` of small helpers) generates AVX2 code. Nothing in ``vllm_dcp2d`` imports it.
"""

import os
import tempfile

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# Inductor's cache keys do not tell these processes from this host's own (an AVX2 process
# that used this host's cache failed: "index out of range" from a compiled embedding
# mask), so they compile into a cache of their own. A parent that used inductor passes
# its cache in the environment (a pytest process does): replaced, not kept.
_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "torchinductor")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache.removesuffix("-avx2_host") + "-avx2_host"

import torch  # noqa: E402

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported"):
    setattr(torch.cpu, _name, lambda: False)
