"""The client side of the gRPC service: one channel, blocking calls, typed errors.

Row ids go as one raw int64 buffer; rows come back in one message when they
fit ``chunk_bytes`` (the daemon's grpc_chunk_bytes, learnt from Info) and as a
stream of chunks otherwise, each copied into the caller's buffer as it lands
(:func:`copy_chunks`: the chunks must cover the request exactly, in order, or
the lookup raises :class:`~engram_store.errors.IncompleteReply`).

Authentication: a token (``token``, ``token_file`` or the file named by
``ENGRAM_STORE_GRPC_TOKEN_FILE``) goes with every call as ``authorization:
Bearer <token>`` metadata; ``tls_cert``/``tls_key`` present a client
certificate to a daemon that requires one (``grpc_tls_client_ca``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable

import grpc
import numpy as np

from .. import errors
from ..format import requests
from ..wire import frames as wire
from ..wire import grpc_codec as lookup_codec
from ..wire._proto import engram_store_pb2 as pb
from ..wire._proto import engram_store_pb2_grpc as pb_grpc
from .transport import Finished

if TYPE_CHECKING:
    from ..format.arena_layout import ArenaView

MAX_MESSAGE_BYTES = 256 << 20  # explicit client limits; the daemon sends at most one chunk per message
TOKEN_FILE_ENV = "ENGRAM_STORE_GRPC_TOKEN_FILE"  # the daemon's config key of the same name, read by clients too

_STATUS_OF_CODE: dict[grpc.StatusCode, wire.Status] = {
    grpc.StatusCode.INVALID_ARGUMENT: wire.Status.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: wire.Status.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND: wire.Status.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: wire.Status.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: wire.Status.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: wire.Status.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: wire.Status.UNAVAILABLE,
    grpc.StatusCode.INTERNAL: wire.Status.INTERNAL,
    grpc.StatusCode.DATA_LOSS: wire.Status.DATA_LOSS,
}


def error_of(exc: grpc.RpcError) -> errors.EngramStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unauthenticated(f"{details} (gRPC {code.name})")
    status = _STATUS_OF_CODE.get(code, wire.Status.INTERNAL)
    return wire.error_of(status, f"{details} (gRPC {code.name})")


def load_token(token: str | None = None, token_file: str | None = None,
               environ: dict[str, str] | os._Environ | None = None) -> str | None:
    """The token to send: ``token``, else the content of ``token_file``, else of the file
    ``$ENGRAM_STORE_GRPC_TOKEN_FILE`` names; None when none is given."""
    if token:
        return token.strip()
    path = token_file or (os.environ if environ is None else environ).get(TOKEN_FILE_ENV, "")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(4097).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"gRPC token file {path}: cannot read a token from it ({exc})") from None
    if not text:
        raise errors.ConfigError(f"gRPC token file {path} is empty")
    return text


def copy_chunks(chunks: Iterable[lookup_codec.LookupChunk], flat: np.ndarray, rows: int, row_bytes: int) -> None:
    """Copy reply chunks into ``flat`` (``rows * row_bytes`` uint8). They must follow one
    another from row 0 and end at ``rows`` (as the daemon sends them): a short stream, a gap,
    an overlap or a chunk of another size raises IncompleteReply, so uninitialized bytes of
    ``flat`` are never returned as rows."""
    done = 0
    for c in chunks:
        if (c.row_bytes != row_bytes or c.total_rows != rows or c.first_row != done
                or len(c.rows) != c.row_count * row_bytes or done + c.row_count > rows):
            raise errors.IncompleteReply(
                f"gRPC reply chunk does not continue the answer: rows {c.first_row}..{c.first_row + c.row_count} "
                f"({len(c.rows)} bytes of {c.row_bytes}-byte rows, total {c.total_rows}) after rows 0..{done} of "
                f"{rows} ({row_bytes}-byte rows)")
        flat[done * row_bytes: (done + c.row_count) * row_bytes] = np.frombuffer(c.rows, dtype=np.uint8)
        done += c.row_count
    if done != rows:
        raise errors.IncompleteReply(f"gRPC reply ended after rows 0..{done} of {rows}: it was cut short")


class GrpcTransport:
    """A channel to ``target`` (``host:port``); TLS when ``tls_ca`` (a PEM file) is given, with
    the client certificate ``tls_cert``/``tls_key`` when given; the token of :func:`load_token`.
    A :class:`~.transport.Transport` without shared memory: no ``region``, no ``arena``, nothing to
    ``reserve``; ``submit`` returns a finished lookup and plan lookups are plain ones."""

    kind = "grpc"
    arena: ArenaView | None = None
    region: np.ndarray | None = None

    def __init__(self, target: str, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, token: str | None = None, token_file: str | None = None,
                 connect_timeout: float = 5.0, call_timeout: float | None = 60.0) -> None:
        self.target, self.call_timeout = target, call_timeout
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        secret = load_token(token, token_file)
        self._metadata = (("authorization", f"Bearer {secret}"),) if secret else None
        if bool(tls_cert) != bool(tls_key):
            raise errors.ConfigError("a client certificate needs both tls_cert and tls_key (PEM files)")
        if tls_cert and not tls_ca:
            raise errors.ConfigError("tls_cert needs TLS: give tls_ca (the PEM file of the daemon's CA) and grpcs://")
        if tls_ca:
            pem = {}
            for name, path in (("root_certificates", tls_ca), ("certificate_chain", tls_cert), ("private_key", tls_key)):
                if path:
                    with open(path, "rb") as f:
                        pem[name] = f.read()
            creds = grpc.ssl_channel_credentials(**pem)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.EngramStoreStub(self._channel)
        # The Lookup RPCs with lookup_codec's decoder: rows stay in the received bytes until
        # they are copied into the caller's buffer.
        lookup = f"/{pb.DESCRIPTOR.services_by_name['EngramStore'].full_name}/"
        self._lookup = self._channel.unary_unary(lookup + "Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                                 response_deserializer=lookup_codec.decode_reply)
        self._lookup_stream = self._channel.unary_stream(lookup + "LookupStream",
                                                         request_serializer=pb.LookupRequest.SerializeToString,
                                                         response_deserializer=lookup_codec.decode_reply)
        self._broken = ""
        try:
            reply = self._stub.Info(pb.InfoRequest(), timeout=connect_timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            self._channel.close()
            err = error_of(exc)
            if isinstance(err, errors.Unauthenticated):  # retrying cannot help
                raise errors.Unauthenticated(f"engram-store at grpc://{target} refused this client: {err}") from None
            raise errors.Unavailable(f"cannot reach engram-store at grpc://{target}: {err}") from None
        self.info_cached = _info_dict(reply)
        self.row_bytes = reply.row_bytes
        self.chunk_bytes = reply.chunk_bytes
        self.max_request_rows = reply.max_request_rows

    def _error(self, exc: grpc.RpcError) -> errors.EngramStoreError:
        """The typed error of a failed call; an Unavailable one marks the channel broken."""
        err = error_of(exc)
        if isinstance(err, errors.Unavailable):
            self._broken = str(err)
        return err

    def _call(self, rpc: Any, request: Any) -> Any:
        try:
            return rpc(request, timeout=self.call_timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        ids = requests.row_ids(row_ids)
        flat = requests.rows_out(out, ids.shape, self.row_bytes).reshape(-1)
        requests.check_count(ids.size, self.max_request_rows)
        request = pb.LookupRequest(layer=layer, row_ids=np.ascontiguousarray(ids.reshape(-1), dtype="<i8").tobytes(),
                                   dtype=pb.INT64)
        rb = self.row_bytes
        try:
            stream = None
            if ids.size * rb <= self.chunk_bytes:
                replies = [self._lookup(request, timeout=self.call_timeout, metadata=self._metadata)]
            else:
                replies = stream = self._lookup_stream(request, timeout=self.call_timeout, metadata=self._metadata)
            try:
                copy_chunks(replies, flat, ids.size, rb)
            except errors.IncompleteReply:
                if stream is not None:  # stop a stream that went wrong
                    stream.cancel()
                raise
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return out

    def submit(self, layer: int, row_ids: np.ndarray) -> Finished:
        """The lookup, done by the time this returns (gRPC has no shared region to leave rows in)."""
        ids = np.asarray(row_ids)
        return Finished(self.lookup_into(layer, ids, np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)))

    def lookup_planned(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """No plan mode over gRPC: the daemon reads every row (``lookup_into``)."""
        return self.lookup_into(layer, row_ids, out)

    def plan_info(self) -> dict[str, Any]:
        return {"executor": "daemon", "fallbacks": {}, "pages_read": 0, "bytes_read": 0}

    def reserve(self, nbytes: int) -> np.ndarray:
        raise errors.InvalidRequest("reserve() needs the unix:// transport (shared memory)")

    def unreserve(self, buf: np.ndarray) -> None:
        raise errors.InvalidRequest("unreserve: a gRPC connection has no reserve() buffers")

    def hint(self, layer: int, row_ids: np.ndarray, key: int) -> int:
        """The Hint RPC (see ``EngramClient.hint``): rows queued."""
        ids = requests.row_ids(row_ids).reshape(-1)
        requests.check_count(ids.size, self.max_request_rows)
        request = pb.HintRequest(layer=layer, row_ids=np.ascontiguousarray(ids, dtype="<i8").tobytes(), dtype=pb.INT64,
                                 key=key)
        return self._call(self._stub.Hint, request).rows_queued

    def withdraw(self, key: int) -> int:
        return self._call(self._stub.Withdraw, pb.WithdrawRequest(key=key)).rows_dropped

    def info(self) -> dict[str, Any]:
        return _info_dict(self._call(self._stub.Info, pb.InfoRequest()))

    def stats(self) -> dict[str, float]:
        return dict(self._call(self._stub.Stats, pb.StatsRequest()).values)

    @property
    def broken(self) -> bool:
        return bool(self._broken)

    def close(self) -> None:
        self._channel.close()


def _info_dict(reply: pb.InfoReply) -> dict[str, Any]:
    layers = [li.layer for li in reply.layers]
    return {"layers": layers, "rows": {str(li.layer): li.rows for li in reply.layers}, "row_bytes": reply.row_bytes,
            "mode": reply.mode, "spec": json.loads(reply.spec_json) if reply.spec_json else {},
            "max_request_rows": reply.max_request_rows, "chunk_bytes": reply.chunk_bytes,
            "protocol_version": reply.protocol_version, "version": reply.version,
            "bad_pages": json.loads(reply.bad_pages_json) if reply.bad_pages_json else {},
            "token_map": json.loads(reply.token_map_json) if reply.token_map_json else None,
            "placement": json.loads(reply.placement_json) if reply.placement_json else {},
            **({"table_scales": json.loads(reply.table_scales_json)} if reply.table_scales_json else {})}
