"""Stopping within ``drain_seconds``, by construction.

SIGTERM (or SIGINT) starts a :class:`StopClock`: from then on the process has
``drain_seconds`` to be gone, whatever it is doing. Two mechanisms make that hold:

- every step of the stop (the listeners' drain, the lookup pool, metrics, closing
  the store) runs with the time left (:meth:`StopClock.wait`); a step still running
  at its limit is *abandoned*: nothing waits for it any more (its thread goes on
  until the process ends), and the log names it;
- a watchdog thread, armed at the signal, ends the process (exit status 0, the stop
  was asked for) at the deadline less :data:`EXIT_MARGIN_SECONDS` if it is still
  alive then, whatever holds it: a step, a table load in progress, a blocked
  notification to the service manager, the interpreter's exit joining a thread.
  Its last log line names the step it cut short and everything abandoned.

A stop that abandoned anything ends with ``os._exit`` as well (:meth:`StopClock.exit`),
since the interpreter's normal exit would wait for the abandoned threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Awaitable

log = logging.getLogger(__name__)

EXIT_MARGIN_SECONDS = 0.25  # the watchdog ends the process this long before the deadline (at most a quarter of it)


class StopClock:
    """The stop's deadline, the step it is at, and what it abandoned. :meth:`start` is idempotent."""

    def __init__(self, drain_seconds: float) -> None:
        self.drain_seconds = drain_seconds
        self.started_at: float | None = None
        self.deadline = float("inf")
        self.step = "waiting for the signal"
        self.abandoned: list[str] = []
        self.watched = False  # the watchdog is armed: a signal asked for this stop
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def start(self, watchdog: bool = True) -> None:
        """The deadline is ``drain_seconds`` from now. ``watchdog``: the stop was asked for (a
        signal), so the process is ended at the deadline whatever holds it; a stop after a
        start-up error only bounds its steps (the error's exit status must come through)."""
        with self._lock:
            if self.started_at is not None:
                return
            self.started_at = time.monotonic()
            self.deadline = self.started_at + self.drain_seconds
            self.watched = watchdog
        if watchdog:
            threading.Thread(target=self._watch, name="engram-stop-watchdog", daemon=True).start()

    def left(self, reserve: float = 0.0) -> float:
        """Seconds until the deadline less ``reserve`` (never negative)."""
        return max(0.0, self.deadline - reserve - time.monotonic())

    def margin(self) -> float:
        return min(EXIT_MARGIN_SECONDS, self.drain_seconds / 4)

    async def wait(self, step: str, work: Awaitable | list[Awaitable], reserve: float = 0.0) -> list:
        """Await ``work`` (one awaitable or several, run together) until the deadline less
        ``reserve`` plus the exit margin; return their results (an exception for one that
        failed). What is still running then is abandoned (named in :attr:`abandoned`) and
        left out of the results."""
        self.step = step
        tasks = [asyncio.ensure_future(w) for w in (work if isinstance(work, list) else [work])]
        _, pending = await asyncio.wait(tasks, timeout=self.left(reserve + self.margin()))
        if pending:
            self.abandon(f"{step} ({len(pending)} of {len(tasks)} not done after "
                         f"{time.monotonic() - (self.started_at or time.monotonic()):.2f}s)")
        return [t.exception() or t.result() for t in tasks if t.done() and not t.cancelled()]

    def abandon(self, what: str) -> None:
        self.abandoned.append(what)
        log.warning("stop: abandoned %s: drain_seconds (%gs) leaves no time to wait for it", what, self.drain_seconds)

    def exit(self, status: int = 0) -> None:
        """End the process now (no interpreter exit, which would join abandoned threads)."""
        log.warning("stop: exiting %.2fs after the signal, abandoning %s", time.monotonic() - (self.started_at or 0.0),
                    "; ".join(self.abandoned) or "nothing")
        _flush_logs()
        os._exit(status)

    def _watch(self) -> None:
        delay = self.deadline - self.margin() - time.monotonic()
        if delay > 0:
            threading.Event().wait(delay)
        log.error("stop: drain_seconds (%gs) ran out during %s; ending the process now", self.drain_seconds, self.step)
        self.exit(0)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # a broken handler must not keep the process alive
            pass
