"""The reference reader: ``TableSet.open(DIR).read_rows(layer, row_ids)``.

Simple and obviously right (a memory map and a vectorized gather); the ground
truth that tests compare every faster path against. Not for serving.
``read_rows`` returns the bytes on disk as they are, checked or not (so that a
test can see what a corrupt page holds); :meth:`TableSet.verify` checks every
page against its crc32c and names the ones that differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TableFormatError, UnknownLayer
from . import requests
from .checksums import page_crcs
from .layout import PAGE_BYTES
from .manifest import Manifest, load_page_crcs

VERIFY_CHUNK_BYTES = 64 << 20  # bytes read and checked at a time by verify


@dataclass(frozen=True)
class Corruption:
    layer: int
    page: int  # page index within the layer file
    offset: int  # first byte of that page in the file
    expected: int  # crc32c in the layer's checksum file
    actual: int  # crc32c of the page's bytes on disk
    file: str = ""  # the data file's name

    def __str__(self) -> str:
        return (f"layer {self.layer}: page {self.page} (bytes {self.offset}..{self.offset + PAGE_BYTES - 1} of "
                f"{self.file}) crc32c {self.actual:#010x}, checksum file says {self.expected:#010x}")


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
            crc_path = directory / e.crc_file
            try:
                crc_size = crc_path.stat().st_size
            except FileNotFoundError:
                raise TableFormatError(f"{crc_path}: layer {e.layer} page checksum file is missing") from None
            if crc_size != e.crc_header().file_bytes:
                raise TableFormatError(f"{crc_path}: layer {e.layer} checksum file has {crc_size} bytes, needs "
                                       f"{e.crc_header().file_bytes} (truncated?)")
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
        ids = requests.flat_row_ids(row_ids)
        requests.check_bounds(layer, ids, e.rows)
        start = e.layout.byte_offset(ids)
        return self._map(layer)[start[:, None] + np.arange(e.row_bytes)]

    def page_crcs(self, layer: int) -> np.ndarray:
        """The expected crc32c of every page of ``layer`` (uint32, from its checksum file)."""
        return load_page_crcs(self.directory, self._entry(layer))

    def verify(self, layer: int | None = None) -> list[Corruption]:
        """Read every page of every layer (or of ``layer``) and check it against its crc32c;
        return the pages that differ, in file order."""
        bad = []
        buf = bytearray(VERIFY_CHUNK_BYTES)
        for e in self.manifest.layers:
            if layer is not None and e.layer != layer:
                continue
            want = self.page_crcs(e.layer)
            with open(self.directory / e.file, "rb") as f:  # buffered: readinto fills the whole chunk
                for p0 in range(0, e.layout.pages, VERIFY_CHUNK_BYTES // PAGE_BYTES):
                    got_bytes = f.readinto(buf)
                    n = got_bytes // PAGE_BYTES
                    got = page_crcs(buf, n)
                    for i in np.flatnonzero(got != want[p0 : p0 + n]).tolist():
                        page = p0 + i
                        bad.append(Corruption(e.layer, page, page * PAGE_BYTES, int(want[page]), int(got[i]), e.file))
                    if n < min(VERIFY_CHUNK_BYTES // PAGE_BYTES, e.layout.pages - p0):
                        raise TableFormatError(f"{self.directory / e.file}: layer {e.layer} ended after page "
                                               f"{p0 + n} of {e.layout.pages} (truncated while verifying?)")
        return bad

    def close(self) -> None:
        self._maps.clear()
