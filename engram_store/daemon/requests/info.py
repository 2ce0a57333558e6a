"""INFO and STATS: the daemon's facts (layers, rows, row format, arena, ...) and its counters.

Both answer what the daemon gave its transports when they started (:class:`~.context.Served`'s
``info`` and ``stats``); each transport encodes them its way (JSON over the Unix socket, the
``InfoReply`` and ``StatsReply`` messages over gRPC).
"""

from __future__ import annotations

from typing import Any

from .context import Served


def info(served: Served) -> dict[str, Any]:
    """The daemon's facts, as the Info request answers them."""
    return served.info()


def stats(served: Served) -> dict[str, float]:
    """The daemon's counters and the store's, as the Stats request answers them."""
    return served.stats()
