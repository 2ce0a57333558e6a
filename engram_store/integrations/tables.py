"""The daemon's tables as an engine wants them: CPU tensors over the shared arena.

::

    tables = EngramStoreTables.connect("unix:///run/engram-store/engram-store.sock")
    weight, scales = tables.views(14, row_start, row_end)   # float8_e4m3fn [n, 256], uint8 [n, 8]
    tables.register_cuda()                                  # once per process, on GPU hosts

The resident arena is in the engines' layout (``engram_store.format.arena_layout``):
per layer a block of payloads and a block of scales, so any TP rank's row range
of either is one contiguous slice, the two tensors vLLM's and SGLang's kernels
read. The views are zero-copy and read-only (the arena memfd is sealed against
writes: a write through them faults).

The mapping is taken once per process and per address (:meth:`shared`) and
never moves: CUDA graphs captured over it stay valid. The connection that
delivered the arena is closed right away, so a daemon restart does not touch
a running engine: its memfd and mapping stay valid, with the rows they had;
an engine started after the restart maps the daemon's new arena.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError, ModelMismatch, StorageError, UnknownLayer
from ..format.arena_layout import ArenaView
from ..spec import ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HELLO_REGION_BYTES = 1 << 16  # the smallest shared region a daemon hands out: this client sends no lookups


class EngramStoreTables:
    """A daemon's resident arena mapped read-only into this process, with its spec."""

    def __init__(self, address: str, view: ArenaView, info: dict[str, Any]) -> None:
        self.address = address
        self.view = view
        self.info = info
        self.spec = ModelSpec.from_dict(info["spec"])
        self.huge_pages = str((info.get("arena") or {}).get("huge_pages", "none"))
        self._whole: "torch.Tensor | None" = None
        self._registered: bool | None = None
        self._lock = threading.RLock()

    # --- opening ------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str, *, connect_timeout: float = 10.0) -> "EngramStoreTables":
        """Map the arena of the daemon at ``address`` (``unix:///path/to.sock``). Raises
        ``Unavailable`` when no daemon answers there and ``StorageError`` when it serves
        any layer cached (its rows are then not all in DRAM and cannot be read in place:
        ``placement`` names such layers) or when any
        page of its arena failed its checksum (those rows are zeros there: never embeddings)."""
        if not address.startswith("unix://"):
            raise ConfigError(f"engine tables need the daemon's Unix socket (unix:///path/to.sock), got {address!r}: "
                              "the arena is shared memory of this host, gRPC cannot pass it")
        from ..client.unix_transport import UnixTransport

        transport = UnixTransport(address[len("unix://"):], HELLO_REGION_BYTES, connect_timeout)
        try:
            info = dict(transport.info_cached)
            cached = sorted(int(layer) for layer, where in (info.get("placement") or {}).items() if where != "resident")
            if info.get("mode") == "mixed" and cached:
                resident = sorted(int(layer) for layer, where in info["placement"].items() if where == "resident")
                asked = ", ".join(f'{layer} = "resident"' for layer in cached)
                raise StorageError(
                    f"the daemon at {address} serves Engram layer(s) {cached} cached (placement; resident: "
                    f"{resident}): engine kernels read every Engram layer in place from the resident arena, so an "
                    "engine cannot use a daemon that holds any layer only in a cache; give those layers DRAM "
                    f"(placement = {{{asked}}} with enough "
                    "dram_bytes: engram-store info DIR gives each layer's size) or serve them from another daemon")
            if info.get("mode") != "resident" or transport.arena is None:
                raise StorageError(
                    f"the daemon at {address} serves its tables in {info.get('mode')!r} mode: engine kernels read "
                    "rows in place from a resident arena (every row in DRAM); give the daemon dram_bytes of at "
                    "least the table set's size (engram-store info DIR) or store_mode = \"resident\"")
            bad = {layer: ranges for layer, ranges in (info.get("bad_pages") or {}).items() if ranges}
            if bad:
                where = "; ".join(f"layer {layer} pages " + ", ".join(f"[{a}, {b})" for a, b in ranges)
                                  for layer, ranges in sorted(bad.items()))
                raise StorageError(
                    f"the daemon at {address} found pages of its tables failing their checksums ({where}): their "
                    "rows are zeros in the arena, and an engine reading the arena in place would use them as "
                    "embeddings; repair the table set (engram-store verify DIR names the pages; re-import or "
                    "re-synth it) and restart the daemon")
            view, transport.arena = transport.arena, None  # ours now: closing the connection keeps the mapping
        finally:
            transport.close()
        log.info("engram-store: mapped the arena of %s (%d bytes, huge pages: %s)", address, view.size,
                 (info.get("arena") or {}).get("huge_pages", "none"))
        return cls(address, view, info)

    @classmethod
    def shared(cls, address: str) -> "EngramStoreTables":
        """One mapping per process and address, opened on first use (engines call this from
        every layer; the arena is mapped once)."""
        return _shared(address)

    # --- facts ----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(a.layer for a in self.view.layers)

    def rows(self, layer: int) -> int:
        return self.view.rows(layer)

    def head_sizes(self, layer: int) -> tuple[int, ...]:
        """Rows of each (order, head) table of ``layer``, in row order (the engines' head order)."""
        return tuple(int(p) for p in self.spec.primes(layer).reshape(-1))

    # --- tensors --------------------------------------------------------------------
    def _whole_tensor(self) -> "torch.Tensor":
        import torch

        with self._lock:
            if self._whole is None:
                with warnings.catch_warnings():  # the buffer is read-only on purpose: the arena is sealed
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    self._whole = torch.frombuffer(self.view.array, dtype=torch.uint8)
            return self._whole

    def views(self, layer: int, row_start: int = 0, row_end: int | None = None) -> "tuple[torch.Tensor, torch.Tensor]":
        """Rows ``[row_start, row_end)`` of ``layer``: ``(weight float8_e4m3fn [n, dim],
        scales uint8 [n, dim // scale_block])``, CPU tensors aliasing the arena (no copy).
        Never write through them: the mapping is read-only and a write faults."""
        import torch

        a = self.view.layout.layer(layer)
        end = a.rows if row_end is None else row_end
        if not 0 <= row_start <= end <= a.rows:
            raise UnknownLayer(f"layer {layer}: row range [{row_start}, {end}) is outside [0, {a.rows})")
        whole, n = self._whole_tensor(), end - row_start
        w0, s0 = a.weight_offset + row_start * a.weight_bytes, a.scale_offset + row_start * a.scale_bytes
        weight = whole[w0: w0 + n * a.weight_bytes].view(torch.float8_e4m3fn).view(n, a.weight_bytes)
        scales = whole[s0: s0 + n * a.scale_bytes].view(n, a.scale_bytes)
        return weight, scales

    def register_cuda(self) -> bool:
        """Page-lock the whole arena for the GPU, read-only, once per process (idempotent), so
        that UVA views of :meth:`views` are zero-copy. True when the views now report
        ``is_pinned()``; False (logged) when the driver refused."""
        from gpu_client.resident import register_host_memory

        with self._lock:
            if self._registered is None:
                whole = self._whole_tensor()
                ok = register_host_memory(whole.data_ptr(), whole.numel(), read_only=True) is not False
                self._registered = ok and bool(whole.is_pinned())
            return self._registered

    # --- checks -----------------------------------------------------------------------
    def check_model(self, *, layer_ids: Sequence[int], rows: Sequence[int], head_sizes: Sequence[Sequence[int]],
                    dim: int, scale_block: int, source: str = "the model config") -> None:
        """Raise ``ModelMismatch`` naming the first field where the engine's model and the
        daemon's tables differ, with both values."""
        fmt = self.spec.row_format

        def mismatch(field: str, engine: Any, daemon: Any) -> ModelMismatch:
            return ModelMismatch(f"{field}: {source} says {engine}, the engram-store daemon at {self.address} serves "
                                 f"{daemon} (tables of spec {self.spec.name!r}); point ENGRAM_STORE_ADDR at a daemon "
                                 "serving this model's tables, or import this checkpoint's tables into it")

        if tuple(layer_ids) != self.layers:
            raise mismatch("Engram layer ids", tuple(layer_ids), self.layers)
        if int(dim) != fmt.dim:
            raise mismatch("Engram head dim", int(dim), fmt.dim)
        if int(scale_block) != fmt.scale_block:
            raise mismatch("scale block", int(scale_block), fmt.scale_block)
        for layer, n, sizes in zip(layer_ids, rows, head_sizes):
            if int(n) != self.rows(layer):
                raise mismatch(f"rows of Engram layer {layer}", int(n), self.rows(layer))
            if tuple(int(s) for s in sizes) != self.head_sizes(layer):
                raise mismatch(f"hash head sizes of Engram layer {layer}", tuple(sizes), self.head_sizes(layer))


@functools.cache
def _shared(address: str) -> EngramStoreTables:
    return EngramStoreTables.connect(address)
