"""What one client may hold of the daemon: memory, hinted rows and worker time.

* :class:`ByteBudget`: bytes many clients draw on together (all client regions,
  ``max_total_client_shm_bytes``; all gRPC replies in flight,
  ``grpc_max_inflight_bytes``). Taking never blocks: past the budget the caller
  refuses the request with RESOURCE_EXHAUSTED naming the key.
* a Unix connection's replies, bounded per connection, in :mod:`.unix.outbox`.
* :class:`TokenBucket` (and :class:`PeerBuckets`, one per client: a Unix uid, a gRPC
  certificate or connection): hinted rows one client may send a second
  (``hint_rows_per_second``); rows past it are dropped.
* :class:`RoundRobin`: lookups of many connections share the worker pool in
  turns. Each connection (a :class:`Lane`) has at most ``per_lane`` pieces in the
  pool at once and goes to the back of the line after each piece, so a large
  request split into pieces cannot keep other connections' requests waiting
  longer than a piece.

Thread safety: every class here may be used from any thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Executor
from typing import Callable

log = logging.getLogger(__name__)


class ByteBudget:
    """``limit`` bytes shared by many holders; :meth:`take` says whether they fit."""

    def __init__(self, limit: int, key: str) -> None:
        self.limit, self.key = limit, key
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes``; False (nothing reserved) when they would pass the limit."""
        with self._lock:
            if self._used + nbytes > self.limit:
                return False
            self._used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def refusal(self, nbytes: int, what: str) -> str:
        """The RESOURCE_EXHAUSTED message for ``nbytes`` of ``what`` that did not fit."""
        return (f"{what} of {nbytes} bytes refused: {self._used} of {self.limit} bytes ({self.key}) "
                "are held by other clients; retry later or raise the limit")


class TokenBucket:
    """``rate`` units a second, at most ``burst`` (default: a second's worth) saved up: :meth:`take`
    grants what the bucket holds, never blocks."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = float(rate), float(rate if burst is None else burst), clock
        self._level, self._at = self.burst, clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        """Up to ``n`` units now; returns how many were granted (the rest are refused)."""
        with self._lock:
            now = self.clock()
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
            self._at = now
            granted = int(min(n, self._level))
            self._level -= granted
            return granted


class PeerBuckets:
    """A :class:`TokenBucket` per peer (a client's identity), the ``max_peers`` most recently seen kept: a
    forgotten peer starts again with a full bucket, so the map stays bounded whoever connects."""

    def __init__(self, rate: float, max_peers: int = 4096) -> None:
        self.rate, self.max_peers = rate, max_peers
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._lock = threading.Lock()

    def take(self, peer: str, n: int) -> int:
        with self._lock:
            bucket = self._buckets.pop(peer, None) or TokenBucket(self.rate)
            self._buckets[peer] = bucket
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        return bucket.take(n)


# --- worker time -----------------------------------------------------------------------
class Lane:
    """One connection's queue of pieces of work for :class:`RoundRobin`."""

    __slots__ = ("pieces", "turns", "cancelled")

    def __init__(self) -> None:
        self.pieces: collections.deque[Callable[[], None]] = collections.deque()
        self.turns = 0  # pieces of this lane in the pool (queued or running)
        self.cancelled = False


class RoundRobin:
    """Runs pieces of many lanes on ``pool``: at most ``per_lane`` of one lane at once, and
    each lane back in line after each piece (the pool's queue is first in, first out)."""

    def __init__(self, pool: Executor, per_lane: int) -> None:
        self.pool, self.per_lane = pool, max(1, per_lane)
        self._lock = threading.Lock()

    def submit(self, lane: Lane, pieces: list[Callable[[], None]]) -> None:
        """Queue ``pieces``; each runs exactly once, even after :meth:`cancel` (then it
        should see ``lane.cancelled`` and end at once). RuntimeError if the pool is shut down."""
        with self._lock:
            lane.pieces.extend(pieces)
            start = min(self.per_lane - lane.turns, len(lane.pieces))
            lane.turns += max(0, start)
        for _ in range(start):
            self._schedule(lane)

    def _schedule(self, lane: Lane) -> None:
        try:
            self.pool.submit(self._turn, lane)
        except RuntimeError:  # the pool is shut down (the daemon is stopping): run them here
            self._turn(lane)

    def _turn(self, lane: Lane) -> None:
        while True:
            with self._lock:
                piece = lane.pieces.popleft() if lane.pieces else None
            if piece is not None:
                try:
                    piece()
                except Exception:  # a piece answers its own errors; this is a bug, not the client's
                    log.exception("lookup piece failed")
            with self._lock:
                if not lane.pieces:
                    lane.turns -= 1
                    return
            try:
                self.pool.submit(self._turn, lane)  # to the back of the line: other lanes' pieces first
                return
            except RuntimeError:  # the pool is shut down: go on on this thread
                continue


# --- gRPC calls ---------------------------------------------------------------------------
class CallSlots:
    """Authenticated gRPC calls in flight: at most ``total`` in all and ``per_peer`` from one peer
    address (the host part of grpc's peer string, so one host's many connections count together).
    Taken before a call's request body is read, given back when the call ends. Runs on the
    daemon's event loop only (no lock)."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.in_flight = 0
        self.by_peer: dict[str, int] = {}

    @staticmethod
    def peer_host(peer: str) -> str:
        """``"ipv4:10.0.0.7:51234"`` -> ``"ipv4:10.0.0.7"``; ``"ipv6:[::1]:5"`` -> ``"ipv6:[::1]"``."""
        head, sep, port = peer.rpartition(":")
        return head if sep and port.isdigit() and ":" in head else peer

    def take(self, peer: str) -> str:
        """"" when the call may go on (its slot taken), else why not."""
        host = self.peer_host(peer)
        held = self.by_peer.get(host, 0)
        if held >= self.per_peer:
            return (f"{held} calls from {host} are in flight already (grpc_max_calls_per_peer = {self.per_peer}); "
                    "wait for replies before sending more")
        if self.in_flight >= self.total:
            return f"{self.in_flight} gRPC calls are in flight (the daemon's limit); retry shortly"
        self.in_flight += 1
        self.by_peer[host] = held + 1
        return ""

    def give(self, peer: str) -> None:
        host = self.peer_host(peer)
        self.in_flight -= 1
        left = self.by_peer.get(host, 1) - 1
        if left > 0:
            self.by_peer[host] = left
        else:
            self.by_peer.pop(host, None)


# --- gRPC replies ------------------------------------------------------------------------
class GrpcReplies:
    """Bounds on gRPC lookup replies: the bytes all of them hold at once (``grpc_max_inflight_bytes``)
    and how long one may wait for its reader (``client_send_timeout_seconds``). A call reserves
    what it can hold (one reply, or the chunks a stream keeps ahead) until it is done; past the
    budget it is refused with RESOURCE_EXHAUSTED. A call whose next message has not gone out
    that long after the previous one is cancelled, which frees what it holds."""

    STREAM_CHUNKS_HELD = 3  # LookupStream: the chunk being sent and two gathered ahead

    def __init__(self, max_bytes: int, chunk_bytes: int, stall_seconds: float) -> None:
        self.budget = ByteBudget(max_bytes, "grpc_max_inflight_bytes")
        self.chunk_bytes, self.stall_seconds = chunk_bytes, stall_seconds

    def reply_bytes(self, request: object, row_bytes: int, streaming: bool) -> int:
        ids = getattr(request, "row_ids", b"")
        rows = len(ids) // (4 if getattr(request, "dtype", 0) == 2 else 8)  # pb.INT32 == 2
        held = rows * row_bytes
        return min(held, self.STREAM_CHUNKS_HELD * self.chunk_bytes) if streaming else held


def bounded_replies(method: Callable) -> Callable:
    """Decorate a Lookup RPC method of a service that has ``replies`` (:class:`GrpcReplies`),
    ``store`` and ``stats``: reserve its reply bytes, cancel it when its reader stalls."""
    import asyncio
    import functools
    import inspect

    import grpc

    async def admit(service, request, context) -> tuple[int, Callable[[], None]]:
        replies: GrpcReplies = service.replies
        row_bytes = service.store.row_bytes if service.store is not None else 0
        nbytes = replies.reply_bytes(request, row_bytes, inspect.isasyncgenfunction(method))
        if not replies.budget.take(nbytes):
            service.stats.record(0, 0, 0.0, "RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, replies.budget.refusal(nbytes, "a gRPC reply"))
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        timer = [loop.call_later(replies.stall_seconds, task.cancel)]

        def rearm() -> None:
            timer[0].cancel()
            timer[0] = loop.call_later(replies.stall_seconds, task.cancel)

        def done(_: object) -> None:
            timer[0].cancel()
            replies.budget.give(nbytes)

        context.add_done_callback(done)
        return nbytes, rearm

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(service, request, context):
            _, rearm = await admit(service, request, context)
            async for message in method(service, request, context):
                yield message  # grpc sends it before asking for the next: a stalled reader stops here
                rearm()
        return stream

    @functools.wraps(method)
    async def unary(service, request, context):
        await admit(service, request, context)
        return await method(service, request, context)
    return unary
