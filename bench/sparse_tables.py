#!/usr/bin/env python3
"""Sparse table sets: a model's full-size table set on disk where only the pages a bench reads hold rows.

A V4.1 layer file is 94.4 GiB; a bench that reads a few million pages of it does not need the
rest. :func:`write_sparse` makes a table set the daemon opens like any other (its manifest,
``engram_store.format.manifest``, names the full spec, every file has its full size) in which:

- each layer's data file has its full size, and only the pages given hold rows: the synthetic
  rows of ``engram_store.tools.synth.synth_rows`` (so any row read back can be checked against
  that reference);
- every other page is a hole: it reads as 4,096 zero bytes and costs no disk space (and no
  device read: the filesystem answers it from its extent map);
- the ``.crc`` file holds the crc32c of every page, the written pages' own and the zero page's
  for the holes, so a read of any page checks fine;
- the manifest is written last (an interrupted write leaves no manifest: it never opens).

How the pages get there matters on a filesystem mounted with online discard (this project's
ext4 VMs): deleting a file issues one discard per extent, and ext4 places a page written at a
scattered offset about where a dense file would have it, so deleting a file of 20,000 pages
written one by one took 54 s (2.7 ms a page: millions of pages would take hours). Where the
filesystem can insert ranges (ext4, XFS: ``fallocate`` ``FALLOC_FL_INSERT_RANGE``), the pages are
therefore written densely, in page order (physically contiguous), and the holes between them
inserted afterwards (no data moves; about 2 us a hole): deleting then costs about 0.14 ms a page
(200,000 pages: 27 s). Elsewhere pages are written in place. Either way the written pages sit on
the device packed together in page order, not spread over the layer's full extent as in a real
table file.

``--quick`` (and the default CLI run) writes a small set, reads a sample of written rows back
through ``TableSet.read_rows`` against ``synth_rows`` and a sample of hole rows (zeros), and
reports the write rate and the disk space used against the logical size.

    python bench/sparse_tables.py --quick --json
    python bench/sparse_tables.py --scale 1 --pages 200000 --workdir /var/tmp
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import JsonReport, add_model_args, add_report_args  # noqa: E402

from engram_store.format.checksums import page_crcs  # noqa: E402
from engram_store.format.layout import PAGE_BYTES, PageLayout  # noqa: E402
from engram_store.format.manifest import (MANIFEST, LayerEntry, Manifest,  # noqa: E402
                                          crc_file_name, layer_file_name)
from engram_store.format.writer import write_file_atomic  # noqa: E402
from engram_store.models.spec import ModelSpec, get_spec  # noqa: E402
from engram_store.tools.synth import synth_rows, synth_table_scale  # noqa: E402

BATCH_PAGES = 8192  # pages synthesized and written per batch (32 MiB)


def zero_page_crc() -> int:
    return int(page_crcs(np.zeros(PAGE_BYTES, dtype=np.uint8))[0])


def synth_pages(spec: ModelSpec, seed: int, layer: int, pages: np.ndarray) -> np.ndarray:
    """uint8 ``[len(pages), 4096]``: those pages of the synthetic layer, laid out as the writer lays them."""
    layout = PageLayout(spec.rows(layer), spec.row_bytes)
    rpp, rb = layout.rows_per_page, layout.row_bytes
    rows = (pages[:, None] * rpp + np.arange(rpp)).reshape(-1)
    valid = rows < layout.rows  # the last page of a layer may be partly empty
    data = np.zeros((rows.size, rb), dtype=np.uint8)
    data[valid] = synth_rows(spec, seed, layer, rows[valid])
    out = np.zeros((len(pages), PAGE_BYTES), dtype=np.uint8)
    out[:, : rpp * rb] = data.reshape(len(pages), rpp * rb)
    return out


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
FALLOC_FL_INSERT_RANGE = 0x20
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _LIBC.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(mode {mode:#x}, {offset}, {length}): {os.strerror(err)}")


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_in_place(fd: int, pages: np.ndarray, data: np.ndarray) -> None:
    """pwrite ``data`` (one 4 KiB row per page of sorted ``pages``), one call per run of adjacent pages."""
    starts = np.flatnonzero(np.diff(pages, prepend=pages[0] - 2) != 1)
    for a, b in zip(starts.tolist(), np.append(starts[1:], len(pages)).tolist()):
        _pwrite_all(fd, data[a:b], int(pages[a]) * PAGE_BYTES)


def can_insert_ranges(directory: Path) -> bool:
    """Whether the filesystem holding ``directory`` inserts ranges (a probe on a file of two pages)."""
    probe = directory / f".insert-probe-{os.getpid()}"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _pwrite_all(fd, np.zeros(2 * PAGE_BYTES, dtype=np.uint8), 0)
        _fallocate(fd, FALLOC_FL_INSERT_RANGE, PAGE_BYTES, PAGE_BYTES)
        return True
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink()


def _insert_holes(fd: int, pages: np.ndarray) -> None:
    """The file holds ``pages`` (sorted, distinct) densely; insert the holes before each so page
    ``p`` sits at byte ``p * 4096``. Front to back: what lies right of each insert is one extent."""
    at = 0  # the page now right after the last one placed
    for p in pages.tolist():
        if p > at:
            _fallocate(fd, FALLOC_FL_INSERT_RANGE, at * PAGE_BYTES, (p - at) * PAGE_BYTES)
        at = p + 1


def _write_layer_file(path: Path, spec: ModelSpec, seed: int, layer: int, pages: np.ndarray, file_bytes: int,
                      progress=None) -> np.ndarray:
    """Write ``path`` (full size, ``pages`` holding rows, holes elsewhere); the written pages' crc32c."""
    crcs = np.empty(len(pages), dtype=np.uint32)
    dense = len(pages) > 0 and can_insert_ranges(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    try:
        for lo in range(0, len(pages), BATCH_PAGES):
            part = pages[lo: lo + BATCH_PAGES]
            data = synth_pages(spec, seed, layer, part)
            crcs[lo: lo + len(part)] = page_crcs(data)
            if dense:
                _pwrite_all(fd, data, lo * PAGE_BYTES)
            else:
                _write_in_place(fd, part, data)
            if (lo // BATCH_PAGES) % 32 == 31:  # bound the page cache this takes on a shared host
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if progress:
                progress(len(part))
        os.fsync(fd)
        if dense:
            _insert_holes(fd, pages)
        os.ftruncate(fd, file_bytes)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the written pages need not stay in the page cache
    finally:
        os.close(fd)
    return crcs


def write_sparse(out: str | os.PathLike, spec: ModelSpec, pages: dict[int, np.ndarray], seed: int = 0,
                 progress=None) -> Manifest:
    """Write the sparse table set of ``spec`` to ``out`` (a new directory): layer ``L``'s pages
    ``pages.get(L, [])`` hold their synthetic rows of ``seed``, all others are holes. Returns the
    manifest. ``progress(pages_written)`` is called after each batch. Remove it with
    :func:`remove_sparse`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    zero_crc = zero_page_crc()
    entries = []
    for layer in spec.layers:
        layout = PageLayout(spec.rows(layer), spec.row_bytes)
        want = np.unique(np.asarray(pages.get(layer, ()), dtype=np.int64))
        if len(want) and (want[0] < 0 or want[-1] >= layout.pages):
            raise ValueError(f"layer {layer}: pages must be in [0, {layout.pages}), got {want[0]}..{want[-1]}")
        crcs = np.full(layout.pages, zero_crc, dtype="<u4")
        crcs[want] = _write_layer_file(out / layer_file_name(layer), spec, seed, layer, want, layout.file_bytes,
                                       progress)
        entry = LayerEntry(layer, layout.rows, layout.row_bytes, layer_file_name(layer), layout.file_bytes,
                           crc_file_name(layer), table_scale=synth_table_scale(spec, layer))
        write_file_atomic(out / crc_file_name(layer), entry.crc_header().pack() + crcs.tobytes())
        entries.append(entry)
    manifest = Manifest(spec, tuple(entries), source={
        "kind": "sparse-synthetic", "seed": seed,
        "written_pages": {str(layer): int(np.unique(pages.get(layer, ())).size) for layer in spec.layers}})
    write_file_atomic(out / MANIFEST, manifest.to_json().encode())
    return manifest


def remove_sparse(directory: str | os.PathLike) -> dict:
    """Remove a table set written by :func:`write_sparse`; returns the seconds it took (see the module
    docstring: about 0.14 ms a written page on a filesystem with online discard)."""
    directory = Path(directory)
    t0, files = time.perf_counter(), 0
    if directory.is_dir():
        for p in sorted(directory.iterdir()):
            p.unlink()
            files += 1
        directory.rmdir()
    return {"seconds": time.perf_counter() - t0, "files": files}


def disk_bytes(directory: str | os.PathLike) -> tuple[int, int]:
    """(logical bytes, allocated bytes) of the files in ``directory``."""
    logical = allocated = 0
    for p in Path(directory).iterdir():
        st = p.stat()
        logical += st.st_size
        allocated += st.st_blocks * 512
    return logical, allocated


def check_sample(directory: Path, spec: ModelSpec, seed: int, layer: int, written: np.ndarray, n: int = 256) -> dict:
    """Rows of written pages equal synth_rows, rows of hole pages are zero (read through TableSet)."""
    from engram_store.format.tableset import TableSet

    rng = np.random.default_rng(1)
    layout = PageLayout(spec.rows(layer), spec.row_bytes)
    rows = rng.choice(written, n) * layout.rows_per_page + rng.integers(0, layout.rows_per_page, n)
    rows = rows[rows < layout.rows]
    holes = np.setdiff1d(rng.integers(0, layout.pages, 4 * n), written)[:n]
    ts = TableSet.open(directory)
    try:
        real = bool(np.array_equal(ts.read_rows(layer, rows), synth_rows(spec, seed, layer, rows)))
        zero = not ts.read_rows(layer, holes * layout.rows_per_page).any()
    finally:
        ts.close()
    return {"rows_checked": int(rows.size), "rows_equal_synth": real, "holes_checked": int(holes.size),
            "holes_zero": zero}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, 1.0, "table scale (1: the full spec)")
    ap.add_argument("--pages", type=int, default=200_000, help="random pages written in the last layer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where to write it (default: the temp dir); removed afterwards")
    add_report_args(ap, "smoke size: V4.1 at scale 0.001, 2,000 pages")
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.pages = min(args.scale, 0.001), min(args.pages, 2000)
    spec = get_spec(args.model) if args.scale == 1 else get_spec(args.model, args.scale)
    layer = spec.layers[-1]
    total = PageLayout(spec.rows(layer), spec.row_bytes).pages
    written = np.sort(np.random.default_rng(args.seed).choice(total, min(args.pages, total), replace=False))
    scratch = Path(tempfile.mkdtemp(prefix="sparse-tables-", dir=args.workdir))
    try:
        with JsonReport(args) as out:
            t0 = time.perf_counter()
            write_sparse(scratch / "tables", spec, {layer: written}, args.seed)
            seconds = time.perf_counter() - t0
            logical, allocated = disk_bytes(scratch / "tables")
            doc = {"model": spec.name, "scale": spec.scale, "layer": layer, "pages_written": int(written.size),
                   "seconds": seconds, "write_mb_per_s": written.size * PAGE_BYTES / seconds / 1e6,
                   "logical_bytes": logical, "allocated_bytes": allocated,
                   "check": check_sample(scratch / "tables", spec, args.seed, layer, written)}
            out.emit(doc, lambda: print(
                f"{spec.name} (scale {spec.scale:g}): {doc['pages_written']:,} pages of layer {layer} written in "
                f"{seconds:.2f} s ({doc['write_mb_per_s']:.0f} MB/s); {logical / 2**30:.1f} GiB logical, "
                f"{allocated / 2**20:.0f} MiB on disk; {doc['check']['rows_checked']} written rows equal synth_rows: "
                f"{doc['check']['rows_equal_synth']}, {doc['check']['holes_checked']} hole rows zero: "
                f"{doc['check']['holes_zero']}"))
    finally:
        removed = remove_sparse(scratch / "tables")
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"removed in {removed['seconds']:.2f} s", file=sys.stderr)
    return 0 if doc["check"]["rows_equal_synth"] and doc["check"]["holes_zero"] else 1


if __name__ == "__main__":
    sys.exit(main())
