"""How each layer's rows land in the prefetcher's device buffers (mixed into
:class:`~gpu_client.prefetch.EngramPrefetcher`): gathered from a mapped resident arena, DMA'd
from the client's shared region registered with CUDA (re-registered after a reconnect), or
looked up into pinned host buffers and copied up; the per-layer fetch threads that do it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from engram_store.errors import EngramStoreError, StorageError
from gpu_client.future import PrefetchFuture
from gpu_client.resident import readonly_tensor, register_host_memory, unregister_host_memory

if TYPE_CHECKING:
    from engram_store.client.transport import Transport


class RowLanding:
    """The fetch side of :class:`~gpu_client.prefetch.EngramPrefetcher`. It uses the prefetcher's
    own state: ``client``, ``spec``, ``layers``, ``plan``, ``_cuda``, ``_stream``, ``_jobs``,
    ``_lookup_li``, ``_lookup_path``, ``_arena``, ``_resident_layers``, ``_device_buf``,
    ``_pinned_rows``, ``_last_copy``, ``_consumed``, ``_region_lock``, ``_region_ptr``,
    ``_region_bytes``, ``_owns_region``, ``_region_generation`` and ``_timed``."""

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

    def _region_closing(self, transport: Transport) -> None:
        """The client is about to close ``transport`` (a reconnect): unregister its shared region
        while it is still mapped. A region unmapped while registered keeps its old pages pinned,
        and a new region mapped at the same address would then be DMA'd from those stale pages."""
        if self._region_ptr is None or transport.region is None or transport.region.ctypes.data != self._region_ptr:
            return
        self._stream.synchronize()  # no copy may still be reading it
        if self._owns_region:
            unregister_host_memory(self._region_ptr)
        self._region_ptr = None
        self._lookup_path = "staged-pinned"  # until _use_region registers the new connection's region

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
            self._lookup_path = self._staged_path(self.client)
            if self._lookup_path != "staged-shm":
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
            for li in self._lookup_li:
                fut._issued[li] = time.perf_counter()
                fut._handles[li] = self.client.submit(self.layers[li], fut._ids[li].numpy())
        except EngramStoreError as exc:  # the waiter sees it; lookups already sent are collected and freed
            fut._error = exc

    def _run(self, li: int) -> None:
        """Fetch thread of layer index ``li``: each submitted step's rows of that layer, as they come."""
        while (fut := self._jobs[li].get()) is not None:
            if fut._claim(li):
                self._fetch(fut, li)

    def _fetch(self, fut: PrefetchFuture, li: int) -> None:
        """Bring layer ``li`` of ``fut`` into its device buffer; sets the layer's ready event whatever happens."""
        if fut._issued[li] is None:
            fut._issued[li] = time.perf_counter()
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
            fut._ready_t[li] = time.perf_counter()
            fut._ready[li].set()

    def _fetch_layer(self, fut: PrefetchFuture, li: int) -> None:
        import torch

        T, R, rb = fut.num_tokens, self.spec.rows_per_token, self.spec.row_bytes
        if T == 0:
            return
        layer = self.layers[li]
        dev = self._device_buf[fut.slot, li, :T]
        if layer in self._resident_layers:
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._consumed[fut.slot])
                    self._arena.gather_into(layer, fut._ids[li], dev.view(T * R, rb))
                    fut._copied[li] = torch.cuda.Event(enable_timing=self._timed)
                    fut._copied[li].record(self._stream)
            else:
                self._arena.gather_into(layer, fut._ids[li], dev.view(T * R, rb))
            return
        handle = fut._handles[li]
        if self._cuda:
            fut._ids_ready.synchronize()  # this layer's thread waits for the ids, the engine thread does not
            with self._region_lock:
                use_region = handle is None and not self.plan and self._use_region(T * R)
            if use_region:
                handle = self.client.submit(layer, fut._ids[li].numpy())
        if handle is not None:  # rows sit in the client's shared region
            try:
                rows = handle.wait()
                if not self._cuda:
                    np.copyto(dev.numpy(), rows.reshape(T, R, rb))
                    return
                if not self._rows_in_region(rows):  # reconnected meanwhile: not DMA-able, copy via the pinned buffers
                    if self._last_copy[fut.slot][li] is not None:
                        self._last_copy[fut.slot][li].synchronize()
                    pinned = self._pinned_rows[fut.slot, li, :T]
                    np.copyto(pinned.numpy(), rows.reshape(T, R, rb))
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(self._consumed[fut.slot])
                        dev.copy_(pinned, non_blocking=True)
                        fut._copied[li] = torch.cuda.Event(enable_timing=self._timed)
                        fut._copied[li].record(self._stream)
                    fut._copied[li].synchronize()
                    return
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._consumed[fut.slot])
                    dev.copy_(readonly_tensor(rows).view(T, R, rb), non_blocking=True)
                    fut._copied[li] = torch.cuda.Event(enable_timing=self._timed)
                    fut._copied[li].record(self._stream)
                fut._copied[li].synchronize()  # the region extent is reused once released
            finally:
                handle.release()
            return
        if self._cuda:
            if self._last_copy[fut.slot][li] is not None:  # the pinned buffer is still being read
                self._last_copy[fut.slot][li].synchronize()
        pinned = self._pinned_rows[fut.slot, li, :T]
        if self.plan:  # cold rows read here from the layer file, every page checked first
            self.client.lookup_planned(layer, fut._ids[li].numpy().reshape(T, R), pinned.numpy())
        else:
            self.client.lookup_into(layer, fut._ids[li].numpy().reshape(T, R), pinned.numpy())
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._consumed[fut.slot])
                dev.copy_(pinned, non_blocking=True)
                fut._copied[li] = self._last_copy[fut.slot][li] = torch.cuda.Event(enable_timing=self._timed)
                fut._copied[li].record(self._stream)
