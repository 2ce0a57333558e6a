"""``EngramClient``: rows from an engram-store daemon, over shared memory or gRPC.

    with EngramClient.connect("unix:///run/engram-store/engram-store.sock") as c:
        rows = c.lookup(1, row_ids)                  # uint8 row_ids.shape + (row_bytes,)
        c.lookup_into(1, row_ids, pinned_buffer)     # into a caller-owned buffer
        with c.lookup_view(1, row_ids) as view:      # unix: read-only view of the shared region
            ...
        h = c.submit(1, row_ids); ...; rows = h.wait(); h.release()
        buf = c.reserve((n, c.row_bytes)); c.lookup_into(1, ids, buf)   # unix: one copy

``unix://PATH`` maps a per-client shared region (``shared_region``, where the
daemon writes rows; register it with cudaHostRegister for DMA) and, when the
daemon is resident, the whole table arena read-only (``arena``). ``grpc://HOST:PORT``
(``grpcs://`` with ``tls_ca``) works from anywhere; the daemon requires client
authentication there: ``token_file=`` (or ``token=``, or the file named by
``ENGRAM_STORE_GRPC_TOKEN_FILE``) and/or a client certificate (``tls_cert``,
``tls_key``). Thread-safe. Each call waits at most ``timeout`` seconds for the
daemon (``DeadlineExceeded`` after that). When the daemon restarts, the next call
reconnects by itself, and a submitted lookup is asked again of the new daemon,
for ``reconnect_timeout`` seconds at most (then ``Unavailable`` says how long it
tried, e.g. while the daemon crash-loops); ``generation`` goes up on each reconnect: views, ``shared_region`` and ``arena`` taken
before belong to the old connection and must be fetched again.
Errors are ``engram_store.errors`` classes carrying the daemon's message.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import numpy as np

from engram_store import errors
from engram_store.client.transport import Pending, Transport

log = logging.getLogger(__name__)

T = TypeVar("T")
_SCHEMES = ("unix://", "grpc://", "grpcs://")


class LookupHandle:
    """A submitted lookup: ``wait()`` -> rows (a read-only view of the shared region over unix,
    an owned array over gRPC); ``release()`` frees the region space. Also a context manager."""

    __slots__ = ("_client", "_layer", "_ids", "_inner", "_rows", "_retry_deadline")

    def __init__(self, client: "EngramClient", layer: int, row_ids: np.ndarray) -> None:
        self._client, self._layer, self._ids = client, layer, row_ids
        self._inner: Pending | None = None
        self._rows: np.ndarray | None = None
        self._retry_deadline: float | None = None  # set by the first lost connection
        self._start()

    def _start(self) -> None:
        self._inner = self._client._with_transport(lambda t: t.submit(self._layer, self._ids), self._retry_deadline)

    def wait(self) -> np.ndarray:
        """The rows. If the daemon goes away meanwhile, the lookup is asked again of the
        restarted one, until ``reconnect_timeout`` after the first loss; then Unavailable."""
        if self._rows is None:
            while True:
                try:
                    self._rows = self._inner.wait()
                    break
                except errors.Unavailable as exc:  # the daemon went away: ask the restarted one
                    self._retry(exc)
        return self._rows

    def _retry(self, lost: errors.Unavailable) -> None:
        client, now = self._client, time.monotonic()
        if self._retry_deadline is None:
            self._retry_deadline = now + client.reconnect_timeout
        if now >= self._retry_deadline or client._closed:
            raise errors.Unavailable(
                f"lookup of layer {self._layer} ({self._ids.size} rows) not answered: the daemon at {client.address} "
                f"went away and was retried for {client.reconnect_timeout:g}s (reconnect_timeout) without an answer; "
                f"last error: {lost}") from None
        try:
            self._start()
        except errors.Unavailable as exc:
            raise errors.Unavailable(
                f"lookup of layer {self._layer} ({self._ids.size} rows) not answered: the daemon at {client.address} "
                f"went away and could not be reached again within {client.reconnect_timeout:g}s (reconnect_timeout): "
                f"{exc}") from None

    def done(self) -> bool:
        return self._rows is not None

    def release(self) -> None:
        if self._inner is not None:
            self._inner.release()
        self._rows = None
        self._inner = None

    def __enter__(self) -> np.ndarray:
        return self.wait()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _key(key: int) -> int:
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= int(key) < 1 << 64:
        raise errors.InvalidRequest(f"a hint key is an unsigned 64-bit integer, got {key!r}")
    return int(key)


class EngramClient:
    """A connection to one engram-store daemon. Build it with :meth:`connect`."""

    def __init__(self, address: str, *, shm_bytes: int = 0, connect_timeout: float = 5.0,
                 reconnect_timeout: float = 30.0, tls_ca: str | None = None, spin_us: int = 0,
                 token: str | None = None, token_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, timeout: float | None = None) -> None:
        if not address.startswith(_SCHEMES):
            raise errors.ConfigError(f"address {address!r}: expected unix:///path/to.sock, grpc://host:port or grpcs://host:port")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
            raise errors.ConfigError(f"timeout must be a positive number of seconds (or None for the default), got {timeout!r}")
        if isinstance(reconnect_timeout, bool) or not isinstance(reconnect_timeout, (int, float)) or not reconnect_timeout >= 0:
            raise errors.ConfigError(f"reconnect_timeout must be a number of seconds >= 0, got {reconnect_timeout!r}")
        self.address, self.timeout = address, timeout
        self.shm_bytes, self.connect_timeout = shm_bytes, connect_timeout
        self.reconnect_timeout, self.tls_ca, self.spin_us = reconnect_timeout, tls_ca, spin_us
        self._auth = {"token": token, "token_file": token_file, "tls_cert": tls_cert, "tls_key": tls_key}
        self._lock = threading.Lock()
        self._transport: Transport | None = None
        self._closed = False
        self.generation = 0  # goes up on every (re)connect
        self._close_hooks: list[Callable[[Transport], None]] = []

    @classmethod
    def connect(cls, address: str, *, shm_bytes: int = 0, connect_timeout: float = 5.0,
                reconnect_timeout: float = 30.0, tls_ca: str | None = None, spin_us: int = 0,
                token: str | None = None, token_file: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None, timeout: float | None = None) -> "EngramClient":
        """Connect now (raises Unavailable if the daemon is not there); later calls reconnect by themselves.
        ``timeout``: the longest one call waits for the daemon's answer, in seconds (default
        10 over unix, 60 over gRPC); past it DeadlineExceeded (the unix connection is closed,
        the next call reconnects). ``reconnect_timeout``: how long calls, and a submitted
        lookup's ``wait()``, keep trying a daemon that went away before Unavailable.
        ``shm_bytes``: size of the shared region to ask for (0 = the daemon's client_shm_bytes).
        ``spin_us`` (unix): busy-poll this long for a reply before sleeping; lower latency when
        the client has a spare CPU (e.g. 2000 for decode-sized lookups), 0 to never spin.
        gRPC only (ignored over unix://): ``token``/``token_file`` (default: the file named by
        ``$ENGRAM_STORE_GRPC_TOKEN_FILE``), re-read on every reconnect; ``tls_cert``/``tls_key``,
        a client certificate for a daemon with ``grpc_tls_client_ca``. A refused client gets
        ``errors.Unauthenticated`` (never retried)."""
        client = cls(address, shm_bytes=shm_bytes, connect_timeout=connect_timeout,
                     reconnect_timeout=reconnect_timeout, tls_ca=tls_ca, spin_us=spin_us, token=token,
                     token_file=token_file, tls_cert=tls_cert, tls_key=tls_key, timeout=timeout)
        client._current()
        return client

    # --- connection management ------------------------------------------------
    def _open(self) -> Transport:
        if self.address.startswith("unix://"):
            from engram_store.client.unix_transport import UnixTransport

            timeout = {} if self.timeout is None else {"timeout": self.timeout}
            return UnixTransport(self.address[len("unix://"):], self.shm_bytes, self.connect_timeout,
                                 spin_seconds=self.spin_us / 1e6, **timeout)
        from engram_store.client.grpc_transport import GrpcTransport

        target = self.address.split("://", 1)[1]
        if self.address.startswith("grpcs://") and not self.tls_ca:
            raise errors.ConfigError("grpcs:// needs tls_ca (the PEM file of the daemon's CA)")
        timeout = {} if self.timeout is None else {"call_timeout": self.timeout}
        return GrpcTransport(target, tls_ca=self.tls_ca, connect_timeout=self.connect_timeout, **self._auth, **timeout)

    def _current(self) -> Transport:
        with self._lock:
            if self._closed:
                raise errors.Unavailable("this EngramClient is closed")
            if self._transport is None or self._transport.broken:
                if self._transport is not None:
                    self._close_transport()
                self._transport = self._open()
                self.generation += 1
            return self._transport

    def _with_transport(self, call: Callable[[Transport], T], deadline: float | None = None) -> T:
        """Run ``call(transport)``; on Unavailable reconnect and retry until reconnect_timeout
        after the first failure (or until ``deadline``, monotonic, when given)."""
        backoff = 0.02
        while True:
            try:
                return call(self._current())
            except errors.Unavailable:
                if self._closed:
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.reconnect_timeout
                if now >= deadline:
                    raise
                time.sleep(min(backoff, max(0.0, deadline - now)))  # back off while the daemon restarts
                backoff = min(backoff * 2, 0.5)

    # --- lookups --------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        return self._with_transport(lambda t: t.row_bytes)

    def lookup(self, layer: int, row_ids: Any) -> np.ndarray:
        """uint8 ``row_ids.shape + (row_bytes,)``, owned by the caller."""
        ids = np.asarray(row_ids)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        return self.lookup_into(layer, ids, out)

    def lookup_into(self, layer: int, row_ids: Any, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (uint8, C-contiguous, ``row_ids.shape + (row_bytes,)``, e.g. pinned); returns it."""
        ids = np.asarray(row_ids)
        return self._with_transport(lambda t: t.lookup_into(layer, ids, out))

    def lookup_planned(self, layer: int, row_ids: Any, out: np.ndarray) -> np.ndarray:
        """``lookup_into`` in plan mode (unix, a cached daemon): the daemon writes the rows it
        holds in DRAM and hands back a read plan of the others, which this process reads from
        the layer file itself (``O_DIRECT``), checking every page's crc32c before any of its
        rows is used; the daemon admits those rows into its cache in the background. Where the
        plan cannot be executed here (the table files are not readable by this process) the
        daemon reads the rows instead (logged once per layer: see :meth:`plan_info`). Over gRPC,
        or a resident layer: exactly ``lookup_into``. Byte-exact either way."""
        ids = np.asarray(row_ids)
        return self._with_transport(lambda t: t.lookup_planned(layer, ids, out))

    def plan_info(self) -> dict[str, Any]:
        """How plan lookups are executed on the current connection: ``executor`` (``host``,
        or ``daemon`` over gRPC), ``fallbacks`` ({layer: why the daemon reads its rows}),
        ``pages_read`` / ``bytes_read`` by this process so far."""
        return self._with_transport(lambda t: t.plan_info())

    def hint(self, layer: int, row_ids: Any, key: int) -> int:
        """Tell the daemon that ``row_ids`` of ``layer`` will be looked up soon, in that order (e.g. a
        prompt's chunks not computed yet): it reads them behind the lookups into its cache. ``key`` (an
        unsigned 64-bit number, the same from every rank sending this hint: a hash of the request's id)
        names the hint for :meth:`withdraw`; identical hints of one key are read once. Returns the rows
        the daemon queued (0 for a resident layer, rows already queued, past the daemon's bounds). Waits
        for the daemon to take the ids, never for a read."""
        ids = np.asarray(row_ids)
        return self._with_transport(lambda t: t.hint(layer, ids, _key(key)))

    def withdraw(self, key: int) -> int:
        """The hints of ``key`` are no longer needed (the request finished or was aborted): the daemon
        drops what it still had queued for this client. Returns the rows dropped."""
        return self._with_transport(lambda t: t.withdraw(_key(key)))

    def submit(self, layer: int, row_ids: Any) -> LookupHandle:
        """Start a lookup and return at once (unix); ``handle.wait()`` gives the rows."""
        return LookupHandle(self, layer, np.asarray(row_ids))

    def lookup_view(self, layer: int, row_ids: Any) -> LookupHandle:
        """Zero copy over unix: ``with client.lookup_view(L, ids) as rows:`` reads rows in the shared region."""
        return self.submit(layer, row_ids)

    # --- shared memory (unix transport) -----------------------------------------
    def reserve(self, shape: tuple[int, ...]) -> np.ndarray:
        """uint8 array of ``shape`` inside the shared region (unix only; pin it with
        cudaHostRegister). ``lookup_into(L, ids, out)`` with ``out`` in it is one copy: the
        daemon writes the rows there. Held until :meth:`unreserve`, or a reconnect (after
        which it is an ordinary buffer and lookups copy into it)."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        return self._with_transport(lambda t: t.reserve(nbytes).reshape(shape))

    def unreserve(self, buf: np.ndarray) -> None:
        """Give a :meth:`reserve` buffer back (a no-op after a reconnect)."""
        transport = self._current()
        if transport.region is not None and np.shares_memory(buf, transport.region):
            transport.unreserve(buf)

    @property
    def shared_region(self) -> np.ndarray | None:
        """uint8 view of the whole shared region rows land in (None over gRPC); stable until a reconnect."""
        return self._with_transport(lambda t: t.region)

    @property
    def arena(self):
        """The daemon's resident arena mapped read-only (``engram_store.format.arena_layout.ArenaView``:
        ``layout``, ``blocks(L) -> (weights, scales)``, ``gather_into(L, ids, out)``) when the
        daemon is resident and local, else None."""
        return self._with_transport(lambda t: t.arena)

    # --- facts ----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """layers, rows ({layer: n}), row_bytes, mode, spec (ModelSpec.to_dict()), max_request_rows, transport."""
        info = dict(self._with_transport(lambda t: t.info() | {"transport": t.kind}))
        info["rows"] = {int(k): int(v) for k, v in info["rows"].items()}
        return info

    def stats(self) -> dict[str, float]:
        """The daemon's counters (store_* from the store, unix_* / grpc_* per transport, hit_ratio)."""
        return self._with_transport(lambda t: t.stats())

    def add_close_hook(self, hook: Callable[[Transport], None]) -> None:
        """Call ``hook(transport)`` before a transport is closed (a reconnect, or ``close``), while
        its shared region and arena are still mapped: e.g. to ``cudaHostUnregister`` them. A hook
        must not call this client; an exception from it is logged and the close goes on."""
        with self._lock:
            self._close_hooks.append(hook)

    def _close_transport(self) -> None:
        """Close the current transport (the lock held, one is open), running the close hooks first."""
        transport: Transport = self._transport  # type: ignore[assignment]
        self._transport = None
        for hook in list(self._close_hooks):
            try:
                hook(transport)
            except Exception:
                log.exception("close hook %r failed", hook)
        transport.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._transport is not None:
                self._close_transport()

    def __enter__(self) -> "EngramClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EngramClient({self.address!r}, generation={self.generation})"
