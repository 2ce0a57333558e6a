"""Layer-ahead prefetch of Engram rows into device buffers.

Row ids depend only on token ids, so the rows of every Engram layer of a step
can be fetched while the layers before them compute::

    pf = EngramPrefetcher(client, device="cuda")
    fut = pf.submit(Step.from_lists(["a", "b"], [[5, 9, 11], [7]]))   # returns at once
    ...                                                               # earlier layers run
    rows = fut.wait(layer)     # uint8 [T, rows_per_token, row_bytes] on the device

``submit`` hashes on the device (keeping each request's last tokens as history
so a decode step hashes like prefill), then a background thread fetches every
layer in layer order. Token ids are compressed, or with ``raw_ids=True`` the
engine's raw ids, mapped on the device through the table set's token map under
the image rule (``block_images``, vLLM's behaviour by default). A request that
does not simply go on says so: ``start(request, position, lookback)`` after a
prefix-cache hit or a preemption, ``rollback(request, n)`` for rejected drafts,
``advance(request, tokens)`` for tokens that were not submitted; or a ``Step``
carries each request's ``lookback`` (the stateless form engines use). ``path`` says how (and ``info()`` reports it):

* ``resident-cpu`` / ``resident-uva``: the daemon is resident and the client
  mapped its arena; rows are gathered in process (CPU) or by the GPU over UVA;
* ``staged-shm`` (CUDA): lookups land in the client's shared region, which is
  registered with ``cudaHostRegister``, and are DMA'd from there on a side stream;
* ``staged-pinned`` (CUDA): lookups into pinned staging buffers, then H2D
  (gRPC clients, or a region the driver refused to register);
* ``staged`` (CPU): lookups straight into the output buffers.

Buffers: ``depth`` (default 2) sets of fixed-capacity buffers, used in turn, so
step k+1's fetch overlaps step k's compute. The rows returned for a step stay
valid until ``depth`` further steps are submitted; on CUDA, work enqueued on the
current stream before a ``submit`` is complete before that submit's copies
overwrite a buffer. CUDA-graph users capture one graph per buffer set over
:meth:`EngramPrefetcher.buffer` and read the row count from :meth:`token_count`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np

from engram_store.errors import EngramStoreError, InvalidRequest, ResourceExhausted, StorageError
from engram_store.hashing import (
    hash_suffix_torch,
    history_from_lookback_numpy,
    history_from_lookback_torch,
    next_history_torch,
    suffix_tokens_torch,
)
from engram_store.spec import ModelSpec
from engram_store.tokens import TokenMap, raw_ids_for
from gpu_client.future import PrefetchFuture
from gpu_client.resident import ArenaGather, readonly_tensor, register_host_memory, unregister_host_memory
from gpu_client.step import RequestHistory, Step

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class EngramPrefetcher:
    """Hashes steps on ``device`` and fetches their rows ahead of the Engram layers.

    ``client``: an ``EngramClient`` or ``LocalClient`` (``info()``, ``lookup_into``,
    optionally ``arena()``). ``prefetch=False`` fetches a layer only when it is waited
    for (the no-prefetch baseline). ``resident=None`` uses the arena when offered.
    ``raw_ids=True``: steps hold raw token ids; the map comes from ``token_map`` (a
    :class:`~engram_store.tokens.TokenMap`, a table-set directory, a ``tokenizer.json``)
    or else from the daemon's Info (same host: the map file of its table set), and must
    match the one Info names. ``block_images``: the image placeholder (and SGLang's
    multimodal pad ids >= 1,000,000) breaks the n-gram (vLLM: always; SGLang: when the
    model has a vision tower). ``max_rollback``: how many tokens :meth:`rollback` can
    take back. Not thread-safe: one engine thread submits and waits.
    """

    def __init__(self, client: Any, device: "str | torch.device" = "cpu", *, max_tokens: int = 8192,
                 depth: int = 2, prefetch: bool = True, resident: bool | None = None, validate: bool = True,
                 raw_ids: bool = False, token_map: "TokenMap | str | None" = None, block_images: bool = True,
                 max_rollback: int = 16) -> None:
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
        self._history = RequestHistory(self.spec, self.device, max_rollback=max_rollback)
        self.raw = raw_ids_for(self.spec, info, token_map, block_images) if raw_ids else None
        self._raw_table = None if self.raw is None else self.raw.device_table(self.device)
        self._arena = ArenaGather.for_client(client, self.spec, self.device) if resident in (None, True) else None
        if resident and self._arena is None:
            raise StorageError("resident=True but the client offers no usable arena (is the daemon resident?)")
        self._region_ptr = None  # staged-shm: the client's shared region, registered for DMA
        self.path = self._arena.path if self._arena is not None else self._staged_path(client)
        # CPU + a client with submit() (EngramClient over unix://): lookups go out from submit() itself and
        # are collected in wait(); the daemon is the background worker, so no thread of ours competes
        # with the model for the GIL. Up to `depth` steps are outstanding, so each gets a share of the region.
        region = getattr(client, "shared_region", None) if self.path == "staged" else None
        self._async = region is not None and hasattr(client, "submit")
        share = region.nbytes // (depth + 1) // len(self.layers) - 2 * 4096 if self._async else 0
        self._async_rows = max(share, 0) // (8 + self.spec.row_bytes)
        R, rb, L = self.spec.rows_per_token, self.spec.row_bytes, len(self.layers)
        shape = (depth, L, max_tokens, R, rb)
        self._device_buf = torch.empty(shape, dtype=torch.uint8, device=self.device)
        self._counts = torch.zeros(depth, dtype=torch.int64, device=self.device)
        self._staging = self._device_buf
        self._host_ids = None
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._consumed: list = [None] * depth
            self._last_copy: list = [[None] * L for _ in range(depth)]  # H2D copies still reading staging
            if self._arena is None:  # pinned staging also backs staged-shm for lookups too big for the region
                self._staging = torch.empty(shape, dtype=torch.uint8).pin_memory()
                self._host_ids = torch.empty((depth, L, max_tokens * R), dtype=torch.int64).pin_memory()
        self._inflight: list[PrefetchFuture | None] = [None] * depth
        self._pending: collections.deque[PrefetchFuture] = collections.deque()
        self._waited: set[int] = set()
        self._submitted = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="engram-prefetch", daemon=True)
        self._worker.start()
        log.info("prefetcher for %s on %s: path %s, depth %d, %d tokens", self.spec.name, self.device, self.path,
                 depth, max_tokens)

    # --- public ----------------------------------------------------------------
    def submit(self, step: Step) -> PrefetchFuture:
        """Hash ``step`` and start fetching its rows for every Engram layer; returns at once."""
        import torch

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
        idx = self._history.slots(step.request_ids)
        tokens = self._compressed(torch.from_numpy(step.tokens).to(self.device, non_blocking=True))
        cu = torch.from_numpy(step.cu_seqlens).to(self.device, non_blocking=True)
        hist = self._history.get(idx) if step.lookback is None else self._lookback_rows(step.lookback)
        tok = suffix_tokens_torch(self.spec, tokens, cu, hist, validate=False)
        ids = [hash_suffix_torch(self.spec, layer, tok).reshape(-1) for layer in self.layers]
        self._history.put(idx, next_history_torch(self.spec, tokens, cu, hist, validate=False))
        self._history.moved(step.request_ids, np.diff(step.cu_seqlens), restarted=step.lookback is not None)
        self._history.drop(step.finished)
        self._counts[slot].fill_(T)
        fut = PrefetchFuture(self, slot, T, ids)
        if self._cuda:
            self._consumed[slot] = torch.cuda.Event()
            self._consumed[slot].record(torch.cuda.current_stream(self.device))
            if self._arena is None:  # ids go to the host for the lookups
                host = self._host_ids[slot]
                for li, layer_ids in enumerate(ids):
                    host[li, : layer_ids.numel()].copy_(layer_ids, non_blocking=True)
                fut._ids = [host[li, : T * self.spec.rows_per_token] for li in range(len(self.layers))]
                fut._ids_ready = torch.cuda.Event()
                fut._ids_ready.record(torch.cuda.current_stream(self.device))
            else:
                for layer_ids in ids:
                    layer_ids.record_stream(self._stream)
        self._inflight[slot] = fut
        self._pending.append(fut)
        self._submitted += 1
        if self.prefetch and self._async and T * self.spec.rows_per_token <= self._async_rows:
            self._submit_lookups(fut)  # the daemon gathers while we compute; no thread of ours involved
        elif self.prefetch:
            self._jobs.put(fut)
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
        import torch

        lb = np.ascontiguousarray(np.asarray(lookback, dtype=np.int64).reshape(1, -1))
        if self.validate:
            self._check(np.zeros(0, dtype=np.int64), lb)
        hist = history_from_lookback_torch(self.spec, torch.from_numpy(lb).to(self.device), self.raw, self._raw_table)
        self._history.start(request, position, hist[0])

    def advance(self, request: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``request``'s history without hashing them (they were not submitted)."""
        import torch

        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if self.validate:
            self._check(arr, None)
        idx = self._history.slots([request])
        t = self._compressed(torch.from_numpy(arr).to(self.device))
        cu = torch.tensor([0, arr.size], dtype=torch.int64, device=self.device)
        self._history.put(idx, next_history_torch(self.spec, t, cu, self._history.get(idx), validate=False))
        self._history.moved([request], np.array([arr.size]))

    def rollback(self, request: Hashable, n: int) -> None:
        """Take back ``request``'s last ``n`` tokens (drafts the engine rejected), at most ``max_rollback``."""
        self._history.rollback(request, int(n))

    @property
    def active_requests(self) -> int:
        return len(self._history)

    def info(self) -> dict[str, Any]:
        lookups = ("on-wait" if not self.prefetch else "async-submit" if self._async else
                   "gpu-stream" if self._arena is not None and self._cuda else "thread")
        return {"path": self.path, "lookups": lookups, "device": str(self.device), "prefetch": self.prefetch,
                "depth": self.depth,
                "max_tokens": self.max_tokens, "layers": list(self.layers), "rows_per_token": self.spec.rows_per_token,
                "row_bytes": self.spec.row_bytes, "spec": self.spec.name, "active_requests": len(self._history)}

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()
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
            if lo < -1 or hi >= self.spec.compressed_vocab:
                raise InvalidRequest(f"tokens must be compressed ids in [0, {self.spec.compressed_vocab}) or -1, "
                                     f"got values in [{lo}, {hi}]; raw ids need raw_ids=True")
        if lookback is not None:
            history_from_lookback_numpy(self.spec, lookback, self.raw)

    def _compressed(self, tokens: "torch.Tensor") -> "torch.Tensor":
        return tokens if self.raw is None else self.raw.compress_torch(self._raw_table, tokens)

    def _lookback_rows(self, lookback: np.ndarray) -> "torch.Tensor":
        """History rows (the table's width) from a step's lookback."""
        import torch

        hist = history_from_lookback_torch(self.spec, torch.from_numpy(lookback).to(self.device, non_blocking=True),
                                           self.raw, self._raw_table)
        pad = self._history.width - hist.shape[1]
        return torch.nn.functional.pad(hist, (pad, 0), value=self.spec.pad_id) if pad else hist

    def _layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise InvalidRequest(f"layer {layer} is not an Engram layer of {self.spec.name!r}; "
                                 f"layers are {list(self.layers)}") from None

    def _staged_path(self, client: Any) -> str:
        """staged (CPU), staged-shm (rows DMA'd from the client's registered shared region) or staged-pinned."""
        if not self._cuda:
            return "staged"
        region = getattr(client, "shared_region", None)
        if region is None or not hasattr(client, "submit"):
            return "staged-pinned"
        registered = register_host_memory(region.ctypes.data, region.nbytes)
        if registered is False:
            return "staged-pinned"
        self._region_ptr, self._region_bytes = region.ctypes.data, region.nbytes
        self._owns_region = bool(registered)  # None: registered by someone else in this process
        self._region_generation = getattr(client, "generation", 0)
        if not getattr(self, "_hooked", False) and hasattr(client, "add_close_hook"):
            client.add_close_hook(self._region_closing)
            self._hooked = True
        return "staged-shm"

    def _region_closing(self, transport: Any) -> None:
        """The client is about to close ``transport`` (a reconnect): unregister its shared region
        while it is still mapped. A region unmapped while registered keeps its old pages pinned,
        and a new region mapped at the same address would then be DMA'd from those stale pages."""
        if self._region_ptr is None or getattr(transport, "region", None) is None \
                or transport.region.ctypes.data != self._region_ptr:
            return
        self._stream.synchronize()  # no copy may still be reading it
        if self._owns_region:
            unregister_host_memory(self._region_ptr)
        self._region_ptr = None
        self.path = "staged-pinned"  # until _use_region registers the new connection's region

    def _use_region(self, rows: int) -> bool:
        """Whether a lookup of ``rows`` rows goes through the registered shared region (it fits, same
        connection). After a reconnect (the close hook unregistered the old region) the new
        connection's region is registered here first."""
        if self._region_ptr is None or getattr(self.client, "generation", 0) != self._region_generation:
            if not self._cuda or not hasattr(self.client, "add_close_hook"):
                return False
            if self._region_ptr is not None and self._owns_region:  # a client without the hook's call
                unregister_host_memory(self._region_ptr)
            self._region_ptr = None
            self.path = self._staged_path(self.client)
            if self.path != "staged-shm":
                self._region_ptr = None
                return False
        return rows * (8 + self.spec.row_bytes) <= self._region_bytes // 4

    def _rows_in_region(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` (a lookup's answer) lie in the shared region registered now: a lookup
        submitted before a reconnect is answered from the new connection's region."""
        ptr = self._region_ptr
        return (ptr is not None and getattr(self.client, "generation", 0) == self._region_generation
                and ptr <= rows.ctypes.data and rows.ctypes.data + rows.nbytes <= ptr + self._region_bytes)

    def _submit_lookups(self, fut: PrefetchFuture) -> None:
        try:
            for li, layer in enumerate(self.layers):
                fut._handles[li] = self.client.submit(layer, fut._ids[li].numpy())
        except EngramStoreError as exc:  # the waiter sees it; lookups already sent are collected and freed
            fut._error = exc

    def _run(self) -> None:
        while (fut := self._jobs.get()) is not None:
            if self._use_region(fut.num_tokens * self.spec.rows_per_token):
                fut._ids_ready.synchronize()
                try:
                    for li, layer in enumerate(self.layers):  # every layer's lookup in flight at once
                        with fut._lock:
                            if not fut._claimed[li]:
                                fut._handles[li] = self.client.submit(layer, fut._ids[li].numpy())
                except EngramStoreError as exc:  # the per-layer fetch retries and reports it
                    log.debug("early submit failed: %s", exc)
            for li in range(len(self.layers)):  # layer order: the first Engram layer is ready first
                if fut._claim(li):
                    self._fetch(fut, li)

    def _fetch(self, fut: PrefetchFuture, li: int) -> None:
        """Bring layer ``li`` of ``fut`` into its device buffer; sets the layer's ready event whatever happens."""
        try:
            if fut._error is None:
                self._fetch_layer(fut, li)
            elif fut._handles[li] is not None:  # a lookup sent before the failure: free its region space
                fut._handles[li].release()
        except EngramStoreError as exc:  # handed to the waiter, which re-raises it in its own thread
            fut._error = exc
        except Exception as exc:
            fut._error = StorageError(f"prefetch of layer {self.layers[li]} failed: {exc!r}")
            fut._error.__cause__ = exc
        finally:
            fut._ready[li].set()

    def _fetch_layer(self, fut: PrefetchFuture, li: int) -> None:
        import torch

        T, R, rb = fut.num_tokens, self.spec.rows_per_token, self.spec.row_bytes
        if T == 0:
            return
        layer = self.layers[li]
        dev = self._device_buf[fut.slot, li, :T]
        if self._arena is not None:
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._consumed[fut.slot])
                    self._arena.gather_into(layer, fut._ids[li], dev.view(T * R, rb))
                    fut._copied[li] = torch.cuda.Event()
                    fut._copied[li].record(self._stream)
            else:
                self._arena.gather_into(layer, fut._ids[li], dev.view(T * R, rb))
            return
        handle = fut._handles[li]
        if self._cuda:
            fut._ids_ready.synchronize()
            if handle is None and self._use_region(T * R):
                handle = self.client.submit(layer, fut._ids[li].numpy())
        if handle is not None:  # rows sit in the client's shared region
            try:
                rows = handle.wait()
                if not self._cuda:
                    np.copyto(dev.numpy(), rows.reshape(T, R, rb))
                    return
                if not self._rows_in_region(rows):  # reconnected meanwhile: not DMA-able, copy via pinned staging
                    if self._last_copy[fut.slot][li] is not None:
                        self._last_copy[fut.slot][li].synchronize()
                    staging = self._staging[fut.slot, li, :T]
                    np.copyto(staging.numpy(), rows.reshape(T, R, rb))
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(self._consumed[fut.slot])
                        dev.copy_(staging, non_blocking=True)
                        fut._copied[li] = torch.cuda.Event()
                        fut._copied[li].record(self._stream)
                    fut._copied[li].synchronize()
                    return
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._consumed[fut.slot])
                    dev.copy_(readonly_tensor(rows).view(T, R, rb), non_blocking=True)
                    fut._copied[li] = torch.cuda.Event()
                    fut._copied[li].record(self._stream)
                fut._copied[li].synchronize()  # the region extent is reused once released
            finally:
                handle.release()
            return
        if self._cuda:
            if self._last_copy[fut.slot][li] is not None:  # the staging buffer is still being read
                self._last_copy[fut.slot][li].synchronize()
        staging = self._staging[fut.slot, li, :T]
        self.client.lookup_into(layer, fut._ids[li].numpy().reshape(T, R), staging.numpy())
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._consumed[fut.slot])
                dev.copy_(staging, non_blocking=True)
                fut._copied[li] = self._last_copy[fut.slot][li] = torch.cuda.Event()
                fut._copied[li].record(self._stream)

