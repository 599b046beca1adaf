"""vLLM ``general_plugins`` entry point (``[project.entry-points."vllm.general_plugins"]``).

vLLM calls ``register()`` once in every process it starts (front end, engine
core, each worker), before any connector or attention backend is resolved.
It makes ``kv_connector="DCP2DConnector"`` resolvable without a module path,
installs the DCP-capable CPU attention backends, the engine core's
layer-split KV layout (``vllm_compat/kv_cache.py``) and, on CPU, speculative
decoding under DCP (``vllm_compat/spec_decode.py``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "DCP2DConnector"


def register() -> None:
    """Make the connector resolvable; install the vLLM patches only on the vLLM they were written for.

    vLLM runs every ``general_plugins`` entry point without a try/except, so an
    exception here, or a patch that does not fit the installed vLLM, breaks every
    engine in the environment, DCP2D or not. On another vLLM version nothing is
    patched: engines that do not use the connector run exactly as vLLM made them,
    and a DCP2D instance refuses at start-up (``check_vllm_version``) naming both
    versions.
    """
    _route_logs()
    _register_connector()
    from vllm_dcp2d.vllm_compat import VLLM_VERSION, installed_vllm_version

    found = installed_vllm_version()
    if found != VLLM_VERSION:
        logger.warning("vllm_dcp2d: vLLM %s is installed, its patches target %s; none installed, "
                       "so %s instances will refuse to start", found, VLLM_VERSION, CONNECTOR_NAME)
        return
    from vllm.platforms import current_platform

    from vllm_dcp2d.vllm_compat import attention, config, kv_cache, spec_decode

    attention.register()
    config.install()  # MLA backend and DCP interleave chosen for DCP2D instances
    kv_cache.install()  # layer-split storage on prefill instances that ask for it
    if current_platform.is_cpu():
        spec_decode.install()  # a draft runs with DCP disabled; ranks agree on what was accepted
    logger.debug("vllm_dcp2d registered %s and the DCP attention backend", CONNECTOR_NAME)


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_dcp2d.connector.connector", "DCP2DConnector")
    except ValueError:
        pass  # already registered: register() can run twice in one process (in-process engine + CLI)


def _route_logs() -> None:
    """Send ``vllm_dcp2d``'s log records through vLLM's handlers, at vLLM's level.

    vLLM configures only its own ``vllm`` logger; without this, the plugin's
    INFO lines (which layers a rank stores and sends, a stalled write) would
    reach a user only at WARNING and above, unformatted.
    """
    theirs, ours = logging.getLogger("vllm"), logging.getLogger("vllm_dcp2d")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False
