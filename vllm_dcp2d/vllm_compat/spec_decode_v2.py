"""Speculative decoding on a DCP instance: vLLM 0.34's Model Runner V2.

vLLM 0.34 removed the V1 model runner; every GPU instance (and the CPU runner,
which subclasses it) runs Model Runner V2. Two of the V1 patches
(``spec_decode.py``) became vLLM's own there, one is ported:

* The draft with DCP disabled over an unsharded pool (design §8) is upstream:
  ``speculative_config.draft_decode_context_parallel_size`` runs the draft at its
  own DCP size, and a draft at 1 keeps ``dcp_sharded=False`` caches
  (``v1/worker/gpu/model_runner.py``, ``get_kv_cache_spec``). vLLM defaults it to the
  target's DCP size; :func:`install_draft_dcp` sets it to 1 for a DCP2D instance
  with DCP > 1 whose user did not set it, and logs it. (Patch ``draft_dcp_size``.)
* The ranks' agreement on the accepted count is not upstream: V2's
  ``GPUModelRunner.sample`` returns each rank's own ``num_sampled``. A rank whose
  draft or logits differ would commit other tokens than its peers, and its next
  forward would feed other tokens into the DCP collectives (a wrong answer, or
  ranks waiting in different collectives). :func:`install_agreement` makes every
  rank keep the MIN over the TP group (which contains the DCP group) before vLLM
  commits, proposes or copies anything. (Patch ``agreed_acceptance``, 0.34.0.)

Both act only where ``instance.spec_patches_act`` says (DCP > 1, on CPU or on a DCP2D
instance); other engines keep vLLM's behaviour. Neither has run: no 0.34 engine
runs on this project's CPU machine (``tests/vllm_compat/test_vllm_sources.py`` checks them
against the 0.34.0 sources).
"""

from __future__ import annotations

import functools
import logging

from vllm_dcp2d.spec_decode.verify import agree_num_sampled

log = logging.getLogger(__name__)

__all__ = ["draft_dcp_for", "install_draft_dcp", "install_agreement"]

_SPEC_FLAGS = ("spec_method", "spec_model", "spec_tokens")  # 0.34's shorthands for --speculative-config


def _connector_name(kv_transfer_config) -> str | None:
    if isinstance(kv_transfer_config, dict):
        return kv_transfer_config.get("kv_connector")
    return getattr(kv_transfer_config, "kv_connector", None)


def draft_dcp_for(engine_args, target_parallel_config) -> None:
    """Set ``draft_decode_context_parallel_size`` to 1 in ``engine_args.speculative_config``
    (a dict, before vLLM builds its ``SpeculativeConfig``) for a DCP2D instance with
    DCP > 1, unless the user set it; logs what it did."""
    if target_parallel_config.decode_context_parallel_size <= 1:
        return
    from vllm_dcp2d.config import CONNECTOR_NAME

    if _connector_name(engine_args.kv_transfer_config) != CONNECTOR_NAME:
        return
    spec = engine_args.speculative_config
    if spec is None and any(getattr(engine_args, f, None) is not None for f in _SPEC_FLAGS):
        spec = engine_args.speculative_config = {}
    if spec is None:
        return
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    if spec.get("draft_decode_context_parallel_size") is None:
        spec["draft_decode_context_parallel_size"] = 1
        log.info("DCP2DConnector: the speculative draft runs unsharded over its own KV cache "
                 "(draft_decode_context_parallel_size=1, decode_context_parallel_size=%d); set "
                 "draft_decode_context_parallel_size in --speculative-config to choose otherwise",
                 target_parallel_config.decode_context_parallel_size)
    engine_args.speculative_config = spec


def _rebind(owner, name: str, make) -> None:
    """Replace ``owner.<name>`` with ``make(vLLM's function)``, marked as the plugin's
    (``_dcp2d``, ``_dcp2d_stock``: the registry's checks read vLLM's own); idempotent."""
    stock = getattr(owner, name)
    if getattr(stock, "_dcp2d", False):
        return
    fn = functools.wraps(stock)(make(stock))
    fn._dcp2d, fn._dcp2d_stock = True, stock
    setattr(owner, name, fn)


# ---- draft_dcp_size: EngineArgs.create_speculative_config (vLLM 0.34.0) ----

def install_draft_dcp(version: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(stock):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            draft_dcp_for(self, target_parallel_config)
            return stock(self, target_model_config, target_parallel_config)
        return create_speculative_config

    _rebind(EngineArgs, "create_speculative_config", make)


# ---- agreed_acceptance: GPUModelRunner.sample (Model Runner V2, vLLM 0.34.0) ----

def install_agreement(version: str) -> None:
    from vllm.distributed import get_tp_group
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_dcp2d.vllm_compat.instance import spec_patches_act as _active

    def make(stock):
        def sample(self, hidden_states, input_batch, grammar_output):
            out = stock(self, hidden_states, input_batch, grammar_output)
            if input_batch.num_draft_tokens > 0 and _active(self.vllm_config):
                _, num_sampled, num_rejected = out
                agree_num_sampled(num_sampled, num_rejected, get_tp_group())
            return out
        return sample

    _rebind(GPUModelRunner, "sample", make)
