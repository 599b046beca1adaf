"""DCP2DConnector as a Ray Serve LLM connector backend: per-replica ports and addresses.

Ray Serve LLM starts many vLLM replicas from one ``LLMConfig``, several to a node,
so a fixed ``bootstrap_port`` in ``kv_connector_extra_config`` would collide and
``127.0.0.1`` would not reach another node. A connector backend fixes that per
replica before its engine starts (``BaseConnectorBackend.setup``), as Ray's own
``NixlConnectorBackend`` does for NIXL's side channel. Ray's default PD
orchestration speaks the NIXL-style protocol (the decode gets the prefill's
``kv_transfer_params``), which DCP2DConnector serves unchanged.

    from vllm_dcp2d import ray_serve
    ray_serve.register()   # once, in the driver, before ``build_pd_openai_app(...)``

Ray is optional: nothing here imports it until ``register()`` or the backend class is
asked for. ``replica_extra_config`` is the whole port and address logic, plain Python.
"""

from __future__ import annotations

import functools

from vllm_dcp2d.config import CONNECTOR_NAME, ConfigError, parse_extra_config

__all__ = ["PORT_BASE", "PORTS_PER_REPLICA", "register", "replica_engine_id", "replica_extra_config"]

PORT_BASE = 17500         # experimental_configs["DCP2D_PORT_BASE"] overrides it
PORTS_PER_REPLICA = 2     # the ZMQ bootstrap and the HTTP bootstrap of a prefill replica

# Where Ray keeps BaseConnectorBackend and the backend factory: the newest layout first.
_RAY_MODULES = (
    ("ray.llm._internal.serve.engines.vllm.kv_transfer.base",
     "ray.llm._internal.serve.engines.vllm.kv_transfer.factory"),
    ("ray.llm._internal.serve.deployments.llm.vllm.kv_transfer_backends.base",
     "ray.llm._internal.serve.deployments.llm.vllm.kv_transfer_backends.factory"),
)


def replica_extra_config(extra: dict | None, offset: int, node_ip: str, base_port: int = PORT_BASE) -> dict:
    """``kv_connector_extra_config`` for the replica at port ``offset`` (Ray's
    ``_compute_port_offset()``: the DP rank, or the replica rank times its devices) on
    the node ``node_ip``. Keys the user set are kept; the rest are filled in:
    ``bootstrap_host`` and ``local_hostname`` = ``node_ip``, ``bootstrap_port`` =
    ``base_port + 2 * offset``, ``http_bootstrap_port`` = that + 1. Raises ``ConfigError``
    naming the values when a port falls outside [1, 65535] or a key is invalid."""
    if not isinstance(offset, int) or offset < 0:
        raise ConfigError(f"replica port offset {offset!r}: expected an int >= 0")
    port = base_port + PORTS_PER_REPLICA * offset
    if not 1 <= base_port or port + 1 > 65535:
        raise ConfigError(f"DCP2D_PORT_BASE {base_port} + {PORTS_PER_REPLICA} x offset {offset} = {port}: expected "
                          f"ports in [1, 65535]; lower DCP2D_PORT_BASE")
    out = {"bootstrap_host": node_ip, "local_hostname": node_ip, "bootstrap_port": port,
           "http_bootstrap_port": port + 1, **(extra or {})}
    parse_extra_config(out)  # the connector would refuse it at start-up: refuse it here, naming the key
    return out


def replica_engine_id(engine_id: str | None, suffix: str, extra: dict) -> str:
    """An engine id unique over replicas: the configured one (or ``suffix``), the node
    address and the bootstrap port, as Ray's NIXL backend makes its own."""
    return "-".join([engine_id or suffix, extra["bootstrap_host"], str(extra["bootstrap_port"])])


def _ray_module(i: int):
    import importlib

    errors = []
    for names in _RAY_MODULES:
        try:
            return importlib.import_module(names[i])
        except ImportError as e:
            errors.append(f"{names[i]}: {e}")
    raise ImportError("Ray Serve LLM's connector backends were not found (is ray[llm] installed?): "
                      + "; ".join(errors))


@functools.cache
def _backend_class():
    import ray

    class DCP2DConnectorBackend(_ray_module(0).BaseConnectorBackend):
        """Called by Ray Serve LLM in each replica before its vLLM engine starts."""

        def setup(self) -> None:
            base = int(self.llm_config.experimental_configs.get("DCP2D_PORT_BASE", PORT_BASE))
            extra = replica_extra_config(self.kv_transfer_config.get("kv_connector_extra_config"),
                                         self._compute_port_offset(), ray.util.get_node_ip_address(), base)
            self.kv_transfer_config["kv_connector_extra_config"] = extra
            self.kv_transfer_config["engine_id"] = replica_engine_id(
                self.kv_transfer_config.get("engine_id"), self._get_unique_suffix(), extra)

    return DCP2DConnectorBackend


def __getattr__(name: str):
    # "vllm_dcp2d.ray_serve:DCP2DConnectorBackend" is how Ray's factory loads it, lazily
    if name == "DCP2DConnectorBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the backend with Ray Serve LLM under the connector's name."""
    factory = _ray_module(1).KVConnectorBackendFactory
    if factory.is_registered(CONNECTOR_NAME):
        return
    try:
        factory.register_backend(CONNECTOR_NAME, f"{__name__}:DCP2DConnectorBackend")
    except TypeError:  # Ray before the registry took "module:class": (name, module, class)
        factory.register_backend(CONNECTOR_NAME, __name__, "DCP2DConnectorBackend")
