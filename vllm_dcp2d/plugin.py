"""vLLM ``general_plugins`` entry point (``[project.entry-points."vllm.general_plugins"]``).

vLLM calls ``register()`` once in every process it starts (front end, engine
core, each worker), before any connector or attention backend is resolved.
It makes ``kv_connector="DCP2DConnector"`` resolvable without a module path
and installs the DCP-capable CPU attention backend.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "DCP2DConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_dcp2d.connector.connector", "DCP2DConnector")
    except ValueError:
        pass  # already registered: register() can run twice in one process (in-process engine + CLI)
    from vllm_dcp2d.vllm_compat import attention

    attention.register()
    logger.debug("vllm_dcp2d registered %s and the DCP attention backend", CONNECTOR_NAME)
