"""Prompt hints from vLLM: when a request's prefill is first scheduled, each rank tells the daemon the rows
of its cached layers' heads for the prompt's tokens after the scheduled chunk, so the daemon reads them
into its cache while the first chunks compute (:mod:`engram_store.integrations.hints`).

Both model runners hand every step's ``SchedulerOutput`` to ``execute_model``; the patched one
(:mod:`.runners`) calls :func:`on_step` with it before the forward. Its new requests carry their raw
prompt token ids and the tokens already computed (a prefix-cache hit hints fewer rows); its finished
requests withdraw what the daemon still had queued. Nothing here blocks the step: the hashing and the
sending run on a thread of their own, and a hint that cannot be sent is dropped (logged once).

Hints need the table set's compressed token map (vLLM holds raw token ids): a daemon whose tables carry
none gets no hints (one INFO line); the steps are served as before, reading each chunk's misses.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_columns: dict[int, slice] = {}  # cached layer -> this rank's hash columns (registered at model build)
_hints: list[Any] = []  # the process's PromptHints once made ([] until the first step; [None]: none possible)
_failed_once = [False]


def register(layer: int, columns: slice) -> None:
    """A cached layer built on this rank, fetching ``columns`` of its hash columns."""
    with _lock:
        _columns[int(layer)] = columns


def _prompt_hints(tables) -> Any:
    with _lock:
        if _hints or not _columns:
            return _hints[0] if _hints else None
        from ...client.client import EngramClient
        from ...errors import EngramStoreError
        from ...tokens import raw_ids_for
        from ..hints import PromptHints

        t = tables()
        try:  # vLLM blocks the image token (the spec's image_token_id) like a dead id
            raw = raw_ids_for(t.spec, t.info, None, block_images=True)
        except EngramStoreError as exc:
            log.info("engram-store: no prompt hints (%s); each prefill chunk of a cached layer reads its misses", exc)
            _hints.append(None)
            return None
        _hints.append(PromptHints(lambda: EngramClient.connect(t.address), t.spec, dict(_columns), raw))
        log.info("engram-store: prompt hints on for cached layers %s: the rows of a prompt's later chunks are "
                 "read ahead by the daemon", sorted(_columns))
        return _hints[0]


def on_step(tables, scheduler_output: Any) -> None:
    """Hints for ``scheduler_output``'s new requests, withdrawals for its finished ones (never raises)."""
    if not _columns or scheduler_output is None or not hasattr(scheduler_output, "scheduled_new_reqs"):
        return
    try:
        hints = _prompt_hints(tables)
        if hints is not None:
            from ..hints import vllm_scheduler_output

            vllm_scheduler_output(hints, scheduler_output)
    except Exception as exc:  # a hint is only a hint: the step goes on without it
        if not _failed_once[0]:
            _failed_once[0] = True
            log.warning("engram-store: prompt hints failed (%s: %s); the steps are served without them",
                        type(exc).__name__, exc)


def stats() -> Any:
    """The process's hint counters (``HintStats``), or None when no hints are sent."""
    return _hints[0].stats if _hints and _hints[0] is not None else None
