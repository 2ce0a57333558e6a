"""The ``serve`` lifecycle: open tables, fill DRAM, open listeners, announce, drain.

Start-up order: (0) check every config value against the host
(:func:`~engram_store.daemon.preflight.preflight`: a daemon already on the socket,
manifest, memory, warm-up profile (read there, once), TLS and token files, free
ports), so a mistake stops the daemon in a moment rather than after a DRAM fill, (1) with ``verify``,
check that every data and page checksum file is there and whole (sizes only:
no table byte is read), (2) open the store (which fills the DRAM tier in
resident mode, checking every page's crc32c as it reads it: one pass; cached
mode reads nothing and starts at once, its pages are checked when read and
by the background scrub), (3) open the Unix socket and gRPC listeners, (4)
write the ready file (JSON with the real addresses) and send systemd
``READY=1``. The HTTP endpoint (metrics and probes) opens right after (0):
``/livez`` answers during the fill, ``/readyz`` turns 200 at (4) and 503 again
when a stop begins. A corrupt page never stops the daemon: its rows are
refused (CorruptRows), the rest is served, and ``info()`` lists it under
``bad_pages``. A layer the store cannot serve (file missing or truncated, with
``verify`` off) is left out of ``info()`` (listed under ``layers_unavailable``);
its lookups fail with a StorageError naming it. SIGTERM/SIGINT: ``STOPPING=1``, stop accepting, let in-flight
lookups finish, close the store, remove the ready file, exit 0: all of it within
``drain_seconds`` of the signal by construction (:mod:`.stopping`: every step
bounded, what does not finish abandoned and logged, a watchdog ending the process
at the deadline). A ready file left by a daemon that did not stop (SIGKILL) is
checked against its pid at the next start (:mod:`.readyfile`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .. import errors
from ..format.manifest import Manifest
from ..format.tableset import TableSet
from ..storage.base import PlanningStore, ProfiledStore, RowStore
from ..storage.placement import format_placement, parse_placement
from ..version import __version__
from ..wire import frames as wire
from . import readyfile
from .config import DaemonConfig
from .fill_progress import logged_fill
from .preflight import preflight
from .stats import DaemonStats, combined_snapshot
from .stopping import StopClock

log = logging.getLogger(__name__)
_UNREAD = object()

STOP_RESERVE_SECONDS = 0.5  # of drain_seconds (a quarter at most), kept for the pool, metrics and store after the listeners
SD_NOTIFY_SECONDS = 0.2  # longest wait to hand a notification to systemd

StoreOpener = Callable[[DaemonConfig], RowStore]


def open_store(config: DaemonConfig, warmup: np.ndarray | None = None) -> RowStore:
    """Open the table set with the tiered store; with ``verify``, refuse one whose data or
    checksum files are missing or truncated (sizes only: pages are checked as they are read).
    ``warmup``: the profile pairs preflight read (the file is not read again)."""
    if not config.tables:
        raise errors.ConfigError("config key 'tables' is empty: give --tables DIR (a table-set directory)")
    if config.verify:
        TableSet.open(config.tables).close()
    from ..storage.hint_queue import HintSettings
    from ..storage.tiered import TieredStore  # the engine is loaded only by the daemon

    hints = HintSettings(cache_share=config.hint_cache_share, queue_depth=config.hint_queue_depth,
                         max_age_seconds=config.hint_max_age_seconds, max_queued_rows=config.hint_max_queued_rows)
    store = TieredStore.open(config.tables, dram_bytes=config.dram_bytes, mode=config.store_mode,
                             placement=parse_placement(config.placement),
                             policy=config.cache_policy, queue_depth=config.nvme_queue_depth,
                             huge_pages=config.huge_pages,
                             warmup=warmup,
                             scrub_bytes_per_second=config.scrub_bytes_per_second, hints=hints)
    for layer, ranges in store.bad_pages().items():
        log.error("layer %d: %d corrupt pages (page ranges %s) are refused; the rest is served. Engine plugins "
                  "reading the arena in place must skip them (info 'bad_pages'); repair the table set",
                  layer, sum(b - a for a, b in ranges), ranges[:8])
    return store


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit: each Unix client holds two fds (socket, region)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the fd limit from %d: %s", soft, exc)
    return soft


def sd_notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` to systemd's NOTIFY_SOCKET if set (datagram, no dependency); True if sent."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(SD_NOTIFY_SECONDS)  # a service manager that reads nothing must not hold the daemon
            s.connect(address)
            s.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify(%s) to %s failed: %s", state, address, exc)
        return False


class Daemon:
    """One ``serve`` run. :meth:`run` is a coroutine on the process's event loop."""

    def __init__(self, config: DaemonConfig, store_opener: StoreOpener | None = None) -> None:
        self.config = config
        self.store_opener = store_opener or (lambda c: open_store(c, self.warmup))
        self.warmup: np.ndarray | None = None  # the warm-up profile's pairs, read by preflight
        self.stats = DaemonStats()
        self.store: RowStore | None = None
        self._token_map: Any = _UNREAD  # the manifest's token-map entry, read on first Info
        self.spec: dict[str, Any] = {}
        self.table_scales: dict[str, float] = {}  # {layer: the table's one scale}, for specs whose rows have one
        self.pool = ThreadPoolExecutor(config.worker_count, thread_name_prefix="engram-lookup")
        self.clock = StopClock(config.drain_seconds)  # started by SIGTERM/SIGINT: the stop's one deadline
        self.unix = None
        self.grpc = None
        self.metrics = None

    # --- facts served to clients ------------------------------------------
    def info(self) -> dict[str, Any]:
        store = self.store
        if store is None:
            raise errors.Unavailable("engram-store is starting")
        arena = store.arena()
        broken = self.unavailable_layers()
        layers = [layer for layer in store.layers if layer not in broken]
        reply = {
            "layers": layers, "rows": {str(layer): store.rows(layer) for layer in layers},
            "layers_unavailable": {str(layer): why for layer, why in broken.items()},
            "row_bytes": store.row_bytes, "mode": store.mode, "spec": self.spec,
            "placement": {str(layer): where for layer, where in store.placement().items()},
            "max_request_rows": self.config.max_request_rows, "workers": self.config.worker_count,
            "unix_native": self.unix is not None and self.unix.native is not None,
            "version": __version__,
            "protocol_version": wire.VERSION, "pid": os.getpid(),
            "token_map": self._token_map_info(),
            "arena": None if arena is None else arena.layout.to_dict() | {"huge_pages": arena.huge_pages,
                                                                          "huge_page_bytes": arena.page_bytes},
            "bulk_reader": getattr(store, "bulk_reader", "none"),  # what filled the arena: posix, kvikio-*, none
            "bad_pages": self.bad_pages(),
            # what a same-host engine's fetch job reads itself while the daemon is gone (paths of this host)
            "layer_files": {str(k): v for k, v in store.layer_files().items()} if isinstance(store, PlanningStore) else {},
        }
        if self.table_scales:  # only for a spec whose rows share one scale per table
            reply["table_scales"] = self.table_scales
        return reply

    def bad_pages(self) -> dict[str, list[list[int]]]:
        """Pages of each layer whose crc32c failed: ``{layer: [[first_page, end_page), ...]}``.
        Their rows are refused; a reader of the resident arena in place must skip them."""
        return {str(layer): ranges for layer, ranges in self.store.bad_pages().items()}

    def _token_map_info(self) -> dict[str, Any] | None:
        """The manifest's token-map entry (files, classes, checksums) and the table set's absolute directory:
        same-host clients read and check the map file there (engram_store.models.tokens.read_token_map)."""
        if self._token_map is _UNREAD:
            entry = Manifest.load(self.config.tables).token_map if self.config.tables else None
            self._token_map = None if entry is None else entry | {"directory": os.path.abspath(self.config.tables)}
        return self._token_map

    def unavailable_layers(self) -> dict[int, str]:
        """Layers of the table set the store cannot serve, with the reason."""
        return dict(self.store.layer_errors())

    def stats_snapshot(self) -> dict[str, float]:
        store_stats = self.store.stats() if self.store is not None else {}
        return combined_snapshot(self.stats, store_stats)

    # --- lifecycle ----------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal() -> None:
            self.clock.start()  # from here the process has drain_seconds, whatever it is doing
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        readyfile.clear_stale(self.config.ready_file)  # refuses one naming another live daemon
        checked = await loop.run_in_executor(None, preflight, self.config)  # nothing to shut down yet if it fails
        self.warmup = checked.warmup
        raise_fd_limit()
        try:
            self._start_http()
            opening = loop.run_in_executor(None, self._open)
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([opening, stopping], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                if not opening.done():  # a resident fill can take minutes: not ours to wait for
                    self.clock.abandon("the table load in progress")
                log.info("stop requested while loading; exiting")
                return 0
            stopping.cancel()
            await opening  # raises what the load raised
            await self._listen()
            self._announce()
            await stop.wait()
            log.info("SIGTERM: draining in-flight requests (at most %.0fs)", self.config.drain_seconds)
            if self.metrics is not None:
                self.metrics.set_state("stopping")
            sd_notify("STOPPING=1")
        finally:
            await self._shutdown()
        return 0

    def _open(self) -> None:
        manifest = Manifest.load(self.config.tables) if self.config.tables else None
        self.spec = manifest.spec.to_dict() if manifest else {}
        self.table_scales = {str(k): v for k, v in manifest.table_scales.items()} if manifest else {}
        with logged_fill(self.config, log):  # a log line every few seconds while the resident arena fills
            store = self.store_opener(self.config)
        self.store = store
        log.info("serving %s: layers %s, %d-byte rows, %s mode (%s)", self.config.tables, list(store.layers),
                 store.row_bytes, store.mode, format_placement(store.placement()))

    def _start_http(self) -> None:
        """Metrics and probes, before the fill: /livez answers at once, /readyz 503 until ready."""
        from .http.metrics import MetricsServer

        if self.config.metrics:
            self.metrics = MetricsServer(self.config.metrics, max_connections=self.config.metrics_max_connections,
                                         request_timeout=self.config.metrics_request_timeout_seconds)
            self.metrics.start()

    async def _listen(self) -> None:
        from .grpc.server import GrpcServer
        from .grpc.service import EngramStoreService
        from .http.exporter import DaemonCollector
        from .unix.server import UnixServer

        store = self.store
        if store is None:
            raise errors.Unavailable("store not open")
        if self.config.socket:
            self.unix = UnixServer(store, self.config, self.stats, self.pool, self.info, self.stats_snapshot)
            self.unix.start()
        if self.config.grpc:
            service = EngramStoreService(self.config, self.stats.grpc, self.pool, self.info, self.stats_snapshot)
            service.attach(store)
            self.grpc = GrpcServer(service, self.config)
            await self.grpc.start()
        if self.metrics is not None:
            self.metrics.attach(DaemonCollector(self.stats, store.stats, store.mode, store.placement(), info=self.info))

    def ready_info(self) -> dict[str, Any]:
        socket_path = os.path.abspath(self.unix.path) if self.unix else ""  # clients may run from any directory
        return {
            "pid": os.getpid(), "version": __version__,
            "socket": socket_path,
            "unix": f"unix://{socket_path}" if socket_path else "",
            "grpc": self.grpc.address if self.grpc else "",
            "metrics": self.metrics.address if self.metrics else "",
            "mode": self.store.mode if self.store else "",
            "placement": {str(layer): where for layer, where in self.store.placement().items()} if self.store else {},
        }

    def _announce(self) -> None:
        ready = self.ready_info()
        if self.metrics is not None:  # /readyz first: whoever sees the ready file finds it 200
            self.metrics.set_state("ready")
        readyfile.write(self.config.ready_file, ready)
        sd_notify(f"READY=1\nSTATUS=serving {ready['mode']}\nMAINPID={os.getpid()}")
        log.info("ready: %s", ready)

    def _save_profile(self) -> None:
        """Cached layers and ``save_profile``: the hottest rows, for the next start's warm-up."""
        path = self.config.save_profile
        if not path or self.store.mode == "resident" or not isinstance(self.store, ProfiledStore):
            return
        try:
            self.store.write_profile(path)
        except OSError as exc:  # the stop goes on: a profile only speeds up the next start
            log.error("config key 'save_profile': cannot write %s: %s", path, exc)

    async def _shutdown(self) -> None:
        """Each step bounded by what is left of drain_seconds since the signal (:class:`StopClock`);
        what does not finish in time is abandoned, logged, and the process ends at once."""
        readyfile.remove(self.config.ready_file)  # first: from here on the daemon accepts nobody new
        clock = self.clock
        clock.start(watchdog=False)  # no signal (an error while starting): bounded steps, no watchdog
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        after = min(STOP_RESERVE_SECONDS, clock.drain_seconds / 4)  # kept for the pool, metrics and store
        listen = clock.left(after + clock.margin())  # the listeners' own drain, then a little to wrap up
        waits = []
        if self.unix is not None:
            waits.append(loop.run_in_executor(None, self.unix.stop, listen))
        if self.grpc is not None:
            waits.append(self.grpc.stop(listen))
        done = await clock.wait("the listeners' drain", waits, reserve=after / 2) if waits else []
        busy = done[0] if self.unix is not None and done and isinstance(done[0], int) else 0
        busy += len(waits) - len(done)  # a listener still draining may still read the store
        for result in done:
            if isinstance(result, BaseException):
                log.error("listener shutdown failed: %s", result)
        t1 = time.monotonic()
        self.pool.shutdown(wait=False, cancel_futures=True)  # queued lookups have nobody to answer any more
        steps = [loop.run_in_executor(None, self.pool.shutdown, True)]
        if self.metrics is not None:
            steps.append(loop.run_in_executor(None, self.metrics.stop))
        finished = await clock.wait("the lookups in flight and the metrics server", steps, reserve=after / 4)
        t2 = time.monotonic()
        if busy or len(finished) < len(steps):  # a lookup may still read the store: leave it to the exit
            log.warning("%d Unix clients or lookups still busy after %.2fs; exiting without closing the store",
                        max(busy, 1), t2 - (clock.started_at or t0))
        elif self.store is not None:
            closed = await clock.wait("closing the store", loop.run_in_executor(None, self._close_store))
            if closed and isinstance(closed[0], BaseException):
                log.error("closing the store failed: %s", closed[0])
        log.info("stopped (listeners %.2fs, lookup pool and metrics %.2fs, store %.2fs; %.2fs since the signal)",
                 t1 - t0, t2 - t1, time.monotonic() - t2, time.monotonic() - (clock.started_at or t0))
        if clock.abandoned and clock.watched:  # the interpreter's exit would wait for what was abandoned
            clock.exit(0)

    def _close_store(self) -> None:
        self._save_profile()
        self.store.close()
        self.store = None


def run(config: DaemonConfig, store_opener: StoreOpener | None = None) -> int:
    """Run the daemon until SIGTERM on uvloop (or plain asyncio when configured or absent)."""
    daemon = Daemon(config, store_opener)
    if config.grpc_event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed; using the asyncio event loop")
        else:
            return uvloop.run(daemon.run())
    return asyncio.run(daemon.run())
