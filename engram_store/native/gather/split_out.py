"""A lookup's output that is a client's staging: rows in the engines' split layout, under its gate.

:class:`SplitOut` stands where a store takes ``out`` (``[n, row_bytes]`` rows): row ``k`` of the
lookup goes to row ``positions[k]`` of the client's payload block and scale block
(``engram_store/wire/staging.py``). :class:`~.gather.Gatherer` writes it with the native gathers
(``gather_to_split`` / ``gather_split_to_split``), so the rows are copied once, from the daemon's
DRAM into the engine's staging.

The gate decides whether they may be written at all: the first write claims it (``OPEN(R) ->
WRITING(R)``; a client that gave up on the request has revoked it, and then nothing is written);
the write that completes the ``n`` rows ends it (``DONE(R)``, waking the client), so the window in
which a client must wait for the daemon is the copy itself. A store writes each row once, in one
or several gathers, after every row it writes is checked; :meth:`SplitOut.finish` (the daemon's
connection, whatever happened) ends a window a failed lookup left open, and says whether every row
went in: only then is the lookup answered OK.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ... import errors


class _Window:
    """The gate and the rows written, shared by a SplitOut and its slices."""

    def __init__(self, native: Any, gate: Any, gate_offset: int, request_id: int, total: int) -> None:
        self.native, self.gate, self.gate_offset, self.request_id = native, gate, gate_offset, request_id
        self.total, self.written = total, 0
        self.claimed = self.revoked = self.closed = self.overflow = False
        self.lock = threading.Lock()

    def begin(self, rows: int) -> bool:
        with self.lock:
            if self.revoked or self.overflow:
                return False
            if self.closed or self.written + rows > self.total:  # rows written twice: never answered OK
                self.overflow = True
                return False
            if not self.claimed:
                if not self.native.gate_claim(self.gate, self.gate_offset, self.request_id):
                    self.revoked = True
                    return False
                self.claimed = True
            return True

    def end(self, rows: int, ok: bool) -> None:
        with self.lock:
            if not ok:  # a gather that raised: the lookup fails; no more writes
                self.overflow = True
                self._close()
                return
            self.written += rows
            if self.written == self.total:
                self._close()

    def _close(self) -> None:
        if self.claimed and not self.closed:
            self.native.gate_done(self.gate, self.gate_offset, self.request_id)
        self.closed = True


class SplitOut:
    """``n`` rows into ``weights`` / ``scales`` (uint8 ``[rows, weight_bytes]`` / ``[rows,
    scale_bytes]``, a client's staging mapped by the daemon) at ``positions`` (int64 ``[n]``), under
    the gate word at ``gate_offset`` of ``gate`` for request ``request_id``. Slicing gives the rows
    ``[a:b]``, sharing the gate."""

    def __init__(self, weights: np.ndarray, scales: np.ndarray, positions: np.ndarray, gate: Any, gate_offset: int,
                 request_id: int, native: Any, _window: _Window | None = None) -> None:
        self.weights, self.scales, self.positions = weights, scales, positions
        self.weight_bytes, self.scale_bytes = weights.shape[1], scales.shape[1]
        self._window = _window or _Window(native, gate, gate_offset, request_id, len(positions))

    @property
    def row_bytes(self) -> int:
        return self.weight_bytes + self.scale_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.positions), self.row_bytes)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, key: slice) -> "SplitOut":
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise errors.StorageError("a lookup into a client's staging is written by the gathers, in contiguous "
                                      "slices of its rows only")
        w = self._window
        return SplitOut(self.weights, self.scales, self.positions[key], w.gate, w.gate_offset, w.request_id,
                        w.native, w)

    def check(self, n: int, row_bytes: int) -> None:
        if len(self.positions) != n or self.row_bytes != row_bytes:
            raise errors.InvalidRequest(f"a staging output of {len(self.positions)} rows of {self.row_bytes} bytes "
                                        f"for {n} ids of {row_bytes}-byte rows")

    def write(self, gather, index: np.ndarray) -> None:
        """Run ``gather(index, positions, weights, scales)`` for these rows inside the gate's window;
        nothing when the client revoked it (or rows would be written twice)."""
        if len(index) != len(self.positions):
            raise errors.StorageError(f"{len(index)} rows gathered into {len(self.positions)} staging rows")
        if not len(index) or not self._window.begin(len(index)):
            return
        ok = False
        try:
            gather(index, self.positions, self.weights, self.scales)
            ok = True
        finally:
            self._window.end(len(index), ok)

    def finish(self) -> bool:
        """End the window (whatever happened); True when every row went in, exactly once."""
        w = self._window
        with w.lock:
            w._close()
            return w.claimed and not w.overflow and w.written == w.total

    @property
    def revoked(self) -> bool:
        """The client gave up on the request before its first row was written."""
        return self._window.revoked
