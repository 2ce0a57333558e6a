"""Resident fast path: gather rows straight from the daemon's read-only arena.

When the daemon runs resident, every row sits in one sealed memfd (see
``engram_store.storage.base.ArenaInfo``). A client that holds the fd maps it
``PROT_READ`` and gathers by itself, with no round trip:

The arena comes from ``client.arena`` (EngramClient over ``unix://`` maps it
when the daemon passes the fd; LocalClient has its own).

* CPU: the store's native gather from the mapping into the caller's buffer
  (``numpy.take`` where it is not built; single threaded and without the GIL, so it overlaps the model's compute on another
  thread; torch's multi-threaded ``index_select`` collapses when it competes
  with the model for the cores);
* CUDA: the mapping is registered with ``cudaHostRegister`` (read-only, mapped)
  and rows are gathered by a GPU kernel reading host memory over UVA, straight
  into device memory.

Also home of the small CUDA helpers the prefetcher shares: a cached CUDA probe
and host-memory registration.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import warnings
from typing import TYPE_CHECKING, Any

from engram_store.errors import InvalidRequest, StorageError
from engram_store.format.arena_layout import ArenaInfo, ArenaView
from engram_store.spec import ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08
HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


@functools.cache
def cuda_available() -> bool:
    """True when torch can use a CUDA device (probed once; imports torch lazily)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed (non-sticky) call we handled ourselves.

    torch exposes no ``cudaGetLastError``, and torch checks the last error after
    every kernel launch, so a refused ``cudaHostRegister`` would otherwise surface
    later as an unrelated launch failure. Calls it in the libcudart torch loaded.
    """
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except OSError as exc:
        log.debug("could not reset the CUDA last error: %s", exc)


def register_host_memory(ptr: int, size: int, *, read_only: bool = False) -> bool | None:
    """Page-lock ``size`` bytes at ``ptr`` for the GPU.

    True: registered here (the caller unregisters); None: already registered in this
    process (usable, not the caller's to unregister); False (logged): the driver refused.
    """
    import torch

    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | (HOST_REGISTER_READ_ONLY if read_only else 0)
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags))
    if err != 0:
        clear_last_cuda_error()
    if err == HOST_MEMORY_ALREADY_REGISTERED:
        return None
    if err != 0:
        log.warning("cudaHostRegister(%#x, %d bytes) failed with cudaError %d; using pinned copies", ptr, size, err)
        return False
    return True


def unregister_host_memory(ptr: int) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        clear_last_cuda_error()
        log.warning("cudaHostUnregister(%#x) failed with cudaError %d", ptr, err)


class _DeviceView:
    """``__cuda_array_interface__`` over registered host memory, so torch sees it as a CUDA tensor (UVA)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], owner: Any) -> None:
        self._owner = owner  # keeps the mapping alive as long as the tensor
        # read-only is a promise kept by the callers (they only gather), not a flag torch enforces
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


def host_memory_as_cuda(ptr: int, shape: tuple[int, ...], owner: Any, device: "torch.device") -> "torch.Tensor":
    """A uint8 CUDA tensor aliasing registered host memory at ``ptr``."""
    import torch

    return torch.as_tensor(_DeviceView(ptr, shape, owner), device=device)


def readonly_tensor(buffer: Any) -> "torch.Tensor":
    """A uint8 CPU tensor over a read-only buffer. The caller promises never to write through it."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buffer, dtype=torch.uint8)


def client_arena(client: Any) -> ArenaView | None:
    """The client's resident arena as an :class:`ArenaView`, or None.

    Accepts ``EngramClient.arena`` / ``LocalClient.arena`` (an ``ArenaView``) and a
    RowStore-style ``arena()`` method returning an :class:`ArenaInfo` (whose fd is
    then mapped read-only here).
    """
    try:
        arena = getattr(client, "arena", None)
        if callable(arena):
            arena = arena()
    except Exception as exc:  # a client that cannot pass the fd (gRPC, old daemon) has no fast path
        log.info("no resident arena from %s: %s", type(client).__name__, exc)
        return None
    if arena is None:
        return None
    if isinstance(arena, ArenaInfo):
        try:
            return ArenaView.map_fd(arena.fd, arena.layout)
        except (OSError, ValueError) as exc:
            log.warning("cannot map the resident arena (fd %d, %d bytes): %s", arena.fd, arena.size, exc)
            return None
    if not isinstance(arena, ArenaView):
        log.warning("%s.arena is neither an ArenaView nor an ArenaInfo; no resident fast path", type(client).__name__)
        return None
    return arena


class ArenaGather:
    """Gathers rows of the resident arena on ``device`` without asking the daemon.

    ``layers``: the Engram layers the arena holds (all of them, or a daemon's resident
    layers when it caches the others: their rows must be looked up).

    ``view``: the arena mapped read-only (:class:`ArenaView`, the engines' layout:
    per layer a weights block and a scales block). Rows come out as stored, payload
    then scales. Thread-safe for concurrent gathers (they only read). ``close``
    drops the views (and unregisters on CUDA).
    """

    def __init__(self, view: ArenaView, spec: ModelSpec, device: "torch.device") -> None:
        import torch

        self.device = torch.device(device)
        self.row_bytes = spec.row_bytes
        self._view = view  # keeps the mapping alive
        fmt = spec.row_format
        by_layer = {a.layer: a for a in view.layers}
        self.layers = frozenset(layer for layer in spec.layers if layer in by_layer)  # a daemon's resident layers
        if not self.layers:
            raise InvalidRequest(f"arena holds none of the Engram layers {list(spec.layers)} (has {sorted(by_layer)})")
        for layer in sorted(self.layers):
            a = by_layer[layer]
            if (a.weight_bytes, a.scale_bytes, a.rows) != (fmt.dim, fmt.scale_count, spec.rows(layer)):
                raise InvalidRequest(f"arena layer {layer}: {a.rows} rows of {a.weight_bytes}+{a.scale_bytes} bytes, "
                                     f"spec {spec.name!r} expects {spec.rows(layer)} of {fmt.dim}+{fmt.scale_count}")
        self._registered = False
        self._owns_registration = False
        self._blocks: dict[int, tuple[Any, Any]] = {}  # per layer (weights, scales): CUDA tensors (UVA) or ndarrays
        if self.device.type == "cuda":
            whole = readonly_tensor(view.array)
            registered = register_host_memory(whole.data_ptr(), whole.numel(), read_only=True)
            if registered is False:
                raise StorageError("cudaHostRegister refused the arena; the UVA gather is unavailable")
            self._registered, self._owns_registration = True, bool(registered)
            self._base_ptr = whole.data_ptr()
            for layer in sorted(self.layers):
                a = by_layer[layer]
                self._blocks[layer] = (
                    host_memory_as_cuda(self._base_ptr + a.weight_offset, (a.rows, a.weight_bytes), self, self.device),
                    host_memory_as_cuda(self._base_ptr + a.scale_offset, (a.rows, a.scale_bytes), self, self.device))
        self.path = "resident-uva" if self._registered else "resident-cpu"
        self._layers = self.layers

    @classmethod
    def for_client(cls, client: Any, spec: ModelSpec, device: "torch.device") -> "ArenaGather | None":
        """The fast path for ``client`` if its daemon is resident and the arena can be used, else None
        (also when pages of the arena failed their checksums: those rows are zeros there, so lookups go
        through the daemon, which refuses them with ``CorruptRows``)."""
        view = client_arena(client)
        if view is None:
            return None
        info = getattr(client, "info", None)
        bad = {k: v for k, v in ((info() if callable(info) else {}).get("bad_pages") or {}).items() if v}
        if bad:
            log.error("resident arena has pages failing their checksums %s; gathering through the daemon instead", bad)
            return None
        try:
            return cls(view, spec, device)
        except (StorageError, InvalidRequest) as exc:
            log.warning("resident arena unusable, falling back to lookups: %s", exc)
            return None

    def gather_into(self, layer: int, row_ids: "torch.Tensor", out: "torch.Tensor") -> None:
        """``out[i] = row row_ids[i]``: ``row_ids`` int64 ``[n]`` and ``out`` uint8 ``[n, row_bytes]`` on the device.

        Row ids are trusted (they come from the hashing of the same spec, whose
        table sizes were checked against the arena at construction).
        """
        if layer not in self._layers:
            raise InvalidRequest(f"layer {layer} is not in the arena (resident layers {sorted(self._layers)})")
        if self._registered:
            weights, scales = self._blocks[layer]
            wb = weights.shape[1]
            out[:, :wb].copy_(weights.index_select(0, row_ids))
            out[:, wb:].copy_(scales.index_select(0, row_ids))
        else:
            self._view.gather_into(layer, row_ids.numpy(), out.numpy())

    def close(self) -> None:
        self._blocks = {}
        if self._registered and self._owns_registration:
            unregister_host_memory(self._base_ptr)
        self._registered = False
        self._view = None
