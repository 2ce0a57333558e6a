"""SGLang's Engram host tables over the daemon's arena: the hooks on ``sglang.srt.layers.engram``.

SGLang's shared host-table layout keeps each Engram layer whole in host memory on
every TP rank, registered with the GPU, and hands its kernels two addresses: the
``[rows, dim]`` FP8 payloads and the ``[rows, dim // 32]`` E8M0 scales. The
daemon's resident arena holds exactly these two blocks per layer
(``engram_store.format.arena_layout``), so here a resident layer's host table *is*
the arena: the layer's ``weight`` / ``scale`` parameters are read-only views of it,
and ``_host_table_ptrs`` are the (registered) addresses of its two blocks. SGLang's
gather kernel (issued a layer ahead by :mod:`.prefetch`), decode CUDA graphs and
scheduler staging (``EngramRowStager``, which ``index_select``\\ s rows out of
``weight`` / ``scale``) read it in place. No memfd is created, no ``/proc/<pid>/fd``
is opened (TP ranks need no shared PID namespace), nothing is loaded.

A cached layer's parameters are the staging of the first of its two fetch jobs
(:mod:`.chain`), which hold :data:`.chain.PIECE_TOKENS` tokens of every head each; the
hash columns the rank fetches are decided here, once (:func:`.chain.columns`).

``SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=per_rank`` is overridden (one log line):
a private shard per rank would be a copy, and the arena is one copy per host.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from ...errors import EngineUnsupported, ModelMismatch
from ..install import Plugin
from . import chain, prefetch, prompt_hints
from .modules import engram as _engram

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArenaHostTable:
    """Stands where SGLang keeps its ``_HostTable``: what SGLang reads of it (``layout``,
    ``dirty``, ``finish_load``, ``device_ptr``) and where the layer's rows are."""

    address: str
    layer: int
    rows: int
    device_ptr: int  # the payload block (SGLang's name); the scales block is scale_device_ptr
    scale_device_ptr: int
    nbytes: int  # payload and scale bytes of the layer (the blocks are not adjacent: no ``bytes`` tensor)
    huge_pages: str
    layout: str = "shared"
    dirty: bool = False  # nothing is ever loaded into it

    def finish_load(self, label: str) -> None:
        log.info("engram host table %s: the engram-store daemon's arena (layer %d, %d rows, huge pages: %s); "
                 "nothing loaded", label, self.layer, self.rows, self.huge_pages)


@functools.cache
def _warn_layout_overridden(layout: str) -> None:
    log.warning("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=%s is ignored while the engram-store plugin is active: every "
                "TP rank maps the daemon's whole table (the shared layout, one copy per host)", layout)


def check_layout(plugin: Plugin, layout: Any, cls: Any, config: Any) -> None:
    """AFTER ``EngramLayout.from_config``: the model config's Engram layout against the daemon's tables."""
    plugin.check_applied()
    if layout is None:  # a DeepSeek-V4 config without Engram layers: nothing to serve
        return
    plugin.model.check_layout(plugin.tables(), layout, int(_engram().FP8_BLOCK_SIZE),
                              source="SGLang's EngramLayout of the model config")


def before_embedding_init(plugin: Plugin, self, num_embeddings: int, dim: int, layer_id: int,
                          column_bounds: Any) -> None:
    """BEFORE ``EngramEmbedding.__init__``: refuse the settings that keep the table out of host memory."""
    plugin.check_applied()
    envs = _engram().envs
    if envs.SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS.get():
        raise EngineUnsupported("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS keeps the Engram tables in GPU memory, loaded "
                                "from the checkpoint; engram-store serves them from its host arena: unset it (or "
                                "unset ENGRAM_STORE_ADDR to run SGLang without engram-store)")
    if not envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.get():
        raise EngineUnsupported("engram-store serves Engram tables as SGLang's host table: set "
                                "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1 (without it SGLang loads them into GPU "
                                "memory from the checkpoint)")


def init_host_table(plugin: Plugin, self, num_embeddings: int, dim: int, layer_id: int) -> None:
    """REPLACE ``EngramEmbedding._init_host_table``: the layer's shared host table is the arena."""
    import torch
    from torch import nn

    plugin.check_applied()
    engram = _engram()
    layout = engram.envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get()
    if layout != "shared":
        _warn_layout_overridden(layout)
    block = int(engram.FP8_BLOCK_SIZE)
    t = plugin.tables()
    if layer_id not in t.layers:
        raise ModelMismatch(f"Engram layer {layer_id}: the engram-store daemon at {t.address} serves layers "
                            f"{t.layers} (tables of spec {t.spec.name!r})")
    if int(num_embeddings) != t.rows(layer_id) or int(dim) != t.spec.row_format.dim or block != plugin.model.scale_block:
        raise ModelMismatch(f"Engram layer {layer_id}: SGLang builds {num_embeddings} rows of {dim} values "
                            f"(scale block {block}), the engram-store daemon at {t.address} serves "
                            f"{t.rows(layer_id)} rows of {t.spec.row_format.dim} (scale block "
                            f"{t.spec.row_format.scale_block})")
    cached = None
    if t.is_resident(layer_id):
        weight, scales = t.views(layer_id)
    else:  # rows fetched per step into two fetch jobs' stagings, read with positional ids (chain.py)
        _check_stage(int(layer_id))
        heads = len(t.head_sizes(layer_id))
        stagings, weight, scales = _stagings(t, engram, int(layer_id), chain.PIECE_TOKENS * heads)
        cached = chain.Cached(stagings, heads, _columns(self, heads))
        prompt_hints.register(int(layer_id), slice(*cached.columns))
    scale = scales.view(torch.float8_e8m0fnu)
    if torch.cuda.is_available() and not (registration := t.register_cuda(int(layer_id))):
        raise EngineUnsupported(f"Engram layer {layer_id}: {registration.message}; SGLang's kernels cannot read it")
    w_ptr = int(engram._registered_device_ptr(weight.data_ptr()))  # the host address on CUDA (UVA); HIP maps it
    s_ptr = int(engram._registered_device_ptr(scale.data_ptr()))
    self.host_table = ArenaHostTable(t.address, int(layer_id), int(num_embeddings), w_ptr, s_ptr,
                                     weight.numel() + scale.numel(), t.huge_pages)
    self.weight = nn.Parameter(weight, requires_grad=False)
    self.scale = nn.Parameter(scale, requires_grad=False)
    self._host_table_ptrs = (w_ptr, s_ptr)
    if cached is None:
        self._sort_host_reads = engram._sorted_host_reads(torch.cuda.current_device())
        log.info("engram-store: Engram layer %d (%d rows) is the daemon's arena: weight %#x, scale %#x (zero copy)",
                 layer_id, num_embeddings, w_ptr, s_ptr)
    else:
        self._sort_host_reads = False  # positional ids: already in address order
        for staging in cached.stagings:
            staging.weight_ptr = int(engram._registered_device_ptr(staging.weight_ptr))
            staging.scale_ptr = int(engram._registered_device_ptr(staging.scale_ptr))
        first, end = cached.columns
        log.info("engram-store: Engram layer %d (%d rows) is cached: each step's rows of hash columns [%d, %d) of %d "
                 "are fetched a layer ahead by two fetch jobs, alternating in pieces of %d tokens (deadline %.1f s, "
                 "then direct page reads)%s", layer_id, num_embeddings, first, end, cached.heads, cached.piece_tokens,
                 cached.stagings[0].job.deadline,
                 "; the TP ranks' rows are summed by SGLang's per_rank all-reduce" if cached.split else "")
    prefetch.register(self, t.layers.index(int(layer_id)), cached)


def _stagings(t: Any, engram: Any, layer: int, max_rows: int) -> tuple[tuple[chain.Staging, chain.Staging], Any, Any]:
    """Two fetch jobs for cached ``layer`` and the first one's weight and scales (the layer's parameters)."""
    import torch

    stagings, first = [], None
    for _ in range(2):
        job = t.fetch_job(layer, max_rows)
        ids, weight, scales = t.job_tensors(job)
        stagings.append(chain.Staging(job, ids, weight.data_ptr(), scales.view(torch.float8_e8m0fnu).data_ptr()))
        if first is None:
            first = (weight, scales)
    return (stagings[0], stagings[1]), first[0], first[1]


def _check_stage(layer: int) -> None:
    """A cached layer's fetch failures are raised where its stage's tokens reach the host; only pipeline
    stage 0 streams them, so a cached layer on a later stage is refused."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.pp_size > 1 and p.pp_rank > 0:
        raise EngineUnsupported(f"Engram layer {layer} is cached by engram-store and sits on pipeline stage {p.pp_rank}; "
                                "SGLang streams a step's tokens from stage 0, which cannot see that stage's fetch "
                                "failures: use fewer pipeline stages, or give the layer DRAM on the daemon "
                                f'(placement = {{{layer} = "resident"}})')


def _columns(embedding: Any, heads: int) -> tuple[int, int]:
    """The hash columns this rank fetches: its share where every TP rank holds the same tokens (no
    attention DP, no context parallelism: SGLang's per_rank layout then sums the ranks' rows)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if embedding.tp_size <= 1:
        return 0, heads
    return chain.columns(heads, embedding.tp_size, int(p.tp_rank), p.attn_dp_size == 1 and p.attn_cp_size == 1)


def is_arena_table(embedding: Any) -> bool:
    return isinstance(getattr(embedding, "host_table", None), ArenaHostTable)


def load_rows(original, self, param, loaded_weight) -> None:
    """AROUND ``EngramEmbedding._load_rows``: an arena table is the daemon's, read-only; nothing
    is copied in (the checkpoint iterators skip these tensors already)."""
    if is_arena_table(self):
        return None
    return original(self, param, loaded_weight)
