"""The background scrub: every page of the table set read and checked, slowly, forever.

In cached mode most pages are cold: a corrupt one would be found only when a
lookup first asks for it (and refused then; nothing corrupt is ever served).
The scrub finds it earlier, so that the operator sees ``corrupt_pages`` rise
and can repair the table set before a client needs those rows. It reads each
layer file front to back in 1 MiB O_DIRECT reads, checks every page against
its crc32c and reports failures to :class:`~.integrity.PageHealth` (logged
once per page, as any other finder). It keeps to ``bytes_per_second`` on
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
from ..native.syscalls import aligned_buffer
from .integrity import PageHealth
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
        p0, n = offset // PAGE_BYTES, nbytes // PAGE_BYTES
        zero = np.zeros(1, dtype=np.int64)
        try:
            self.reader.read(lf.file.fd, buf, zero + offset, zero + nbytes, zero, queue_depth=1)
        except OSError as exc:
            log.error("scrub: layer %d: reading %d bytes at %d of %s failed: %s", lf.layer, nbytes, offset, lf.path, exc)
            self.health.mark(lf.layer, lf.layer_pages(np.arange(p0, p0 + n)), "the scrub (read error)")
            return
        bad = check_pages(buf, lf.crcs[p0 : p0 + n])
        if len(bad):
            self.health.mark(lf.layer, lf.layer_pages(p0 + bad), "the scrub")
