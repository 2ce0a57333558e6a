"""DeepSeek-V4.1's Engram tables, as the engine plugins see them.

Each Engram layer ``L`` of the checkpoint holds one table as two tensors,
``layers.{L}.engram.embed.weight`` (FP8 payloads, ``[rows, dim]``) and ``.scale`` (E8M0 scales, one per
32 values), maybe ``model.``-prefixed: the rows of every (n-gram order, hash head) table of the layer,
in head order. vLLM and SGLang describe them with an ``EngramLayout`` of the model config
(``layer_ids``, ``num_embeddings``, ``primes`` per layer, order and head, ``head_dim``), which
:meth:`DeepSeekV41Engram.check_layout` compares with the daemon's tables.
"""

from __future__ import annotations

import re
from typing import Any

TABLE_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.engram\.embed\.(?:weight|scale)$")
SCALE_BLOCK = 32  # values per E8M0 scale (vLLM's ParallelEngramEmbedding.block_size, SGLang's FP8_BLOCK_SIZE)


class DeepSeekV41Engram:
    """The :class:`~engram_store.integrations.models.ModelAdapter` of DeepSeek-V4.1's Engram."""

    name = "DeepSeek-V4.1"
    scale_block = SCALE_BLOCK

    def is_table_tensor(self, name: str) -> bool:
        return TABLE_TENSOR.search(name) is not None

    def check_layout(self, tables: Any, layout: Any, scale_block: int, source: str) -> None:
        tables.check_model(layer_ids=layout.layer_ids, rows=layout.num_embeddings,
                           head_sizes=[[p for order in per_layer for p in order] for per_layer in layout.primes],
                           dim=layout.head_dim, scale_block=scale_block, source=source)


DEEPSEEK_V41 = DeepSeekV41Engram()
