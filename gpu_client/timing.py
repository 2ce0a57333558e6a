"""Layer-ahead timing of a prefetcher: per Engram layer, when its rows landed against when the model asked.

Times are milliseconds from the step's ``submit()`` call:

* ``issued_ms``: the layer's lookup left (sent to the daemon, or the in-process gather began);
* ``rows_ready_ms``: the rows were in the layer's buffer, seen from the host (on CUDA: the copy
  was enqueued, or for the staged-shm path had run; for lookups sent from ``submit`` to the daemon,
  ``async-submit``, when they were collected, which is inside the ``wait``);
* ``needed_at_ms``: the model asked for them (``wait(layer)`` was called), i.e. how long the
  hashing plus the layers before this one ran;
* ``slack_ms`` = needed_at - rows_ready: positive, the rows were early; negative, the model waited;
* ``waited_ms``: how long ``wait(layer)`` blocked.

On CUDA the same figures are also taken on the device, from timing events on the submitting
stream (submit, and the point where the layer's compute waits) and on the copy stream (rows
landed): ``device_ready_ms``, ``device_needed_ms``, ``device_slack_ms``. They are read with a
non-blocking ``query``, never a synchronize, when a later step is submitted or the figures are asked for.

Stats are rolling over the last ``window`` steps (count of all steps, mean, p50, p99); a few
``perf_counter`` calls per layer per step, no per-row work.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HOST_FIELDS = ("issued_ms", "rows_ready_ms", "needed_at_ms", "slack_ms", "waited_ms")
DEVICE_FIELDS = ("device_ready_ms", "device_needed_ms", "device_slack_ms")


def summarize(values: Any) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.percentile(a, (50, 99))
    return {"mean": round(float(a.mean()), 4), "p50": round(float(p50), 4), "p99": round(float(p99), 4)}


@dataclass
class _LayerStats:
    window: int
    steps: int = 0  # all steps recorded, not only the window
    late: int = 0  # steps whose slack was negative (host side)
    device_steps: int = 0
    host: collections.deque = field(init=False)
    device: collections.deque = field(init=False)

    def __post_init__(self) -> None:
        self.host = collections.deque(maxlen=self.window)
        self.device = collections.deque(maxlen=self.window)


class LayerTimings:
    """Rolling per-layer timing stats of one prefetcher (recorded by the engine thread only)."""

    def __init__(self, layers: tuple[int, ...], window: int = 1024) -> None:
        self.layers = layers
        self.window = window
        self._stats = [_LayerStats(window) for _ in layers]

    def record(self, li: int, issued: float, ready: float, needed: float, waited: float) -> None:
        """One step's host figures for layer index ``li``, in milliseconds from its submit."""
        s = self._stats[li]
        s.steps += 1
        s.late += needed < ready
        s.host.append((issued, ready, needed, needed - ready, waited))

    def record_device(self, li: int, ready: float, needed: float) -> None:
        s = self._stats[li]
        s.device_steps += 1
        s.device.append((ready, needed, needed - ready))

    def fold_device(self, steps: collections.deque) -> None:
        """The device figures of finished steps (futures, with ``device_times()``), oldest first, as far
        as their events have completed; folded steps leave ``steps``. Never waits for the GPU."""
        while steps:
            times = steps[0].device_times()
            if times is None:
                return
            steps.popleft()
            for li, ready, needed in times:
                self.record_device(li, ready, needed)

    def reset(self) -> None:
        self._stats = [_LayerStats(self.window) for _ in self.layers]

    def summary(self) -> dict[str, Any]:
        """``{"window": N, "layers": {layer: {"steps", "late", "issued_ms": {mean, p50, p99}, ...}}}``."""
        out: dict[str, Any] = {"window": self.window, "layers": {}}
        for layer, s in zip(self.layers, self._stats):
            doc: dict[str, Any] = {"steps": s.steps, "late": s.late}
            host = np.asarray(s.host, dtype=np.float64).reshape(-1, len(HOST_FIELDS))
            for k, name in enumerate(HOST_FIELDS):
                doc[name] = summarize(host[:, k])
            if s.device_steps:
                dev = np.asarray(s.device, dtype=np.float64).reshape(-1, len(DEVICE_FIELDS))
                doc["device_steps"] = s.device_steps
                for k, name in enumerate(DEVICE_FIELDS):
                    doc[name] = summarize(dev[:, k])
            out["layers"][layer] = doc
        return out
