"""The gRPC service (grpc.aio): Lookup, LookupStream, Info, Stats, Hint, Withdraw.

Each RPC decodes its request, hands it to its handler in :mod:`engram_store.daemon.requests`
(through the one error policy, :func:`~engram_store.daemon.requests.outcome.outcome`) and
encodes the reply; the listener is :mod:`.server`, the callers' identities :mod:`.auth`.

Row ids arrive as one raw little-endian buffer; rows leave as one raw buffer,
or as a stream of messages of at most ``grpc_chunk_bytes`` row bytes (the
next chunk is gathered while the current one is sent). Gathers run on the
daemon's worker pool so the event loop never blocks. Errors map onto status
codes that mean something (see :data:`CODE_OF`).

Every EngramStore RPC authenticates its caller first, from the call's metadata,
before one byte of its request body is read: with ``grpc_token_file`` the call
must carry ``authorization: Bearer <token>`` metadata (compared in constant
time), with ``grpc_tls_client_ca`` the TLS handshake already required a client
certificate that CA signed. Anything else is UNAUTHENTICATED at once, so an
unauthenticated caller costs neither memory for its bodies nor a slot: the RPCs
are registered with streamed requests (the wire format of a unary request is the
same), which grpc hands over before the body arrives. An authenticated call then
takes a slot (:class:`~engram_store.daemon.limits.CallSlots`: at most
``max(64, max_clients)`` in flight, ``grpc_max_calls_per_peer`` from one host),
and its one request message must arrive within ``handshake_timeout_seconds``.
The health service (:mod:`.health`) is open and never reads a request.
A request that does not parse is INVALID_ARGUMENT and a call the client cancels
ends quietly: each is one log line, never a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from ... import errors
from ...storage.base import RowStore
from ...version import __version__
from ...wire import frames as wire
from ...wire import grpc_codec as lookup_codec
from ...wire._proto import engram_store_pb2 as pb
from .. import limits
from ..config import DaemonConfig
from ..requests import hints, info, lookup
from ..requests.context import Caller, Served
from ..requests.outcome import failed, outcome
from ..stats import TransportStats
from .auth import TokenCheck, hint_owner

log = logging.getLogger(__name__)

SERVICE_NAME = "engram_store.v1.EngramStore"

CODE_OF: dict[wire.Status, grpc.StatusCode] = {
    wire.Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    wire.Status.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    wire.Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    wire.Status.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    wire.Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    wire.Status.INTERNAL: grpc.StatusCode.INTERNAL,
    wire.Status.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
}
_DTYPES = {pb.INT64: np.dtype("<i8"), pb.INT32: np.dtype("<i4")}


class Malformed:
    """What the request deserializer returns for bytes that are not the request message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer that hands bad bytes to the handler (one INVALID_ARGUMENT) instead of
    raising inside gRPC (which logs a traceback and answers INTERNAL)."""
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc) or "not a protobuf message")

    return deserialize


class EngramStoreService:
    """Serves ``store`` once :meth:`attach` is called; UNAVAILABLE before and while draining.

    Not derived from the generated ``EngramStoreServicer``: that base answers UNIMPLEMENTED for
    any RPC a subclass forgets, while :func:`add_service` looks every RPC of the proto up on
    this class, so a missing one stops the daemon at start-up instead."""

    def __init__(self, config: DaemonConfig, stats: TransportStats, pool: Executor,
                 info: Callable[[], dict[str, Any]], stats_snapshot: Callable[[], dict[str, float]]) -> None:
        self.config, self.stats, self.pool = config, stats, pool
        self.info, self.stats_snapshot = info, stats_snapshot
        self.store: RowStore | None = None
        self.served: Served | None = None
        self.replies = limits.GrpcReplies(config.grpc_max_inflight_bytes, config.grpc_chunk_bytes,
                                          config.client_send_timeout_seconds)
        self.broken_layers: dict[int, str] = {}
        self.draining = False
        self.token_check: TokenCheck | None = None  # set by GrpcServer when grpc_token_file is configured
        self.slots = limits.CallSlots(max(64, config.max_clients), config.grpc_max_calls_per_peer)
        self.hint_rates = limits.PeerBuckets(config.hint_rows_per_second)  # hinted rows a client may send a second
        self._refusals_logged = 0

    def attach(self, store: RowStore) -> None:
        self.broken_layers = dict(store.layer_errors())
        self.served = Served(store, self.config.max_request_rows, self.hint_rates, self.info, self.stats_snapshot)
        self.store = store

    async def gate(self, context: grpc.aio.ServicerContext) -> str:
        """Before any of the request body is read: abort the call unless its caller is authenticated
        and a slot is free; returns the peer whose slot it holds (give it back with :meth:`release`)."""
        why = self.token_check.refusal(context.invocation_metadata()) if self.token_check is not None else ""
        if why:
            self.stats.record(0, 0, 0.0, "UNAUTHENTICATED")
            self._refusals_logged += 1
            if self._refusals_logged <= 10:  # a client retrying in a loop must not flood the log
                log.warning("gRPC call from %s refused: %s%s", context.peer(), why.split(";")[0],
                            "; further refusals are counted, not logged" if self._refusals_logged == 10 else "")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"engram-store: {why}")
        peer = context.peer()
        why = self.slots.take(peer)
        if why:
            self.stats.record(0, 0, 0.0, "RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"engram-store: {why}")
        return peer

    def release(self, peer: str) -> None:
        self.slots.give(peer)

    async def read_request(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        """The call's one request message, parsed; aborts when it does not come in time or does not parse."""
        timeout = self.config.handshake_timeout_seconds
        try:
            request = await asyncio.wait_for(requests.__anext__(), timeout)
        except StopAsyncIteration:
            request = Malformed("the call carried no request message")
        except asyncio.TimeoutError:
            self.stats.record(0, 0, 0.0, "DEADLINE_EXCEEDED")
            log.info("gRPC call from %s sent no request within %.1fs; dropped", context.peer(), timeout)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {timeout:g}s (handshake_timeout_seconds)")
        if isinstance(request, Malformed):
            self.stats.record(0, 0, 0.0, "INVALID_ARGUMENT")
            log.info("gRPC request from %s does not parse: %s", context.peer(), request.why)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.why}")
        return request

    # --- helpers ----------------------------------------------------------
    def _serving(self) -> Served:
        if self.served is None:
            raise errors.Unavailable("engram-store is starting (tables still loading); retry shortly")
        if self.draining:
            raise errors.Unavailable("engram-store is shutting down; retry on the restarted daemon")
        return self.served

    def _answer(self, rpc: str, handler: Callable[..., Any], *args: Any) -> Any:
        """``handler(served, *args)`` once the service is serving, through the error policy: its value
        or the error (a store bug's message is its own: gRPC's INTERNAL names no prefix)."""
        return outcome(f"gRPC {rpc}", lambda: handler(self._serving(), *args), internal="")

    def _lookup_request(self, served: Served, request: pb.LookupRequest) -> tuple[Served, np.ndarray]:
        """The request's row ids, once its layer, dtype, length and count are checked."""
        served.check_layer(request.layer)
        if request.layer in self.broken_layers:
            raise errors.LayerUnavailable(f"layer {request.layer} is unavailable: {self.broken_layers[request.layer]}")
        dtype = _DTYPES.get(request.dtype)
        if dtype is None:
            raise errors.InvalidRequest(f"row id dtype {request.dtype} unknown; use INT64 or INT32")
        if len(request.row_ids) % dtype.itemsize:
            raise errors.InvalidRequest(f"row_ids holds {len(request.row_ids)} bytes, "
                                        f"not a multiple of {dtype.itemsize} ({dtype})")
        served.check_count(len(request.row_ids) // dtype.itemsize)
        return served, np.frombuffer(request.row_ids, dtype=dtype)

    def _unary_lookup(self, served: Served, request: pb.LookupRequest) -> tuple[Served, np.ndarray]:
        served, ids = self._lookup_request(served, request)
        if ids.size * served.store.row_bytes > self.config.grpc_chunk_bytes:
            raise errors.ResourceExhausted(
                f"{ids.size} rows are {ids.size * served.store.row_bytes} bytes, above one message "
                f"({self.config.grpc_chunk_bytes} bytes, grpc_chunk_bytes); use LookupStream")
        return served, ids

    async def _gather(self, store: RowStore, layer: int, ids: np.ndarray) -> Any:
        """The rows of ``ids``, gathered on the worker pool, or the error."""
        out = np.empty((ids.size, store.row_bytes), dtype=np.uint8)
        call = functools.partial(outcome, "gRPC lookup", lookup.rows_into, store, layer, ids, out, internal="")
        error = await asyncio.get_running_loop().run_in_executor(self.pool, call)
        return out if error is None else error

    def _cancelled(self, rpc: str, t0: float) -> None:
        # Nothing of the call's context here: grpc may have freed the call already (its peer()
        # then crashes the process).
        self.stats.record(0, 0, time.perf_counter() - t0, "CANCELLED")
        log.info("gRPC %s cancelled by the client after %.3fs", rpc, time.perf_counter() - t0)

    async def _fail(self, context: grpc.aio.ServicerContext, error: errors.EngramStoreError, t0: float) -> None:
        """Answer a request's error (an :func:`outcome`) with the status code it maps to."""
        status = wire.status_of(error)
        self.stats.record(0, 0, time.perf_counter() - t0, status.name)
        await context.abort(CODE_OF.get(status, grpc.StatusCode.INTERNAL), str(error))

    # --- RPCs -------------------------------------------------------------
    @limits.bounded_replies
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> lookup_codec.EncodedReply:
        t0 = time.perf_counter()
        try:
            got = self._answer("Lookup", self._unary_lookup, request)
            if not failed(got):
                served, ids = got
                got = await self._gather(served.store, request.layer, ids)
        except asyncio.CancelledError:
            self._cancelled("Lookup", t0)
            raise
        if failed(got):
            await self._fail(context, got, t0)
        row_bytes = served.store.row_bytes
        self.stats.record(ids.size, row_bytes, time.perf_counter() - t0)
        return lookup_codec.encode_reply(got, 0, ids.size, row_bytes, ids.size)

    @limits.bounded_replies
    async def LookupStream(self, request: pb.LookupRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[lookup_codec.EncodedReply]:
        t0 = time.perf_counter()
        pending: list[asyncio.Future | None] = []
        error = None
        try:
            got = self._answer("LookupStream", self._lookup_request, request)
            if failed(got):
                error = got
            else:
                served, ids = got
                store = served.store
                step = max(1, self.config.grpc_chunk_bytes // store.row_bytes)
                starts = range(0, ids.size, step)
                pending += [asyncio.ensure_future(self._gather(store, request.layer, ids[s: s + step]))
                            for s in starts[:2]]
                for i, start in enumerate(starts):
                    out = await pending[i]
                    if failed(out):
                        error = out
                        break
                    if i + 2 < len(starts):  # keep two gathers ahead of the sender
                        nxt = starts[i + 2]
                        pending.append(asyncio.ensure_future(self._gather(store, request.layer, ids[nxt: nxt + step])))
                    pending[i] = None  # drop the finished buffer
                    yield lookup_codec.encode_reply(out, start, len(out), store.row_bytes, ids.size)
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, went away or ran out of time
            self._cancelled("LookupStream", t0)
            raise
        finally:  # also when the client's cancel closes this generator at a yield
            for fut in pending:
                if fut is not None:
                    fut.cancel()
        if error is not None:
            await self._fail(context, error, t0)
            return
        self.stats.record(ids.size, store.row_bytes, time.perf_counter() - t0)

    async def Hint(self, request: pb.HintRequest, context: grpc.aio.ServicerContext) -> pb.HintReply:
        """Queue rows the caller will look up soon (the store reads them behind its lookups); answered at once.
        The caller's identity (:func:`~.auth.hint_owner`) owns the hint: its rate, its share of the queue, its keys."""
        got = self._answer("Hint", self._lookup_request, request)
        if not failed(got):
            served, ids = got
            owner = hint_owner(context)
            call = functools.partial(outcome, "gRPC Hint", hints.hint, Caller(served, owner, owner), request.layer, ids,
                                     request.key, internal="")
            got = await asyncio.get_running_loop().run_in_executor(self.pool, call)
        if failed(got):
            await self._fail(context, got, time.perf_counter())
        return pb.HintReply(rows_queued=got)

    async def Withdraw(self, request: pb.WithdrawRequest, context: grpc.aio.ServicerContext) -> pb.WithdrawReply:
        """Drop what the caller still has queued under the key (another client's hints of it are left alone)."""
        owner = hint_owner(context)
        got = self._answer("Withdraw", lambda served: hints.withdraw(Caller(served, owner, owner), request.key))
        if failed(got):
            await self._fail(context, got, time.perf_counter())
        return pb.WithdrawReply(rows_dropped=got)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        got = self._answer("Info", info.info)
        if failed(got):
            await self._fail(context, got, time.perf_counter())
        return pb.InfoReply(
            layers=[pb.LayerInfo(layer=int(k), rows=v) for k, v in got["rows"].items()],
            row_bytes=got["row_bytes"], mode=got["mode"], spec_json=json.dumps(got["spec"]),
            max_request_rows=self.config.max_request_rows, chunk_bytes=self.config.grpc_chunk_bytes,
            protocol_version=wire.VERSION, version=__version__, bad_pages_json=json.dumps(got.get("bad_pages") or {}),
            token_map_json=json.dumps(got["token_map"]) if got.get("token_map") else "",
            placement_json=json.dumps(got.get("placement") or {}),
            table_scales_json=json.dumps(got["table_scales"]) if got.get("table_scales") else "")

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        got = self._answer("Stats", info.stats)
        if failed(got):
            await self._fail(context, got, time.perf_counter())
        return pb.StatsReply(values=got)
