"""SGLang's Engram rows fetched a layer ahead: a side-stream chain per Engram layer, started as soon as
the step's hash ids exist, waited for at the layer.

SGLang 0.5.23 gathers each Engram layer's rows inline, at the layer, on the main stream. Here, right
after ``EngramHasher.forward`` returns the step's hash ids (inside the decode CUDA graph too), one
chain per Engram layer of this process is enqueued on a side stream (one per device, layers in
order), and ``EngramEmbedding.forward`` at the layer waits for its chain's event and returns the rows:

* a resident layer: SGLang's own ``engram_gather`` over the arena, as its shared host table does;
* a cached layer (its rows not all in DRAM): the step's ids copied device-to-host into its fetch job
  (registered memory), the job's run function as a CUDA host function, then ``engram_gather`` over
  the job's staging with positional ids (row ``i`` of the staging is id ``i``), in pieces of at
  most :data:`PIECE_TOKENS` tokens.

Every TP rank of SGLang's shared layout gathers every head, so the ranks send identical requests:
the daemon reads each page once for all of them (its reads in flight are shared).

A forward whose ids are not the ones hashed ahead (prefill with context parallelism, which slices
them; a breakable-graph extend, which copies them) gathers inline, cached layers through the same
chain. Scheduler staging (``EngramRowStager``, which reads host tables on the CPU) is turned off
when a layer is cached. A fetch failure (a page that failed its checksum with no good copy: its rows
are zero) raises at the layer on the CPU, and on a GPU after ``ModelRunner.forward`` (the step's
host-visible point), which stops SGLang's scheduler.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from ...client.fetch import FetchJob
from . import hooks

log = logging.getLogger(__name__)

PIECE_TOKENS = 4096  # tokens a cached layer's staging holds (x its heads); larger steps go in pieces

_lock = threading.Lock()
_embeddings: list[Any] = []  # every Engram layer's EngramEmbedding of this process, in layer order
_streams: dict[str, Any] = {}  # device -> the side stream of the chains
_staging_off_logged = False


@dataclass
class Cached:
    """A cached layer's fetch job and the tensors its chain uses."""

    job: FetchJob
    ids: Any  # torch int64 [max_rows] over the job's staging
    weight_ptr: int
    scale_ptr: int
    tokens: int  # tokens one piece holds
    positions: dict  # device -> int64 [tokens * heads] positional ids


def register(embedding: Any, index: int, cached: Cached | None) -> None:
    """Take part in the prefetch: ``index`` is the layer's column in the hasher's ids."""
    embedding._engram_store_index = index
    embedding._engram_store_cached = cached
    embedding._engram_store_ahead = None
    with _lock:
        _embeddings.append(embedding)
        _embeddings.sort(key=lambda e: e._engram_store_index)


def _key(indices: Any) -> tuple:
    return indices.data_ptr(), tuple(indices.shape), tuple(indices.stride()), str(indices.device)


def _gather(engram: Any, w_ptr: int, s_ptr: int, ids: Any, out: Any, dim: int, sort_ids: bool) -> None:
    engram.engram_gather(w_ptr, s_ptr, ids, out, dim, int(engram.FP8_BLOCK_SIZE), sort_ids=sort_ids)


def chain(embedding: Any, indices: Any, out: Any) -> None:
    """The layer's rows of ``indices`` ([T, heads] hash ids) into ``out`` ([T, heads, dim] bf16), on the
    current stream: SGLang's gather over the arena, or a cached layer's fetch then gather."""
    import torch

    from .host_table import _engram

    engram = _engram()
    dim = embedding.dim
    cached: Cached | None = getattr(embedding, "_engram_store_cached", None)
    if indices.shape[0] == 0:
        return
    if cached is None:
        w_ptr, s_ptr = embedding._table_ptrs()
        _gather(engram, w_ptr, s_ptr, indices.reshape(-1), out.view(-1, dim), dim, embedding._sort_host_reads)
        return
    heads = indices.shape[1]
    flat_out = out.view(-1, dim)
    for start in range(0, indices.shape[0], cached.tokens):
        piece = indices[start: start + cached.tokens]
        rows = piece.shape[0] * heads
        cached.ids[:rows].view(piece.shape[0], heads).copy_(piece, non_blocking=piece.is_cuda)
        if piece.is_cuda:
            cached.job.launch_host(torch.cuda.current_stream(piece.device).cuda_stream, rows)
        else:
            cached.job.run(rows)
        _gather(engram, cached.weight_ptr, cached.scale_ptr, _positions(cached, piece.device)[:rows],
                flat_out[start * heads: start * heads + rows], dim, False)


def _positions(cached: Cached, device: Any) -> Any:
    import torch

    pos = cached.positions.get(str(device))
    if pos is None:
        pos = cached.positions[str(device)] = torch.arange(cached.job.max_rows, dtype=torch.int64, device=device)
    return pos


def _stream(device: Any) -> Any:
    import torch

    stream = _streams.get(str(device))
    if stream is None:
        stream = _streams[str(device)] = torch.cuda.Stream(device)
    return stream


def start(embedding: Any, indices: Any) -> None:
    """Enqueue the layer's chain for ``indices`` ahead of the layer (a side stream on a GPU)."""
    import torch

    out = embedding.new_rows(indices)
    event = None
    if indices.is_cuda:
        current, stream = torch.cuda.current_stream(indices.device), _stream(indices.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            chain(embedding, indices, out)
            event = torch.cuda.Event()
            event.record(stream)
        indices.record_stream(stream)  # the ids and rows stay allocated until the chain is done with them
        out.record_stream(stream)
    else:
        chain(embedding, indices, out)
    embedding._engram_store_ahead = (_key(indices), out, event)


def after_hasher(hash_ids: Any, hasher: Any, input_ids: Any, forward_batch: Any = None, *args: Any, **kw: Any) -> None:
    """AFTER ``EngramHasher.forward``: start every layer's chain for the step's hash ids
    (``[T, n_engram_layers, heads]``); a batch the scheduler staged needs none."""
    if forward_batch is not None and getattr(forward_batch, "engram_staged_rows", None) is not None:
        return None
    with _lock:
        embeddings = list(_embeddings)
    for embedding in embeddings:
        start(embedding, hash_ids[:, embedding._engram_store_index])
    return None


def forward(original: Any, self: Any, indices: Any, forward_batch: Any = None, *args: Any, **kw: Any) -> Any:
    """AROUND ``EngramEmbedding.forward``: the rows fetched ahead for these ids, else the chain inline
    (a cached layer) or SGLang's own forward (a resident one)."""
    import torch

    if not hasattr(self, "_engram_store_index"):
        return original(self, indices, forward_batch, *args, **kw)
    ahead, self._engram_store_ahead = self._engram_store_ahead, None
    if ahead is not None and ahead[0] == _key(indices):
        _, out, event = ahead
        if event is not None:
            torch.cuda.current_stream(indices.device).wait_event(event)
    elif self._engram_store_cached is not None:
        out = self.new_rows(indices)
        chain(self, indices, out)
    else:
        return original(self, indices, forward_batch, *args, **kw)
    if not indices.is_cuda:  # the fetch is done: its failure is this step's
        hooks.tables().check_fetches()
    return out


def stager_from_model(original: Any, cls: Any, model: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``EngramRowStager.from_model``: no scheduler staging when a layer is cached (it gathers
    host tables on the CPU; a cached layer's rows are fetched by its chain)."""
    global _staging_off_logged
    if any(getattr(m, "_engram_store_cached", None) is not None for m in model.modules()):
        if not _staging_off_logged:
            _staging_off_logged = True
            log.warning("SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING is off for this model: an Engram layer is cached by "
                        "engram-store, and every layer's rows are fetched a layer ahead on a side stream instead")
        return None
    return original(cls, model, *args, **kw)


def after_step(result: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``ModelRunner.forward``: raise a fetch failure of this or an earlier step (on a GPU the
    host functions of the steps in flight may still run: their failures surface at a later step)."""
    from ..tables import _shared

    if _shared.cache_info().currsize:
        hooks.tables().check_fetches()
    return None
