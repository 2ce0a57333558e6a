"""Access profiles: files of hot row ids, written from live traffic, read for warm-up.

Format: a ``.npy`` file holding an int64 array of shape ``[n, 2]``, one
``(layer, row)`` pair per line, hottest first. Written atomically by
:meth:`TieredStore.write_profile` (the daemon does at stop, config ``save_profile``),
read by ``TieredStore.open(..., warmup=PATH)`` or :meth:`TieredStore.warm_up`
(config ``warmup_profile``). A file is checked before it is read (:func:`open_profile`:
a regular file, a ``.npy`` header of the right type and shape, a size that matches it) and
read in bounded chunks, only as far as the cache can use (:meth:`ProfileFile.read`).

:class:`AccessSampler` keeps a bounded ring of sampled keys from live requests
(a few rows per request, never a Python step per row).
"""

from __future__ import annotations

import io
import os
import stat
import threading
from dataclasses import dataclass
from typing import Collection

import numpy as np
from numpy.lib import format as npformat

from ..errors import ConfigError
from ..format.writer import write_file_atomic

SAMPLES_PER_REQUEST = 64
DEFAULT_CAPACITY = 1 << 20  # keys kept (8 MiB)
READ_PAIRS = 1 << 20  # a profile is read this many pairs (16 MiB) at a time


class AccessSampler:
    """Thread-safe ring of sampled ``(layer, row)`` keys."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, per_request: int = SAMPLES_PER_REQUEST) -> None:
        self.layer = np.zeros(max(capacity, 1), dtype=np.int64)
        self.row = np.zeros(max(capacity, 1), dtype=np.int64)
        self.per_request = per_request
        self.next = 0
        self.filled = 0
        self._lock = threading.Lock()

    def record(self, layer: int, rows: np.ndarray) -> None:
        if not rows.size or self.per_request <= 0:
            return
        picked = rows[:: max(1, rows.size // self.per_request)][: self.per_request]
        k, cap = len(picked), len(self.row)
        with self._lock:
            at = self.next
            if at + k <= cap:  # slices, not index arrays: this runs on every request
                self.row[at : at + k] = picked
                self.layer[at : at + k] = layer
            else:
                ring = (at + np.arange(k)) % cap
                self.row[ring] = picked
                self.layer[ring] = layer
            self.next = (at + k) % cap
            self.filled = min(cap, self.filled + k)

    def hottest(self) -> np.ndarray:
        """int64 ``[n, 2]`` distinct sampled (layer, row), most sampled first."""
        with self._lock:
            pairs = np.stack([self.layer[: self.filled], self.row[: self.filled]], axis=1)
        if not len(pairs):
            return np.zeros((0, 2), dtype=np.int64)
        distinct, counts = np.unique(pairs, axis=0, return_counts=True)
        return distinct[np.argsort(-counts, kind="stable")]

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes + self.row.nbytes


def merge_hottest(*parts: np.ndarray) -> np.ndarray:
    """Concatenate ``[n, 2]`` pair lists keeping the first occurrence of each pair."""
    pairs = np.concatenate([p.reshape(-1, 2) for p in parts]) if parts else np.zeros((0, 2), dtype=np.int64)
    if not len(pairs):
        return pairs.astype(np.int64)
    _, first = np.unique(pairs, axis=0, return_index=True)
    return pairs[np.sort(first)].astype(np.int64)


def write_profile(path: str | os.PathLike, pairs: np.ndarray) -> int:
    """Write ``pairs`` (int64 ``[n, 2]``) atomically; returns n."""
    data = io.BytesIO()
    np.save(data, np.ascontiguousarray(pairs, dtype=np.int64))
    write_file_atomic(path, data.getvalue())
    return len(pairs)


def read_profile(path: str | os.PathLike, max_pairs: int | None = None, skip_layers: Collection[int] = ()) -> np.ndarray:
    """int64 ``[n, 2]`` (layer, row) pairs of a profile file, in file order (hottest first):
    all of them, or the first ``max_pairs`` not of ``skip_layers`` (the file read front to
    back in bounded chunks, never more than that in memory). ConfigError if it is not a
    profile (:func:`open_profile`)."""
    return open_profile(path).read(max_pairs, skip_layers)


@dataclass(frozen=True)
class ProfileFile:
    """A profile file whose type, header and size were checked (:func:`open_profile`)."""

    path: str
    pairs: int  # (layer, row) pairs the file holds
    dtype: np.dtype  # of its values (an integer type)
    offset: int  # of the first value

    def read(self, max_pairs: int | None = None, skip_layers: Collection[int] = (),
             known_layers: Collection[int] | None = None) -> np.ndarray:
        """The first ``max_pairs`` pairs (all: None) whose layer is not in ``skip_layers``. The
        whole file is read, in chunks of :data:`READ_PAIRS` (memory: a chunk and the pairs
        kept); with ``known_layers``, a pair of any other layer is a ConfigError."""
        want = self.pairs if max_pairs is None else max(0, max_pairs)
        skip = np.asarray(sorted(skip_layers), dtype=np.int64)
        known = None if known_layers is None else np.asarray(sorted(known_layers), dtype=np.int64)
        parts, got = [], 0
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                for lo in range(0, self.pairs, READ_PAIRS):
                    n = min(READ_PAIRS, self.pairs - lo)
                    chunk = np.fromfile(f, dtype=self.dtype, count=2 * n)
                    if chunk.size != 2 * n:
                        raise ConfigError(f"access profile {self.path}: ended after {lo + chunk.size // 2} of its "
                                          f"{self.pairs} pairs (changed while read?)")
                    chunk = chunk.reshape(n, 2).astype(np.int64)
                    if known is not None and not np.isin(chunk[:, 0], known).all():
                        unknown = np.setdiff1d(chunk[:, 0], known)
                        raise ConfigError(f"access profile {self.path} names layers {unknown[:8].tolist()} that the "
                                          f"table set does not hold ({known.tolist()})")
                    if got < want:
                        if len(skip):
                            chunk = chunk[~np.isin(chunk[:, 0], skip)]
                        parts.append(chunk[: want - got])
                        got += len(parts[-1])
                    elif known is None:
                        break  # nothing more to keep or to check
        except OSError as exc:
            raise ConfigError(f"access profile {self.path}: cannot read it ({exc.strerror or exc})") from exc
        return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)


def open_profile(path: str | os.PathLike) -> ProfileFile:
    """Check a profile file without reading its pairs: a regular file (a FIFO or a device
    would block or never end), a ``.npy`` (an ``.npz`` is a zip archive) whose header holds
    an integer array of shape ``[n, 2]`` in C order, and exactly as long as that header says
    (a header claiming 4e9 rows in a small file is refused, not allocated). ConfigError
    saying what is wrong."""
    path = os.fspath(path)
    try:  # O_NONBLOCK: opening a FIFO with no writer must not wait for one
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"access profile {path}: cannot open it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
                "not a regular file"
            raise ConfigError(f"access profile {path} is {kind}; expected a regular .npy file (int64 [n, 2])")
        head = f.read(6)
        if head.startswith(b"PK"):
            raise ConfigError(f"access profile {path} is a zip archive (an .npz?); expected a .npy file holding "
                              "one int64 [n, 2] array (numpy.save, not numpy.savez)")
        if head != npformat.MAGIC_PREFIX:
            raise ConfigError(f"access profile {path} is not a .npy file (it starts {head!r}); expected "
                              "an int64 [n, 2] array written by numpy.save")
        f.seek(0)
        try:
            version = npformat.read_magic(f)
            reader = {(1, 0): npformat.read_array_header_1_0, (2, 0): npformat.read_array_header_2_0}.get(version)
            if reader is None:
                raise ValueError(f".npy format version {version}")
            shape, fortran, dtype = reader(f)
        except ValueError as exc:
            raise ConfigError(f"access profile {path}: unreadable .npy header ({exc})") from None
        offset = f.tell()
    if dtype.kind not in "iu" or len(shape) != 2 or shape[1] != 2 or fortran or dtype.hasobject:
        raise ConfigError(f"access profile {path}: {dtype} array of shape {shape}{' (Fortran order)' if fortran else ''}"
                          ", expected int64 [n, 2] (layer, row)")
    want = offset + shape[0] * 2 * dtype.itemsize
    if st.st_size != want:
        raise ConfigError(f"access profile {path}: its header says {shape[0]} pairs ({want - offset} bytes of data), "
                          f"the file holds {st.st_size - offset}; a truncated or forged profile: delete it")
    return ProfileFile(path, int(shape[0]), dtype, offset)
