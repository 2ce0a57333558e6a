"""The background scrub: every page of the table set read and checked, slowly, forever.

In cached mode most pages are cold: a corrupt one would be found only when a
lookup first asks for it (and refused then; nothing corrupt is ever served).
The scrub finds it earlier, so that the operator sees ``corrupt_pages`` rise
and can repair the table set before a client needs those rows. It reads each
layer file front to back in 1 MiB O_DIRECT reads, checks every page against
its crc32c and reports failures to :class:`~.integrity.PageHealth` (logged
once per page, as any other finder); a read that fails is retried on halves
until the unreadable pages are found, and only those are marked. A page marked
bad that the scrub reads good again (the file was repaired) is cleared. It keeps to ``bytes_per_second`` on
average (never bursting to catch up), so its share of the disk is known: at
32 MiB/s one pass over V4.1's 189 GiB takes about 1.7 hours.

A striped layer is scrubbed stripe after stripe; a failing local page q of
stripe k is reported as layer page k + K * q.

Not used in resident mode: the fill checked every page and nothing is read
from NVMe afterwards.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..format.checksums import bad_pages as check_pages
from ..format.layout import PAGE_BYTES
from ..native.readers import PageReader
from ..native.syscalls import aligned_buffer, as_array
from .integrity import PageHealth, failing_items
from .layer_file import LayerFile

log = logging.getLogger(__name__)

SCRUB_READ_BYTES = 1 << 20  # one O_DIRECT read, then a rate-keeping pause
MAX_LAG_SECONDS = 1.0  # a scrub further behind its schedule than this restarts the schedule (no burst)


class Scrubber:
    """One daemon thread scrubbing ``files`` at ``bytes_per_second``. :meth:`stop` joins it."""

    def __init__(self, files: list[LayerFile], reader: PageReader, health: PageHealth, bytes_per_second: int) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second}")
        self.files = [lf for lf in files if lf.file is not None and lf.crcs is not None]
        self.reader = reader
        self.health = health
        self.rate = bytes_per_second
        self.bytes_checked = 0
        self.passes = 0  # complete passes over every layer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engram-scrub", daemon=True)

    def start(self) -> "Scrubber":
        if self.files:
            self._thread.start()
            log.info("scrub: checking every page of %d layers in the background at %.1f MiB/s", len(self.files),
                     self.rate / 2**20)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        buf = aligned_buffer(SCRUB_READ_BYTES)
        try:
            start, done = time.monotonic(), 0
            while not self._stop.is_set():
                for lf in (part for f in self.files for part in f.parts()):
                    for offset in range(0, lf.layout.file_bytes, SCRUB_READ_BYTES):
                        if self._stop.is_set():
                            return
                        n = min(SCRUB_READ_BYTES, lf.layout.file_bytes - offset)
                        self._check(lf, offset, n, buf)
                        self.bytes_checked += n
                        done += n
                        delay = start + done / self.rate - time.monotonic()
                        if delay < -MAX_LAG_SECONDS:
                            start, done = time.monotonic(), 0
                        elif delay > 0 and self._stop.wait(delay):
                            return
                self.passes += 1
        finally:
            buf.close()

    def _check(self, lf: LayerFile, offset: int, nbytes: int, buf) -> None:
        """Read and check one extent; mark the pages that fail, clear marked ones that pass."""
        p0, n = offset // PAGE_BYTES, nbytes // PAGE_BYTES
        unreadable = read_pages(self.reader, lf, p0, n, buf)
        if len(unreadable):
            readable = np.setdiff1d(np.arange(n), unreadable)
            bad = readable[check_pages(as_array(buf)[: n * PAGE_BYTES].reshape(n, PAGE_BYTES)[readable],
                                       lf.crcs[p0 + readable])]
        else:
            readable, bad = np.arange(n), check_pages(buf, lf.crcs[p0 : p0 + n])
        if len(unreadable) or len(bad):
            self.health.mark(lf.layer, lf.layer_pages(p0 + np.union1d(unreadable, bad)), "the scrub")
        if self.health.has_bad(lf.layer):
            self.health.clear(lf.layer, lf.layer_pages(p0 + np.setdiff1d(readable, bad)), "the scrub")


def read_pages(reader: PageReader, lf: LayerFile, p0: int, n: int, buf) -> np.ndarray:
    """Read pages ``p0..p0+n-1`` of ``lf`` into ``buf`` (page i at ``i * 4096``) in one read; if
    that fails, find the pages that cannot be read by halving (:func:`.integrity.failing_items`)
    and read the others. Returns the (local, 0-based) indices of the unreadable ones."""
    def attempt(lo: int, hi: int) -> None:
        one = np.ones(1, dtype=np.int64)
        reader.read(lf.file.fd, buf, one * (p0 + lo) * PAGE_BYTES, one * (hi - lo) * PAGE_BYTES, one * lo * PAGE_BYTES,
                    queue_depth=1)

    try:
        attempt(0, n)
        return np.empty(0, dtype=np.int64)
    except OSError as exc:
        log.debug("scrub: layer %d: reading pages %d..%d of %s failed (%s); retrying page ranges", lf.layer, p0,
                  p0 + n - 1, lf.path, str(exc))
    return np.asarray(failing_items(n, attempt), dtype=np.int64)
