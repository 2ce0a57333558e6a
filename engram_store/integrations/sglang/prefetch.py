"""SGLang's Engram rows fetched a layer ahead: every Engram layer's chain (:mod:`.chain`) is issued on
the side lanes (:mod:`.lanes`) as soon as the step's hash ids exist, and waited for at the layer.

SGLang 0.5.23 gathers each Engram layer's rows inline, at the layer, on the main stream. With the
plugin, right after ``EngramHasher.forward`` returns the step's hash ids (inside the decode CUDA graph
too), each Engram layer's chain is issued: SGLang's ``engram_gather`` over the arena (a resident
layer), or a cached layer's fetch jobs then ``engram_gather`` over their stagings, double-buffered
in pieces. ``EngramEmbedding.forward`` at the layer makes the main stream wait for the chain's last
gather and returns its rows.

A forward whose ids are not the ones hashed ahead (a rank's slice of a context-parallel prefill,
the static ids of a breakable-CUDA-graph extend) runs its chain there, a cached layer's on the same
side lanes after every chain issued before (so it never refills a staging an earlier chain still
reads) and the main stream waits for it; a resident layer's is SGLang's own forward. No chain is
issued at hash time for those steps. Scheduler staging (``EngramRowStager``, which reads host
tables on the CPU) is turned off when a layer is cached.

Where a cached layer's rank fetches only its hash columns (:func:`.chain.columns`), the layer's rows
are SGLang's ``_reduce_owned_rows`` of the ranks' rows, the all-reduce of its ``per_rank`` layout. A
fetch failure is raised before the step's tokens leave the scheduler (:mod:`.failures`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from . import chain, lanes
from .modules import engram

log = logging.getLogger(__name__)

_lock = threading.Lock()
_embeddings: list[Any] = []  # every Engram layer's EngramEmbedding of this process, in layer order
_staging_off_logged = False


@dataclass
class Ahead:
    """A layer's chain issued at hash time: for which ids, into which rows, done at which marker."""

    key: tuple
    out: Any
    done: Any


def register(embedding: Any, index: int, cached: chain.Cached | None) -> None:
    """Take part in the prefetch: ``index`` is the layer's column in the hasher's ids."""
    embedding._engram_store_index = index
    embedding._engram_store_cached = cached
    embedding._engram_store_ahead = None
    with _lock:
        _embeddings.append(embedding)
        _embeddings.sort(key=lambda e: e._engram_store_index)


def has_cached() -> bool:
    """Whether an Engram layer of this process is cached (its steps can fail)."""
    return any(e._engram_store_cached is not None for e in _embeddings)


def lanes_for(device: Any) -> lanes.Lanes:
    return lanes.for_device(device)


def _key(indices: Any) -> tuple:
    return indices.data_ptr(), tuple(indices.shape), tuple(indices.stride()), str(indices.device)


def _issue(embedding: Any, indices: Any, out: Any, on: lanes.Lanes) -> Any:
    cached = embedding._engram_store_cached
    if cached is None:
        return chain.issue_resident(engram(), embedding, indices, out, on)
    return chain.issue(engram(), cached, indices, out, on)


def start(embedding: Any, indices: Any) -> None:
    """Issue the layer's chain for ``indices`` ([T, heads] hash ids) ahead of the layer."""
    if indices.shape[0] == 0:
        embedding._engram_store_ahead = None
        return
    out = embedding.new_rows(indices)
    embedding._engram_store_ahead = Ahead(_key(indices), out, _issue(embedding, indices, out, lanes_for(indices.device)))


def _ahead_of_layers(forward_batch: Any) -> bool:
    """Whether the layers will take the hasher's ids as they are: not when the scheduler staged the
    rows, for a context-parallel extend (each rank takes its slice) or a breakable-graph extend (the
    graph copies the ids into its own buffer and gathers there)."""
    if forward_batch is None:
        return True
    if getattr(forward_batch, "engram_staged_rows", None) is not None:
        return False
    mode = forward_batch.forward_mode
    if mode.is_extend():
        from sglang.srt.layers.cp.utils import is_cp_active
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            is_in_breakable_cuda_graph)

        return not (is_in_breakable_cuda_graph() or is_cp_active(forward_batch))
    return True


def after_hasher(hash_ids: Any, hasher: Any, input_ids: Any, forward_batch: Any = None, *args: Any, **kw: Any) -> None:
    """AFTER ``EngramHasher.forward``: issue every layer's chain for the step's hash ids
    (``[T, n_engram_layers, heads]``)."""
    if not _ahead_of_layers(forward_batch):
        return None
    with _lock:
        embeddings = list(_embeddings)
    for embedding in embeddings:
        start(embedding, hash_ids[:, embedding._engram_store_index])
    return None


def forward(original: Any, self: Any, indices: Any, forward_batch: Any = None, *args: Any, **kw: Any) -> Any:
    """AROUND ``EngramEmbedding.forward``: the rows issued ahead for these ids, else a cached layer's
    chain now (on the side lanes, after every chain issued before), else SGLang's own forward."""
    if not hasattr(self, "_engram_store_index"):
        return original(self, indices, forward_batch, *args, **kw)
    ahead, self._engram_store_ahead = self._engram_store_ahead, None
    cached: chain.Cached | None = self._engram_store_cached
    on = lanes_for(indices.device)
    if ahead is not None and ahead.key == _key(indices):
        out, done = ahead.out, ahead.done
    elif cached is not None and indices.shape[0]:
        out = self.new_rows(indices)
        done = _issue(self, indices, out, on)
    elif cached is not None:
        return self.new_rows(indices)
    else:
        return original(self, indices, forward_batch, *args, **kw)
    on.main.wait(done)
    if cached is not None and cached.split:
        out = self._reduce_owned_rows(out)  # SGLang's per_rank all-reduce: each row comes from one rank
    return out


def stager_from_model(original: Any, cls: Any, model: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``EngramRowStager.from_model``: no scheduler staging when a layer is cached (it gathers
    host tables on the CPU; a cached layer's rows are fetched by its chain)."""
    global _staging_off_logged
    if any(getattr(m, "_engram_store_cached", None) is not None for m in model.modules()):
        if not _staging_off_logged:
            _staging_off_logged = True
            log.warning("SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING is off for this model: an Engram layer is cached by "
                        "engram-store, and every layer's rows are fetched a layer ahead on side streams instead")
        return None
    return original(cls, model, *args, **kw)
