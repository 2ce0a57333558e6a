"""Ranks that share a batch agree on a step's fetch failures before any of its tokens or KV leave them.

An engine's ranks (TP, CP, PP) each fetch their own part of a cached layer, and what one rank read
reaches the others through the model's collectives; but only some ranks hand tokens or KV out (vLLM's
output rank and every rank's KV connector; SGLang's first TP rank; under vLLM's ``external_launcher``
every rank). So a failure seen on any rank must stop every rank of the batch at the same point:

* ranks that map one failure board (:mod:`.failures`: the ranks of one server on one host) read it:
  a fetch job writes its failure there before its rows are used, so before they reach another rank;
* ranks that do not (other hosts, Ray workers, ``external_launcher``, pods with private ``/dev/shm``)
  agree at each step: a MAX all-reduce of one flag over the groups' CPU (gloo) groups, in order, and
  on a failure every rank raises, naming the rank, layer and pages that failed.

Which of the two applies is surveyed once, collectively (:func:`survey`): every rank tells its host,
its board's device and inode, and whether it serves a cached layer (ranks of several hosts may be served
by daemons that place layers differently; a rank with no cached layer still agrees, as its tokens and
KV carry the others' rows).

Every rank of the groups must call :func:`survey` and then :func:`agree` at the same points of the
same steps (the engine plugins call them where every rank runs: vLLM's ``sample_tokens`` and KV
connector ``wait_for_save``, SGLang's ``process_batch_result``); each call is a collective.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
from typing import Any, Sequence

from .. import errors

log = logging.getLogger(__name__)


class Mode(enum.Enum):
    """How this rank's batch learns of its ranks' fetch failures."""

    NONE = "no rank serves a cached layer: nothing to agree on"
    BOARD = "read from the failure board every rank of the batch maps"
    AGREE = "agreed at each step (the ranks do not share a failure board)"


def survey(groups: Sequence[Any], board: Any, cached: bool) -> Mode:
    """The mode of ``groups`` (torch.distributed CPU groups, in order), agreed collectively: call it on
    every rank of them, once. ``board``: this rank's :class:`~.failures.Board` (or None); ``cached``:
    whether this rank serves a cached layer."""
    if not groups:
        return Mode.BOARD if cached else Mode.NONE
    import torch.distributed as dist

    identity = None
    if board is not None:
        st = os.stat(board.path)
        identity = (socket.gethostname(), st.st_dev, st.st_ino)
    mine = (identity, bool(cached))
    seen = [mine]
    for group in groups:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, seen, group=group)
        seen = [entry for part in gathered for entry in part]
    if not any(c for _, c in seen):
        mode = Mode.NONE
    elif identity is not None and all(i == identity for i, _ in seen):
        mode = Mode.BOARD
    else:
        mode = Mode.AGREE
    log.info("engram-store: fetch failures of the %d ranks sharing this rank's batches are %s", len(seen), mode.value)
    return mode


def agree(local: errors.EngramStoreError | None, groups: Sequence[Any], rank: int, label: str = "rank") -> None:
    """Raise on every rank of ``groups`` when any of them had a failure (``local``: this rank's, or
    None): this rank's own, or one naming the first failing rank (``label`` ``rank``). Collective."""
    if not groups:
        if local is not None:
            raise local
        return
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(local is not None)], dtype=torch.int32)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    reports = [_report(rank, local)] if local is not None else []
    for group in groups:  # a failure is rare: every rank learns what failed where
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, reports, group=group)
        reports = sorted({report for part in gathered for report in part})
    if local is not None:
        try:
            raise local
        finally:  # the raising frame must not hold its own exception (a cycle pinning the groups)
            local = None
    first_rank, kind, message, layer, pages = reports[0]
    text = f"{label} {first_rank}: {message} (this rank's rows were exact; the step's tokens and KV are not)"
    if kind == "corrupt":
        raise errors.CorruptRows(text, layer, pages)
    raise errors.StorageError(text)


def _report(rank: int, exc: errors.EngramStoreError) -> tuple:
    if isinstance(exc, errors.CorruptRows):
        return rank, "corrupt", str(exc), exc.layer, tuple(exc.pages)
    return rank, "error", str(exc), -1, ()
