"""The small per-step inputs of the step path (token ids, cu_seqlens, slots, lookback) on their way to the device.

A ``non_blocking`` copy from pageable memory is synchronous on CUDA (the driver
bounces it through a pinned buffer of its own and waits for the queue), and
``torch.tensor(..., device=cuda)`` is a blocking copy: either in ``submit()``
would stall the engine thread until the GPU caught up, undoing the layer-ahead
overlap. So each step's int64 inputs are written with numpy into one reused
pinned buffer and go to the device in one ``non_blocking`` copy.

Reuse is safe: a buffer is written again only once the copy that last read it
has run (its CUDA event has completed, asked with a non-blocking ``query``).
When the GPU is that far behind, the ring grows by one buffer instead (up to
``max_ring``), and only beyond that does the host wait. On CPU the buffers are
plain memory and the "device" tensors returned are views of them, valid until
the ring comes round to that buffer again (``ring`` further puts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class _Buffer:
    __slots__ = ("array", "event", "host")

    def __init__(self, host: "torch.Tensor") -> None:
        self.host = host  # int64 [capacity], pinned on CUDA
        self.array = host.numpy()  # numpy view made once: writing it is no torch call
        self.event = None  # CUDA event recorded after the last copy from this buffer


class StepInputs:
    """A ring of int64 host buffers (pinned when ``device`` is CUDA) for host-to-device copies of step inputs.

    ``put(*arrays)`` copies the arrays into the next free buffer and returns one tensor per array on
    ``device`` (same shapes), all from a single copy. ``allocations`` counts the buffers made (steady
    state: none per step). Not thread-safe: the engine thread that submits steps puts.
    """

    def __init__(self, device: "torch.device", capacity: int = 4096, ring: int = 2, max_ring: int = 8) -> None:
        import torch

        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._capacity = max(int(capacity), 1)
        self._max_ring = max(max_ring, ring, 1)
        self.allocations = 0
        self._ring = [self._buffer(self._capacity) for _ in range(max(ring, 1))]
        self._next = 0

    def _buffer(self, n: int) -> _Buffer:
        import torch

        self.allocations += 1
        return _Buffer(torch.empty(n, dtype=torch.int64, pin_memory=self._cuda))

    def _take(self, n: int) -> _Buffer:
        i = self._next
        buf = self._ring[i]
        if buf.event is not None and not buf.event.query():  # a copy may still be reading it
            if len(self._ring) < self._max_ring:
                buf = self._buffer(max(n, self._capacity))
                self._ring.insert(i, buf)
            else:
                buf.event.synchronize()  # the GPU is max_ring steps behind: wait for that copy
        if buf.host.numel() < n:  # the old buffer is freed; torch's host allocator keeps it until its copy ran
            self._capacity = max(n, 2 * self._capacity)
            buf = self._ring[i] = self._buffer(self._capacity)
        self._next = (i + 1) % len(self._ring)
        return buf

    def put(self, *arrays: np.ndarray) -> tuple["torch.Tensor", ...]:
        """The arrays (int64, any shape) on the device, from one copy of a reused host buffer."""
        import torch

        sizes = [int(a.size) for a in arrays]
        total = sum(sizes)
        buf = self._take(total)
        at = 0
        for a, n in zip(arrays, sizes):
            np.copyto(buf.array[at: at + n], a.reshape(-1), casting="same_kind")
            at += n
        src = buf.host[:total]
        if self._cuda:
            dev = src.to(self.device, non_blocking=True)
            if buf.event is None:
                buf.event = torch.cuda.Event()
            buf.event.record(torch.cuda.current_stream(self.device))
        elif self.device.type != "cpu":  # another device (the tests' "meta"): a plain copy
            dev = src.to(self.device)
        else:
            dev = src
        out, at = [], 0
        for a, n in zip(arrays, sizes):
            out.append(dev[at: at + n].view(a.shape))
            at += n
        return tuple(out)

    def owns(self, tensor: "torch.Tensor") -> bool:
        """Whether ``tensor``'s memory lies in one of the ring's buffers (for tests)."""
        ptr = tensor.data_ptr()
        return any(b.host.data_ptr() <= ptr < b.host.data_ptr() + b.host.numel() * 8 for b in self._ring) \
            or tensor.numel() == 0
