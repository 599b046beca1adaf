"""The KV connector: DCP2DConnector, its scheduler and worker sides, and what they tell vLLM (docs/layout.md).

The transfer it drives lives in ``vllm_dcp2d.transfer``, which imports nothing from here.

Its name, as users write it in ``--kv-transfer-config``, lives in the leaf
``vllm_dcp2d.config``, which the plugin entry point and the vLLM glue read too.
"""

from vllm_dcp2d.config import CONNECTOR_CLASS, CONNECTOR_NAME

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_NAME"]
