"""The standard gRPC health service (``grpc.health.v1.Health``), open to anyone, body unread.

Health checks need no credentials (Kubernetes and load balancers probe without them),
so anyone can call them. grpc hands a unary handler its request only once the whole
message has arrived, up to the server's receive limit (what ``max_request_rows`` ids
need, megabytes); an open service that read its requests would let any caller make the
daemon hold that much per call. These handlers take their request as a stream and
never read it: the daemon's status is one for the whole process (the service names
``""`` and ``engram_store.v1.EngramStore`` always agree), so ``Check`` answers it for
any name, and ``Watch`` sends it and each change. At most the transport's flow-control
window of an unread body is ever buffered.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

SERVICE = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """One status for the daemon, answered without reading requests."""

    def __init__(self) -> None:
        self.status = NOT_SERVING
        self._changed = asyncio.Event()

    def set(self, status: int) -> None:
        if status != self.status:
            self.status = status
            self._changed.set()
            self._changed = asyncio.Event()

    async def check(self, requests: Any, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=self.status)

    async def watch(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        while True:
            changed = self._changed
            yield health_pb2.HealthCheckResponse(status=self.status)
            await changed.wait()

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Check": grpc.stream_unary_rpc_method_handler(
                self.check, response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
            "Watch": grpc.stream_stream_rpc_method_handler(
                self.watch, response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        })
