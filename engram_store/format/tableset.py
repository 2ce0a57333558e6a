"""The reference reader: ``TableSet.open(DIR).read_rows(layer, row_ids)``.

Simple and obviously right (a memory map and a vectorized gather); the ground
truth that tests compare every faster path against. Not for serving.
``read_rows`` returns the bytes on disk as they are, checked or not (so that a
test can see what a corrupt page holds); :meth:`TableSet.verify` checks every
page against its crc32c and names the ones that differ. A striped layer (see
:mod:`engram_store.format.manifest`) is read through one memory map per stripe.
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
from .manifest import Manifest, PageCrcHeader, load_page_crcs, scale_mismatch

VERIFY_CHUNK_BYTES = 64 << 20  # bytes read and checked at a time by verify


@dataclass(frozen=True)
class Corruption:
    layer: int
    page: int  # page index within the layer
    offset: int  # first byte of that page in its file (the stripe's, for a striped layer)
    expected: int  # crc32c in the layer's checksum file
    actual: int  # crc32c of the page's bytes on disk
    file: str = ""  # the data file's name (the stripe file's path, for a striped layer)

    def __str__(self) -> str:
        return (f"layer {self.layer}: page {self.page} (bytes {self.offset}..{self.offset + PAGE_BYTES - 1} of "
                f"{self.file}) crc32c {self.actual:#010x}, checksum file says {self.expected:#010x}")


class TableSet:
    """An opened table set directory."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.spec = manifest.spec
        self._maps: dict[int, list[np.ndarray]] = {}  # per layer: its file's map, or one per stripe

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "TableSet":
        """Open a table set, checking without reading table data that the manifest tells the truth:
        the manifest against its spec (:meth:`Manifest.load`), every data and stripe file's size,
        every checksum file's length and header (its table scale included), and the token map (size, sha256, every value in
        ``[0, compressed_vocab)``; a map whose bytes fail their crc32 is corruption, left to
        :meth:`verify`'s caller). TableFormatError naming layer, field and both values."""
        directory = Path(directory)
        manifest = Manifest.load(directory)
        problems = []
        for e in manifest.layers:
            sized = list(zip(e.stripe_paths(directory), (st.file_bytes for st in e.stripes))) if e.stripes \
                else [(directory / e.file, e.file_bytes)]
            for path, want in sized:
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    problems.append(f"{path}: layer {e.layer} data file is missing")
                    continue
                if size != want:
                    problems.append(f"{path}: layer {e.layer} file has {size} bytes, field 'file_bytes' says {want} "
                                    "(truncated?)")
            problems += _crc_file_problems(directory, e)
        if manifest.token_map is not None:
            problems += _token_map_lies(directory, manifest)
        if problems:
            raise TableFormatError("; ".join(problems))
        return cls(directory, manifest)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(e.layer for e in self.manifest.layers)

    @property
    def row_bytes(self) -> int:
        return self.spec.row_bytes

    def rows(self, layer: int) -> int:
        return self._entry(layer).rows

    def table_scale(self, layer: int) -> float | None:
        """``layer``'s one table scale (a float32 value; rows dequantize as value x block scale x it),
        or None when the spec's rows have none."""
        return self._entry(layer).table_scale

    def path(self, layer: int) -> Path:
        """The layer's data file; a striped layer has none (its stripes: ``manifest.layer(l).stripe_paths``)."""
        return self.directory / self._entry(layer).file

    def read_pages(self, layer: int) -> np.ndarray:
        """Every page of ``layer`` in layer page order, striped or not: uint8 ``[file_bytes]`` (a copy)."""
        maps = self._map(layer)
        if len(maps) == 1:
            return np.array(maps[0])
        pages = np.empty((self._entry(layer).layout.pages, PAGE_BYTES), dtype=np.uint8)
        for k, m in enumerate(maps):
            pages[k :: len(maps)] = m.reshape(-1, PAGE_BYTES)
        return pages.reshape(-1)

    def total_bytes(self) -> int:
        return sum(e.file_bytes for e in self.manifest.layers)

    def _entry(self, layer: int):
        try:
            return self.manifest.layer(layer)
        except KeyError:
            raise UnknownLayer(f"layer {layer} is not in this table set; layers are {list(self.layers)}") from None

    def _files(self, layer: int) -> list[tuple[Path, int]]:
        """(path, bytes) of the layer's data file, or of each of its stripes in order."""
        e = self._entry(layer)
        if e.stripes:
            return list(zip(e.stripe_paths(self.directory), (st.file_bytes for st in e.stripes)))
        return [(self.directory / e.file, e.file_bytes)]

    def _map(self, layer: int) -> list[np.ndarray]:
        if layer not in self._maps:
            self._maps[layer] = [np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)) if size else
                                 np.empty(0, dtype=np.uint8) for path, size in self._files(layer)]
        return self._maps[layer]

    def read_rows(self, layer: int, row_ids) -> np.ndarray:
        """uint8 ``[n, row_bytes]`` for int row ids (flattened)."""
        e = self._entry(layer)
        ids = requests.flat_row_ids(row_ids)
        requests.check_bounds(layer, ids, e.rows)
        maps = self._map(layer)
        if len(maps) == 1:
            return maps[0][e.layout.byte_offset(ids)[:, None] + np.arange(e.row_bytes)]
        out = np.empty((len(ids), e.row_bytes), dtype=np.uint8)
        page, slot = np.divmod(ids, e.layout.rows_per_page)
        stripe, local = np.divmod(page, len(maps))[::-1]
        for k, m in enumerate(maps):  # page p: stripe p % K, local page p // K
            at = np.flatnonzero(stripe == k)
            if len(at):
                start = local[at] * PAGE_BYTES + slot[at] * e.row_bytes
                out[at] = m[start[:, None] + np.arange(e.row_bytes)]
        return out

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
            files = self._files(e.layer)
            found = []
            for k, (path, size) in enumerate(files):
                name = e.file if len(files) == 1 else str(path)
                found += _verify_file(e.layer, path, name, want[k :: len(files)], buf, k, len(files))
            bad += sorted(found, key=lambda c: c.page)
        return bad

    def close(self) -> None:
        self._maps.clear()


def _verify_file(layer: int, path: Path, name: str, want: np.ndarray, buf: bytearray, k: int, stripes: int) -> list[Corruption]:
    """Check every page of one data file (or stripe ``k`` of ``stripes``: its local page q is layer
    page k + stripes * q) against ``want``, its pages' expected crc32c in file order."""
    bad = []
    pages = len(want)
    with open(path, "rb") as f:  # buffered: readinto fills the whole chunk
        for q0 in range(0, pages, VERIFY_CHUNK_BYTES // PAGE_BYTES):
            n = f.readinto(buf) // PAGE_BYTES
            got = page_crcs(buf, n)
            for i in np.flatnonzero(got != want[q0 : q0 + n]).tolist():
                q = q0 + i
                bad.append(Corruption(layer, k + stripes * q, q * PAGE_BYTES, int(want[q]), int(got[i]), name))
            if n < min(VERIFY_CHUNK_BYTES // PAGE_BYTES, pages - q0):
                raise TableFormatError(f"{path}: layer {layer} ended after page {q0 + n} of {pages} "
                                       "(truncated while verifying?)")
    return bad


def _crc_file_problems(directory: Path, e) -> list[str]:
    """The layer's checksum file: present, ``PageCrcHeader + 4 bytes per page`` long, its header for
    this layer and page count."""
    path = directory / e.crc_file
    want = e.crc_header()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(PageCrcHeader.STRUCT.size)
    except FileNotFoundError:
        return [f"{path}: layer {e.layer} page checksum file is missing"]
    except OSError as exc:
        return [f"{path}: layer {e.layer} page checksum file unreadable: {exc.strerror}"]
    if size != want.file_bytes:
        return [f"{path}: layer {e.layer} checksum file has {size} bytes, {want.pages} pages need {want.file_bytes} "
                f"({PageCrcHeader.STRUCT.size}-byte header + 4 per page; truncated?)"]
    try:
        got = PageCrcHeader.unpack(head, str(path))
    except TableFormatError as exc:
        return [str(exc)]
    if (got.layer, got.pages) != (e.layer, want.pages):
        return [f"{path}: checksum file header says layer {got.layer}, {got.pages} pages; layer {e.layer} has "
                f"{want.pages}"]
    if got.table_scale_bits != want.table_scale_bits:
        return [scale_mismatch(path, e, got)]
    return []


def _token_map_lies(directory: Path, manifest: Manifest) -> list[str]:
    """What the token map's files say against the manifest (size, sha256, values in range); a map
    whose crc32 fails is corrupt, not lying: :func:`engram_store.models.tokens.token_map_problems` reports it."""
    from ..models.tokens import read_token_map, token_map_problems

    entry = manifest.token_map
    if token_map_problems(directory, {k: entry.get(k) for k in ("file", "crc32")}):
        return []
    try:
        read_token_map(directory, entry, manifest.spec.compressed_vocab)
    except TableFormatError as exc:
        return [str(exc)]
    return []
