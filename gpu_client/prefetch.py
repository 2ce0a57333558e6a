"""Layer-ahead prefetch of Engram rows into device buffers.

Row ids depend only on token ids, so the rows of every Engram layer of a step
can be fetched while the layers before them compute::

    pf = EngramPrefetcher(client, device="cuda")
    fut = pf.submit(Step.from_lists(["a", "b"], [[5, 9, 11], [7]]))   # returns at once
    ...                                                               # earlier layers run
    rows = fut.wait(layer)     # uint8 [T, rows_per_token, row_bytes] on the device

``submit`` hashes on the device (keeping each request's last tokens as history
so a decode step hashes like prefill) without waiting for it: the step's inputs
go up in one copy from a reused pinned buffer (:mod:`gpu_client.step_inputs`), and
nothing is read back. Then every layer's lookup starts at once: sent to the
daemon from ``submit`` itself, or by one background thread per Engram layer.
Token ids are compressed, or with ``raw_ids=True`` the engine's raw ids, mapped
on the device through the table set's token map under the image rule
(``block_images``, vLLM's behaviour by default). A request that does not simply
go on says so: ``start(request, position, lookback)`` after a
prefix-cache hit or a preemption, ``rollback(request, n)`` for rejected drafts,
``advance(request, tokens)`` for tokens that were not submitted; or a ``Step``
carries each request's ``lookback`` (the stateless form engines use). ``path`` says how (and ``info()`` reports it):

* ``resident-cpu`` / ``resident-uva``: the daemon is resident and the client
  mapped its arena; rows are gathered in process (CPU) or by the GPU over UVA;
* ``staged-shm`` (CUDA): lookups land in the client's shared region, which is
  registered with ``cudaHostRegister``, and are DMA'd from there on a side stream;
* ``staged-pinned`` (CUDA): lookups into pinned host buffers, then H2D
  (gRPC clients, or a region the driver refused to register);
* ``staged`` (CPU): lookups straight into the output buffers;
* ``<resident path>+<staged path>``: a daemon with per-layer placement: its resident
  layers are gathered from the mapped arena, its cached ones looked up
  (``info()["placement"]`` says which layer goes which way).

Buffers: ``depth`` (default 2) sets of fixed-capacity buffers, used in turn, so
step k+1's fetch overlaps step k's compute. The rows returned for a step stay
valid until ``depth`` further steps are submitted; on CUDA, work enqueued on the
current stream before a ``submit`` is complete before that submit's copies
overwrite a buffer. CUDA-graph users capture one graph per buffer set over
:meth:`EngramPrefetcher.buffer` and read the row count from :meth:`token_count`.

Timing (:meth:`EngramPrefetcher.timings`, :mod:`gpu_client.timing`): per layer, when its
lookup left and its rows landed against when the model asked for them (the ``wait`` call),
the slack between the two and how long ``wait`` blocked; rolling p50/p99 over recent steps.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np

from engram_store.errors import EngramStoreError, InvalidRequest, ResourceExhausted, StorageError
from engram_store.models.hashing import (
    hash_suffix_torch,
    history_from_lookback_numpy,
    history_from_lookback_torch,
    next_history_torch,
    suffix_tokens_torch,
)
from engram_store.models.spec import ModelSpec
from engram_store.models.tokens import TokenMap, raw_ids_for
from gpu_client.future import PrefetchFuture, PrefetchOwner
from gpu_client.landing import RowLanding
from gpu_client.resident import ArenaGather, unregister_host_memory
from gpu_client.step import RequestHistory, Step
from gpu_client.step_inputs import StepInputs
from gpu_client.timing import LayerTimings

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class EngramPrefetcher(RowLanding):
    """Hashes steps on ``device`` and fetches their rows ahead of the Engram layers.

    ``client``: an ``EngramClient`` or ``LocalClient`` (``info()``, ``lookup_into``,
    optionally ``arena()``). ``prefetch=False`` fetches a layer only when it is waited
    for (the no-prefetch baseline). ``resident=None`` uses the arena when offered.
    ``raw_ids=True``: steps hold raw token ids (a model that hashes raw ids, Qwen4Exp, takes them as they are);
    the map comes from ``token_map`` (a
    :class:`~engram_store.models.tokens.TokenMap`, a table-set directory, a ``tokenizer.json``)
    or else from the daemon's Info (same host: the map file of its table set), and must
    match the one Info names. ``block_images``: the image placeholder (and SGLang's
    multimodal pad ids >= 1,000,000) breaks the n-gram (vLLM: always; SGLang: when the
    model has a vision tower). ``max_rollback``: how many tokens :meth:`rollback` can
    take back. ``timing``: record per-layer timings (:meth:`timings`) over the last
    ``timing_window`` steps. ``plan``: cold rows of a cached daemon's layers read by this
    process from the layer files (plan mode, :meth:`EngramClient.lookup_planned`: every page
    checked against its crc32c; the daemon reads them where the files are not readable here).
    ``None`` (default) leaves it off: on the host it costs as much as the daemon's own read
    plus the daemon's second read for its cache (measured: no gain); ``True`` turns it on.
    Not thread-safe: one engine thread submits and waits.
    """

    def __init__(self, client: Any, device: "str | torch.device" = "cpu", *, max_tokens: int = 8192,
                 depth: int = 2, prefetch: bool = True, resident: bool | None = None, validate: bool = True,
                 raw_ids: bool = False, token_map: "TokenMap | str | None" = None, block_images: bool = True,
                 max_rollback: int = 16, timing: bool = True, timing_window: int = 1024,
                 plan: bool | None = None) -> None:
        import torch

        info = client.info()
        self.spec = ModelSpec.from_dict(info["spec"])
        self.layers = tuple(self.spec.layers)
        missing = set(self.layers) - {int(x) for x in info["layers"]}
        if missing:
            raise InvalidRequest(f"the store does not serve Engram layers {sorted(missing)} of {self.spec.name!r}")
        if max_tokens < 1 or depth < 1:
            raise InvalidRequest(f"max_tokens and depth must be >= 1, got {max_tokens} and {depth}")
        self.client = client
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.depth = depth
        self.prefetch = prefetch
        self.validate = validate
        self._cuda = self.device.type == "cuda"
        self._inputs = StepInputs(self.device, capacity=4 * max_tokens + 1024)  # one H2D copy per step
        self._history = RequestHistory(self.spec, self.device, max_rollback=max_rollback, inputs=self._inputs)
        self._timed = timing
        self._timing = LayerTimings(self.layers, timing_window)
        self._owner = PrefetchOwner(self.layers, self.device, timing, self._layer_index, self._fetch,
                                    self._timing.record, self.buffer)  # what this prefetcher's futures call
        self._device_timed: collections.deque[PrefetchFuture] = collections.deque(maxlen=64)
        compressed = self.spec.token_ids != "raw"  # a model hashing raw ids (Qwen4Exp) needs no map
        self.raw = raw_ids_for(self.spec, info, token_map, block_images) if raw_ids and compressed else None
        self._raw_table = None if self.raw is None else self.raw.device_table(self.device)
        self._arena = ArenaGather.for_client(client, self.spec, self.device) if resident in (None, True) else None
        if resident and self._arena is None:
            raise StorageError("resident=True but the client offers no usable arena (is the daemon resident?)")
        self._region_ptr = None  # staged-shm: the client's shared region, registered for DMA
        # a daemon with per-layer placement: resident layers are gathered from the arena, the others looked up
        self._resident_layers = self._arena.layers if self._arena is not None else frozenset()
        self._lookup_li = [li for li, layer in enumerate(self.layers) if layer not in self._resident_layers]
        self._lookup_path = self._staged_path(client) if self._lookup_li else "none"
        # CPU + a client with submit() (EngramClient over unix://): lookups go out from submit() itself and
        # are collected in wait(); the daemon is the background worker, so no thread of ours competes
        # with the model for the GIL. Up to `depth` steps are outstanding, so each gets a share of the region.
        self.plan = bool(plan) and bool(self._lookup_li) and hasattr(client, "lookup_planned")
        if plan and not self.plan:
            raise InvalidRequest("plan=True needs a client with lookup_planned (EngramClient) and a layer the daemon "
                                 "caches")
        region = getattr(client, "shared_region", None) if self._lookup_path == "staged" and not self.plan else None
        self._async = region is not None and hasattr(client, "submit")
        share = region.nbytes // (depth + 1) // len(self._lookup_li) - 2 * 4096 if self._async else 0
        self._async_rows = max(share, 0) // (8 + self.spec.row_bytes)
        R, rb, L = self.spec.rows_per_token, self.spec.row_bytes, len(self.layers)
        shape = (depth, L, max_tokens, R, rb)
        self._device_buf = torch.empty(shape, dtype=torch.uint8, device=self.device)
        self._counts = torch.zeros(depth, dtype=torch.int64, device=self.device)
        self._pinned_rows = self._device_buf
        self._host_ids = None
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._consumed: list = [None] * depth
            self._last_copy: list = [[None] * L for _ in range(depth)]  # H2D copies still reading the pinned buffers
            if self._lookup_li:  # pinned buffers also back staged-shm for lookups too big for the region
                self._pinned_rows = torch.empty(shape, dtype=torch.uint8).pin_memory()
                self._host_ids = torch.empty((depth, L, max_tokens * R), dtype=torch.int64).pin_memory()
        self._inflight: list[PrefetchFuture | None] = [None] * depth
        self._pending: collections.deque[PrefetchFuture] = collections.deque()
        self._waited: set[int] = set()
        self._submitted = 0
        self._region_lock = threading.Lock()  # _use_region (re)registers the shared region
        # one fetch thread per Engram layer, so every layer's lookup is in flight at once
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.layers]
        self._workers = [threading.Thread(target=self._run, args=(li,), name=f"engram-prefetch-{layer}", daemon=True)
                         for li, layer in enumerate(self.layers)]
        for worker in self._workers:
            worker.start()
        log.info("prefetcher for %s on %s: path %s, depth %d, %d tokens", self.spec.name, self.device, self.path,
                 depth, max_tokens)

    # --- public ----------------------------------------------------------------
    def submit(self, step: Step) -> PrefetchFuture:
        """Hash ``step`` and start fetching its rows for every Engram layer; returns at once."""
        import torch

        t0 = time.perf_counter()
        T = step.num_tokens
        if T > self.max_tokens:
            raise ResourceExhausted(f"step has {T} tokens, the prefetcher holds {self.max_tokens}; "
                                    "raise max_tokens or split the chunk")
        if self.validate:
            self._check(step.tokens, step.lookback)
        slot = self._submitted % self.depth
        previous = self._inflight[slot]
        if previous is not None:  # the step that used this buffer set `depth` steps ago must have landed
            previous._settle()
            if self._pending and self._pending[0] is previous:
                self._waited = set()
            if previous in self._pending:
                self._pending.remove(previous)
            if self._timed and self._cuda:
                self._device_timed.append(previous)
        if self._device_timed:
            self._timing.fold_device(self._device_timed)
        # every input of the step in one copy from pinned memory (a pageable one would wait for the GPU)
        slots, fresh = self._history.assign(step.request_ids)
        extra = () if step.lookback is None else (step.lookback,)
        tokens, cu, idx, fresh_dev, *lookback = self._inputs.put(step.tokens, step.cu_seqlens, slots, fresh, *extra)
        if fresh.size:
            self._history.reset(fresh_dev)
        tokens = self._compressed(tokens)
        hist = self._history.get(idx) if step.lookback is None else self._lookback_rows(lookback[0])
        tok = suffix_tokens_torch(self.spec, tokens, cu, hist, validate=False)
        ids = [hash_suffix_torch(self.spec, layer, tok).reshape(-1) for layer in self.layers]
        self._history.put(idx, next_history_torch(self.spec, tokens, cu, hist, validate=False))
        self._history.moved(step.request_ids, np.diff(step.cu_seqlens), restarted=step.lookback is not None)
        self._history.drop(step.finished)
        self._counts[slot].fill_(T)
        fut = PrefetchFuture(self._owner, slot, T, ids)
        fut._t0 = t0
        if self._cuda:
            self._consumed[slot] = fut._t0_event = torch.cuda.Event(enable_timing=self._timed)
            self._consumed[slot].record(torch.cuda.current_stream(self.device))
            if self._lookup_li:  # the looked-up layers' ids go to the host
                host = self._host_ids[slot]
                for li in self._lookup_li:
                    host[li, : ids[li].numel()].copy_(ids[li], non_blocking=True)
                fut._ids = [host[li, : T * self.spec.rows_per_token] if li in self._lookup_li else ids[li]
                            for li in range(len(self.layers))]
                fut._ids_ready = torch.cuda.Event()
                fut._ids_ready.record(torch.cuda.current_stream(self.device))
            for li, layer in enumerate(self.layers):
                if layer in self._resident_layers:  # gathered on the side stream from the device ids
                    ids[li].record_stream(self._stream)
        self._inflight[slot] = fut
        self._pending.append(fut)
        self._submitted += 1
        if self.prefetch:
            sent = self._async and T * self.spec.rows_per_token <= self._async_rows
            if sent:
                self._submit_lookups(fut)  # the daemon gathers while we compute; no thread of ours involved
            for li, jobs in enumerate(self._jobs):
                if not (sent and li in self._lookup_li):
                    jobs.put(fut)
        return fut

    def wait(self, layer: int) -> "torch.Tensor":
        """Rows of ``layer`` for the oldest step whose layers have not all been waited for."""
        if not self._pending:
            raise InvalidRequest("wait() without a submitted step")
        rows = self._pending[0].wait(layer)
        self._waited.add(layer)
        if len(self._waited) == len(self.layers):
            self._pending.popleft()
            self._waited = set()
        return rows

    def buffer(self, slot: int, layer: int) -> "torch.Tensor":
        """Fixed-capacity uint8 ``[max_tokens, rows_per_token, row_bytes]`` device buffer of a buffer set."""
        return self._device_buf[slot, self._layer_index(layer)]

    def token_count(self, slot: int) -> "torch.Tensor":
        """Device int64 scalar: valid rows in buffer set ``slot`` (for captured consumers)."""
        return self._counts[slot]

    def drain(self) -> None:
        """Block until the rows of every submitted step have landed (or failed; errors stay with their futures)."""
        for fut in list(self._pending):
            fut._settle()

    def forget(self, request_ids: Sequence[Hashable]) -> None:
        """Drop requests' history (finished, aborted or preempted outside a step)."""
        self._history.drop(request_ids)

    def start(self, request: Hashable, position: int = 0, lookback: Sequence[int] = ()) -> None:
        """(Re)start ``request`` at ``position``: its next submitted token sits there (a prefix-cache hit,
        a resumed request). ``lookback``: the ids at ``position - 1, position - 2, ...`` (newest first,
        raw or compressed like the steps, -1 none); positions before 0 hash as pad whatever is given."""
        lb = np.ascontiguousarray(np.asarray(lookback, dtype=np.int64).reshape(1, -1))
        if self.validate:
            self._check(np.zeros(0, dtype=np.int64), lb)
        (lb_dev,) = self._inputs.put(lb)
        hist = history_from_lookback_torch(self.spec, lb_dev, self.raw, self._raw_table)
        self._history.start(request, position, hist[0])

    def advance(self, request: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``request``'s history without hashing them (they were not submitted)."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if self.validate:
            self._check(arr, None)
        t, cu = self._inputs.put(arr, np.array([0, arr.size], dtype=np.int64))
        t = self._compressed(t)
        idx = self._history.slots([request])
        self._history.put(idx, next_history_torch(self.spec, t, cu, self._history.get(idx), validate=False))
        self._history.moved([request], np.array([arr.size]))

    def rollback(self, request: Hashable, n: int) -> None:
        """Take back ``request``'s last ``n`` tokens (drafts the engine rejected), at most ``max_rollback``."""
        self._history.rollback(request, int(n))

    @property
    def active_requests(self) -> int:
        return len(self._history)

    def timings(self, reset: bool = False) -> dict[str, Any]:
        """Per-layer timing over the last ``timing_window`` steps (see :mod:`gpu_client.timing`):
        ``{"window", "layers": {layer: {"steps", "late", "issued_ms", "rows_ready_ms", "needed_at_ms",
        "slack_ms", "waited_ms"[, "device_*"]}}}``, each figure ``{"mean", "p50", "p99"}`` in ms from
        the step's submit. A layer counts once per step, at its first wait. On CUDA the device figures
        cover steps whose buffer set has been reused and whose events have completed (never synced).
        ``reset``: start afresh after reading (e.g. after a warm-up)."""
        if self._device_timed:
            self._timing.fold_device(self._device_timed)
        doc = self._timing.summary()
        if reset:
            self._timing.reset()
            self._device_timed.clear()
        return doc

    def info(self) -> dict[str, Any]:
        lookups = ("on-wait" if not self.prefetch else "async-submit" if self._async else
                   "gpu-stream" if not self._lookup_li and self._cuda else "thread-per-layer")
        return {"path": self.path, "lookups": lookups,
                "placement": {layer: "resident" if layer in self._resident_layers else "lookup" for layer in self.layers},
                "plan": self.client.plan_info() if self.plan else None, "device": str(self.device), "prefetch": self.prefetch,
                "depth": self.depth,
                "max_tokens": self.max_tokens, "layers": list(self.layers), "rows_per_token": self.spec.rows_per_token,
                "row_bytes": self.spec.row_bytes, "spec": self.spec.name, "active_requests": len(self._history)}

    def close(self) -> None:
        for jobs, worker in zip(self._jobs, self._workers):
            if worker.is_alive():
                jobs.put(None)
        for worker in self._workers:
            if worker.is_alive():
                worker.join()
        for fut in self._pending:  # unblock anyone still waiting
            if fut._error is None and not fut.done():
                fut._error = EngramStoreError("prefetcher closed")
            for event in fut._ready:
                event.set()
        self._pending.clear()
        if self._arena is not None:
            self._arena.close()
        if self._region_ptr is not None and self._owns_region:
            unregister_host_memory(self._region_ptr)
        self._region_ptr = None

    def __enter__(self) -> "EngramPrefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------
    def _check(self, tokens: np.ndarray, lookback: np.ndarray | None) -> None:
        """Host-side id checks (the device path does none, so that it never syncs)."""
        if self.raw is not None:
            self.raw.check("tokens", tokens)
        elif tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < (0 if self.spec.token_ids == "raw" else -1) or hi >= self.spec.compressed_vocab:
                raise InvalidRequest(f"tokens must be compressed ids in [0, {self.spec.compressed_vocab}) or -1, "
                                     f"got values in [{lo}, {hi}]; raw ids need raw_ids=True")
        if lookback is not None:
            history_from_lookback_numpy(self.spec, lookback, self.raw)

    def _compressed(self, tokens: "torch.Tensor") -> "torch.Tensor":
        return tokens if self.raw is None else self.raw.compress_torch(self._raw_table, tokens)

    def _lookback_rows(self, lookback: "torch.Tensor") -> "torch.Tensor":
        """History rows (the table's width) from a step's lookback (already on the device)."""
        import torch

        hist = history_from_lookback_torch(self.spec, lookback, self.raw, self._raw_table)
        pad = self._history.width - hist.shape[1]
        return torch.nn.functional.pad(hist, (pad, 0), value=self.spec.pad_id) if pad else hist

    def _layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise InvalidRequest(f"layer {layer} is not an Engram layer of {self.spec.name!r}; "
                                 f"layers are {list(self.layers)}") from None

    @property
    def path(self) -> str:
        """How rows arrive: the arena's path (every layer resident), the lookup path (none), or
        ``"<arena path>+<lookup path>"`` when the daemon holds some layers resident and others cached."""
        if not self._lookup_li:
            return self._arena.path
        return self._lookup_path if self._arena is None else f"{self._arena.path}+{self._lookup_path}"
