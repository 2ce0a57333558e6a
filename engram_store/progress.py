"""Progress of long jobs with a rate and an ETA: synth, import, verify, the daemon's resident fill.

:class:`Progress` is fed byte counts (``progress(nbytes)``, what the table writer calls) or an
absolute count (:meth:`Progress.update`), or samples one itself (:meth:`Progress.watch`, for work
it cannot be handed into). It writes ``label: 42.0% 1.23/2.93 GB, 350 MB/s, 4m 51s left``:

- on a terminal, one live line on ``stream`` (redrawn twice a second);
- forced on elsewhere (``enabled=True``, a CLI's ``--progress``), the same as a plain line
  every ``every`` seconds, so that a log file gets lines, not carriage returns;
- to a logger (``log=``, the daemon), an INFO record every ``every`` seconds.

The rate is measured over the last :data:`RATE_WINDOW_SECONDS` (the ETA follows the current
speed, not the start's); the summary fields (``done``, ``elapsed``, :meth:`rate_mb_s`) cover the
whole job.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

RATE_WINDOW_SECONDS = 10.0
LIVE_REDRAW_SECONDS = 0.5
DEFAULT_EVERY_SECONDS = 5.0


def format_duration(seconds: float | None) -> str:
    """``4m 51s``, ``1h 02m``, ``12s``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s // 60 % 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Callable with byte counts; reports ``label: pct% done/total GB, MB/s, time left``."""

    def __init__(self, label: str, total_bytes: int, enabled: bool | None = None, stream: TextIO | None = None, *,
                 log: logging.Logger | None = None, every: float = DEFAULT_EVERY_SECONDS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.label = label
        self.total = max(int(total_bytes), 1)
        self.done = 0
        self.stream = stream = sys.stderr if stream is None else stream  # the one of the moment, not of the import
        self.live = bool(stream.isatty()) if enabled is None else bool(enabled) and bool(stream.isatty())
        self.lines = bool(enabled) and not self.live  # forced on where there is no terminal: plain lines
        self.log = log
        self.every = every
        self.clock = clock
        self.t0 = clock()
        self._last_live = self._last_line = self.t0
        self._window: collections.deque[tuple[float, int]] = collections.deque([(self.t0, 0)])
        self._lock = threading.Lock()
        self._drawn = False

    @property
    def enabled(self) -> bool:
        return self.live or self.lines or self.log is not None

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def rate_mb_s(self) -> float:
        """Average MB/s over the whole job so far."""
        return self.done / 1e6 / max(self.elapsed, 1e-9)

    def rate(self) -> float:
        """Bytes per second over the last RATE_WINDOW_SECONDS (the whole job until then)."""
        with self._lock:
            (t_old, d_old), (t_new, d_new) = self._window[0], self._window[-1]
        return (d_new - d_old) / (t_new - t_old) if t_new > t_old else 0.0

    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate (None before a rate is known)."""
        rate = self.rate()
        if self.done >= self.total:
            return 0.0
        return (self.total - self.done) / rate if rate > 0 else None

    def describe(self) -> str:
        return (f"{self.label}: {100 * min(self.done, self.total) / self.total:5.1f}% "
                f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB, {self.rate() / 1e6:.0f} MB/s, "
                f"{format_duration(self.eta_seconds())} left")

    def __call__(self, nbytes: int) -> None:
        self.update(self.done + int(nbytes))

    def update(self, done: int) -> None:
        """Set the bytes done so far (never backwards) and report when due."""
        now = self.clock()
        with self._lock:
            self.done = max(self.done, int(done))
            window = self._window
            if now - window[-1][0] >= 0.1 or self.done >= self.total:
                window.append((now, self.done))
                while len(window) > 2 and now - window[1][0] >= RATE_WINDOW_SECONDS:
                    window.popleft()
        finished = self.done >= self.total
        if self.live and (now - self._last_live >= LIVE_REDRAW_SECONDS or finished):
            self._last_live = now
            self.stream.write("\r" + self.describe().ljust(78))
            self.stream.flush()
            self._drawn = True
        if (self.lines or self.log is not None) and now - self._last_line >= self.every:
            self._last_line = now
            self._line(self.describe())

    def _line(self, text: str) -> None:
        if self.lines:
            self.stream.write(text + "\n")
            self.stream.flush()
        if self.log is not None:
            self.log.info("%s", text)

    def close(self) -> None:
        """End the live line; a line or log record with the totals."""
        summary = (f"{self.label}: {self.done / 1e9:.2f} GB in {format_duration(self.elapsed)}, "
                   f"{self.rate_mb_s():.0f} MB/s")
        if self.live and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        if self.lines or self.log is not None:
            self._line(summary)

    @contextlib.contextmanager
    def watch(self, source: Callable[[], int], interval: float = 0.5) -> Iterator["Progress"]:
        """Sample ``source()`` (bytes done so far) every ``interval`` s in a thread while the block
        runs, for work that cannot call back (a fill inside the store, a read inside a library)."""
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(interval):
                try:
                    self.update(source())
                except OSError:  # what it samples went away (the job is ending): stop reporting
                    return

        thread = threading.Thread(target=poll, name=f"progress-{self.label}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


def read_bytes_counter(proc_io: str = "/proc/self/io") -> Callable[[], int]:
    """A :meth:`Progress.watch` source: bytes this process has read through read calls since now
    (``rchar``; 0 on a system without ``/proc/self/io``), for a reader that cannot call back."""
    def rchar() -> int:
        try:
            with open(proc_io) as f:
                for line in f:
                    if line.startswith("rchar:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    start = rchar()
    return lambda: rchar() - start
