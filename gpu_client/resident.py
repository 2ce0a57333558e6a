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
* GPU (CUDA or ROCm): the mapping is registered with the runtime (read-only where
  supported, see below) and rows are gathered by a GPU kernel reading host memory
  over UVA, straight into device memory.

Also home of the host-registration helpers the prefetcher and the engine tables share, through the
GPU-runtime seam (:mod:`engram_store.native.gpu_runtime`: CUDA or HIP, whichever torch runs on), and
this process's record of what it registered (AMD's runtime cannot say "already registered").

Read-only registration (:func:`register_read_only`). The arena is a sealed memfd mapped ``PROT_READ``.
On CUDA it is registered with ``cudaHostRegisterReadOnly`` where the device reports
``cudaDevAttrHostRegisterReadOnlySupported = 1``. Where it reports 0 (some x86 B300 hosts), the flag
fails with ``cudaErrorNotSupported``, and a registration without it asks the driver to pin the pages
for device writes: NVIDIA documents the flag as required to register memory mapped read-only unless
the GPU reads pageable memory through the host's page tables
(``cudaDevAttrPageableMemoryAccessUsesHostPageTables = 1``, e.g. Grace with ATS), and elsewhere the
driver refuses a read-only mapping without it (``cudaErrorInvalidValue``). So the arena is then
registered without the flag (logged once), which works on hosts using the host page tables, and where
the driver refuses that too the arena is refused with both attributes' values in the message: a
writable (copy-on-write) mapping is no way out, since pinning it for writes copies every page into a
private copy of the tables per process. The staging of fetch jobs is writable memory of the process
and is registered on its own, so cached layers are served either way. On ROCm there is no read-only
registration AMD GPUs honour: everything is registered Portable | Mapped.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engram_store.errors import InvalidRequest, StorageError
from engram_store.format.arena_layout import ArenaInfo, ArenaView
from engram_store.native.gpu_runtime import runtime
from engram_store.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_pinned: dict[int, int] = {}  # address -> bytes of every host range registered here (and not unregistered)
_pinned_lock = threading.Lock()


@functools.cache
def cuda_available() -> bool:
    """True when torch can use a GPU (CUDA, or ROCm through torch.cuda); probed once; imports torch lazily."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class Registration:
    """What registering host memory for the GPU gave: truthy when ``what`` is registered (now, or
    already in this process); ``how`` says with which flags; ``message`` says why not (the runtime's
    error, the attributes read, what to do)."""

    what: str
    ok: bool
    how: str = ""
    message: str = ""
    code: int = 0  # the runtime's error code of the refusal (0: none)
    owned: bool = False  # registered by this call: the caller's to unregister (or its owner's, when collected)

    def __bool__(self) -> bool:
        return self.ok

    @staticmethod
    def combine(what: str, parts: "list[Registration]") -> "Registration":
        """One outcome for several ranges: registered when every part is; the refusals' messages."""
        refused = [p for p in parts if not p.ok]
        return Registration(what, not refused, ", ".join(sorted({p.how for p in parts if p.ok and p.how})),
                            "; ".join(p.message for p in refused), refused[0].code if refused else 0)


def _register(ptr: int, size: int, what: str, read_only: bool, owner: Any = None) -> Registration:
    rt = runtime()
    with _pinned_lock:
        if ptr in _pinned:
            return Registration(what, True, "already registered here")
        code = rt.register(ptr, size, read_only=read_only)
        if code == 0:
            _pinned[ptr] = size
            if owner is not None:  # its memory may be unmapped and the address reused: unregister with it
                weakref.finalize(owner, _forget, rt, ptr)
            how = "read-only" if read_only and rt.flags.read_only else "writable" if not read_only else \
                f"Portable | Mapped ({rt.side.label} has no read-only flag)"
            return Registration(what, True, how, owned=True)
    rt.clear_last_error()
    if rt.already_registered(code):  # by someone else in this process: usable, not ours to unregister
        return Registration(what, True, "registered by another owner in this process")
    name = rt.error_name(code)
    return Registration(what, False, message=f"{rt.side.prefix}HostRegister refused {what} ({size} bytes at "
                        f"{ptr:#x}{', read-only' if read_only and rt.flags.read_only else ''}): {name}", code=code)


def register_host_memory(ptr: int, size: int, *, read_only: bool = False) -> bool | None:
    """Page-lock ``size`` bytes at ``ptr`` for the GPU (Portable | Mapped, plus the read-only flag where the
    runtime has one and ``read_only``).

    True: registered here (the caller unregisters); None: already registered in this process (usable, not
    the caller's to unregister); False (logged): the runtime refused.
    """
    reg = _register(ptr, size, "host memory", read_only)
    if not reg:
        log.warning("%s; using pinned copies", reg.message)
        return False
    return True if reg.owned else None


def _forget(rt: Any, ptr: int) -> None:
    with _pinned_lock:
        if _pinned.pop(ptr, None) is None:
            return
        code = rt.unregister(ptr)
    if code != 0:
        rt.clear_last_error()


def register_writable(ptr: int, size: int, what: str, owner: Any = None) -> Registration:
    """Register memory the host writes and the GPU reads (a fetch job's staging). With ``owner`` (the
    object holding the memory), the registration ends when it is collected."""
    reg = _register(ptr, size, what, False, owner)
    return reg if reg else Registration(what, False, message=reg.message + "; check the memlock limit (ulimit -l)",
                                        code=reg.code)


def register_read_only(ptr: int, size: int, what: str, owner: Any = None) -> Registration:
    """Register memory the GPU only reads and that may be mapped ``PROT_READ`` (the arena): read-only where
    supported, else without the flag (logged once), else refused naming the attributes (module docstring).
    ``owner``: as for :func:`register_writable`."""
    rt = runtime()
    support = rt.read_only_support()
    if support.supported is not False:  # supported, or no such flag (HIP), or unknown: the runtime decides
        reg = _register(ptr, size, what, True, owner)
        unknown_and_unsupported = (support.supported is None and bool(rt.flags.read_only)
                                   and reg.code == rt.side.not_supported)
        if not unknown_and_unsupported:
            return reg if reg else replace(reg, message=f"{reg.message} ({support.detail})")
    _without_flag_once(support.detail)
    reg = _register(ptr, size, what, False, owner)
    if reg:
        return replace(reg, how="without the read-only flag") if reg.owned else reg
    return Registration(what, False, code=reg.code, message=(
        f"{what} cannot be registered with the GPU: read-only registration is unsupported here ({support.detail}) "
        f"and {rt.side.prefix}HostRegister refused it without the flag ({rt.error_name(reg.code)}): the driver pins "
        "memory for device writes and this memory is mapped read-only. Resident layers cannot be read in place by "
        "this GPU; cached layers are not affected. Place those layers cached, or use a driver and GPU reporting "
        "the attribute as 1"))


@functools.cache
def _without_flag_once(detail: str) -> None:
    log.warning("read-only host registration is unsupported here (%s): registering the read-only arena without the "
                "flag", detail)


def unregister_host_memory(ptr: int) -> None:
    rt = runtime()
    with _pinned_lock:
        _pinned.pop(ptr, None)
        code = rt.unregister(ptr)
    if code != 0:
        rt.clear_last_error()
        log.warning("%sHostUnregister(%#x) failed: %s", rt.side.prefix, ptr, rt.error_name(code))


def registered_here(ptr: int) -> bool:
    """Whether ``ptr`` starts a host range registered through this module and not unregistered."""
    with _pinned_lock:
        return ptr in _pinned


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
            if (a.weight_bytes, a.scale_bytes, a.rows) != (fmt.payload_bytes, fmt.scale_count, spec.rows(layer)):
                raise InvalidRequest(f"arena layer {layer}: {a.rows} rows of {a.weight_bytes}+{a.scale_bytes} bytes, "
                                     f"spec {spec.name!r} expects {spec.rows(layer)} of {fmt.payload_bytes}+{fmt.scale_count}")
        self._registered = False
        self._owns_registration = False
        self._blocks: dict[int, tuple[Any, Any]] = {}  # per layer (weights, scales): CUDA tensors (UVA) or ndarrays
        if self.device.type == "cuda":
            whole = readonly_tensor(view.array)
            registration = register_read_only(whole.data_ptr(), whole.numel(), "the resident arena")
            if not registration:
                raise StorageError(f"{registration.message}; the UVA gather is unavailable")
            self._registered = True
            self._owns_registration = registration.owned
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
