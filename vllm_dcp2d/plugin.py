"""vLLM ``general_plugins`` entry point (``[project.entry-points."vllm.general_plugins"]``).

vLLM calls ``register()`` once in every process it starts (front end, engine
core, each worker), before any connector or attention backend is resolved.
It makes ``kv_connector="DCP2DConnector"`` resolvable without a module path
and installs the patches of ``vllm_compat/patches.py`` that fit the installed
vLLM: the DCP-capable CPU attention backends, the engine core's layer-split KV
layout, speculative decoding under DCP and the start-up choices DCP2D needs.
"""

from __future__ import annotations

import logging

from vllm_dcp2d.config import CONNECTOR_NAME

logger = logging.getLogger(__name__)

__all__ = ["register", "CONNECTOR_NAME"]


def register() -> None:
    """Make the connector resolvable, and install the vLLM patches that fit this vLLM.

    vLLM runs every ``general_plugins`` entry point without a try/except, so an
    exception here, or a patch that does not fit the installed vLLM, would break
    every engine in the environment, DCP2D or not. ``registry.install_all`` installs
    only the patches whose targets (per vLLM version, ``vllm_compat/patches.py``) are
    there with the parameters they were written for; it records the others, and a
    DCP2D instance that needs one refuses at start-up naming the version, the patch
    and the reason. Engines that do not use the connector run as vLLM made them,
    apart from the CPU attention backends' DCP support, which they only reach with
    ``decode_context_parallel_size > 1``.
    """
    from vllm_dcp2d.vllm_compat import registry
    from vllm_dcp2d.vllm_compat.startup import route_logs

    route_logs()

    registry.register_connector()
    registry.install_all()
    logger.debug("vllm_dcp2d registered %s", CONNECTOR_NAME)
