"""Executing read plans on the GPU with kvikio: pages read into device memory and checked there.

- :class:`KvikioPlanExecutor` (CUDA + kvikio, imported lazily): pages read with
  ``kvikio.CuFile.pread`` straight into a device staging tensor (GPUDirect
  Storage where cuFile is in use), checked **on the device** (:class:`DeviceCrc`:
  crc32c is affine over GF(2), so a page's crc is an XOR of per-position byte
  tables, computed with torch integer ops), rows extracted on the device into
  the output tensor. The check itself is tested on CPU against the reference;
  the kvikio reads have not run on a GPU in this project's tests.

The executors' contract and the layer files they share are :mod:`.plan`'s.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from .. import errors
from ..format import checksums
from ..format.layout import PAGE_BYTES, extents
from ..wire.frames import ReadPlan
from .plan import CHUNK_PAGES, MAX_COALESCE_PAGES, LayerFiles, PlanUnusable, corrupt_rows, open_cufile


@functools.cache
def kvikio_usable() -> str:
    """'' when kvikio and a CUDA device are usable here, else why not (probed once)."""
    try:
        import kvikio  # noqa: F401  (optional extra "gds")
        import torch
    except Exception as exc:  # a broken CUDA install raises more than ImportError
        return f"kvikio or torch not importable ({exc.__class__.__name__}: {exc}); install engram-store[gds]"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device"
    except Exception as exc:
        return f"CUDA cannot be probed ({exc})"
    return ""


@functools.cache
def _position_tables(page_bytes: int) -> tuple[np.ndarray, int]:
    """crc32c over a page of ``page_bytes`` is affine over GF(2): ``crc(page) = crc(zeros) ^
    XOR_k T[k, page[k]]``. Returns (T as int32 ``[page_bytes * 256]``, ``crc(zeros)``), built
    from the crcs of the single-bit pages (once per process, about 128 MiB of pages hashed)."""
    zero = int(checksums.page_crcs(np.zeros(page_bytes, np.uint8))[0])
    bit_crc = np.empty((page_bytes, 8), dtype=np.uint32)
    step = 512
    for k0 in range(0, page_bytes, step):
        k1 = min(k0 + step, page_bytes)
        pages = np.zeros(((k1 - k0) * 8, page_bytes), np.uint8)
        idx = np.arange((k1 - k0) * 8)
        pages[idx, k0 + idx // 8] = (1 << (idx % 8)).astype(np.uint8)
        bit_crc[k0:k1] = (checksums.page_crcs(pages) ^ np.uint32(zero)).reshape(k1 - k0, 8)
    values = np.arange(256)
    table = np.zeros((page_bytes, 256), dtype=np.uint32)
    for bit in range(8):
        table ^= np.where((values >> bit) & 1, bit_crc[:, bit:bit + 1], np.uint32(0))
    return table.reshape(-1).view(np.int32), zero


class DeviceCrc:
    """crc32c of 4 KiB pages held in a torch tensor, computed where the tensor is (CUDA or
    CPU) with integer ops: one table gather, then an XOR tree over the page. Exact (tested
    against :func:`engram_store.format.checksums.page_crcs`)."""

    def __init__(self, device: Any, page_bytes: int = PAGE_BYTES) -> None:
        import torch

        table, zero = _position_tables(page_bytes)
        self.page_bytes, self.zero = page_bytes, zero
        self.table = torch.from_numpy(table.copy()).to(device)
        self.base = torch.arange(page_bytes, device=device, dtype=torch.int64) * 256

    def __call__(self, pages: Any) -> Any:
        """int64 crc32c per row of uint8 ``pages [n, page_bytes]`` (a tensor on this device)."""
        import torch

        x = torch.take(self.table, self.base + pages.to(torch.int64))  # [n, page_bytes] int32
        width = self.page_bytes
        while width > 1:
            width //= 2
            x = torch.bitwise_xor(x[:, :width], x[:, width: 2 * width])
        return (x[:, 0].to(torch.int64) & 0xFFFFFFFF) ^ self.zero


class KvikioPlanExecutor:
    """Executes plans into a CUDA tensor with kvikio: pages ``CuFile.pread`` into a device
    staging tensor (cuFile / GPUDirect Storage when kvikio is not in compatibility mode), each
    page checked on the device (:class:`DeviceCrc`) before any row of it is extracted, rows
    gathered on the device into ``out`` (uint8 CUDA tensor ``[n, row_bytes]``).

    UNTESTED on a GPU: no device ran this project's tests. The crc check (:class:`DeviceCrc`)
    is tested on CPU tensors, the file identity logic (:class:`LayerFiles`, :func:`open_cufile`)
    with a stand-in for ``CuFile``; the kvikio reads and device indexing are not. One ``CuFile``
    per layer file, checked against the identity the daemon sends with every plan and opened
    again when the daemon's file changed (the same logic as the host executor), closed by
    :meth:`close`."""

    name = "kvikio"

    def __init__(self, device: Any = None, chunk_pages: int = CHUNK_PAGES) -> None:
        why = kvikio_usable()
        if why:
            raise PlanUnusable(f"the kvikio plan executor cannot run here: {why}")
        import torch

        self.device = torch.device(device if device is not None else "cuda")
        self.chunk_pages = chunk_pages
        self._crc = DeviceCrc(self.device)
        import kvikio

        self._files = LayerFiles(lambda path: open_cufile(path, kvikio.CuFile), lambda f: f.close())
        self._lock = threading.Lock()
        self._staging = torch.empty(chunk_pages * PAGE_BYTES, dtype=torch.uint8, device=self.device)

    def execute(self, layer: int, plan: ReadPlan, out: Any) -> None:
        import torch

        if not len(plan.positions):
            return
        pb, rb = plan.page_bytes, plan.row_bytes
        rpp = pb // rb
        order = np.argsort(plan.page_index, kind="stable")
        sorted_pages = plan.page_index[order]
        with self._files.lease(plan) as f, self._lock:  # one staging tensor
            for lo in range(0, len(plan.pages), self.chunk_pages):
                hi = min(lo + self.chunk_pages, len(plan.pages))
                begin, npages = extents(plan.pages[lo:hi], MAX_COALESCE_PAGES)
                futures = [f.pread(self._staging[int(b) * pb: (int(b) + int(n)) * pb], int(n) * pb,
                                   int(plan.pages[lo + int(b)]) * pb) for b, n in zip(begin, npages)]
                got = sum(fut.get() for fut in futures)
                if got != (hi - lo) * pb:
                    raise errors.StorageError(f"short read of {plan.path}: {got} of {(hi - lo) * pb} bytes")
                staged = self._staging[: (hi - lo) * pb].view(hi - lo, pb)
                crcs = self._crc(staged).cpu().numpy()
                bad = np.flatnonzero(crcs != plan.crcs[lo:hi].astype(np.int64))
                if len(bad):
                    raise corrupt_rows(layer, plan, plan.pages[lo:hi][bad])
                a, b = np.searchsorted(sorted_pages, (lo, hi))
                sel = order[a:b]
                body = staged[:, : rpp * rb].reshape(hi - lo, rpp, rb)
                pi = torch.from_numpy(plan.page_index[sel] - lo).to(self.device)
                slot = torch.from_numpy(plan.slots[sel]).to(self.device)
                out[torch.from_numpy(plan.positions[sel]).to(self.device)] = body[pi, slot]

    def close(self) -> None:
        self._files.close()
