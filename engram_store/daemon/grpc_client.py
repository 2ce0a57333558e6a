"""The client side of the gRPC service: one channel, blocking calls, typed errors.

Row ids go as one raw int64 buffer; rows come back in one message when they
fit ``chunk_bytes`` (the daemon's grpc_chunk_bytes, learnt from Info) and as a
stream of chunks otherwise, each copied into the caller's buffer as it lands.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import numpy as np

from .. import errors
from .._proto import engram_store_pb2 as pb
from .._proto import engram_store_pb2_grpc as pb_grpc
from . import lookup_codec, wire
from .unix_client import _check_ids, _check_out

MAX_MESSAGE_BYTES = 256 << 20  # explicit client limits; the daemon sends at most one chunk per message

_STATUS_OF_CODE: dict[grpc.StatusCode, wire.Status] = {
    grpc.StatusCode.INVALID_ARGUMENT: wire.Status.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: wire.Status.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND: wire.Status.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: wire.Status.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: wire.Status.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: wire.Status.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: wire.Status.UNAVAILABLE,
    grpc.StatusCode.INTERNAL: wire.Status.INTERNAL,
}


def error_of(exc: grpc.RpcError) -> errors.EngramStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    status = _STATUS_OF_CODE.get(code, wire.Status.INTERNAL)
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return wire.error_of(status, f"{details} (gRPC {code.name})")


class GrpcTransport:
    """A channel to ``target`` (``host:port``); TLS when ``tls_ca`` (a PEM file) is given."""

    kind = "grpc"
    arena = None
    region = None

    def __init__(self, target: str, *, tls_ca: str | None = None, connect_timeout: float = 5.0,
                 call_timeout: float | None = 60.0) -> None:
        self.target, self.call_timeout = target, call_timeout
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        if tls_ca:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
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
            reply = self._stub.Info(pb.InfoRequest(), timeout=connect_timeout)
        except grpc.RpcError as exc:
            self._channel.close()
            raise errors.Unavailable(f"cannot reach engram-store at grpc://{target}: {error_of(exc)}") from None
        self.info_cached = _info_dict(reply)
        self.row_bytes = reply.row_bytes
        self.chunk_bytes = reply.chunk_bytes
        self.max_request_rows = reply.max_request_rows

    def _raise(self, exc: grpc.RpcError) -> None:
        err = error_of(exc)
        if isinstance(err, errors.Unavailable):
            self._broken = str(err)
        raise err from None

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        ids = _check_ids(row_ids)
        flat = _check_out(out, ids.shape, self.row_bytes).reshape(-1)
        if ids.size > self.max_request_rows:
            raise errors.ResourceExhausted(f"{ids.size} rows asked; the daemon allows {self.max_request_rows} per request")
        request = pb.LookupRequest(layer=layer, row_ids=np.ascontiguousarray(ids.reshape(-1), dtype="<i8").tobytes(),
                                   dtype=pb.INT64)
        rb = self.row_bytes
        try:
            replies = [self._lookup(request, timeout=self.call_timeout)] if ids.size * rb <= self.chunk_bytes \
                else self._lookup_stream(request, timeout=self.call_timeout)
            for reply in replies:
                start = reply.first_row * rb
                if reply.row_bytes != rb or start + len(reply.rows) > flat.size:
                    raise errors.StorageError(f"gRPC reply does not fit the request: rows from {reply.first_row}, "
                                              f"{len(reply.rows)} bytes of {reply.row_bytes}-byte rows")
                flat[start: start + len(reply.rows)] = np.frombuffer(reply.rows, dtype=np.uint8)
        except grpc.RpcError as exc:
            self._raise(exc)
        return out

    def info(self) -> dict[str, Any]:
        try:
            return _info_dict(self._stub.Info(pb.InfoRequest(), timeout=self.call_timeout))
        except grpc.RpcError as exc:
            self._raise(exc)
            raise  # unreachable

    def stats(self) -> dict[str, float]:
        try:
            return dict(self._stub.Stats(pb.StatsRequest(), timeout=self.call_timeout).values)
        except grpc.RpcError as exc:
            self._raise(exc)
            raise  # unreachable

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
            "protocol_version": reply.protocol_version, "version": reply.version}
