"""The gRPC server (grpc.aio): its listener, its TLS and token, and how each RPC is registered.

Every RPC of the proto is registered from its descriptor (:func:`add_service`) with a streamed
request, so that :meth:`~.service.EngramStoreService.gate` authenticates the caller and takes its
slot before one byte of the request body is read (the wire format of a unary request is the
same); ``LookupReply`` messages go out through :mod:`engram_store.wire.grpc_codec` (rows copied
once). The standard health service (:mod:`.health`) is registered beside it. A client that goes
away while its reply is being sent is one INFO line, not grpc's traceback.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import grpc

from ... import errors
from ...wire import grpc_codec as lookup_codec
from ...wire._proto import engram_store_pb2 as pb
from ..config import DaemonConfig, parse_hostport, read_token
from .auth import TokenCheck
from .health import NOT_SERVING, SERVING, Health
from .service import EngramStoreService, lenient

log = logging.getLogger(__name__)

_ENVELOPE = 1024  # protobuf framing allowance on top of the raw buffers


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
                                request_deserializer=lenient(getattr(pb, m.input_type.name).FromString),
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
