"""The reference reader: ``TableSet.open(DIR).read_rows(layer, row_ids)``.

Simple and obviously right (a memory map and a vectorized gather); the ground
truth that tests compare every faster path against. Not for serving.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RowOutOfRange, TableFormatError, UnknownLayer
from .manifest import Manifest


@dataclass(frozen=True)
class Corruption:
    layer: int
    chunk: int  # chunk index within the layer file
    offset: int  # first byte of that chunk
    expected: int
    actual: int

    def __str__(self) -> str:
        return (f"layer {self.layer}: chunk {self.chunk} (bytes {self.offset}..) crc32 {self.actual:#010x}, "
                f"manifest says {self.expected:#010x}")


class TableSet:
    """An opened table set directory."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.spec = manifest.spec
        self._maps: dict[int, np.ndarray] = {}

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "TableSet":
        directory = Path(directory)
        manifest = Manifest.load(directory)
        for e in manifest.layers:
            path = directory / e.file
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise TableFormatError(f"{path}: layer {e.layer} data file is missing") from None
            if size != e.file_bytes:
                raise TableFormatError(f"{path}: layer {e.layer} file has {size} bytes, manifest says {e.file_bytes} (truncated?)")
        return cls(directory, manifest)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(e.layer for e in self.manifest.layers)

    @property
    def row_bytes(self) -> int:
        return self.spec.row_bytes

    def rows(self, layer: int) -> int:
        return self._entry(layer).rows

    def path(self, layer: int) -> Path:
        return self.directory / self._entry(layer).file

    def total_bytes(self) -> int:
        return sum(e.file_bytes for e in self.manifest.layers)

    def _entry(self, layer: int):
        try:
            return self.manifest.layer(layer)
        except KeyError:
            raise UnknownLayer(f"layer {layer} is not in this table set; layers are {list(self.layers)}") from None

    def _map(self, layer: int) -> np.ndarray:
        if layer not in self._maps:
            e = self._entry(layer)
            self._maps[layer] = np.memmap(self.directory / e.file, dtype=np.uint8, mode="r", shape=(e.file_bytes,))
        return self._maps[layer]

    def read_rows(self, layer: int, row_ids) -> np.ndarray:
        """uint8 ``[n, row_bytes]`` for int row ids (flattened)."""
        e = self._entry(layer)
        ids = np.asarray(row_ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"row ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= e.rows):
            raise RowOutOfRange(f"layer {layer}: row ids must be in [0, {e.rows}), got [{ids.min()}, {ids.max()}]")
        start = e.layout.byte_offset(ids)
        return self._map(layer)[start[:, None] + np.arange(e.row_bytes)]

    def verify(self, layer: int | None = None) -> list[Corruption]:
        """Recompute every chunk checksum; return the chunks that differ."""
        bad = []
        chunk = self.manifest.chunk_bytes
        for e in self.manifest.layers:
            if layer is not None and e.layer != layer:
                continue
            with open(self.directory / e.file, "rb", buffering=0) as f:
                for i, want in enumerate(e.chunk_crc32):
                    got = zlib.crc32(f.read(chunk))
                    if got != want:
                        bad.append(Corruption(e.layer, i, i * chunk, want, got))
        return bad

    def close(self) -> None:
        self._maps.clear()
