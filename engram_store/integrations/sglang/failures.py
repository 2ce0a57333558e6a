"""A cached layer's fetch failure stops SGLang before any token of the failed step leaves the scheduler.

A fetch job that could not serve a row (a page that failed its crc32c check with no good copy; a
read that failed) leaves the row zero and records the failure; the step computes on. SGLang 0.5.23
makes a step's sampled tokens host-visible in ``Scheduler.process_batch_result`` (right after the
forward in the normal loop, one step later in the overlap loop): its result processors wait for
the tokens' copy (``result.copy_done.synchronize()``, or ``next_token_ids.tolist()``) and then append
them to the requests and stream them. The plugin's hook runs first: it waits for the same copy, by
then every host function of that step has run, and raises the failure (``CorruptRows`` naming layer,
rows and pages) before SGLang touches the tokens. The exception ends SGLang's scheduler process
("Scheduler hit an exception"), which stops the server.

Only the ranks that stream (TP rank 0 of each group sharing a batch) send tokens, but the rank whose
job failed may be another one (with per-rank heads, only the rank fetching a column reads it). Where a
step's tokens are shared by several ranks (the TP group; with attention DP, its attention TP and CP
groups):

* ranks of one server on one host share its failure board (``engram_store.integrations.failures``):
  every fetch job's run function writes its failure there before the step's rows are used, and the
  rows reach the streaming rank only through the model's collectives, after that; so the check reads
  the board, with no collective per step. Whether every rank of the groups maps the same board is
  agreed once (an all-gather of its host, device and inode at the first check);
* otherwise (ranks on several hosts, or started outside the server's process tree) the ranks agree at
  each step, as SGLang agrees on a failed multimodal input: a MAX all-reduce of one flag on the group's
  CPU (gloo) group, and on a failure every rank raises, naming the rank, layer and pages.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

from ... import errors

log = logging.getLogger(__name__)


def host_visible(result: Any) -> None:
    """Block until ``result``'s sampled tokens are on the host, as SGLang's result processing does next
    (``copy_done``; without one, the current stream, whose ``tolist()`` would wait the same)."""
    done = getattr(result, "copy_done", None)
    if done is not None:
        done.synchronize()
        return
    ids = getattr(result, "next_token_ids", None)
    if getattr(ids, "is_cuda", False):
        import torch

        torch.cuda.current_stream(ids.device).synchronize()


def check(tables: Any, groups: Sequence[Any] = (), rank: int = 0) -> None:
    """Raise the first fetch failure of this process since the last check, or on every rank of
    ``groups`` (torch.distributed CPU groups, in order) the first of any of their ranks."""
    local: errors.EngramStoreError | None = None
    try:
        tables.check_fetches()
    except errors.EngramStoreError as exc:
        local = exc
    if not groups:
        if local is not None:
            raise local
        return
    if tables.failure_board is not None and board_shared(tuple(groups), tables.failure_board):
        if local is not None:
            raise local
        failure = tables.failure_board.failure()  # another rank's, written before its rows left it
        if failure is not None:
            raise failure.error()
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
        raise local
    first_rank, kind, message, layer, pages = reports[0]
    text = f"TP rank {first_rank}: {message} (this rank's rows were exact; the step's tokens are not)"
    if kind == "corrupt":
        raise errors.CorruptRows(text, layer, pages)
    raise errors.StorageError(text)


_shared_boards: dict[tuple, bool] = {}


def board_shared(groups: tuple, board: Any) -> bool:
    """Whether every rank of ``groups`` maps ``board`` (agreed once per groups, collectively)."""
    key = (groups, board.path)
    if key not in _shared_boards:
        import os
        import socket

        import torch.distributed as dist

        st = os.stat(board.path)
        mine = (socket.gethostname(), st.st_dev, st.st_ino)
        same = True
        for group in groups:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            same &= all(g == mine for g in gathered)
        _shared_boards[key] = same
        log.info("engram-store: fetch failures of this server's ranks are %s", "read from their shared failure "
                 "board" if same else "agreed at each step (the ranks do not share a failure board)")
    return _shared_boards[key]


def _report(rank: int, exc: errors.EngramStoreError) -> tuple:
    if isinstance(exc, errors.CorruptRows):
        return rank, "corrupt", str(exc), exc.layer, tuple(exc.pages)
    return rank, "error", str(exc), -1, ()


@functools.cache
def sglang_groups() -> tuple[tuple[Any, ...], int]:
    """The CPU groups of ranks that share this rank's batches in SGLang, and this rank's TP rank."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.attn_dp_size > 1:
        sized = ((p.attn_tp_size, "attn_tp_group"), (p.attn_cp_size, "attn_cp_group"))
    else:
        sized = ((p.tp_size, "tp_group"),)
    groups = tuple(getattr(p, name).cpu_group for size, name in sized if size > 1)
    return groups, (int(p.tp_rank) if p.tp_size > 1 else 0)


def before_results(original: Any, scheduler: Any, batch: Any, result: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``Scheduler.process_batch_result``: a step's fetch failures raised once its tokens are on
    the host, before SGLang appends or streams them (a process without a cached layer: nothing)."""
    from . import hinting, hooks, prefetch

    if not prefetch.has_cached():
        return original(scheduler, batch, result, *args, **kw)
    host_visible(result)
    groups, rank = sglang_groups()
    check(hooks.tables(), groups, rank)
    out = original(scheduler, batch, result, *args, **kw)
    hinting.after_results(batch)  # its finished requests' hints withdrawn
    return out
