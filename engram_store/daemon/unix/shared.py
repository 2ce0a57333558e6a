"""What every connection of one Unix listener draws on, as one value the listener hands to each.

A connection reads these and nothing of its listener's: it never imports the server
(:mod:`.server`), which builds this value when it starts and calls back into nothing
but the two callables given here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import limits
from ..config import DaemonConfig
from ..requests.context import Served
from ..stats import DaemonStats
from . import fastpath, outbox


@dataclass(frozen=True)
class Shared:
    """What every connection of one Unix listener draws on, handed to each by the listener.

    ``served``: the request layer's view of the daemon (store, limits, hint rates, the clients'
    memory budget, info and stats); ``turns`` / ``piece_rows``: the worker pool's fair turns and
    the rows of one piece; ``poll_token`` / ``busy_poll_seconds``: the one busy-poller;
    ``native``: the native path (None: all in Python); ``fd_limit_refusal``: counts a client
    refused for want of file descriptors and says what to tell it; ``forget``: called once a
    connection has closed."""

    served: Served
    config: DaemonConfig
    stats: DaemonStats
    sender: outbox.Sender
    turns: limits.RoundRobin
    piece_rows: int
    poll_token: fastpath.PollToken
    busy_poll_seconds: float
    native: fastpath.NativePath | None
    fd_limit_refusal: Callable[[OSError], str]
    forget: Callable[[Any], None]  # given the connection (typed Any: it imports this module)
