"""``vllm_dcp2d/ray_serve.py``: the per-replica ports and addresses (plain Python, every
case), and the backend's wiring into Ray Serve LLM's factory. Ray is not installed here
(``ray[llm]`` pins another vLLM), so the wiring runs against a stand-in for the three
Ray names it uses (``BaseConnectorBackend``, ``KVConnectorBackendFactory``,
``ray.util.get_node_ip_address``), written from Ray's source; that stand-in is all this
test can say about Ray itself."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_dcp2d import ray_serve
from vllm_dcp2d.config import ConfigError, parse_extra_config
from vllm_dcp2d.ray_serve import PORTS_PER_REPLICA, replica_engine_id, replica_extra_config


@given(st.integers(1, 60000), st.lists(st.integers(0, 200), min_size=2, max_size=8, unique=True))
def test_replicas_never_share_a_port(base, offsets):
    top = base + PORTS_PER_REPLICA * max(offsets) + 1
    if top > 65535:
        with pytest.raises(ConfigError, match=rf"DCP2D_PORT_BASE {base} \+ 2 x offset \d+ = \d+: expected ports"):
            for o in offsets:
                replica_extra_config({}, o, "10.0.0.7", base)
        return
    ports = []
    for o in offsets:
        extra = replica_extra_config({}, o, "10.0.0.7", base)
        assert extra["bootstrap_port"] == base + 2 * o and extra["http_bootstrap_port"] == base + 2 * o + 1
        assert extra["bootstrap_host"] == extra["local_hostname"] == "10.0.0.7"
        parse_extra_config(extra)
        ports += [extra["bootstrap_port"], extra["http_bootstrap_port"]]
    assert len(set(ports)) == len(ports)


def test_the_users_keys_win_and_bad_ones_are_named():
    extra = replica_extra_config({"bootstrap_port": 9000, "send_timeout_s": 30.0}, 3, "10.0.0.7")
    assert extra["bootstrap_port"] == 9000 and extra["http_bootstrap_port"] == ray_serve.PORT_BASE + 7
    assert extra["send_timeout_s"] == 30.0
    with pytest.raises(ConfigError, match=r"\['bootstarp_port'\]"):
        replica_extra_config({"bootstarp_port": 1}, 0, "10.0.0.7")
    with pytest.raises(ConfigError, match=r"offset -1: expected an int >= 0"):
        replica_extra_config({}, -1, "10.0.0.7")
    assert replica_engine_id(None, "ab12", extra) == "ab12-10.0.0.7-9000"
    assert replica_engine_id("prefill", "ab12", extra) == "prefill-10.0.0.7-9000"


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray's names as its source defines them, reduced to what the backend uses."""
    mods = {}

    def module(name):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
        return mods[name]

    ray = module("ray")
    ray.util = module("ray.util")
    ray.util.get_node_ip_address = lambda: "10.1.2.3"
    base = module("ray.llm._internal.serve.engines.vllm.kv_transfer.base")
    factory_mod = module("ray.llm._internal.serve.engines.vllm.kv_transfer.factory")

    class BaseConnectorBackend:
        def __init__(self, llm_config):
            self.llm_config = llm_config

        @property
        def kv_transfer_config(self):
            return self.llm_config.engine_kwargs["kv_transfer_config"]

        def _get_unique_suffix(self, len: int = 6) -> str:
            return "suffix"

        def _compute_port_offset(self) -> int:
            return self.llm_config.replica_rank * self.llm_config.num_devices

    class KVConnectorBackendFactory:
        registry: dict = {}

        @classmethod
        def register_backend(cls, name, class_or_path):
            cls.registry[name] = class_or_path

        @classmethod
        def is_registered(cls, name):
            return name in cls.registry

        @classmethod
        def create_backend(cls, name, llm_config):
            module, _, attr = cls.registry[name].partition(":")
            return getattr(importlib.import_module(module), attr)(llm_config)

    base.BaseConnectorBackend = BaseConnectorBackend
    factory_mod.KVConnectorBackendFactory = KVConnectorBackendFactory
    ray_serve._backend_class.cache_clear()
    yield KVConnectorBackendFactory
    ray_serve._backend_class.cache_clear()


def _llm_config(rank: int, extra: dict, **experimental):
    return types.SimpleNamespace(replica_rank=rank, num_devices=2, experimental_configs=experimental,
                                 engine_kwargs={"kv_transfer_config": {"kv_connector": "DCP2DConnector",
                                                                       "kv_role": "kv_producer",
                                                                       "kv_connector_extra_config": extra}})


def test_the_backend_sets_each_replicas_ports_and_address(fake_ray):
    ray_serve.register()
    ray_serve.register()  # twice is harmless
    assert fake_ray.registry == {"DCP2DConnector": "vllm_dcp2d.ray_serve:DCP2DConnectorBackend"}
    configs = [_llm_config(rank, {"stats_file": "/tmp/s.jsonl"}, DCP2D_PORT_BASE=30000) for rank in (0, 1, 2)]
    for c in configs:
        fake_ray.create_backend("DCP2DConnector", c).setup()
    kv = [c.engine_kwargs["kv_transfer_config"] for c in configs]
    # offset = replica rank x 2 devices; 2 ports per offset
    assert [k["kv_connector_extra_config"]["bootstrap_port"] for k in kv] == [30000, 30004, 30008]
    assert all(k["kv_connector_extra_config"]["local_hostname"] == "10.1.2.3" for k in kv)
    assert all(k["kv_connector_extra_config"]["stats_file"] == "/tmp/s.jsonl" for k in kv)
    assert [k["engine_id"] for k in kv] == [f"suffix-10.1.2.3-{p}" for p in (30000, 30004, 30008)]


def test_without_ray_the_error_says_so(monkeypatch):
    for name in ray_serve._RAY_MODULES[0] + ray_serve._RAY_MODULES[1]:
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    with pytest.raises(ImportError, match=r"connector backends were not found \(is ray\[llm\] installed\?\)"):
        ray_serve.register()
