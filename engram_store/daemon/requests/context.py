"""What a request handler is given: what it may touch (:class:`Served`) and who asks (:class:`Caller`).

A transport builds one :class:`Served` when it starts serving (the store, the limits of one
request, its own bounds on hints and client memory, the daemon's facts) and one
:class:`Caller` per client (a Unix connection, a gRPC call); the handlers of
:mod:`engram_store.daemon.requests` read nothing else, so none of them knows which
transport a request came through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...format import requests
from ...storage.base import RowStore

if TYPE_CHECKING:
    from ..limits import ByteBudget, PeerBuckets


@dataclass(frozen=True)
class Served:
    """What one transport's requests may touch.

    ``hint_rates``: hinted rows a second, per owner (each transport has its own);
    ``region_budget`` / ``max_client_shm_bytes``: the bytes of client memory the daemon maps
    (Unix regions and stagings; None where a transport maps none); ``info`` / ``stats``: the
    daemon's facts and counters, as the Info and Stats requests answer them."""

    store: RowStore
    max_request_rows: int
    hint_rates: PeerBuckets
    info: Callable[[], dict[str, Any]]
    stats: Callable[[], dict[str, float]]
    region_budget: ByteBudget | None = None
    max_client_shm_bytes: int = 0
    layers: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", frozenset(self.store.layers))

    def check_layer(self, layer: int) -> None:
        """UnknownLayer unless the store holds ``layer``."""
        requests.check_layer(layer, self.layers)

    def check_count(self, count: int) -> None:
        """InvalidRequest unless ``count`` rows are within ``max_request_rows``."""
        requests.check_count(count, self.max_request_rows)


@dataclass(frozen=True)
class Caller:
    """Who asks: ``owner`` (the client as the owner of hints: its rate, its share of the queue, its
    keys) and ``holder`` (the name its hints are held under; a client's connection, or the client)."""

    served: Served
    owner: str
    holder: str
