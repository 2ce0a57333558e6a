"""Reading a table's rows out of checkpoint tensors, a block at a time, the next block in flight.

A checkpoint holds a table as one tensor or as row shards (Qwen4Exp's ``shard_{k}``), each in
column parts (DeepSeek-V4.1's payload and scales, NVFP4's packed values and block scales).
:class:`RowPieces` names where every row range lies; :func:`read_ahead` streams the table's rows
as ``(part, ...)`` blocks of uint8 ``[n, width]`` arrays, reading block ``i + 1`` on a thread
while block ``i`` is written, so memory stays bounded by two blocks whatever the table's size.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import CheckpointImportError
from ..format.layout import PageLayout
from ..format.manifest import Manifest
from ..format.writer import Progress, TableSetWriter
from ..models.spec import MODELS, ModelSpec
from .safetensors_io import TensorRef, read_header


@dataclass(frozen=True)
class RowPiece:
    """Rows ``first .. first + rows`` of a table, held by one tensor per column part."""

    first: int  # the table row its first row is
    parts: tuple[TensorRef, ...]  # [rows, width_i] each, in row-byte order (payload first)

    @property
    def rows(self) -> int:
        return self.parts[0].shape[0]


class RowPieces:
    """A table of ``rows`` rows laid over consecutive :class:`RowPiece` s; reads any row range
    into preallocated column parts by positioned reads (one descriptor per file, kept open)."""

    def __init__(self, pieces: list[RowPiece]) -> None:
        self.pieces = sorted((p for p in pieces if p.rows), key=lambda p: p.first)
        self.rows = sum(p.rows for p in self.pieces)
        self.widths = tuple(ref.row_nbytes for ref in self.pieces[0].parts) if self.pieces else ()
        self._starts = np.array([p.first for p in self.pieces], dtype=np.int64)
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[path] = fd
        return self._fds[path]

    def read(self, first: int, count: int) -> tuple[np.ndarray, ...]:
        """Rows ``first .. first + count`` as one uint8 ``[count, width]`` array per column part."""
        out = tuple(np.empty((count, w), dtype=np.uint8) for w in self.widths)
        i = int(np.searchsorted(self._starts, first, side="right")) - 1
        at = first
        while at < first + count:
            piece = self.pieces[i]
            n = min(piece.first + piece.rows, first + count) - at
            for ref, dst in zip(piece.parts, out, strict=True):
                ref.read_rows(at - piece.first, n, self._fd(ref.file), out=dst[at - first : at - first + n])
            at += n
            i += 1
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_ahead(table: RowPieces, block_rows: int, pool: ThreadPoolExecutor) -> Iterator[tuple[np.ndarray, ...]]:
    """The rows of ``table`` in blocks of ``block_rows`` (the last shorter), the next one read on
    ``pool`` while the caller handles the current one; closes ``table`` at the end."""
    starts = range(0, table.rows, block_rows)
    try:
        pending = pool.submit(table.read, 0, min(block_rows, table.rows)) if table.rows else None
        for i, start in enumerate(starts):
            parts = pending.result()
            if i + 1 < len(starts):
                nxt = starts[i + 1]
                pending = pool.submit(table.read, nxt, min(block_rows, table.rows - nxt))
            else:
                pending = None
            yield parts
    finally:
        if pending is not None:
            pending.cancel()
            try:
                pending.result()
            except BaseException:  # a cancelled or failed read-ahead: the caller already stopped
                pass
        table.close()


def checkpoint_tensors(ckpt: Path) -> Iterator[tuple[str, TensorRef]]:
    """Every tensor of every ``*.safetensors`` shard of ``ckpt``, shard by shard in name order."""
    shards = sorted(ckpt.glob("*.safetensors"))
    if not shards:
        raise CheckpointImportError(f"{ckpt}: no *.safetensors shards found")
    for shard in shards:
        yield from read_header(shard).items()


def read_config(ckpt: Path) -> dict | None:
    """The checkpoint's config.json, or None when it has none."""
    path = ckpt / "config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointImportError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointImportError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def built_in(spec: ModelSpec) -> ModelSpec:
    """The built-in model ``spec`` describes (same geometry, rows and hash; its name aside), else ``spec``."""
    def same(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("name", "expected_rows", "scale")}

    mine = same(spec.to_dict())
    return next((known for known in MODELS.values() if same(known.to_dict()) == mine), spec)


def raw_ids_only(tokenizer: str | os.PathLike | None, family: str) -> None:
    """Refuse ``--tokenizer`` for a family that hashes raw token ids (its table set stores no token map)."""
    if tokenizer is not None:
        raise CheckpointImportError(f"--tokenizer {tokenizer}: {family} hashes raw token ids, its table set stores no "
                                    "token map; import without --tokenizer")


def write_tables(ckpt: Path, out: str | os.PathLike, spec: ModelSpec, tables: dict[int, tuple[RowPieces, float | None]],
                 *, overwrite: bool, progress: Progress | None, block_rows: int, group: str | None,
                 stripe_dirs: list | None, log_line) -> Manifest:
    """Write ``tables`` (``{layer: (rows, table scale)}``) of checkpoint ``ckpt`` as a table set at ``out``,
    in blocks of whole pages of about ``block_rows`` rows, the next block read while one is written;
    ``log_line(layer, rows, scale)`` says what each layer is."""
    rpp = PageLayout(0, spec.row_bytes).rows_per_page
    block_rows = max(rpp, block_rows // rpp * rpp)
    with TableSetWriter(out, spec, source={"kind": "checkpoint", "path": str(ckpt.resolve())}, overwrite=overwrite,
                        group=group, stripe_dirs=stripe_dirs, inputs=[ckpt]) as w, \
            ThreadPoolExecutor(1, thread_name_prefix="import-read") as pool:
        for layer, (table, scale) in tables.items():
            log_line(layer, table, scale)
            w.write_layer(layer, read_ahead(table, block_rows, pool), progress, table_scale=scale)
        return w.commit()
