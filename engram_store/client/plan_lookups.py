"""Plan-mode lookups over one Unix connection: a request in pieces, each one plan lookup whose plan
this process executes, with the daemon reading the rows where a plan cannot be executed here."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import numpy as np

from ..format import requests
from ..wire.frames import ReadPlan
from .plan import HostPlanExecutor, PlanExecutor, PlanUnusable

log = logging.getLogger(__name__)


class PlanConnection(Protocol):
    """What plan lookups need of their connection (``UnixTransport``)."""

    row_bytes: int
    info_cached: dict[str, Any]

    def plan_lookup(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> ReadPlan | None: ...

    def plan_piece_rows(self) -> int: ...

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray: ...


class PlannedLookups:
    """Plan-mode lookups over one Unix connection (``UnixTransport.planned``): each piece of
    a request is one :meth:`UnixTransport.plan_lookup`, whose plan this process executes
    (``executor``, by default a :class:`HostPlanExecutor` of this connection). Where a plan
    cannot be executed here (:class:`PlanUnusable`: e.g. the file is not readable by this
    process) the daemon reads those rows instead, and later calls for that layer are plain
    lookups; logged once per layer. Thread-safe."""

    def __init__(self, transport: PlanConnection) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._executor: HostPlanExecutor | None = None
        self.fallbacks: dict[int, str] = {}  # layer -> why its plans are not executed here

    def lookup(self, layer: int, row_ids: np.ndarray, out: np.ndarray, executor: PlanExecutor | None = None) -> np.ndarray:
        """``lookup_into`` in plan mode; byte-exact with it either way (CorruptRows, and no row of
        the page returned, when a page read here fails its crc32c)."""
        t = self._transport
        ids = requests.row_ids(row_ids)
        flat = requests.rows_out(out, ids.shape, t.row_bytes)
        ids = ids.reshape(-1)
        if not ids.size:
            requests.check_layer(layer, t.info_cached["layers"])
            return out
        if layer in self.fallbacks:
            t.lookup_into(layer, ids, flat)
            return out
        executor = executor or self._host_executor()
        step = t.plan_piece_rows()
        for start in range(0, ids.size, step):
            piece_ids, piece_out = ids[start: start + step], flat[start: start + step]
            plan = t.plan_lookup(layer, piece_ids, piece_out)
            if plan is None:
                continue
            try:
                executor.execute(layer, plan, piece_out)
            except PlanUnusable as exc:
                self._fallback(layer, str(exc))
                missing = plan.positions
                piece_out[missing] = t.lookup_into(layer, piece_ids[missing],
                                                   np.empty((len(missing), t.row_bytes), np.uint8))
        return out

    def info(self) -> dict[str, Any]:
        ex = self._executor
        return {"executor": "host", "fallbacks": dict(self.fallbacks),
                "pages_read": ex.pages_read if ex is not None else 0,
                "bytes_read": ex.bytes_read if ex is not None else 0}

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()

    def _host_executor(self) -> HostPlanExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = HostPlanExecutor()
            return self._executor

    def _fallback(self, layer: int, why: str) -> None:
        with self._lock:
            first = layer not in self.fallbacks
            self.fallbacks[layer] = why
        if first:
            log.warning("plan mode off for layer %d: %s; the daemon reads its cold rows instead", layer, why)
