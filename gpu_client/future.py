"""The rows of one step submitted to a prefetcher (``gpu_client.prefetch.EngramPrefetcher``): a small future.

A future knows its prefetcher only through :class:`PrefetchOwner`, the few calls it makes back
(fetch a layer now, note when the model waited, the layer's device buffer), made once per prefetcher.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PrefetchOwner:
    """What the futures of one prefetcher need of it (one per prefetcher, shared by its futures)."""

    layers: tuple[int, ...]  # its Engram layers, in order
    device: Any  # torch.device the rows land on
    timed: bool  # record per-layer timings at each layer's first wait
    layer_index: Callable[[int], int]  # layer -> its index in ``layers`` (InvalidRequest for another layer)
    fetch: Callable[["PrefetchFuture", int], None]  # bring layer index ``li`` of a future onto the device now
    note_wait: Callable[[int, float, float, float, float], None]  # (li, issued, ready, needed, waited) ms
    buffer: Callable[[int, int], "torch.Tensor"]  # (slot, layer) -> the layer's device buffer of a buffer set


class PrefetchFuture:
    """The rows of one submitted step; ``wait(layer)`` blocks only until that layer is on the device.

    The time of a layer's first ``wait`` is when the model needed its rows (see ``EngramPrefetcher.timings``).
    """

    def __init__(self, owner: PrefetchOwner, slot: int, num_tokens: int, ids: list) -> None:
        self._owner = owner
        self.slot = slot  # which buffer set holds the rows
        self.num_tokens = num_tokens
        self._ids = ids  # per layer: int64 row ids [T * rows_per_token] (host for staged, device for resident)
        self._ids_ready = None  # CUDA event: ids copied to the host
        self._handles: list = [None] * len(owner.layers)  # staged-shm: lookups in flight in the daemon
        self._ready = [threading.Event() for _ in owner.layers]
        self._copied: list = [None] * len(owner.layers)  # CUDA events: rows on the device
        self._error: BaseException | None = None
        self._claimed = [False] * len(owner.layers)
        self._lock = threading.Lock()
        # timing (perf_counter seconds): submit, per layer lookup issued / rows landed, first wait recorded
        self._t0 = 0.0
        self._issued: list = [None] * len(owner.layers)
        self._ready_t: list = [None] * len(owner.layers)
        self._noted = [not owner.timed] * len(owner.layers)  # True: nothing (more) to record
        self._t0_event = None  # CUDA: timing event on the submitting stream at submit
        self._needed: list = [None] * len(owner.layers)  # CUDA: timing events where the model waited

    def done(self) -> bool:
        return all(e.is_set() for e in self._ready)

    def wait(self, layer: int) -> "torch.Tensor":
        """uint8 ``[num_tokens, rows_per_token, row_bytes]`` on the device (a view of buffer set ``slot``)."""
        import torch

        asked = time.perf_counter()
        li = self._owner.layer_index(layer)
        if not self._ready[li].is_set() and self._claim(li):  # lazy (no prefetch) or not yet started
            self._owner.fetch(self, li)
        self._ready[li].wait()
        if self._error is not None:
            raise self._error
        if self._copied[li] is not None:
            stream = torch.cuda.current_stream(self._owner.device)
            if not self._noted[li]:  # where the model's stream reaches this layer (before it waits)
                self._needed[li] = torch.cuda.Event(enable_timing=True)
                self._needed[li].record(stream)
            stream.wait_event(self._copied[li])
        if not self._noted[li]:  # host timing at the layer's first wait, in ms from the submit
            self._noted[li] = True
            t0, returned = self._t0, time.perf_counter()
            self._owner.note_wait(li, (self._issued[li] - t0) * 1e3, (self._ready_t[li] - t0) * 1e3, (asked - t0) * 1e3,
                                  (returned - asked) * 1e3)
        return self._owner.buffer(self.slot, layer)[: self.num_tokens]

    def wait_all(self) -> None:
        for layer in self._owner.layers:
            self.wait(layer)

    def device_times(self) -> list[tuple[int, float, float]] | None:
        """CUDA: ``(layer index, rows landed, model waited)`` in ms from the submit, per layer with both
        events, once every event of the step has completed; None before (asked with a non-blocking
        ``query``, never a wait)."""
        events = [self._t0_event, *(e for e in self._copied if e is not None),
                  *(e for e in self._needed if e is not None)]
        if not all(e.query() for e in events):
            return None
        return [(li, self._t0_event.elapsed_time(ready), self._t0_event.elapsed_time(needed))
                for li, (ready, needed) in enumerate(zip(self._copied, self._needed))
                if ready is not None and needed is not None]

    def _settle(self) -> None:
        """Wait (host side) until every layer has landed or failed, fetching unclaimed ones; never raises."""
        for li, ready in enumerate(self._ready):
            if not ready.is_set() and self._claim(li):
                self._owner.fetch(self, li)
            ready.wait()

    def _claim(self, li: int) -> bool:
        with self._lock:
            claimed, self._claimed[li] = self._claimed[li], True
            return not claimed
