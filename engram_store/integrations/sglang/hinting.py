"""Prompt hints from SGLang: when the scheduler plans a prefill batch, each rank tells the daemon the rows of
its cached layers' hash columns for the tokens of the batch's new requests after the planned chunk, so the
daemon reads them into its cache while the first chunks compute (:mod:`engram_store.integrations.hints`).

``Scheduler.get_new_batch_prefill`` (AFTER) hands its plan's batch to :func:`after_prefill_plan`: each
request (``origin_input_ids``, the radix-cache hit ``prefix_len``, the chunk's ``extend_end``) is hinted
once, at its first planned chunk. ``Scheduler.process_batch_result`` (the plugin's hook, failures.py)
hands every processed batch to :func:`after_results`, which withdraws the hints of its finished (or
aborted) requests. Nothing here blocks the scheduler: the hashing and sending run on a thread of their
own, and a hint that cannot be sent is dropped (logged once). Off (one INFO line) when the table set
carries no compressed token map (SGLang holds raw token ids).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_columns: dict[int, slice] = {}  # cached layer -> this rank's hash columns (registered at model build)
_hints: list[Any] = []  # the process's PromptHints once made ([None]: none possible)
_failed_once = [False]


def register(layer: int, columns: slice) -> None:
    """A cached layer built on this rank, fetching ``columns`` of its hash columns."""
    with _lock:
        _columns[int(layer)] = columns


def _prompt_hints() -> Any:
    with _lock:
        if _hints or not _columns:
            return _hints[0] if _hints else None
        from ...client.client import EngramClient
        from ...errors import EngramStoreError
        from ...tokens import raw_ids_for
        from ..hints import PromptHints
        from .hooks import tables

        t = tables()
        try:  # SGLang blocks the image token only with a vision tower; V4.1-Flash has none
            raw = raw_ids_for(t.spec, t.info, None, block_images=False)
        except EngramStoreError as exc:
            log.info("engram-store: no prompt hints (%s); each prefill chunk of a cached layer reads its misses", exc)
            _hints.append(None)
            return None
        _hints.append(PromptHints(lambda: EngramClient.connect(t.address), t.spec, dict(_columns), raw))
        log.info("engram-store: prompt hints on for cached layers %s: the rows of a prompt's later chunks are "
                 "read ahead by the daemon", sorted(_columns))
        return _hints[0]


def _guarded(what: str, fn, *args: Any) -> None:
    if not _columns:
        return
    try:
        hints = _prompt_hints()
        if hints is not None:
            fn(hints, *args)
    except Exception as exc:  # a hint is only a hint: the scheduler goes on without it
        if not _failed_once[0]:
            _failed_once[0] = True
            log.warning("engram-store: prompt hints failed at %s (%s: %s); the steps are served without them", what,
                        type(exc).__name__, exc)


def after_prefill_plan(plan: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``Scheduler.get_new_batch_prefill``: hints for the planned prefill batch's new requests."""
    from ..hints import sglang_prefill_batch

    _guarded("a prefill plan", sglang_prefill_batch, getattr(plan, "batch_to_run", None))
    return None


def after_results(batch: Any) -> None:
    """A processed batch (``Scheduler.process_batch_result``): its finished requests withdraw their hints."""
    from ..hints import sglang_finished

    _guarded("a batch result", sglang_finished, getattr(batch, "reqs", None) or ())


def stats() -> Any:
    """The process's hint counters (``HintStats``), or None when no hints are sent."""
    return _hints[0].stats if _hints and _hints[0] is not None else None
