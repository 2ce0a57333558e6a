"""Prompt hints from SGLang: when the scheduler plans a prefill batch, each rank tells the daemon the rows of
its cached layers' hash columns for the tokens of the batch's new requests after the planned chunk, so the
daemon reads them into its cache while the first chunks compute (:mod:`engram_store.integrations.prompt_hints`).

``Scheduler.get_new_batch_prefill`` (AFTER) hands its plan's batch to :func:`after_prefill_plan`: each
request (``origin_input_ids``, the radix-cache hit ``prefix_len``, the chunk's ``extend_end``) is hinted
once, at its first planned chunk. ``Scheduler.process_batch_result`` (the plugin's hook, failures.py)
hands every processed batch to :func:`after_results`, which withdraws the hints of its finished (or
aborted) requests. Nothing here blocks the scheduler.

The layers hinted are the cached ones built in this process: V4.1's Engram layers with this rank's share of
their hash columns (:mod:`.host_table`), Qwen4Exp's PLE layers and LongCat's n-gram table with all their
columns (:mod:`.qwen4exp`, :mod:`.longcat`: TP shards their rows, not their columns, so every rank hints the
same rows of a request and the daemon reads them once). The rows are hashed as SGLang 0.5.23 hashes them
(:func:`sglang_spec`): V4.1 through the table set's token map (V4.1-Flash has no vision tower, so SGLang
does not block its image token; without the token map there are no hints); Qwen4Exp over the raw prompt as
the spec says (SGLang's ``_shift_right_ignore_eos`` pads the look-back past an EOS and before the prompt
with EOS, as vLLM does); LongCat over the raw prompt with an EOS current token hashed with its look-back
(``eos_current = "rehash"``), whatever rule the daemon's spec names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ...models.spec import ModelSpec
from ..prompt_hints import RankHints, sglang_finished, sglang_prefill_batch


def sglang_spec(spec: ModelSpec) -> ModelSpec:
    """The table set's spec with SGLang 0.5.23's hashing rule: an EOS current token of a gram-cutting
    (``boundary = "eos_cut"``: LongCat) hash is hashed with its look-back; other specs as they are."""
    return dataclasses.replace(spec, eos_current="rehash") if spec.boundary == "eos_cut" else spec


RANK = RankHints(block_images=False, engine_spec=sglang_spec)


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
