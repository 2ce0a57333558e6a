"""One step's rows of an Engram layer, issued on the lanes of :mod:`.lanes`: SGLang's gather over the
arena (a resident layer), or a cached layer's fetch jobs filling their stagings, then SGLang's gather
reading them with positional ids (row ``i`` of a staging is the ``i``-th id copied into it).

A cached layer has two fetch jobs (:class:`Staging`), each holding :data:`PIECE_TOKENS` tokens of
every head. A step goes in pieces of as many tokens as a staging holds, alternating between the two:
piece ``k + 1`` is fetched into one staging while piece ``k`` is gathered from the other, and a
staging is refilled only after the gather that read it. A chain's first fetch waits for every
gather issued before it (the chain of another step, or of the same step started at hash time), so
a staging is never refilled while an earlier chain still reads it.

Where every TP rank holds the same tokens (no attention DP, no context parallelism) a rank fetches
only its own hash columns (``columns``, SGLang's ``shard_range`` split of the layer's 24 heads): its
gather writes zeros for the other columns, and SGLang's ``_reduce_owned_rows`` (the all-reduce of its
``per_rank`` layout) adds the ranks' rows up, exactly one rank holding each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ...fetch.job import FetchJob
from .lanes import Lanes

PIECE_TOKENS = 4096  # tokens of every head one staging holds (a rank fetching fewer heads: more tokens)


@dataclass
class Staging:
    """A cached layer's fetch job and where SGLang's kernels read its staging."""

    job: FetchJob
    ids: Any  # torch int64 [max_rows] over the job's staging
    weight_ptr: int
    scale_ptr: int


@dataclass
class Cached:
    """A cached layer of this process: its two stagings and the hash columns this rank fetches."""

    stagings: tuple[Staging, Staging]
    heads: int  # hash columns of the layer (24 for V4.1)
    columns: tuple[int, int]  # [first, end) fetched here; the others come from the other ranks
    positions: dict = field(default_factory=dict)  # device -> int64 [piece_tokens, heads]

    @property
    def split(self) -> bool:
        """Whether this rank fetches part of the columns (its rows are summed with the others')."""
        return self.columns != (0, self.heads)

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    @property
    def piece_tokens(self) -> int:
        return self.stagings[0].job.max_rows // self.width

    @property
    def jobs(self) -> tuple[FetchJob, ...]:
        return tuple(s.job for s in self.stagings)


def columns(heads: int, tp_size: int, tp_rank: int, same_tokens: bool) -> tuple[int, int]:
    """The hash columns a TP rank fetches: its equal share when every rank holds the same tokens and
    the ranks divide the columns (SGLang's ``shard_range`` on column bounds), else all of them."""
    if tp_size <= 1 or not same_tokens or heads % tp_size:
        return 0, heads
    share = heads // tp_size
    return tp_rank * share, (tp_rank + 1) * share


def positions(cached: Cached, device: Any) -> Any:
    """``[piece_tokens, heads]`` int64: the staging row of each (token, column) of a piece, -1 (read as
    zeros by SGLang's gather) for the columns another rank fetches. Made once per device."""
    pos = cached.positions.get(str(device))
    if pos is None:
        import torch

        first, end = cached.columns
        column = torch.arange(cached.heads, dtype=torch.int64, device=device)
        row = torch.arange(cached.piece_tokens, dtype=torch.int64, device=device)[:, None] * cached.width
        pos = torch.where((column >= first) & (column < end), row + (column - first), -1).contiguous()
        cached.positions[str(device)] = pos
    return pos


def issue(engram: Any, cached: Cached, indices: Any, out: Any, lanes: Lanes) -> Any:
    """Issue a cached layer's rows of ``indices`` ([T, heads] hash ids) into ``out`` ([T, heads, dim]
    bf16, zeros in the columns another rank fetches); returns the marker of the last gather."""
    dim = out.shape[-1]
    first, end = cached.columns
    per = cached.piece_tokens
    pos = positions(cached, indices.device)
    start = lanes.main.record()  # the ids and out exist
    lanes.fetch.wait(start)
    lanes.gather.wait(start)
    lanes.fetch.wait(lanes.gather.record())  # every gather issued before (other chains) has read its staging
    last: list[Any] = [None, None]  # per staging: this chain's last gather reading it
    done = None
    for k, at in enumerate(range(0, indices.shape[0], per)):
        staging = cached.stagings[k % 2]
        piece = indices[at: at + per, first:end]
        n = piece.shape[0]
        lanes.fetch.wait(last[k % 2])  # piece k - 2's gather is done with this staging
        lanes.fetch.run(partial(_copy_ids, staging.ids, piece, n * cached.width))
        lanes.fetch.fetch(staging.job, n * cached.width)
        lanes.gather.wait(lanes.fetch.record())
        lanes.gather.run(partial(gather, engram, staging.weight_ptr, staging.scale_ptr, pos[:n], out[at: at + n],
                                 dim, False))
        done = last[k % 2] = lanes.gather.record()
    lanes.fetch.keep(indices)
    lanes.gather.keep(out)
    return done


def issue_resident(engram: Any, embedding: Any, indices: Any, out: Any, lanes: Lanes) -> Any:
    """Issue a resident layer's rows of ``indices`` into ``out``: SGLang's gather over the arena, as
    its shared host table does; returns its marker."""
    lanes.gather.wait(lanes.main.record())
    w_ptr, s_ptr = embedding._table_ptrs()
    lanes.gather.run(partial(gather, engram, w_ptr, s_ptr, indices, out, out.shape[-1],
                             bool(embedding._sort_host_reads)))
    lanes.gather.keep(indices)
    lanes.gather.keep(out)
    return lanes.gather.record()


def _copy_ids(ids: Any, piece: Any, rows: int) -> None:
    ids[:rows].view(piece.shape).copy_(piece, non_blocking=piece.is_cuda)


def gather(engram: Any, w_ptr: int, s_ptr: int, ids: Any, out: Any, dim: int, sort_ids: bool) -> None:
    """SGLang's ``engram_gather`` of rows ``ids`` (any shape) into ``out`` (``[*ids.shape, dim]``)."""
    engram.engram_gather(w_ptr, s_ptr, ids.reshape(-1), out.view(-1, dim), dim, int(engram.FP8_BLOCK_SIZE),
                         sort_ids=sort_ids)
