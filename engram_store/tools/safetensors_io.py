"""A minimal streaming reader for safetensors shards (header + positioned reads).

We read slices of huge tensors with ``os.pread`` into our own buffers so that
importing a 189 GiB checkpoint needs bounded memory; the format is tiny
(``u64 header_len | JSON header | data``) and needs no library for this.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointImportError

MAX_HEADER_BYTES = 100 << 20
_LEN = struct.Struct("<Q")  # header length in bytes, little endian

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F64": 8, "BOOL": 1}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie in a shard."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def row_nbytes(self) -> int:
        """Bytes per index of the first dimension."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0

    def read_rows(self, first: int, count: int, fd: int, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 ``[count, row_nbytes]`` of rows ``first .. first + count`` (into ``out``, C-contiguous, when given)."""
        rb = self.row_nbytes
        if out is None:
            out = np.empty((count, rb), dtype=np.uint8)
        want = count * rb
        got = os.preadv(fd, [memoryview(out).cast("B")], self.start + first * rb)
        if got != want:
            raise CheckpointImportError(f"{self.file}: short read of tensor {self.name} rows {first}..{first + count} "
                                        f"({got} of {want} bytes): is the shard truncated?")
        return out

    def read_all(self) -> np.ndarray:
        """The whole tensor's bytes, uint8 (for small tensors: scalars, buffers)."""
        with open(self.file, "rb") as f:
            f.seek(self.start)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise CheckpointImportError(f"{self.file}: short read of tensor {self.name} ({len(data)} of {self.nbytes} "
                                        "bytes): is the shard truncated?")
        return np.frombuffer(data, dtype=np.uint8)


def read_header(path: Path) -> dict[str, TensorRef]:
    """Tensors of one shard, validated against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_LEN.size)
            if len(head) != _LEN.size:
                raise CheckpointImportError(f"{path}: too short for a safetensors file ({size} bytes)")
            (n,) = _LEN.unpack(head)
            if n > MAX_HEADER_BYTES or n > size - _LEN.size:
                raise CheckpointImportError(f"{path}: header length {n} is impossible for a {size}-byte file (truncated or not safetensors)")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointImportError(f"{path}: unreadable safetensors header: {exc}") from exc
    base = _LEN.size + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(x) for x in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointImportError(f"{path}: malformed header entry for {name}: {exc}") from exc
        if dtype in DTYPE_BYTES and e - b != int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]:
            raise CheckpointImportError(f"{path}: tensor {name} spans {e - b} bytes, shape {list(shape)} of {dtype} needs more or less")
        if base + e > size:
            raise CheckpointImportError(f"{path}: tensor {name} ends at byte {base + e}, file has {size}: shard is truncated")
        out[name] = TensorRef(name, path, dtype, shape, base + b, e - b)
    return out
