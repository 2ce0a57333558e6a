"""The hint reader: one background thread that reads queued hints (:mod:`.hint_queue`) behind the lookups.

It takes a batch of a hint's rows at a time (holders in turns, :meth:`~.hint_queue.HintQueue.take`) and
hands it to the store (``read_batch``), which reads its pages:

- **behind lookups**: it starts reading only once no lookup is reading
  (:meth:`~.inflight.InFlight.wait_for_lookups`), and a lookup that starts reading raises a stop flag
  (:attr:`~.inflight.InFlight.hint_stop`) on which the hint read queues no more pages: the lookup
  shares the device with at most the hint reads already in flight, and the hint read resumes after
  it. A stream of lookups that never pauses holds the reader back :data:`STARVE_SECONDS` at most; then
  a few pages go anyway (``STARVED_READS`` times its queue depth), so hints still move;
- **with a share of the queue depth**: ``queue_depth`` reads in flight at most
  (:class:`~.hint_queue.HintSettings`), never the lookups' full depth;
- **shared**: its rows are claimed as a read in flight (:mod:`.inflight`), so a lookup missing them
  waits for it (which then gives way at once) rather than reading them twice, and rows a lookup is
  reading are left out.

Every :data:`SETTLE_SECONDS` it settles the cache's hinted share (``settle``: rows a lookup read go
to the policy, rows that aged unread are freed) and drops queued hints that aged. When the hinted
share is full, or the cache has no slot a hinted row may take (every row in it is one lookups keep
hitting: see :meth:`~.row_cache.RowCache.admit_hinted`), it settles and waits rather than read rows it
could not keep. When the queue empties after a flood it hands the freed memory back
(:meth:`~.hint_queue.HintQueue.trim`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .hint_queue import HintQueue

log = logging.getLogger(__name__)

BATCH_ROWS = 4096  # rows of a hint taken at a time (one read, which a lookup interrupts)
STARVE_SECONDS = 0.05  # the longest the reader defers a chunk to lookups before reading it anyway
SETTLE_SECONDS = 0.25  # how often the hinted share is settled and aged hints dropped
FULL_PAUSE_SECONDS = 0.05  # the hinted share is full: pause this long before looking again


class HintReader:
    """The thread. ``room()``: slots the hinted share has free; ``read_batch(layer, rows)``: read and admit
    a batch; ``settle()``: settle the hinted share. Started by :meth:`start` (the first hint), stopped by
    :meth:`stop` (the store's close), which waits for the batch being read."""

    def __init__(self, queue: HintQueue, room: Callable[[], int], read_batch: Callable[[int, object], None],
                 settle: Callable[[], None]) -> None:
        self.queue, self._room, self._read_batch, self._settle = queue, room, read_batch, settle
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.busy = False  # a batch is being read

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self.stopping.is_set():
                self._thread = threading.Thread(target=self._run, name="engram-hint-reader", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.queue.close()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def idle(self) -> bool:
        """Nothing queued and no batch being read."""
        return self.queue.empty and not self.busy

    def _run(self) -> None:
        next_settle = 0.0
        clock = self.queue.clock
        while not self.stopping.is_set():
            try:
                if clock() >= next_settle:
                    self._settle()
                    self.queue.drop_aged()
                    next_settle = clock() + SETTLE_SECONDS
                room = self._room()
                if room <= 0:  # (the periodic settle above still drops hints that aged meanwhile)
                    self._settle()
                    if self._room() <= 0:
                        self.stopping.wait(FULL_PAUSE_SECONDS)
                        continue
                    room = self._room()
                self.busy = True  # before the take: idle() never sees a batch taken but not read yet
                try:
                    got = self.queue.take(min(BATCH_ROWS, room))
                    if got is not None:
                        self._read_batch(*got)
                finally:
                    self.busy = False
                if got is None:
                    self.queue.trim()  # emptied after a flood: its memory goes back to the system
                    self.queue.wait(SETTLE_SECONDS)
            except Exception:  # a failed batch must not end the reader; its rows were only a hint
                log.exception("reading a batch of hinted rows failed")
                self.stopping.wait(FULL_PAUSE_SECONDS)
