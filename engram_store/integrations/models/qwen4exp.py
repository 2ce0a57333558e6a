"""Qwen4Exp's (Qwen3.8-Flash-Next) PLE n-gram table, as the engine plugins see it.

Each PLE decoder layer ``i`` of the checkpoint holds one table, ``layers.{i}.ple.ple_embedding.
ngram_embedding``, split into row shards ``shard_{k}.weight`` (and, for NVFP4 rows, ``shard_{k}.
weight_scale``, the block scales), or whole as ``.weight``; maybe ``model.``-prefixed. Those are the
rows the daemon serves, never read from the checkpoint. The table's one global scale (FP8's
``weight_scale``, NVFP4's ``weight_scale_2``) is a scalar: the engine loads it as usual and the plugin
checks it against the daemon's.

vLLM describes the table by its model config and the storage method it picked for the table's quant
config; the plugin gathers that into a :class:`PLELayout`, which :meth:`Qwen4ExpPLE.check_layout`
compares with the daemon's tables: PLE layers, rows (padded as vLLM pads), head sizes, row width, row
format and ETP sharding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ModelMismatch

TABLE_TENSOR = re.compile(
    r"(?:^|\.)layers\.\d+\.ple\.ple_embedding\.ngram_embedding\.(?:shard_\d+\.(?:weight|weight_scale)|weight)$")
PAYLOADS = {"float8_e4m3fn": "FP8", "bfloat16": "BF16", "float4_e2m1fn": "NVFP4"}  # row formats, by payload dtype


@dataclass(frozen=True)
class PLELayout:
    """The PLE tables as the engine describes them (from its model config and quant method)."""

    layer_ids: tuple[int, ...]  # decoder layer indices (config ple_layer_ids, one-indexed, minus one)
    rows: tuple[int, ...]  # rows per table, padded as the engine pads them
    head_sizes: tuple[tuple[int, ...], ...]  # rows of each (order, head) of each table, in row order
    dim: int  # values per row (ple_embed_dim / heads)
    payload_dtype: str  # what a row's values are: "float8_e4m3fn", "bfloat16", "float4_e2m1fn", or another dtype
    scale_block: int  # values per block scale in a row (NVFP4: 16), 0 for none
    table_scale: bool  # whether the engine reads one global scale per table
    etp_size: int  # ranks the engine shards each table across (contiguous row ranges)


class Qwen4ExpPLE:
    """The :class:`~engram_store.integrations.models.ModelAdapter` of Qwen4Exp's PLE n-gram table."""

    name = "Qwen4Exp PLE"
    scale_block = 0  # FP8 and BF16 rows carry no block scales (NVFP4's 16 comes with its layout)

    def is_table_tensor(self, name: str) -> bool:
        return TABLE_TENSOR.search(name) is not None

    def check_layout(self, tables: Any, layout: PLELayout, scale_block: int, source: str) -> None:
        spec = tables.spec
        if spec.multiplier_rule != "splitmix64" or spec.boundary != "eos":
            raise _mismatch(tables, source, "model family", "Qwen4Exp's PLE n-gram table",
                            f"tables of another family (spec {spec.name!r})")
        fmt = spec.row_format
        engine = PAYLOADS.get(layout.payload_dtype, layout.payload_dtype)
        if layout.payload_dtype != fmt.payload_dtype:
            daemon = PAYLOADS.get(fmt.payload_dtype, fmt.payload_dtype)
            raise _mismatch(tables, source, "PLE row format", engine, daemon)
        if layout.table_scale != bool(fmt.table_scale_dtype):
            raise _mismatch(tables, source, "PLE table scale", "one" if layout.table_scale else "none",
                            "one" if fmt.table_scale_dtype else "none")
        tables.check_model(layer_ids=layout.layer_ids, rows=layout.rows, head_sizes=layout.head_sizes,
                           dim=layout.dim, scale_block=scale_block, source=source)
        for layer, rows in zip(layout.layer_ids, layout.rows):
            if layout.etp_size < 1 or rows % layout.etp_size:
                raise _mismatch(tables, source, "ETP size", f"{layout.etp_size} ranks",
                                f"{rows} rows in PLE layer {layer}, which that many ranks cannot split evenly")


def _mismatch(tables: Any, source: str, field: str, engine: Any, daemon: Any) -> ModelMismatch:
    return ModelMismatch(f"{field}: {source} says {engine}, the engram-store daemon at {tables.address} serves "
                         f"{daemon} (tables of spec {tables.spec.name!r}); point ENGRAM_STORE_ADDR at a daemon "
                         "serving this model's tables, or import this checkpoint's tables into it")


QWEN4EXP = Qwen4ExpPLE()
