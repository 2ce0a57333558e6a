"""Prompt hints for the engine plugins: when a request's prefill is first scheduled, the rows of its chunks
not computed yet go to the daemon, which reads them ahead behind the lookups (``EngramClient.hint``).

A cached Engram layer costs a long prompt a disk read per chunk: every chunk of 8,192 tokens asks for
about 196,608 rows. Yet all of a prompt's row ids are known when it is scheduled (they depend on its
token ids alone). :class:`PromptHints` turns the engine's view of a newly scheduled request (its raw
prompt token ids, how many are computed already, e.g. by a prefix-cache hit, and the chunk scheduled
now) into one hint per cached layer: the rows of the tokens after the scheduled chunk, hashed exactly
as the engine's own kernels hash them (:func:`pending_rows`: :mod:`engram_store.models.hashing` by
position, the tokens before as lookback, with the family's boundary rule: V4.1 through the table set's
compressed token map; Qwen4Exp and LongCat over raw ids, the prompt's start and its EOS tokens cutting
the grams as vLLM's id kernels cut them), this rank's hash columns only, each row once. When the request finishes or is aborted, it withdraws what the daemon
still had queued.

Nothing here blocks the engine: :meth:`PromptHints.scheduled` copies the token ids and returns; a
background thread hashes and sends (fire and forget: errors are logged once and counted, a full
backlog drops new hints). The key of a hint is :func:`hint_key` of the engine's request id, the same on
every rank: identical hints from several ranks are read once by the daemon.

Where the plugins call it (both engines run it in every rank's process):

* vLLM (both model runners): :func:`vllm_scheduler_output` with each step's ``SchedulerOutput``, in
  ``execute_model`` before the forward: its ``scheduled_new_reqs`` (``NewRequestData``: ``req_id``,
  ``prompt_token_ids`` / V2's ``prefill_token_ids``, ``num_computed_tokens``), its
  ``num_scheduled_tokens`` and its ``finished_req_ids`` (finished and aborted requests).
* SGLang: :func:`sglang_prefill_batch` with the ``ScheduleBatch`` the scheduler's
  ``get_new_batch_prefill`` plans (its ``reqs``: ``rid``, ``origin_input_ids``, ``prefix_len``,
  ``extend_end``), and :func:`sglang_finished` with the requests of each processed batch.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..models.hashing import row_ids_numpy
from ..models.spec import ModelSpec
from ..models.tokens import BLOCKED, RawIds

log = logging.getLogger(__name__)

MAX_BACKLOG = 256  # hints and withdrawals waiting for the sender thread; past it new hints are dropped (counted)
EXIT_JOIN_SECONDS = 3.0  # at interpreter exit, how long the sender may take to finish a send in progress


def hint_key(request_id: str) -> int:
    """The key of a request's hints: 63 bits of BLAKE2b of its id, the same on every rank and process."""
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def pending_rows(spec: ModelSpec, layer: int, tokens: Any, start: int, *, raw: RawIds | None = None,
                 columns: slice | None = None) -> np.ndarray:
    """Row ids of ``layer`` for the tokens ``tokens[start:]`` of a prompt, in token order, each once.

    ``tokens``: the prompt's token ids (raw engine ids with ``raw``, else the ids the spec hashes: compressed
    ids, or a ``token_ids = "raw"`` spec's raw ids; positions before the prompt hash as the spec's boundary
    says: a pad, Qwen4Exp's EOS, LongCat's cut); each
    position hashes with the up to ``max_ngram - 1`` tokens before it, as the engine hashes a chunk
    from its tokens and their lookback, so the rows equal those of the whole prompt from ``start`` on.
    ``columns``: the hash columns (of ``rows_per_token``, in (order, head) order) this rank fetches;
    None: all. Empty when ``start`` is at or past the end."""
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if start >= toks.size:
        return np.zeros(0, dtype=np.int64)
    start = max(0, int(start))
    h = spec.history_len
    before = toks[max(0, start - h): start][::-1]  # newest first
    lookback = np.full((1, h), BLOCKED, dtype=np.int64)  # -1: before the prompt's start
    lookback[0, : before.size] = before
    ids = row_ids_numpy(spec, layer, toks[start:], lookback=lookback, raw=raw)
    if columns is not None:
        ids = ids[:, columns]
    flat = ids.reshape(-1)
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)]


@dataclass
class HintStats:
    """What a :class:`PromptHints` did: hints and rows sent (rows per layer, summed), rows the daemon queued,
    withdrawals sent, hints dropped (full backlog), sends that failed."""

    requests: int = 0
    hints_sent: int = 0
    rows_sent: int = 0
    rows_queued: int = 0
    withdrawals: int = 0
    dropped: int = 0
    failed: int = 0


class PromptHints:
    """A rank's prompt hints. ``client``: an ``EngramClient`` (or a callable that makes one, called on the
    sender thread at its first send); ``layers``: ``{cached layer: this rank's hash columns (a slice) or
    None (all)}``; ``raw``: the table set's raw-id rule (``tokens.raw_ids_for``), None when the engine
    hands compressed ids. Thread-safe."""

    def __init__(self, client: Any, spec: ModelSpec, layers: Mapping[int, slice | None], raw: RawIds | None = None,
                 *, max_backlog: int = MAX_BACKLOG) -> None:
        self._client = client
        self.spec, self.layers, self.raw, self.max_backlog = spec, dict(layers), raw, max_backlog
        self.stats = HintStats()
        self._sent: dict[str, bool] = {}  # request id -> a hint was sent for it (False: nothing left to hint)
        self._jobs: collections.deque[tuple] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None

    # --- the engine's side ---------------------------------------------------------------------
    def scheduled(self, request_id: str, tokens: Any, computed: int, scheduled: int) -> bool:
        """A request's prefill is scheduled: ``tokens`` its prompt, ``computed`` tokens already in its KV
        cache (a prefix hit), ``scheduled`` tokens computed in this step. At its first call per request,
        hints the tokens after ``computed + scheduled``; later calls do nothing. Returns whether a hint
        was queued. Never blocks."""
        start = int(computed) + int(scheduled)
        with self._cond:
            if request_id in self._sent or self._closed or not self.layers:
                return False
            toks = np.array(tokens, dtype=np.int64)  # a copy: the engine may change its list afterwards
            self._sent[request_id] = False
            if start >= toks.size:
                return False  # the whole prompt is in this step: nothing to read ahead
            if len(self._jobs) >= self.max_backlog:
                self.stats.dropped += 1
                return False
            self._sent[request_id] = True
            self.stats.requests += 1
            self._jobs.append(("hint", hint_key(request_id), toks, start))
            self._start()
            self._cond.notify()
        return True

    def finished(self, request_ids: Iterable[str]) -> None:
        """Requests finished or aborted: the hints sent for them are withdrawn. Never blocks."""
        with self._cond:
            for request_id in request_ids:
                if self._sent.pop(request_id, False) and not self._closed:
                    self._jobs.append(("withdraw", hint_key(request_id)))
                    self._start()
            self._cond.notify()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued hint and withdrawal is sent (for tests and shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop the sender (queued hints are dropped; waiting at most ``timeout`` seconds for a send in
        progress); the client given as an object stays open."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # --- the sender thread -------------------------------------------------------------------------
    def _start(self) -> None:  # _cond held
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engram-prompt-hints", daemon=True)
            self._thread.start()
            # ended before the interpreter finalizes: a daemon thread still running then may free torch
            # objects (the garbage collector runs on any thread) while CPython ends it, which aborts
            atexit.register(self.close, EXIT_JOIN_SECONDS)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._send(job)
            except Exception as exc:  # a hint is only a hint: the engine goes on without it
                self.stats.failed += 1
                kind = type(exc).__name__
                if kind not in self._warned:
                    self._warned.add(kind)
                    log.warning("engram-store: a prompt hint could not be sent (%s: %s); further failures of this "
                                "kind are counted, not logged", kind, exc)

    def _connection(self) -> Any:
        if callable(self._client) and not hasattr(self._client, "hint"):
            self._client = self._client()
        return self._client

    def _send(self, job: tuple) -> None:
        client = self._connection()
        if job[0] == "withdraw":
            client.withdraw(job[1])
            self.stats.withdrawals += 1
            return
        _, key, tokens, start = job
        for layer, columns in self.layers.items():
            rows = pending_rows(self.spec, layer, tokens, start, raw=self.raw, columns=columns)
            if len(rows):
                self.stats.rows_queued += client.hint(layer, rows, key)
                self.stats.hints_sent += 1
                self.stats.rows_sent += len(rows)


# --- what the engines hand over -------------------------------------------------------------------
def vllm_scheduler_output(hints: PromptHints, scheduler_output: Any) -> None:
    """vLLM (0.33, both model runners): hints for the step's new requests, withdrawals for its finished
    ones, from its ``SchedulerOutput``. A request given by prompt embeddings (no token ids) is skipped."""
    scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        if new.prompt_token_ids is None:  # both runners get it (V2 also prefill_token_ids: prompt + outputs)
            continue
        hints.scheduled(new.req_id, new.prompt_token_ids, new.num_computed_tokens, scheduled.get(new.req_id, 0))
    if scheduler_output.finished_req_ids:
        hints.finished(scheduler_output.finished_req_ids)


def sglang_prefill_batch(hints: PromptHints, batch: Any) -> None:
    """SGLang (0.5.23): hints for the requests of a prefill batch the scheduler planned (``ScheduleBatch``;
    None: nothing planned). A request's tokens ``[prefix_len, extend_end)`` run in this batch; those after
    ``extend_end`` are hinted, once per request."""
    for req in getattr(batch, "reqs", None) or ():
        end = getattr(req, "extend_end", None)
        if end is None:
            continue
        hints.scheduled(req.rid, req.origin_input_ids, req.prefix_len, end - req.prefix_len)


def sglang_finished(hints: PromptHints, reqs: Iterable[Any], is_finished: Callable[[Any], bool] | None = None) -> None:
    """SGLang: withdraw the hints of the finished (or aborted) requests among ``reqs`` (``req.finished()``)."""
    done = is_finished or (lambda req: req.finished())
    hints.finished([req.rid for req in reqs if done(req)])


class RankHints:
    """A plugin's prompt hints in one engine process: the cached layers built there with the hash columns
    this rank fetches (:meth:`register`, at model build), and the :class:`PromptHints` made at first use.
    A family whose hash reads compressed ids (DeepSeek-V4.1) needs the table set's token map, as engines
    hold raw token ids (none: no hints, one INFO line); one whose hash reads raw ids (``token_ids = "raw"``:
    Qwen4Exp, LongCat) hashes the prompt as it is. ``engine_spec``: the engine's hashing rule over the
    table set's spec where the two differ (SGLang's LongCat: ``eos_current = "rehash"``); None: the spec's.
    :meth:`call` runs an adapter above and never raises into the engine (a failure is logged once)."""

    def __init__(self, block_images: bool, engine_spec: Callable[[ModelSpec], ModelSpec] | None = None) -> None:
        self.block_images = block_images
        self.engine_spec = engine_spec
        self._lock = threading.Lock()
        self._columns: dict[int, slice] = {}
        self._hints: list[PromptHints | None] = []  # [] until first use
        self._failed = False

    def register(self, layer: int, columns: slice) -> None:
        with self._lock:
            self._columns[int(layer)] = columns

    @property
    def columns(self) -> dict[int, slice]:
        return dict(self._columns)

    def hints(self, tables: Callable[[], Any]) -> PromptHints | None:
        """The process's PromptHints (made at the first call), or None: no cached layer, no token map."""
        with self._lock:
            if self._hints or not self._columns:
                return self._hints[0] if self._hints else None
            from ..client.client import EngramClient
            from ..errors import EngramStoreError
            from ..models.tokens import raw_ids_for

            t = tables()
            spec = t.spec if self.engine_spec is None else self.engine_spec(t.spec)
            try:  # raw ids: hashed as they are; compressed ids: through the table set's token map
                raw = None if spec.token_ids == "raw" else raw_ids_for(spec, t.info, None,
                                                                       block_images=self.block_images)
            except EngramStoreError as exc:
                log.info("engram-store: no prompt hints (%s); each prefill chunk of a cached layer reads its misses",
                         exc)
                self._hints.append(None)
                return None
            address = t.address
            self._hints.append(PromptHints(lambda: EngramClient.connect(address), spec, dict(self._columns), raw))
            log.info("engram-store: prompt hints on for cached layers %s: the rows of a prompt's later chunks are "
                     "read ahead by the daemon", sorted(self._columns))
            return self._hints[0]

    def call(self, tables: Callable[[], Any], what: str, adapter: Callable[..., None], *args: Any) -> None:
        """``adapter(hints, *args)`` when hints are on; a failure is logged once, never raised."""
        if not self._columns:
            return
        try:
            hints = self.hints(tables)
            if hints is not None:
                adapter(hints, *args)
        except Exception as exc:  # a hint is only a hint: the engine goes on without it
            if not self._failed:
                self._failed = True
                log.warning("engram-store: prompt hints failed at %s (%s: %s); the steps are served without them",
                            what, type(exc).__name__, exc)
