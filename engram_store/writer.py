"""Writing table sets atomically: temp directory, fsync, manifest last, rename.

:class:`TableSetWriter` is used by both ``synth`` and ``import``. Rows are fed
per layer as a stream of uint8 ``[n, row_bytes]`` blocks; the writer lays them
out in pages, checksums every 64 MiB chunk, and publishes the directory only
in :meth:`TableSetWriter.commit`. Leaving the ``with`` block without commit
(an exception, Ctrl-C) removes the temp directory; a killed process leaves
only a ``.tmp-*`` directory that holds no manifest and never opens.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import TableFormatError
from .layout import PageLayout
from .manifest import CHUNK_BYTES, MANIFEST, LayerEntry, Manifest, layer_file_name
from .spec import ModelSpec

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with bytes written since the last call


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` by temp file, fsync and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class _ChunkCrc:
    """crc32 per fixed-size chunk over a stream of writes of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.done: list[int] = []
        self.crc = 0
        self.fill = 0

    def update(self, buf: memoryview) -> None:
        while len(buf):
            take = min(len(buf), self.chunk_bytes - self.fill)
            self.crc = zlib.crc32(buf[:take], self.crc)
            self.fill += take
            buf = buf[take:]
            if self.fill == self.chunk_bytes:
                self.done.append(self.crc)
                self.crc, self.fill = 0, 0

    def finish(self) -> tuple[int, ...]:
        if self.fill:
            self.done.append(self.crc)
        return tuple(self.done)


class TableSetWriter:
    """Context manager producing one table set directory at ``out``."""

    def __init__(self, out: str | os.PathLike, spec: ModelSpec, *, source: dict | None = None, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.spec = spec
        self.source = source or {}
        self.overwrite = overwrite
        self.entries: list[LayerEntry] = []
        self.tmp: Path | None = None

    def __enter__(self) -> "TableSetWriter":
        if self.out.exists() and not self.overwrite:
            raise TableFormatError(f"{self.out} already exists; remove it or pass --force")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp is not None and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def write_layer(self, layer: int, blocks: Iterable[np.ndarray | Sequence[np.ndarray]], progress: Progress | None = None) -> LayerEntry:
        """Write one layer from blocks of rows: uint8 ``[n, row_bytes]`` arrays, or tuples of
        column parts (see :meth:`PageLayout.pack`). Every block but the last must hold a
        multiple of the layout's rows_per_page rows."""
        assert self.tmp is not None, "use TableSetWriter as a context manager"
        layout = PageLayout(self.spec.rows(layer), self.spec.row_bytes)
        name = layer_file_name(layer)
        crc = _ChunkCrc(CHUNK_BYTES)
        written_rows = 0
        t0 = time.perf_counter()
        with open(self.tmp / name, "wb", buffering=0) as f:
            for block in blocks:
                parts = [block] if isinstance(block, np.ndarray) else list(block)
                n = parts[0].shape[0]
                if any(p.dtype != np.uint8 or p.ndim != 2 or p.shape[0] != n for p in parts):
                    raise TableFormatError(f"layer {layer}: block parts must be uint8 [n, width] with one n, got "
                                           f"{[(p.dtype, p.shape) for p in parts]}")
                if written_rows % layout.rows_per_page:
                    raise TableFormatError(f"layer {layer}: only the last block may end inside a page")
                pages = memoryview(layout.pack(parts)).cast("B")
                crc.update(pages)
                f.write(pages)
                written_rows += n
                if progress:
                    progress(len(pages))
            if written_rows != layout.rows:
                raise TableFormatError(f"layer {layer}: wrote {written_rows} rows, the spec says {layout.rows}")
            os.fsync(f.fileno())
        log.debug("layer %d: %d rows in %.2fs", layer, written_rows, time.perf_counter() - t0)
        entry = LayerEntry(layer, layout.rows, layout.row_bytes, name, layout.file_bytes, crc.finish())
        self.entries.append(entry)
        return entry

    def commit(self) -> Manifest:
        """Write the manifest and publish the directory by rename."""
        assert self.tmp is not None
        missing = set(self.spec.layers) - {e.layer for e in self.entries}
        if missing:
            raise TableFormatError(f"cannot publish {self.out}: layers {sorted(missing)} were not written")
        manifest = Manifest(self.spec, tuple(sorted(self.entries, key=lambda e: e.layer)), source=self.source)
        write_file_atomic(self.tmp / MANIFEST, manifest.to_json().encode())
        fsync_dir(self.tmp)
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        fsync_dir(self.out.parent)
        self.tmp = None
        return manifest
