"""The daemon's tables as an engine wants them: CPU tensors over the shared arena (resident layers)
and fetch jobs (cached layers).

::

    tables = EngramStoreTables.connect("unix:///run/engram-store/engram-store.sock")
    weight, scales = tables.views(1, row_start, row_end)    # a resident layer: float8_e4m3fn [n, 256], uint8 [n, 8]
    job = tables.fetch_job(14, max_rows)                    # a cached layer: rows fetched per step (fetch/job.py)
    weight, scales = tables.staged(14, ids)                 # one step's rows of a cached layer, run here
    tables.register_cuda()                                  # once per process, on GPU hosts
    tables.check_fetches()                                  # at each host-visible point of a step: raises failures

The resident arena is in the engines' layout (``engram_store.format.arena_layout``):
per layer a block of payloads and a block of scales, so any TP rank's row range
of either is one contiguous slice, the two tensors vLLM's and SGLang's kernels
read. The views are zero-copy and read-only (the arena memfd is sealed against
writes: a write through them faults).

A cached layer's rows are not all in DRAM. Its rows of each step are fetched by a
:class:`~engram_store.fetch.job.FetchJob` (native code a CUDA host function runs,
inside the engines' CUDA graphs) into a staging buffer in the same split layout, which
the engines' kernels read with positional ids (row ``i`` of the staging is ``ids[i]``).
A daemon whose *first* Engram layer is cached is served too, with one warning giving
the fetch time measured over the first steps (that layer has about one layer of compute
ahead of it to hide the fetch).

The mapping is taken once per process and per address (:meth:`shared`) and
never moves: CUDA graphs captured over it stay valid. The connection that
delivered the arena is closed right away, so a daemon restart does not touch
a running engine: its memfd and mapping stay valid, with the rows they had;
an engine started after the restart maps the daemon's new arena. Fetch jobs
outlive a daemon restart too (they read the table files themselves meanwhile).
The tables' identity (spec, each layer's files and page checksums, from the
daemon's Info) is taken at :meth:`EngramStoreTables.connect`; every fetch job
made here, now or later, reads those tables: a daemon restarted on another
table set at the same address is refused (naming both) and the job reads its
own files, so one engine never mixes two table sets.

It runs past 400 lines as one class: the one object every engine adapter is handed (views, fetch
jobs, GPU registration, the model check share its lock and its record of jobs).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from ..fetch.job import FetchJob
from ..client.table_files import TableIdentity
from ..errors import ConfigError, ModelMismatch, StorageError, UnknownLayer
from ..format.arena_layout import ArenaView
from ..models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from gpu_client.resident import Registration

log = logging.getLogger(__name__)

HELLO_REGION_BYTES = 1 << 16  # the smallest shared region a daemon hands out: this client sends no lookups
FIRST_LAYER_STEPS = 64  # steps of a cached first layer measured before its one warning
STAGED_MIN_ROWS = 4096  # staged(): the smallest job made (grown when a call asks for more)
PROBE_WAIT_SECONDS = 30.0  # how long an engine plugin waits at load for a daemon that is not listening yet
PROBE_WAIT_ENV = "ENGRAM_STORE_CONNECT_WAIT_SECONDS"
PROBE_PAUSE_SECONDS = 0.25


class EngramStoreTables:
    """A daemon's resident arena mapped read-only into this process, with its spec."""

    def __init__(self, address: str, view: ArenaView | None, info: dict[str, Any]) -> None:
        self.address = address
        self.view = view  # None when every layer is cached
        self.info = info
        self.identity = TableIdentity.from_info(info, address)  # every fetch job made here reads these tables
        self.spec = ModelSpec.from_dict(info["spec"])
        self.placement = _placement(info)
        self.huge_pages = str((info.get("arena") or {}).get("huge_pages", "none"))
        self._whole: "torch.Tensor | None" = None
        self._registered: bool | None = None  # True once register_cuda ran: fetch_job registers new jobs
        self._arena_registration = None  # register_cuda's outcome for the arena
        self._lock = threading.RLock()
        self._jobs: list[FetchJob] = []  # every fetch job made here, for check_fetches
        self._staged: dict[int, FetchJob] = {}  # staged()'s job per layer
        self._first_warned = False
        # The engine plugins set the server's failure board (integrations/failures.py): the fetch jobs made
        # from then on write their failures there for every rank to see.
        self.failure_board = None

    # --- opening ------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str, *, connect_timeout: float = 10.0) -> "EngramStoreTables":
        """Map the arena of the daemon at ``address`` (``unix:///path/to.sock``) when it holds any
        layer resident. Raises ``Unavailable`` when no daemon answers there and ``StorageError``
        when a page of a resident layer failed its checksum (those rows are zeros in the arena:
        never embeddings) or when a layer is unavailable."""
        if not address.startswith("unix://"):
            raise ConfigError(f"engine tables need the daemon's Unix socket (unix:///path/to.sock), got {address!r}: "
                              "the arena is shared memory of this host, gRPC cannot pass it")
        from ..client.unix_transport import UnixTransport

        transport = UnixTransport(address[len("unix://"):], HELLO_REGION_BYTES, connect_timeout)
        try:
            info = dict(transport.info_cached)
            placement = _placement(info)
            resident = sorted(layer for layer, where in placement.items() if where == "resident")
            unavailable = info.get("layers_unavailable") or {}
            if unavailable:
                why = "; ".join(f"layer {layer}: {reason}" for layer, reason in sorted(unavailable.items()))
                raise StorageError(f"the daemon at {address} cannot serve every Engram layer ({why}); an engine needs "
                                   "all of them: repair the table set and restart the daemon")
            bad = {layer: ranges for layer, ranges in (info.get("bad_pages") or {}).items()
                   if ranges and int(layer) in resident}
            if bad:
                where = "; ".join(f"layer {layer} pages " + ", ".join(f"[{a}, {b})" for a, b in ranges)
                                  for layer, ranges in sorted(bad.items()))
                raise StorageError(
                    f"the daemon at {address} found pages of its tables failing their checksums ({where}): their "
                    "rows are zeros in the arena, and an engine reading the arena in place would use them as "
                    "embeddings; repair the table set (engram-store verify DIR names the pages; re-import or "
                    "re-synth it) and restart the daemon")
            if resident and transport.arena is None:
                raise StorageError(f"the daemon at {address} holds layers {resident} resident but sent no arena")
            view, transport.arena = transport.arena, None  # ours now: closing the connection keeps the mapping
        finally:
            transport.close()
        cached = [layer for layer, where in placement.items() if where != "resident"]
        if view is not None:
            log.info("engram-store: mapped the arena of %s (%d bytes, huge pages: %s); resident layers %s%s", address,
                     view.size, (info.get("arena") or {}).get("huge_pages", "none"), resident,
                     f", cached layers {cached} fetched per step" if cached else "")
        else:
            log.info("engram-store: the daemon at %s holds every Engram layer cached (%s): rows fetched per step",
                     address, cached)
        return cls(address, view, info)

    @staticmethod
    def probe(address: str, wait: float | None = None) -> dict[str, Any]:
        """The Info of the daemon at ``address``, checked now (engine plugins call it when they load,
        so a wrong address stops the engine at start, not at model build). Waits up to ``wait``
        seconds for a daemon that is not listening yet (an engine started before the daemon);
        raises ``ConfigError`` for an address that is not a Unix socket and ``Unavailable`` naming the
        address when no daemon answers."""
        import time

        from ..client.unix_transport import UnixTransport
        from ..errors import Unavailable

        if not address.startswith("unix://"):
            raise ConfigError(f"engine tables need the daemon's Unix socket (unix:///path/to.sock), got {address!r}")
        if wait is None:
            text = os.environ.get(PROBE_WAIT_ENV, "")
            try:
                wait = float(text) if text else PROBE_WAIT_SECONDS
            except ValueError:
                raise ConfigError(f"{PROBE_WAIT_ENV}={text!r}: expected seconds, e.g. 30") from None
        deadline, told = time.monotonic() + wait, False
        while True:
            try:
                transport = UnixTransport(address[len("unix://"):], HELLO_REGION_BYTES, min(5.0, max(wait, 0.1)))
            except Unavailable as exc:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no engram-store daemon answers at {address} ({exc}); start it (systemctl start "
                                      "engram-store, or its DaemonSet) or unset ENGRAM_STORE_ADDR") from None
                if not told:
                    log.warning("engram-store: no daemon answers at %s yet; waiting up to %.0f s", address, wait)
                    told = True
                time.sleep(PROBE_PAUSE_SECONDS)
                continue
            try:
                return dict(transport.info_cached)
            finally:
                transport.close()

    @classmethod
    def shared(cls, address: str) -> "EngramStoreTables":
        """One mapping per process and address, opened on first use (engines call this from
        every layer; the arena is mapped once)."""
        with _shared_lock:
            tables = _shared_tables.get(address)
            if tables is None:
                tables = _shared_tables[address] = cls.connect(address)
            return tables

    @staticmethod
    def shared_if_open(address: str) -> "EngramStoreTables | None":
        """The :meth:`shared` tables of ``address`` when this process opened them already, else None
        (never connects: what no mapping exists for, nothing can alias)."""
        with _shared_lock:
            return _shared_tables.get(address)

    # --- facts ----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.placement))

    def rows(self, layer: int) -> int:
        try:
            return int(self.info["rows"][str(layer)])
        except KeyError:
            raise UnknownLayer(f"layer {layer}: the daemon at {self.address} serves layers {self.layers}") from None

    def is_resident(self, layer: int) -> bool:
        """Whether ``layer`` is in the arena (read in place); otherwise its rows are fetched per step."""
        self.rows(layer)
        return self.placement[layer] == "resident"

    def head_sizes(self, layer: int) -> tuple[int, ...]:
        """Rows of each (order, head) table of ``layer``, in row order (the engines' head order)."""
        return tuple(int(p) for p in self.spec.primes(layer).reshape(-1))

    def table_scale(self, layer: int) -> float | None:
        """The one scale of ``layer``'s whole table (vLLM's FP8 ``weight_scale``, NVFP4's ``weight_scale_2``),
        as the daemon's Info gives it; None when the daemon gives none (a row format without one)."""
        self.rows(layer)
        value = (self.info.get("table_scales") or {}).get(str(layer))
        return None if value is None else float(value)

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
        """Rows ``[row_start, row_end)`` of resident ``layer``: ``(weight float8_e4m3fn [n, dim],
        scales uint8 [n, dim // scale_block])``, CPU tensors aliasing the arena (no copy).
        Never write through them: the mapping is read-only and a write faults."""
        import torch

        if not self.is_resident(layer):
            raise StorageError(f"layer {layer} is cached by the daemon at {self.address}: its rows are not all in "
                               "DRAM and have no place in the arena; they are fetched per step (fetch_job, staged)")
        a = self.view.layout.layer(layer)
        end = a.rows if row_end is None else row_end
        if not 0 <= row_start <= end <= a.rows:
            raise UnknownLayer(f"layer {layer}: row range [{row_start}, {end}) is outside [0, {a.rows})")
        whole, n = self._whole_tensor(), end - row_start
        w0, s0 = a.weight_offset + row_start * a.weight_bytes, a.scale_offset + row_start * a.scale_bytes
        weight = whole[w0: w0 + n * a.weight_bytes].view(torch.float8_e4m3fn).view(n, a.weight_bytes)
        scales = whole[s0: s0 + n * a.scale_bytes].view(n, a.scale_bytes)
        return weight, scales

    def owns(self, address: int) -> bool:
        """Whether ``address`` lies in memory of the daemon's tables in this process: the mapped arena
        or a fetch job's staging (engines must never write there, nor load checkpoint rows into it)."""
        import numpy as np

        spans = [] if self.view is None else [(self.view.array.ctypes.data, self.view.size)]
        spans += [(np.frombuffer(job.staging, np.uint8).ctypes.data, len(job.staging)) for job in list(self._jobs)]
        return any(base <= address < base + size for base, size in spans)

    # --- cached layers ------------------------------------------------------------------
    def fetch_job(self, layer: int, max_rows: int) -> FetchJob:
        """A new fetch job for cached ``layer``, sized for ``max_rows`` rows a step (its own staging
        and connection; see :mod:`engram_store.fetch.job`), built from the tables this object
        connected to (:attr:`identity`): it reads those files and refuses a daemon serving others,
        even after a restart. Kept for :meth:`check_fetches`."""
        if self.is_resident(layer):
            raise StorageError(f"layer {layer} is resident: read it in place (views), no fetch job needed")
        job = FetchJob(self.address, layer, max_rows, identity=self.identity)
        if self.failure_board is not None:
            self.failure_board.attach_job(job.native)
        with self._lock:
            self._jobs.append(job)
            if self._registered and not (registration := _register_staging(job)):
                raise StorageError(f"layer {layer}'s fetch job: {registration.message}")
        if layer == min(self.layers) and not self._first_warned:
            log.info("engram-store: Engram layer %d, the model's first, is cached: at most one layer of compute hides "
                     "its fetch (none for a table read before decoder layer 0); the fetch time measured over the "
                     "first %d steps is logged", layer, FIRST_LAYER_STEPS)
        return job

    def job_tensors(self, job: FetchJob) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        """``(ids int64 [max_rows], weight float8_e4m3fn [max_rows, dim], scales uint8 [max_rows, sb])``:
        CPU tensors over the job's staging (the engines' kernels read the last two with positional ids)."""
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            ids = torch.from_numpy(job.ids)
            weight = torch.from_numpy(job.weight).view(torch.float8_e4m3fn)
            scales = torch.from_numpy(job.scales)
        return ids, weight, scales

    def staged(self, layer: int, ids: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        """One step's rows of cached ``layer``, fetched here (synchronously): ``(weight float8_e4m3fn
        [n, dim], scales uint8 [n, scale_bytes])``, row ``i`` = ``ids[i]`` (ids outside the layer:
        zeros). CPU tensors over the layer's staging: valid until the next ``staged`` of that layer.
        Raises ``CorruptRows`` when a page failed its checksum."""
        import numpy as np

        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self._lock:
            job = self._staged.get(layer)
            if job is None or job.max_rows < flat.size:
                if job is not None:
                    job.close()
                    self._jobs.remove(job)
                job = self._staged[layer] = self.fetch_job(layer, max(flat.size, STAGED_MIN_ROWS))
            job.ids[: flat.size] = flat
            job.run(flat.size)
            job.raise_if_failed()
            _, weight, scales = self.job_tensors(job)
            return weight[: flat.size], scales[: flat.size]

    def check_fetches(self) -> None:
        """Raise the first failure of any fetch job of this process since the last check (a page
        that failed its checksum: ``CorruptRows`` naming layer, rows and pages). Engines call it at
        each host-visible point of a step. Logs the measured fetch time of a cached first layer once."""
        for job in list(self._jobs):
            job.raise_if_failed()
        if not self._first_warned:
            first = [job for job in self._jobs if job.layer == min(self.layers)]
            if first and first[0].native.stats()["steps"] >= FIRST_LAYER_STEPS:
                self._first_warned = True
                stats = first[0].stats()
                log.warning("engram-store: Engram layer %d is cached and is the model's first: at most one layer of "
                            "compute hides its fetch (none for a table read before decoder layer 0), so each step may "
                            "wait for its rows; over %d steps a "
                            "fetch took %.2f ms on average, %.2f ms at most (%d of them read pages directly); give it "
                            "DRAM (placement = {%d = \"resident\"}) to take that off every step", first[0].layer,
                            stats["steps"], 1e3 * stats["total_seconds"] / max(1, stats["steps"]),
                            1e3 * stats["max_seconds"], stats["direct_steps"], first[0].layer)

    def register_cuda(self, layer: int | None = None) -> "Registration":
        """Page-lock for the GPU what its kernels read over UVA, once per process, through the GPU runtime
        torch runs on (CUDA or ROCm): the arena, read-only where the runtime supports it (else without the
        flag, else refused naming the attribute read: :func:`gpu_client.resident.register_read_only`), and
        the staging of every fetch job (writable: the jobs write it), each on its own, so a refused arena
        leaves cached layers served and a refused staging names its layer. Jobs made afterwards are
        registered by :meth:`fetch_job`. Idempotent.

        Returns the outcome for ``layer``: the arena for a resident layer, its fetch jobs' staging for a
        cached one; without ``layer``, for everything. Truthy when registered (and, where torch has a GPU,
        reported by ``is_pinned()``); falsy with ``.message`` saying what was refused and why."""
        from gpu_client.resident import Registration, register_read_only

        with self._lock:
            if self.view is not None and self._arena_registration is None:
                whole = self._whole_tensor()
                what = f"the arena of {self.address} (mapped read-only)"
                reg = register_read_only(whole.data_ptr(), whole.numel(), what, self.view)
                if reg and _torch_has_gpu() and not whole.is_pinned():
                    reg = Registration(what, False, message=f"{what} is registered ({reg.how}) but torch does not "
                                       "report it pinned: engines would copy it")
                if not reg:
                    log.error("engram-store: %s", reg.message)
                self._arena_registration = reg
            self._registered = True  # fetch_job registers the staging of jobs made from now on
            staging = {id(job): _register_staging(job) for job in self._jobs}
            arena = [self._arena_registration] if self.view is not None else []
            if layer is None:
                return Registration.combine("the arena and every fetch job's staging", arena + list(staging.values()))
            if self.is_resident(layer):
                return arena[0]
            mine = [staging[id(job)] for job in self._jobs if job.layer == layer]
            return Registration.combine(f"the staging of layer {layer}'s fetch jobs", mine)

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


_shared_lock = threading.Lock()
_shared_tables: dict[str, EngramStoreTables] = {}  # EngramStoreTables.shared: address -> the process's mapping


def describe_placement(info: dict[str, Any]) -> str:
    """One phrase for the log: which layers are read in place and which are fetched per step."""
    placement = _placement(info)
    resident = [layer for layer, where in sorted(placement.items()) if where == "resident"]
    cached = [layer for layer, where in sorted(placement.items()) if where != "resident"]
    parts = ([f"layers {resident} resident, mapped on first use"] if resident else []) + \
        ([f"layers {cached} cached, fetched a layer ahead"] if cached else [])
    return "; ".join(parts) or "no layers"


def _placement(info: dict[str, Any]) -> dict[int, str]:
    """``{layer: "resident" | "cached"}`` of a daemon's Info (an older daemon without placement: its mode)."""
    placement = {int(layer): where for layer, where in (info.get("placement") or {}).items()}
    if not placement:
        where = "resident" if info.get("mode") == "resident" else "cached"
        placement = {int(layer): where for layer in info.get("rows") or {}}
    return placement


def _register_staging(job: FetchJob) -> "Registration":
    """Page-lock a fetch job's staging for the GPU (writable: the job writes rows there). Idempotent (a
    staging registered before answers "already registered here" without asking the runtime again)."""
    from gpu_client.resident import register_writable

    import numpy as np

    base = np.frombuffer(job.staging, dtype=np.uint8)
    reg = register_writable(base.ctypes.data, base.nbytes, f"the staging of layer {job.layer}'s fetch job", job.staging)
    if not reg:
        log.error("engram-store: %s", reg.message)
    return reg


def staging_is_pinned(tensor: "torch.Tensor") -> bool:
    """Whether an engine's CPU tensor over a fetch job's staging is page-locked where torch has a GPU
    (always true without one: nothing reads it over UVA)."""
    return not _torch_has_gpu() or bool(tensor.is_pinned())


def _torch_has_gpu() -> bool:
    from gpu_client.resident import cuda_available

    return cuda_available()
