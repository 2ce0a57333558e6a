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
  the board, with no collective per step. Whether every rank of the groups maps the same board (and
  whether any serves a cached layer) is surveyed once, collectively (:mod:`..agreement`);
* otherwise (ranks on several hosts, or started outside the server's process tree) the ranks agree at
  each step, as SGLang agrees on a failed multimodal input: a MAX all-reduce of one flag on the group's
  CPU (gloo) group, and on a failure every rank raises, naming the rank, layer and pages. A rank
  without a cached layer (its host's daemon holds the layers resident) agrees too: its tokens carry
  the other ranks' rows.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

from ... import errors
from .. import agreement
from ..install import Plugin
from . import longcat, prefetch, prompt_hints, qwen4exp

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


def check(tables: Any, groups: Sequence[Any] = (), rank: int = 0, cached: bool = True) -> None:
    """Raise the first fetch failure of this process since the last check, or on every rank of
    ``groups`` (torch.distributed CPU groups, in order) the first of any of their ranks (``cached``:
    whether this rank serves a cached layer; see :func:`.agreement.survey`)."""
    local: errors.EngramStoreError | None = None
    try:
        tables.check_fetches()
    except errors.EngramStoreError as exc:
        local = exc
    if not groups:  # one rank: its own jobs are all there is (the board holds nothing else)
        if local is not None:
            raise local
        return
    mode = batch_mode(groups, tables.failure_board, cached)
    if mode is agreement.Mode.BOARD:
        if local is not None:
            raise local
        failure = tables.failure_board.failure() if tables.failure_board is not None else None
        if failure is not None:  # another rank's, written before its rows left it
            raise failure.error()
        return
    if mode is agreement.Mode.AGREE:
        agreement.agree(local, groups, rank, label="TP rank")
    elif local is not None:
        raise local


_modes: dict[tuple, agreement.Mode] = {}


def batch_mode(groups: Sequence[Any], board: Any, cached: bool) -> agreement.Mode:
    """How the ranks of ``groups`` learn of each other's failures (surveyed once per groups, collectively)."""
    key = (tuple(groups), getattr(board, "path", None))
    if key not in _modes:
        _modes[key] = agreement.survey(tuple(groups), board, cached)
    return _modes[key]


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


def before_results(plugin: Plugin, original: Any, scheduler: Any, batch: Any, result: Any, *args: Any,
                   **kw: Any) -> Any:
    """AROUND ``Scheduler.process_batch_result``: a step's fetch failures raised once its tokens are on
    the host, before SGLang appends or streams them (a process without a cached layer: nothing)."""
    groups, rank = sglang_groups()
    cached = prefetch.has_cached() or longcat.has_cached() or qwen4exp.has_cached()
    if not cached and not groups:
        return original(scheduler, batch, result, *args, **kw)
    tables = plugin.tables()
    if batch_mode(groups, tables.failure_board, cached) is agreement.Mode.NONE:
        return original(scheduler, batch, result, *args, **kw)
    host_visible(result)
    check(tables, groups, rank, cached)
    out = original(scheduler, batch, result, *args, **kw)
    prompt_hints.after_results(plugin.tables, batch)  # its finished requests' hints withdrawn
    return out
