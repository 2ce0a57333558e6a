"""Fetch jobs: one cached Engram layer's rows of each step, fetched by native code (``fetch/_fetch.c``)
that a CUDA host function can run inside an engine's CUDA graph.

::

    job = FetchJob("unix:///run/engram-store/engram-store.sock", layer=14, max_rows=6144)
    job.ids[:n] = row_ids                # the engines copy them device-to-host instead
    job.run(n)                           # on GPU: job.launch_host(stream, n), captured by CUDA graphs
    job.raise_if_failed()                # at the engine's next host-visible point
    job.weight[:n], job.scales[:n]       # float8 payloads / E8M0 scales, row i = ids[i]

A job owns a staging buffer for its life (its address never changes, so a CUDA graph captured over
it stays valid): the ids, then the payload block ``[max_rows, dim]`` and the scale block
``[max_rows, scale_bytes]``, the split layout vLLM's and SGLang's kernels read (``weight`` /
``weight_scale_inv``) with positional ids. :attr:`FetchJob.staging` is what an engine registers
with ``cudaHostRegister``. It lives in a memfd of the job's, sealed against shrinking and growing,
which the job hands to every daemon it connects to (``engram_store/wire/staging.py``): the daemon
writes each step's rows straight into the two blocks, one host copy per row. A daemon that does not
take it (an older one) writes the rows into the shared region and the job copies them into the
blocks (two copies), as ``one_copy=False`` asks.

A job is made from one table-set identity (:class:`~engram_store.client.table_files.TableIdentity`:
the spec and, per layer, the files the daemon reads and the crc32 of their page checksums), the one
its engine captured when it connected, or the daemon's at the job's own handshake. It opens those
files itself and refuses a daemon that later answers with another identity (restarted on another
table set), naming both; it then reads its own files.

A step asks the daemon over a connection of its own (one LOOKUP, the rows written into the staging
under its *gate*: a step that gives up on the daemon revokes its request first, so that no late answer
ever writes into the staging after the step returned; a daemon caught mid-write is waited for until its
write ends or it is gone, seen by its pidfd or, where none can be had (an older kernel across PID
namespaces, as for pods without ``hostPID``), by its connection hanging up: ``fetch/writer.h``). A daemon that is slow is not waited on for long:
once it has not answered
within the *hedge budget* (2 ms plus twice the p99 of its last 128 answers, at most 100 ms or a
quarter of the deadline; ``hedge`` or ``ENGRAM_STORE_FETCH_HEDGE_SECONDS`` fixes it), the job also
reads the rows' pages from the table files itself (O_DIRECT, each 4 KiB page checked against the
crc32c the daemon checks against), and the first complete source wins. A daemon still busy with a request a step gave up on
is skipped until its late answer is read and dropped; one that misses its budget three times in a row
is skipped for 50 ms, doubling up to 2 s while it keeps missing. A daemon that is gone is dropped
and a thread of this process reconnects in the background. The direct reads of all jobs on the node
that read one device share one budget of pages in flight (:mod:`.budget`: the device's queue
depth, or ``ENGRAM_STORE_DIRECT_BUDGET_PAGES``): with none of it free a step waits for its daemon (or
for the budget) to its deadline instead of adding reads to a busy disk; :meth:`FetchJob.stats` says
which path served each step.

Every step ends within ``deadline`` (default :data:`DEFAULT_DEADLINE_SECONDS`, or
``ENGRAM_STORE_FETCH_DEADLINE_SECONDS``): direct reads run in a reader thread the step waits for, so
a stuck device fails the step at the deadline (its rows zero, :meth:`FetchJob.raise_if_failed`
raises ``StorageError`` naming layer and deadline) and later direct reads fail at once until it
ends. A page that fails its checksum (no good copy anywhere) fails a step too: its rows are zero and
``raise_if_failed`` raises ``CorruptRows`` naming the layer, rows and pages; so does a table file
changed, replaced or removed since the job opened it (``StorageError`` naming layer and file).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading
from typing import Any

import numpy as np

from .. import errors
from ..native import load, shm, syscalls
from ..models.spec import ModelSpec
from ..wire import frames as wire
from ..wire import staging as wst
from ..client.table_files import TableFiles, TableIdentity
from ..client.unix_transport import UnixTransport
from . import budget as direct_budget

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_SECONDS = 2.0  # the longest a step takes: past it, its rows are zero and the failure raised
DEADLINE_ENV = "ENGRAM_STORE_FETCH_DEADLINE_SECONDS"
HEDGE_ENV = "ENGRAM_STORE_FETCH_HEDGE_SECONDS"  # a fixed hedge budget; unset: measured (see the module docstring)
RECONNECT_SECONDS = 0.25  # how often a job without its daemon tries to get it back
RECONNECT_TIMEOUT_SECONDS = 2.0  # one attempt's connect + handshake, and then its staging offer's reply, each
EXIT_JOIN_SECONDS = 2 * RECONNECT_TIMEOUT_SECONDS + 1.0  # at exit: the longest one attempt takes, and a margin
QUEUE_DEPTH = 64  # direct page reads in flight


def native_fetch():
    """The native module, or EngineUnsupported when it is not built (there is no fallback: a CUDA
    host function must be native code)."""
    module = load("_fetch", "cached Engram layers cannot be served to engines", package=__package__)
    if module is None:
        raise errors.EngineUnsupported("engram_store.fetch._fetch is not built: engines cannot be served cached "
                                       "Engram layers; reinstall engram-store with a C compiler (pip install .)")
    wire.check_native_layout(module.FRAME_FIELDS, "engram_store/fetch/_fetch.c")
    direct_budget.check_native_layout(module)
    native = (module.FLAG_SPLIT, module.SPLIT_PAD_ID, tuple(module.GATE_STATES))
    python = (int(wire.Flag.SPLIT), wst.PAD_ID, (wst.GATE_REVOKED, wst.GATE_OPEN, wst.GATE_WRITING, wst.GATE_DONE))
    if native != python:
        raise wire.ProtocolError(f"engram_store/fetch/_fetch.c and engram_store/wire disagree on the staging protocol "
                                 f"(C {native}, Python {python}); rebuild the native modules (pip install -e .)")
    return module


def socket_path(address: str) -> str:
    if not address.startswith("unix://"):
        raise errors.ConfigError(f"a fetch job needs the daemon's Unix socket (unix:///path/to.sock), got {address!r}")
    return address[len("unix://"):]


def deadline_seconds(value: float | None = None) -> float:
    if value is None:
        text = os.environ.get(DEADLINE_ENV, "")
        try:
            value = float(text) if text else DEFAULT_DEADLINE_SECONDS
        except ValueError:
            raise errors.ConfigError(f"{DEADLINE_ENV}={text!r}: expected seconds, e.g. 2.0") from None
    if not 0 < value <= 600:
        raise errors.ConfigError(f"fetch deadline {value!r}: expected seconds in (0, 600]")
    return float(value)


def hedge_seconds(value: float | None, deadline: float) -> float | None:
    """A fixed hedge budget (``value``, else ``ENGRAM_STORE_FETCH_HEDGE_SECONDS``), or None: measured."""
    if value is None:
        text = os.environ.get(HEDGE_ENV, "")
        if not text:
            return None
        try:
            value = float(text)
        except ValueError:
            raise errors.ConfigError(f"{HEDGE_ENV}={text!r}: expected seconds, e.g. 0.01") from None
    if not 0 < value <= deadline:
        raise errors.ConfigError(f"fetch hedge budget {value!r}: expected seconds in (0, {deadline:g}] (the deadline; "
                                 "equal to it: never read directly while the daemon may still answer)")
    return float(value)


class FetchJob:
    """One cached layer's fetch job in this process (see the module docstring). Thread-safe; its
    runs are serialized (an engine issues them in stream order).

    ``identity``: the tables the job reads and accepts a daemon for (an engine's, taken when it
    connected); None: the daemon's at ``address`` now. ``hedge``: a fixed hedge budget in seconds
    instead of the measured one (or ``ENGRAM_STORE_FETCH_HEDGE_SECONDS``; equal to the deadline: no
    hedging). ``deadline``: the longest a step takes (see the module docstring). ``one_copy``: hand
    the staging to the daemon, which then writes the rows there itself (False: the daemon writes them
    into the shared region and the job copies them into the staging)."""

    def __init__(self, address: str, layer: int, max_rows: int, *, deadline: float | None = None,
                 queue_depth: int = QUEUE_DEPTH, connect_timeout: float = 10.0, identity: TableIdentity | None = None,
                 hedge: float | None = None, one_copy: bool = True) -> None:
        native = native_fetch()
        self.address, self.path, self.layer = address, socket_path(address), int(layer)
        self.deadline = deadline_seconds(deadline)
        self.hedge = hedge_seconds(hedge, self.deadline)
        if identity is None:  # the daemon's tables now: its Info at a handshake of our own
            transport = UnixTransport(self.path, MIN_REGION_BYTES, connect_timeout)
            try:
                identity = TableIdentity.from_info(transport.info_cached, address)
            finally:
                transport.close()
        self.identity = identity
        described = identity.described(self.layer)
        self.spec = ModelSpec.from_dict(identity.spec)
        if self.layer not in self.spec.layers:
            raise errors.UnknownLayer(f"layer {self.layer} is not an Engram layer of spec {self.spec.name!r}")
        fmt = self.spec.row_format
        self.layer_rows = identity.rows[str(self.layer)]
        self.row_bytes, self.dim, self.scale_bytes = fmt.row_bytes, fmt.payload_bytes, fmt.scale_count
        files = TableFiles(self.layer, described, native)
        self.one_copy = bool(one_copy)
        try:
            nbytes = native.staging_bytes(max_rows, self.dim, self.scale_bytes)
            self._staging_fd, self._memory = _staging_memfd(nbytes + syscalls.PAGE)  # the gate: the page after
            self.staging = memoryview(self._memory)[:nbytes]
            watched = files.take()
        finally:
            files.close()
        self.device = watched[0][2]  # the table files' device: the node's direct-read budget is its
        budget = direct_budget.open_budget(self.device)
        try:
            self.native = native.Job(self.layer, self.layer_rows, self.row_bytes, self.dim, files.rows_per_page,
                                     self.staging, files.checksums, watched, queue_depth, self.deadline,
                                     self.hedge or 0.0, memoryview(self._memory)[nbytes: nbytes + wst.GATE_BYTES],
                                     budget)
        finally:
            if budget >= 0:
                os.close(budget)  # the job keeps its own dup
        self.max_rows = int(self.native.max_rows)
        ids_at, weight_at, scales_at = self.native.offsets
        self._geometry = wst.StagingGeometry(self.dim, self.scale_bytes, self.max_rows, weight_at, scales_at, nbytes)
        whole = np.frombuffer(self.staging, dtype=np.uint8)
        self.ids = whole[ids_at: ids_at + self.max_rows * 8].view("<i8")
        self.weight = whole[weight_at: weight_at + self.max_rows * self.dim].reshape(self.max_rows, self.dim)
        self.scales = whole[scales_at: scales_at + self.max_rows * self.scale_bytes].reshape(self.max_rows,
                                                                                               self.scale_bytes)
        self._region = None
        self._lock = threading.Lock()
        self._closed = False
        self._refused = ""  # why the last daemon reached was not taken (another table set)
        self._declined = ""  # why the last daemon did not take the staging (one host copy)
        self.reconnects = 0
        try:
            self.connect(connect_timeout)
        except errors.EngramStoreError as exc:  # the job works without the daemon; it comes back later
            log.warning("engram-store fetch job, layer %d: no daemon connection yet (%s); reading pages directly "
                        "until one is made", self.layer, exc)
        _supervisor().watch(self)

    # --- the daemon connection ---------------------------------------------------------
    def connect(self, timeout: float) -> None:
        """Make (or remake) the job's connection; refuses a daemon serving other tables than the job's
        identity (``ModelMismatch`` naming both; logged once per change). Takes at most ``timeout`` to
        connect and shake hands, and ``timeout`` more for the daemon's answer to the staging offer."""
        transport = UnixTransport(self.path, _region_bytes(self.max_rows, self.row_bytes), timeout, timeout=timeout)
        try:
            other = self.identity.mismatch(transport.info_cached, self.layer)
            if other:
                why = (f"the daemon at {self.address} serves other tables for layer {self.layer} than this engine "
                       f"started with ({other}); this job keeps reading its own files directly (restart the engine "
                       "to use the new tables)")
                if why != self._refused:
                    log.error("engram-store fetch job: %s", why)
                    self._refused = why
                raise errors.ModelMismatch(why)
            split = self._offer_staging(transport)
            fd, region = transport.hand_over()
        finally:
            transport.close()
        ids_bytes = wire.align(self.max_rows * 8)
        with self._lock:
            if self._closed:
                os.close(fd)
                shm.release(region)
                return
            self.native.attach(fd, region, 0, ids_bytes, split)  # the job releases the previous region's buffer
            old, self._region = self._region, region
        shm.release(old)

    def _offer_staging(self, transport: UnixTransport) -> bool:
        """Hand the daemon this job's staging memfd: True when it writes the rows there itself."""
        if not self.one_copy:
            return False
        try:
            transport.attach_staging(self._staging_fd, self._geometry)
        except errors.EngramStoreError as exc:
            if transport.broken:
                raise
            why = str(exc)
            if why != self._declined:
                log.info("engram-store fetch job, layer %d: the daemon at %s writes rows into the shared region, the "
                         "job copies them into its staging (two host copies): %s", self.layer, self.address, why)
                self._declined = why
            return False
        self._declined = ""
        return True

    @property
    def connected(self) -> bool:
        return bool(self.native.connected)

    # --- runs -------------------------------------------------------------------------------
    def run(self, n: int) -> None:
        """Fetch rows ``0..n-1`` of :attr:`ids` into the blocks now (the GIL released)."""
        self.native.run(n)

    def launch_host(self, stream: int, n: int) -> None:
        """Enqueue the run on CUDA ``stream`` (a ``cudaStream_t``) as a host function."""
        self.native.launch_host(stream, n)

    def raise_if_failed(self) -> None:
        """Raise the first failure since the last call: ``CorruptRows`` (pages that failed their
        checksum; their rows were zero) or ``StorageError`` (a read that failed)."""
        kind, message, pages = self.native.error()
        if not kind:
            return
        self.native.clear_error()
        if kind == "corrupt":
            raise errors.CorruptRows(f"engram-store fetch job: {message}", self.layer, tuple(pages))
        raise errors.StorageError(f"engram-store fetch job: {message}")

    def stats(self) -> dict[str, Any]:
        """The job's counters. How each step was served: ``daemon_steps`` (of which ``waited_steps`` waited
        for the daemon because the node's direct-read budget was spent), ``hedged_direct_steps`` (read
        directly after asking the daemon), ``fallback_direct_steps`` (read directly without it);
        ``budget_refusals``: steps the budget refused a direct read at least once; ``direct_budget_pages``:
        the node's budget now (0: none)."""
        return self.native.stats() | {"connected": self.connected, "reconnects": self.reconnects,
                                      "max_rows": self.max_rows, "deadline_seconds": self.deadline}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _supervisor().forget(self)
        self.native.detach()
        self.native.close()  # a run in progress ends first (within its deadline); none runs after
        region, self._region = self._region, None
        shm.release(region)
        fd, self._staging_fd = self._staging_fd, -1
        if fd >= 0:
            os.close(fd)  # (the mapping, and so the staging, lives on while anything holds it)


MIN_REGION_BYTES = 1 << 16  # the smallest shared region a daemon hands out
STAGING_SEALS = syscalls.F_SEAL_SHRINK | syscalls.F_SEAL_GROW | syscalls.F_SEAL_SEAL  # what a daemon checks


def _staging_memfd(nbytes: int) -> tuple[int, mmap.mmap]:
    """A zeroed memfd of ``nbytes``, sealed at that size for good, and this process's shared mapping of
    it (page aligned, registrable with cudaHostRegister)."""
    fd = os.memfd_create("engram-store-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        syscalls.add_seals(fd, STAGING_SEALS)
        memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, memory


def _region_bytes(max_rows: int, row_bytes: int) -> int:
    return max(MIN_REGION_BYTES, wire.align(max_rows * 8) + wire.align(max_rows * row_bytes) + wire.ALIGN)


class _Supervisor:
    """One thread per process that gives jobs without a daemon connection a new one. A connection the
    daemon closed while its job sat between steps (its ``client_idle_timeout_seconds``, a restart) is
    noticed here (``probe``) and remade at once, so the next step still goes to the daemon; the late
    answer of a request a step gave up on is read and dropped there too (or the connection dropped
    once it is a deadline late).

    The thread ends before the interpreter finalizes (:meth:`stop`, an ``atexit`` hook). CPython ends a
    daemon thread still running then with ``pthread_exit`` when it next takes the GIL, and this one may
    be outside the GIL in C++ code: the cyclic GC runs on whichever thread allocates, and torch's
    destructors release the GIL (a gloo ``ProcessGroup`` that a failed step's traceback kept past
    ``destroy_process_group``, freed here, joins its threads so). The forced unwind then meets a
    ``noexcept`` destructor and libstdc++ aborts the process ("terminate called without an active
    exception", rc -6).

    The thread holds jobs only during a pass (:meth:`_pass`), never between passes: a job its owner
    closed and dropped is freed in the owner's thread, not in this one at exit (freeing a job closes its
    table files, and the last close of a removed file frees its blocks: seconds with online discard)."""

    def __init__(self) -> None:
        self._jobs: list[FetchJob] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def watch(self, job: FetchJob) -> None:
        with self._lock:
            self._jobs.append(job)
            if self._stopping.is_set():
                return  # the interpreter is exiting: no thread to outlive it
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(self.stop)
                self._thread = threading.Thread(target=self._loop, name="engram-store-fetch-reconnect", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread and wait for it: a reconnect in progress ends within its timeouts."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(EXIT_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("engram-store: the fetch jobs' reconnect thread did not end within %.0f s at exit (the "
                            "longest a reconnect attempt takes); the interpreter ends it where it stands",
                            EXIT_JOIN_SECONDS)

    def forget(self, job: FetchJob) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def _loop(self) -> None:
        while not self._stopping.wait(RECONNECT_SECONDS):
            self._pass()  # its references to the jobs end with it: none is held between passes

    def _pass(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            if job.connected and job.native.probe():  # (a late answer is read and dropped there too)
                log.info("engram-store fetch job, layer %d: %s; reconnecting", job.layer, job.native.stats()["note"])
        for job in jobs:
            if job.connected:
                continue
            if self._stopping.is_set():
                return
            try:
                job.connect(RECONNECT_TIMEOUT_SECONDS)
            except errors.EngramStoreError:
                continue
            job.reconnects += 1
            log.info("engram-store fetch job, layer %d: back on the daemon at %s", job.layer, job.address)


_SUPERVISOR = _Supervisor()


def _supervisor() -> _Supervisor:
    return _SUPERVISOR
