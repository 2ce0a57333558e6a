"""The vLLM ranks that share this rank's batches, and how they learn of each other's fetch failures.

The ranks of one vLLM engine (one DP rank) that compute one batch are its TP, PCP and PP groups; their
CPU (gloo) groups, which vLLM makes on every launch (multiproc on one or several nodes, Ray,
``external_launcher``), carry the agreement of :mod:`..agreement`. Which mode applies is surveyed once,
at the first step point every rank runs (:func:`mode`): ranks of one server on one host map one
failure board; others agree at each step.

``cached`` layers are noted here by :mod:`.cached` as the model is built (:func:`serve_cached`), before
any step.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import agreement, failures

GROUPS = ("get_tp_group", "get_pcp_group", "get_pp_group")  # vllm.distributed.parallel_state, in this order

_lock = threading.Lock()
_cached_layers: set[int] = set()
_mode: agreement.Mode | None = None


def serve_cached(layer: int) -> None:
    """Note that this process serves cached ``layer`` (its fetch job runs every step)."""
    with _lock:
        _cached_layers.add(layer)


def has_cached() -> bool:
    return bool(_cached_layers)


def batch_groups() -> tuple[tuple[Any, ...], int]:
    """The CPU groups of the ranks sharing this rank's batches (those of more than one rank), and this
    rank's global rank."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    groups = []
    for name in GROUPS:
        getter = getattr(parallel_state, name, None)  # vLLM 0.32 and 0.33 both have all three
        coordinator = getter() if getter is not None else None
        if coordinator is not None and coordinator.world_size > 1:
            groups.append(coordinator.cpu_group)
    return tuple(groups), (dist.get_rank() if dist.is_initialized() else 0)


def mode() -> agreement.Mode:
    """This engine's mode, surveyed on first use (collectively: every rank calls it at the same point)."""
    global _mode
    if _mode is None:
        groups, _ = batch_groups()
        _mode = agreement.survey(groups, failures.board(), has_cached())
    return _mode


def known() -> agreement.Mode | None:
    """The mode if surveyed already (never a collective: safe inside a forward)."""
    return _mode


def reset() -> None:
    """A new engine in this process: its layers and mode are its own."""
    global _mode
    with _lock:
        _cached_layers.clear()
        _mode = None
