"""Prompt hints from vLLM: when a request's prefill is first scheduled, each rank tells the daemon the rows
of its cached layers' heads for the prompt's tokens after the scheduled chunk, so the daemon reads them
into its cache while the first chunks compute (:mod:`engram_store.integrations.prompt_hints`).

Both model runners hand every step's ``SchedulerOutput`` to ``execute_model``; the patched one
(:mod:`.runners`) calls :func:`on_step` with it before the forward. Its new requests carry their raw
prompt token ids and the tokens already computed (a prefix-cache hit hints fewer rows); its finished
requests withdraw what the daemon still had queued. Nothing here blocks the step: the hashing and the
sending run on a thread of their own, and a hint that cannot be sent is dropped (logged once).

The cached layers register here when they are built: DeepSeek-V4.1's Engram layers with this rank's heads
(:mod:`.cached`; hashed through the table set's token map, vLLM blocking the image token like a dead id:
without the map there are no hints), Qwen4Exp's PLE layers (:mod:`.qwen4exp`) and LongCat's n-gram table
(:mod:`.longcat`) with all their columns, hashed over the raw prompt with the family's EOS and
request-start rules.
"""

from __future__ import annotations

from typing import Any

from ..prompt_hints import RankHints, vllm_scheduler_output

RANK = RankHints(block_images=True)


def register(layer: int, columns: slice) -> None:
    """A cached layer built on this rank, fetching ``columns`` of its hash columns."""
    RANK.register(layer, columns)


def on_step(tables, scheduler_output: Any) -> None:
    """Hints for ``scheduler_output``'s new requests, withdrawals for its finished ones (never raises)."""
    if scheduler_output is not None and hasattr(scheduler_output, "scheduled_new_reqs"):
        RANK.call(tables, "a scheduler output", vllm_scheduler_output, scheduler_output)
