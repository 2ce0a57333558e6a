"""The gRPC service (grpc.aio): Lookup, LookupStream, Info, Stats, Hint, Withdraw and the standard health service.

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
The health service (:mod:`.grpc_health`) is open and never reads a request.
A request that does not parse is INVALID_ARGUMENT and a call the client cancels
ends quietly: each is one log line, never a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import time
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from .. import errors
from ..format import requests
from ..storage.base import HintingStore, RowStore
from ..version import __version__
from ..wire import frames as wire
from ..wire import grpc_codec as lookup_codec
from ..wire._proto import engram_store_pb2 as pb
from . import limits
from .config import DaemonConfig, parse_hostport, read_token
from .grpc_health import NOT_SERVING, SERVING, Health
from .stats import TransportStats

log = logging.getLogger(__name__)

SERVICE_NAME = "engram_store.v1.EngramStore"
_ENVELOPE = 1024  # protobuf framing allowance on top of the raw buffers

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


def message_limits(config: DaemonConfig) -> list[tuple[str, int]]:
    """Server channel options: requests up to max_request_rows int64 ids, replies up to one chunk,
    request bodies received as they are read."""
    return [
        ("grpc.max_receive_message_length", config.max_request_rows * 8 + _ENVELOPE),
        ("grpc.max_send_message_length", config.grpc_chunk_bytes + _ENVELOPE),
        ("grpc.so_reuseport", 0),
        # A fixed 64 KiB receive window per call (no bandwidth-delay probing): a body is received only
        # as the handler reads it, so a call refused at its headers leaves at most that much behind.
        ("grpc.http2.bdp_probe", 0),
    ]


class TokenCheck:
    """``authorization: Bearer <token>`` call metadata against the daemon's token, in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def refusal(self, metadata: Any) -> str:
        """"" when the metadata carries the token, else why not (for the client's error)."""
        for key, value in metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
                if hmac.compare_digest(given, self._expected):
                    return ""
                return "wrong token in the 'authorization' metadata"
        return ("no 'authorization' metadata; send 'authorization: Bearer <token>' with the token of the daemon's "
                "grpc_token_file (EngramClient.connect(..., token_file=PATH) or ENGRAM_STORE_GRPC_TOKEN_FILE)")


def hint_owner(context: grpc.aio.ServicerContext) -> str:
    """Who a Hint or Withdraw call comes from, as the owner of its hints: the client certificate the TLS
    handshake verified (``grpc_tls_client_ca``: the same client over all its connections), else the
    call's connection. A shared ``grpc_token_file`` token is every gRPC client's, so it tells none
    apart: each connection is then a client of its own (never its host, which clients share)."""
    pem = (context.auth_context() or {}).get("x509_pem_cert")
    if pem:
        return "grpc:cert:" + hashlib.sha256(pem[0]).hexdigest()[:32]
    return "grpc:conn:" + context.peer()


class _Malformed:
    """What the request deserializer returns for bytes that are not the request message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer that hands bad bytes to the handler (one INVALID_ARGUMENT) instead of
    raising inside gRPC (which logs a traceback and answers INTERNAL)."""
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Malformed(str(exc) or "not a protobuf message")

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
            request = _Malformed("the call carried no request message")
        except asyncio.TimeoutError:
            self.stats.record(0, 0, 0.0, "DEADLINE_EXCEEDED")
            log.info("gRPC call from %s sent no request within %.1fs; dropped", context.peer(), timeout)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {timeout:g}s (handshake_timeout_seconds)")
        if isinstance(request, _Malformed):
            self.stats.record(0, 0, 0.0, "INVALID_ARGUMENT")
            log.info("gRPC request from %s does not parse: %s", context.peer(), request.why)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.why}")
        return request

    # --- helpers ----------------------------------------------------------
    def _serving(self) -> RowStore:
        if self.store is None:
            raise errors.Unavailable("engram-store is starting (tables still loading); retry shortly")
        if self.draining:
            raise errors.Unavailable("engram-store is shutting down; retry on the restarted daemon")
        return self.store

    def _request(self, request: pb.LookupRequest) -> tuple[RowStore, np.ndarray]:
        store = self._serving()
        requests.check_layer(request.layer, store.layers)
        if request.layer in self.broken_layers:
            raise errors.LayerUnavailable(f"layer {request.layer} is unavailable: {self.broken_layers[request.layer]}")
        dtype = _DTYPES.get(request.dtype)
        if dtype is None:
            raise errors.InvalidRequest(f"row id dtype {request.dtype} unknown; use INT64 or INT32")
        if len(request.row_ids) % dtype.itemsize:
            raise errors.InvalidRequest(f"row_ids holds {len(request.row_ids)} bytes, "
                                        f"not a multiple of {dtype.itemsize} ({dtype})")
        count = len(request.row_ids) // dtype.itemsize
        requests.check_count(count, self.config.max_request_rows)
        return store, np.frombuffer(request.row_ids, dtype=dtype)

    async def _gather(self, store: RowStore, layer: int, ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.size, store.row_bytes), dtype=np.uint8)
        await asyncio.get_running_loop().run_in_executor(self.pool, store.lookup_into, layer, ids, out)
        return out

    def _cancelled(self, rpc: str, t0: float) -> None:
        # Nothing of the call's context here: grpc may have freed the call already (its peer()
        # then crashes the process).
        self.stats.record(0, 0, time.perf_counter() - t0, "CANCELLED")
        log.info("gRPC %s cancelled by the client after %.3fs", rpc, time.perf_counter() - t0)

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException, t0: float) -> None:
        status = wire.status_of(exc)
        if status is wire.Status.INTERNAL and not isinstance(exc, errors.StorageError):
            log.exception("gRPC request failed", exc_info=exc)
        self.stats.record(0, 0, time.perf_counter() - t0, status.name)
        await context.abort(CODE_OF.get(status, grpc.StatusCode.INTERNAL), str(exc))

    # --- RPCs -------------------------------------------------------------
    @limits.bounded_replies
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> lookup_codec.EncodedReply:
        t0 = time.perf_counter()
        try:
            store, ids = self._request(request)
            if ids.size * store.row_bytes > self.config.grpc_chunk_bytes:
                raise errors.ResourceExhausted(
                    f"{ids.size} rows are {ids.size * store.row_bytes} bytes, above one message "
                    f"({self.config.grpc_chunk_bytes} bytes, grpc_chunk_bytes); use LookupStream")
            out = await self._gather(store, request.layer, ids)
        except asyncio.CancelledError:
            self._cancelled("Lookup", t0)
            raise
        except Exception as exc:
            await self._fail(context, exc, t0)
            raise  # unreachable: abort raises
        self.stats.record(ids.size, store.row_bytes, time.perf_counter() - t0)
        return lookup_codec.encode_reply(out, 0, ids.size, store.row_bytes, ids.size)

    @limits.bounded_replies
    async def LookupStream(self, request: pb.LookupRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[lookup_codec.EncodedReply]:
        t0 = time.perf_counter()
        pending: list[asyncio.Future | None] = []
        try:
            store, ids = self._request(request)
            step = max(1, self.config.grpc_chunk_bytes // store.row_bytes)
            starts = range(0, ids.size, step)
            pending += [asyncio.ensure_future(self._gather(store, request.layer, ids[s: s + step])) for s in starts[:2]]
            for i, start in enumerate(starts):
                out = await pending[i]
                if i + 2 < len(starts):  # keep two gathers ahead of the sender
                    nxt = starts[i + 2]
                    pending.append(asyncio.ensure_future(self._gather(store, request.layer, ids[nxt: nxt + step])))
                pending[i] = None  # drop the finished buffer
                yield lookup_codec.encode_reply(out, start, len(out), store.row_bytes, ids.size)
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, went away or ran out of time
            self._cancelled("LookupStream", t0)
            raise
        except Exception as exc:
            await self._fail(context, exc, t0)
            return
        finally:  # also when the client's cancel closes this generator at a yield
            for fut in pending:
                if fut is not None:
                    fut.cancel()
        self.stats.record(ids.size, store.row_bytes, time.perf_counter() - t0)

    async def Hint(self, request: pb.HintRequest, context: grpc.aio.ServicerContext) -> pb.HintReply:
        """Queue rows the caller will look up soon (the store reads them behind its lookups); answered at once.
        The caller's identity (:func:`hint_owner`) owns the hint: its rate, its share of the queue, its keys."""
        try:
            store, ids = self._request(request)
            owner = hint_owner(context)
            granted = self.hint_rates.take(owner, ids.size)
            queued = 0
            if isinstance(store, HintingStore):  # the ids are copied: the queue keeps them past this request
                hint = functools.partial(store.hint, request.layer, ids[:granted].copy(), request.key, owner,
                                         rate_limited=ids.size - granted, owner=owner)
                queued = await asyncio.get_running_loop().run_in_executor(self.pool, hint)
        except Exception as exc:
            await self._fail(context, exc, time.perf_counter())
            raise
        return pb.HintReply(rows_queued=queued)

    async def Withdraw(self, request: pb.WithdrawRequest, context: grpc.aio.ServicerContext) -> pb.WithdrawReply:
        """Drop what the caller still has queued under the key (another client's hints of it are left alone)."""
        try:
            store = self._serving()
            dropped = store.withdraw(request.key, hint_owner(context)) if isinstance(store, HintingStore) else 0
        except Exception as exc:
            await self._fail(context, exc, time.perf_counter())
            raise
        return pb.WithdrawReply(rows_dropped=dropped)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        try:
            self._serving()
            info = self.info()
        except Exception as exc:
            await self._fail(context, exc, time.perf_counter())
            raise
        return pb.InfoReply(
            layers=[pb.LayerInfo(layer=int(k), rows=v) for k, v in info["rows"].items()],
            row_bytes=info["row_bytes"], mode=info["mode"], spec_json=json.dumps(info["spec"]),
            max_request_rows=self.config.max_request_rows, chunk_bytes=self.config.grpc_chunk_bytes,
            protocol_version=wire.VERSION, version=__version__, bad_pages_json=json.dumps(info.get("bad_pages") or {}),
            token_map_json=json.dumps(info["token_map"]) if info.get("token_map") else "",
            placement_json=json.dumps(info.get("placement") or {}))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        try:
            self._serving()
            values = self.stats_snapshot()
        except Exception as exc:
            await self._fail(context, exc, time.perf_counter())
            raise
        return pb.StatsReply(values=values)


def add_service(service: EngramStoreService, server: grpc.aio.Server) -> None:
    """What the generated ``add_EngramStoreServicer_to_server`` does, built from the proto's
    descriptor: every RPC must be a method of ``service`` (AttributeError otherwise), each is
    registered with a streamed request so that :meth:`EngramStoreService.gate` runs before its
    body is read, and ``LookupReply`` messages go out through :mod:`lookup_codec` (rows copied once)."""
    (desc,) = pb.DESCRIPTOR.services_by_name.values()
    handlers = {}
    for m in desc.methods:
        if m.client_streaming:
            raise TypeError(f"{m.full_name}: gated handlers read exactly one request message")
        out_type = getattr(pb, m.output_type.name)
        serialize = lookup_codec.serialize_reply if out_type is pb.LookupReply else out_type.SerializeToString
        method = getattr(service, m.name)
        make = grpc.stream_stream_rpc_method_handler if m.server_streaming else grpc.stream_unary_rpc_method_handler
        handlers[m.name] = make((_gated_stream if m.server_streaming else _gated_unary)(service, method),
                                request_deserializer=_lenient(getattr(pb, m.input_type.name).FromString),
                                response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)


class _ClientGoneFilter(logging.Filter):
    """grpc's core logs an ERROR with a traceback when a reply message cannot be sent because
    the client cancelled the call an instant before (ExecuteBatchError); for a daemon that is
    a client going away, not an error: make it one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "ExecuteBatchError" not in record.getMessage():
            return True
        method = record.getMessage().rpartition("[")[2].rstrip("]")
        record.msg, record.args, record.exc_info, record.exc_text = (
            "gRPC %s: the client went away while its reply was being sent", (method,), None, None)
        record.levelno, record.levelname = logging.INFO, "INFO"
        return log.isEnabledFor(logging.INFO)


_GRPC_CORE_LOG = logging.getLogger("grpc._cython.cygrpc")


def _gated_unary(service: EngramStoreService, method: Callable) -> Callable:
    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        peer = await service.gate(context)
        try:
            return await method(await service.read_request(requests, context), context)
        finally:
            service.release(peer)

    return call


def _gated_stream(service: EngramStoreService, method: Callable) -> Callable:
    async def call(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        peer = await service.gate(context)
        try:
            async for reply in method(await service.read_request(requests, context), context):
                yield reply
        finally:
            service.release(peer)

    return call


class GrpcServer:
    """The grpc.aio server, run on the caller's event loop."""

    def __init__(self, service: EngramStoreService, config: DaemonConfig) -> None:
        self.service, self.config = service, config
        self.health = Health()
        self._quiet = _ClientGoneFilter()
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        server = grpc.aio.server(options=message_limits(self.config))  # calls are counted after authentication
        add_service(self.service, server)
        server.add_generic_rpc_handlers((self.health.handlers(),))
        host, _ = parse_hostport(self.config.grpc, "grpc")
        cfg = self.config
        if cfg.grpc_token_file:
            self.service.token_check = TokenCheck(read_token(cfg.grpc_token_file))
        if cfg.grpc_tls_cert:
            with open(cfg.grpc_tls_key, "rb") as k, open(cfg.grpc_tls_cert, "rb") as c:
                pair = (k.read(), c.read())
            client_ca = None
            if cfg.grpc_tls_client_ca:
                with open(cfg.grpc_tls_client_ca, "rb") as f:
                    client_ca = f.read()
            creds = grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                                require_client_auth=client_ca is not None)
            port = server.add_secure_port(self.config.grpc, creds)
        else:
            port = server.add_insecure_port(self.config.grpc)
        if port == 0:
            raise errors.ConfigError(f"grpc: cannot listen on {self.config.grpc} (address in use or not local)")
        await server.start()
        _GRPC_CORE_LOG.addFilter(self._quiet)
        self._server = server
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.health.set(SERVING)
        auth = [name for name, on in (("token", cfg.grpc_token_file), ("client certificates", cfg.grpc_tls_client_ca))
                if on]
        log.info("gRPC listening on %s%s; clients authenticate by %s", self.address,
                 " (TLS)" if cfg.grpc_tls_cert else "", " and ".join(auth))
        return self.address

    async def stop(self, grace: float) -> None:
        """NOT_SERVING for health checks, refuse new RPCs, let running ones finish within ``grace``."""
        self.service.draining = True
        self.health.set(NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
            _GRPC_CORE_LOG.removeFilter(self._quiet)
