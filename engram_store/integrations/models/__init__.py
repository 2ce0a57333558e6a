"""Model adapters: what the engine plugins need to know about one model family's embedding tables.

The engine adapters (:mod:`..vllm.patches`, :mod:`..sglang.hooks`) patch an engine; a model adapter
says which of the model's tensors are the tables the daemon serves, how the engine's config describes
them, and the row layout the engine's kernels read. One adapter per family, one module each
(:mod:`.deepseek_v41`: DeepSeek-V4.1's Engram; :mod:`.qwen4exp`: Qwen4Exp's PLE n-gram table;
:mod:`.longcat`: LongCat-Flash's n-gram tables); a new family adds a module here and names its
adapter where the engine adapters are installed.
"""

from __future__ import annotations

from typing import Any, Protocol


class ModelAdapter(Protocol):
    """One model family's embedding tables, as the engine plugins see them. Stateless: every method
    takes what it reads; safe to share between threads and engines."""

    name: str  # the family, for log lines: "DeepSeek-V4.1"
    scale_block: int  # values per E8M0 scale of a row (the engines' kernels are built for it)

    def is_table_tensor(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is one of the tables the daemon serves (never read)."""

    def check_layout(self, tables: Any, layout: Any, scale_block: int, source: str) -> None:
        """Raise ``ModelMismatch`` where the engine's description of the tables (``layout``, from the
        model config; ``scale_block``, the engine's kernels') differs from the daemon's ``tables``
        (an ``EngramStoreTables``), naming the field and ``source``."""
