"""The suite's sweep of ``/dev/shm`` at start (the root ``conftest.py``): what earlier runs'
engines left. ``vllm_dcp2d/local/shm.py`` removes what this run's servers leave, file by
file as each stops; this removes the rest."""

from __future__ import annotations

from vllm_dcp2d.attention.shm_gather import PREFIX
from vllm_dcp2d.local.shm import SHM, remove_unheld

__all__ = ["remove_stale_vllm_shm"]


def remove_stale_vllm_shm() -> int:
    """Unlink every vLLM CPU-communicator file (``vllm_dist_*-cpushm*``) and every segment
    of the plugin's DCP all-gather (``attention/shm_gather.py``, ``vllm_dcp2d_gather-*``)
    that no process holds; returns how many.

    vLLM's names carry a fresh uuid per engine, so an unheld one can never be opened
    again: it is garbage from an engine that stopped earlier (this suite's or not). The
    plugin unlinks its segment once the group is set up; one is left only by a rank 0
    killed during set-up, and its ranks hold it until they exit."""
    return remove_unheld(set(SHM.glob("vllm_dist_*-cpushm*")) | set(SHM.glob(f"{PREFIX}*")))
