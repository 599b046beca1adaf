"""Bench-only shim for vLLM's built-in MooncakeConnector on a CPU host (``bench/pd_serving.py``).

vLLM 0.32's ``MooncakeConnectorWorker.__init__`` calls
``torch.accelerator.current_device_index()``, which raises on a host without
an accelerator, so the built-in connector cannot start on CPU. Python imports
this module at start-up in the processes the bench launches for that case only
(their ``PYTHONPATH`` lists this folder); it answers device 0 there instead of
raising. The plugin never loads it.
"""

import torch

_current_device_index = torch.accelerator.current_device_index


def _cpu_device_index() -> int:
    try:
        return _current_device_index()
    except RuntimeError:  # no accelerator: the CPU platform has a single device, 0
        return 0


torch.accelerator.current_device_index = _cpu_device_index
