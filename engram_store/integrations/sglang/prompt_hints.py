"""Prompt hints from SGLang: when the scheduler plans a prefill batch, each rank tells the daemon the rows of
its cached layers' hash columns for the tokens of the batch's new requests after the planned chunk, so the
daemon reads them into its cache while the first chunks compute (:mod:`engram_store.integrations.prompt_hints`).

``Scheduler.get_new_batch_prefill`` (AFTER) hands its plan's batch to :func:`after_prefill_plan`: each
request (``origin_input_ids``, the radix-cache hit ``prefix_len``, the chunk's ``extend_end``) is hinted
once, at its first planned chunk. ``Scheduler.process_batch_result`` (the plugin's hook, failures.py)
hands every processed batch to :func:`after_results`, which withdraws the hints of its finished (or
aborted) requests. Nothing here blocks the scheduler. V4.1-Flash has no vision tower, so SGLang does not
block its image token. Without the table set's token map there are no hints.
"""

from __future__ import annotations

from typing import Any, Callable

from ..prompt_hints import RankHints, sglang_finished, sglang_prefill_batch

RANK = RankHints(block_images=False)


def register(layer: int, columns: slice) -> None:
    """A cached layer built on this rank, fetching ``columns`` of its hash columns."""
    RANK.register(layer, columns)


def after_prefill_plan(tables: Callable[[], Any], plan: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``Scheduler.get_new_batch_prefill``: hints for the planned prefill batch's new requests
    (``tables``: the plugin's, bound when the hook is made)."""
    RANK.call(tables, "a prefill plan", sglang_prefill_batch, getattr(plan, "batch_to_run", None))
    return None


def after_results(tables: Callable[[], Any], batch: Any) -> None:
    """A processed batch (``Scheduler.process_batch_result``): its finished requests withdraw their hints."""
    RANK.call(tables, "a batch result", sglang_finished, getattr(batch, "reqs", None) or ())
