"""The close gate of a store: lookups in flight are counted, and closing waits for them.

Every public call that touches the store's memory or files passes the gate (:meth:`CloseGate.enter`
... :meth:`CloseGate.exit`); :meth:`CloseGate.close` refuses new entries and waits until the
calls inside have left, so files and memory are released only once nothing uses them. Background
work (an admission after a reply, a hint read, a planned rows' admission) enters the same way and
simply does nothing once the store is closing (``enter`` raises :class:`~engram_store.errors.StorageError`).
"""

from __future__ import annotations

import threading

from ..errors import StorageError


class CloseGate:
    """Counts the calls inside a store; :meth:`close` waits for them. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards _closed and _active
        self._closed = False
        self._active = 0

    def enter(self) -> None:
        """One more call inside; raises ``StorageError("the store is closed")`` once :meth:`close` began."""
        with self._cond:
            if self._closed:
                raise StorageError("the store is closed")
            self._active += 1

    def exit(self) -> None:
        """A call entered with :meth:`enter` has left."""
        with self._cond:
            self._active -= 1
            if self._closed and not self._active:
                self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """:meth:`close` has begun (read without the lock: a hint for callers that check before they enter)."""
        return self._closed

    def close(self) -> bool:
        """Refuse new entries and wait for the calls inside to leave. False when already closed (nothing to do)."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.wait_for(lambda: self._active == 0)
        return True
