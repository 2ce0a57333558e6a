"""LongCat-Flash-Lite's n-gram embedding tables, as the engine plugins see them.

The checkpoint holds ``K * (N - 1)`` tables, ``[model.]ngram_embeddings.embedders.{e}.weight`` (BF16,
``m + 2e + 1`` rows of ``hidden_size // (K * (N - 1))`` values); vLLM 0.33 concatenates them in ``e``
order into one ``VocabParallelEmbedding`` (``NgramEmbedding.oe_embedder``), the daemon's layer 0. Those
are the rows the daemon serves, never read from the checkpoint (the projections ``post_projs`` are
the engine's as usual).

vLLM describes the table by its model config (``vocab_size``, ``ngram_vocab_size_ratio``,
``emb_neighbor_num``, ``emb_split_num``, ``hidden_size``, the config dtype); the plugin gathers what
``NgramEmbedding`` builds from it into an :class:`NgramLayout`, which :meth:`LongcatNgram.check_layout`
compares with the daemon's tables: family, row format, table sizes, rows, row width.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ModelMismatch

TABLE_TENSOR = re.compile(r"(?:^|\.)ngram_embeddings\.embedders\.\d+\.weight$")
LAYER = 0  # the daemon's one layer: the concatenated table, read before decoder layer 0


@dataclass(frozen=True)
class NgramLayout:
    """The n-gram table as the engine builds it (from its model config)."""

    vocab: int  # vocab_size: the hash's base
    sizes: tuple[int, ...]  # rows of each table e (vLLM's ``_sizes``), in row order
    dim: int  # values per row (oe_dim)
    payload_dtype: str  # the table's dtype ("bfloat16", or another the engine would use)


class LongcatNgram:
    """The :class:`~engram_store.integrations.models.ModelAdapter` of LongCat-Flash's n-gram tables."""

    name = "LongCat-Flash n-gram"
    scale_block = 0  # BF16 rows: no block scales

    def is_table_tensor(self, name: str) -> bool:
        return TABLE_TENSOR.search(name) is not None

    def check_layout(self, tables: Any, layout: NgramLayout, scale_block: int, source: str) -> None:
        spec = tables.spec

        def mismatch(field: str, engine: Any, daemon: Any) -> ModelMismatch:
            return ModelMismatch(f"LongCat {field}: {source} gives {engine}; the engram-store daemon at "
                                 f"{tables.address} serves {daemon} (tables of spec {spec.name!r}): point "
                                 "ENGRAM_STORE_ADDR at a daemon serving this model's n-gram tables, or import them")

        if spec.hash_rule != "poly_mod":
            raise mismatch("model family", "LongCat-Flash's n-gram tables", "tables of another family")
        if layout.payload_dtype != spec.row_format.payload_dtype:
            raise mismatch("table dtype", layout.payload_dtype, spec.row_format.payload_dtype)
        if layout.vocab != spec.compressed_vocab:
            raise mismatch("vocab_size", layout.vocab, spec.compressed_vocab)
        tables.check_model(layer_ids=(LAYER,), rows=(sum(layout.sizes),), head_sizes=(layout.sizes,), dim=layout.dim,
                           scale_block=scale_block, source=source)


LONGCAT = LongcatNgram()
