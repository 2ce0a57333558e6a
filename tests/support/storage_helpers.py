"""Shared helpers of the storage-engine tests (imported by tests/test_storage_*.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engram_store.format.layout import PAGE_BYTES
from engram_store.format.manifest import Manifest
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import synth_rows, write_synthetic

SEED = 11
TINY = get_spec("tiny")
FLASH = get_spec("deepseek-v4.1-flash", scale=0.0002)  # 264-byte rows, ~77k rows per layer


def make_tables(root: Path, spec=TINY, seed: int = SEED) -> Path:
    out = root / f"{spec.name}-{seed}"
    if not (out / "manifest.json").exists():
        write_synthetic(out, spec, seed=seed)
    return out


def check_rows(store, tables: Path, spec, layer: int, ids: np.ndarray, out: np.ndarray, seed: int = SEED) -> None:
    """``out`` must equal both independent references, byte for byte."""
    ref = TableSet.open(tables).read_rows(layer, ids.reshape(-1)).reshape(out.shape)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out.reshape(-1, spec.row_bytes), synth_rows(spec, seed, layer, ids.reshape(-1)))


def cache_budget(spec, fraction: float) -> int:
    """dram_bytes giving a cache of about ``fraction`` of the table's rows."""
    rows = sum(spec.rows(layer) for layer in spec.layers)
    return int(rows * fraction) * (spec.row_bytes + 40)


def flip(directory, layer: int, page: int, at: int = 100) -> None:
    """Flip one byte inside ``page`` of ``layer``'s data file (inside a row, not the padding)."""
    path = directory / Manifest.load(directory).layer(layer).file
    with open(path, "r+b") as f:
        f.seek(page * PAGE_BYTES + at)
        b = f.read(1)
        f.seek(page * PAGE_BYTES + at)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
