"""A PD deployment on this machine, as the demo (``vllm-dcp2d demo``) and
``vllm_dcp2d/gpu_check.py`` start it: ``vllm serve`` instances and the proxy as
real processes (``servers.py``), the ``/dev/shm`` files they leave (``shm.py``),
and tiny models built locally (``tiny_models.py``). The tests and benches start
their servers with these too; helpers only they use are in ``tests/support/``."""
