"""A small progress line for long CLI jobs (stderr, only on a terminal unless forced)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Callable with byte counts; prints ``label: pct% done/total GB  MB/s``."""

    def __init__(self, label: str, total_bytes: int, enabled: bool | None = None, stream=sys.stderr) -> None:
        self.label = label
        self.total = max(total_bytes, 1)
        self.done = 0
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()
        self._last = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rate_mb_s(self) -> float:
        return self.done / 1e6 / max(self.elapsed, 1e-9)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.5 or self.done >= self.total):
            self._last = now
            self.stream.write(f"\r{self.label}: {100 * self.done / self.total:5.1f}% "
                              f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB  {self.rate_mb_s():.0f} MB/s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
