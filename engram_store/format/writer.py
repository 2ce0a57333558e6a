"""Writing table sets atomically: temp directory, fsync, manifest last, rename.

:class:`TableSetWriter` is used by both ``synth`` and ``import``. Rows are fed
per layer as a stream of uint8 ``[n, row_bytes]`` blocks; the writer lays them
out in pages, writes the crc32c of every 4 KiB page to the layer's ``.crc``
file beside it (see :mod:`engram_store.format.manifest`), and publishes the directory
only in :meth:`TableSetWriter.commit`. Leaving the ``with`` block without commit
(an exception, Ctrl-C) removes the temp directory; a killed process leaves
only a ``.tmp-*`` directory that holds no manifest and never opens.

Free space is checked before the first byte is written (the whole table set
must fit, as the old one stays until the rename), and running out anyway
(ENOSPC, EDQUOT) is one :class:`~engram_store.errors.InsufficientSpace` naming
the path and the bytes needed. A published table set is readable by its group:
directory :data:`DIR_MODE` (0750), files :data:`FILE_MODE` (0640), whatever the
umask; ``group`` gives it to the daemon's group (e.g. ``engram-store``).

With ``stripe_dirs`` (K >= 2 directories, typically one per NVMe device) each
layer's pages are dealt round-robin into K stripe files, one per directory,
named ``<table-set name>.layer_NNN.sK.bin`` (see
:mod:`engram_store.format.manifest`). They are written under a hidden temp
name in their directory, fsynced, and renamed to their final name just before
the table-set directory is published; leaving the ``with`` block without
commit removes them too (a killed process leaves hidden ``.*.tmp-PID`` files
there, never a name a manifest points to). A new set never takes the name of a
stripe the set it replaces still uses, so the old set stays whole until the swap;
its stripes are removed after it.

The temp directory holds the writer's marker (:class:`~engram_store.format.owned.Mark`,
written the moment the directory is made, listing every stripe file as it is created); it
is published with the set. It is how a later writer tells its own leftovers and stripes
from a user's files (see :mod:`engram_store.format.owned`).

Where ``out`` may be, the atomic replace and the removal of a killed writer's
leftovers are :mod:`engram_store.format.target`'s.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import InsufficientSpace, TableFormatError
from ..models.spec import ModelSpec
from . import owned, target
from .checksums import page_crcs
from .layout import PAGE_BYTES, PageLayout
from .manifest import (
    MANIFEST,
    LayerEntry,
    Manifest,
    PageCrcHeader,
    StripeEntry,
    crc_file_name,
    float32_bits,
    layer_file_name,
    stripe_pages,
    table_scale_problems,
)

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with bytes written since the last call
DIR_MODE = 0o750  # a published table-set directory: the owner writes, its group reads
FILE_MODE = 0o640  # its files
MANIFEST_ALLOWANCE = 1 << 20  # room kept for the manifest and directory entries
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_needed(spec: ModelSpec) -> int:
    """Bytes a table set of ``spec`` needs on disk: data files, page checksum files, manifest."""
    layouts = {layer: PageLayout(spec.rows(layer), spec.row_bytes) for layer in spec.layers}
    return sum(lay.file_bytes + PageCrcHeader(layer, lay.pages).file_bytes for layer, lay in layouts.items()) \
        + MANIFEST_ALLOWANCE


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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    fsync_dir(path.parent)


class TableSetWriter:
    """Context manager producing one table set directory at ``out``."""

    def __init__(self, out: str | os.PathLike, spec: ModelSpec, *, source: dict | None = None, overwrite: bool = False,
                 group: str | None = None, stripe_dirs: Sequence[str | os.PathLike] | None = None,
                 inputs: Sequence[str | os.PathLike] = ()) -> None:
        self.out = Path(out)
        self.stripe_dirs = [Path(d).resolve() for d in stripe_dirs or ()]
        if len(self.stripe_dirs) == 1:
            raise TableFormatError(f"stripe_dirs: one directory ({self.stripe_dirs[0]}) is no striping; give at least "
                                   "two (one per device), or none to write one file per layer")
        if len(set(self.stripe_dirs)) != len(self.stripe_dirs):
            raise TableFormatError(f"stripe_dirs: a directory is listed twice: {[str(d) for d in self.stripe_dirs]}")
        self._stripe_tmp: list[tuple[Path, Path]] = []  # (temp path, final path) of every stripe file written
        self.spec = spec
        self.source = source or {}
        self.overwrite = overwrite
        self.inputs = list(inputs)
        self._locks: list[int] = []  # flocks held while writing (temp directory, temp stripe files)
        self.gid = -1 if group is None else _group_id(group)
        self.entries: list[LayerEntry] = []
        self.tmp: Path | None = None
        self.mark: owned.Mark | None = None  # the writer's marker in self.tmp
        self.token_map: dict | None = None  # manifest entry of files written by add_file (engram_store.models.tokens)
        self.needed = space_needed(spec)
        if self.stripe_dirs:  # the directory holds only checksum files and the manifest
            self.needed -= sum(PageLayout(spec.rows(layer), spec.row_bytes).file_bytes for layer in spec.layers)

    def __enter__(self) -> "TableSetWriter":
        target.check_target(self.out, self.overwrite, self.inputs, self.stripe_dirs)
        with self._space(self.out.parent):
            self.out.parent.mkdir(parents=True, exist_ok=True)
        with target.locked(self.out.parent):
            target.remove_stale(self.out, self.stripe_dirs)  # a killed run's bytes do not count below
            free = free_bytes(self.out.parent)
            if free < self.needed:
                raise InsufficientSpace(f"{self.out.parent}: the table set needs {self.needed} bytes, {free} are free; "
                                        "free some space or write it elsewhere")
            self._check_stripe_space()
            with self._space(self.out.parent):
                self.tmp = Path(tempfile.mkdtemp(prefix=f"{target.temp_prefix(self.out)}{os.getpid()}-",
                                                 dir=self.out.parent))
                self.mark = owned.Mark.create(self.tmp, self.out)  # what tells it from a user's directory
            self._locks.append(target.lock(self.tmp))  # held while writing: not a leftover
        return self

    def _check_stripe_space(self) -> None:
        """Each stripe directory must exist and hold its stripes (summed per filesystem)."""
        k_total = len(self.stripe_dirs)
        per_fs: dict[int, tuple[Path, int]] = {}
        for k, d in enumerate(self.stripe_dirs):
            if not d.is_dir():
                raise TableFormatError(f"stripe directory {d} does not exist or is not a directory; create it first")
            need = sum(stripe_pages(PageLayout(self.spec.rows(layer), self.spec.row_bytes).pages, k_total, k)
                       for layer in self.spec.layers) * PAGE_BYTES
            dev = os.stat(d).st_dev
            per_fs[dev] = (d, per_fs.get(dev, (d, 0))[1] + need)
        for d, need in per_fs.values():
            free = free_bytes(d)
            if free < need:
                raise InsufficientSpace(f"{d}: the table set's stripes there need {need} bytes, {free} are free; free "
                                        "some space or stripe over other directories")

    @contextlib.contextmanager
    def _space(self, path: Path) -> Iterator[None]:
        """Turn running out of space while writing ``path`` into one InsufficientSpace."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            raise InsufficientSpace(f"{path}: no space left on the device ({os.strerror(exc.errno)}); the table set "
                                    f"needs {self.needed} bytes, {free_bytes(path.parent)} are free now") from None

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp is not None:
            for tmp, _ in self._stripe_tmp:
                tmp.unlink(missing_ok=True)
            if self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    def _stripe_file(self, layer: int, k: int) -> tuple[Path, Path]:
        d = self.stripe_dirs[k]
        final = d / f"{self.out.name}.layer_{layer:03d}.s{k}.bin"
        if os.path.lexists(final):  # the set being replaced (or a user) owns that name: keep it intact
            final = d / f"{self.out.name}.layer_{layer:03d}.s{k}.{self.tmp.name.rpartition('-')[2]}.bin"
        tmp = d / f".{final.name}.tmp-{os.getpid()}"
        self._stripe_tmp.append((tmp, final))
        return tmp, final

    def write_layer(self, layer: int, blocks: Iterable[np.ndarray | Sequence[np.ndarray]], progress: Progress | None = None,
                    *, table_scale: float | None = None) -> LayerEntry:
        """Write one layer from blocks of rows: uint8 ``[n, row_bytes]`` arrays, or tuples of
        column parts (see :meth:`PageLayout.pack`). Every block but the last must hold a
        multiple of the layout's rows_per_page rows. ``table_scale``: the layer's one scale, a
        float32 value, given exactly when the spec's rows have one (checked before any row)."""
        assert self.tmp is not None, "use TableSetWriter as a context manager"
        bad = table_scale_problems(self.spec, layer, table_scale)
        if bad:
            raise TableFormatError("; ".join(bad))
        layout = PageLayout(self.spec.rows(layer), self.spec.row_bytes)
        name, crc_name = layer_file_name(layer), crc_file_name(layer)
        k_total = len(self.stripe_dirs)
        if k_total:
            stripe_files = [self._stripe_file(layer, k) for k in range(k_total)]
            paths = [tmp for tmp, _ in stripe_files]
        else:
            paths = [self.tmp / name]
        written_rows = 0
        t0 = time.perf_counter()
        with self._space(paths[0].parent), contextlib.ExitStack() as files, \
                open(self.tmp / crc_name, "wb") as crc_f:
            data_files = [files.enter_context(open(p, "xb" if k_total else "wb", buffering=0)) for p in paths]
            if k_total:  # held while writing: not a leftover; listed in the marker: the writer's own
                self._locks += [target.lock(p) for p in paths]
                for (tmp, final), f in zip(stripe_files, data_files, strict=True):
                    self.mark.add_stripe(tmp, final, os.fstat(f.fileno()))
            scale_bits = 0 if table_scale is None else float32_bits(table_scale)
            crc_f.write(PageCrcHeader(layer, layout.pages, table_scale_bits=scale_bits).pack())
            for block in blocks:
                parts = [block] if isinstance(block, np.ndarray) else list(block)
                n = parts[0].shape[0]
                if any(p.dtype != np.uint8 or p.ndim != 2 or p.shape[0] != n for p in parts):
                    raise TableFormatError(f"layer {layer}: block parts must be uint8 [n, width] with one n, got "
                                           f"{[(p.dtype, p.shape) for p in parts]}")
                if written_rows % layout.rows_per_page:
                    raise TableFormatError(f"layer {layer}: only the last block may end inside a page")
                packed = layout.pack(parts)
                crc_f.write(page_crcs(packed).astype("<u4").tobytes())
                if k_total:  # page p goes to stripe p % K, in order
                    p0 = written_rows // layout.rows_per_page
                    for k, f in enumerate(data_files):
                        f.write(np.ascontiguousarray(packed[(k - p0) % k_total :: k_total]).reshape(-1))
                else:
                    data_files[0].write(memoryview(packed).cast("B"))
                written_rows += n
                if progress:
                    progress(packed.nbytes)
            if written_rows != layout.rows:
                raise TableFormatError(f"layer {layer}: wrote {written_rows} rows, the spec says {layout.rows}")
            for f in data_files:
                os.fsync(f.fileno())
            crc_f.flush()
            os.fsync(crc_f.fileno())
        log.debug("layer %d: %d rows in %.2fs", layer, written_rows, time.perf_counter() - t0)
        stripes = tuple(StripeEntry(str(final), stripe_pages(layout.pages, k_total, k) * PAGE_BYTES)
                        for k, (_, final) in enumerate(stripe_files)) if k_total else ()
        entry = LayerEntry(layer, layout.rows, layout.row_bytes, name, layout.file_bytes, crc_name, stripes,
                           None if table_scale is None else float(table_scale))
        self.entries.append(entry)
        return entry

    def add_file(self, name: str, data: bytes) -> None:
        """Write one more file (the token map, a tokenizer) into the set, published with it."""
        assert self.tmp is not None, "use TableSetWriter as a context manager"
        if "/" in name or name.startswith(".") or name == MANIFEST:
            raise TableFormatError(f"extra file name {name!r} must be a plain name other than {MANIFEST}")
        self.needed += len(data)
        with self._space(self.tmp / name):
            write_file_atomic(self.tmp / name, data)

    def commit(self) -> Manifest:
        """Write the manifest and publish the directory by rename."""
        assert self.tmp is not None
        missing = set(self.spec.layers) - {e.layer for e in self.entries}
        if missing:
            raise TableFormatError(f"cannot publish {self.out}: layers {sorted(missing)} were not written")
        manifest = Manifest(self.spec, tuple(sorted(self.entries, key=lambda e: e.layer)), source=self.source,
                            token_map=self.token_map)
        with self._space(self.tmp / MANIFEST):
            write_file_atomic(self.tmp / MANIFEST, manifest.to_json().encode())
            if self._stripe_tmp:
                self.mark.seal()  # the stripes are complete: their size and time join the marker
        for path in (*self.tmp.iterdir(), self.tmp, *(tmp for tmp, _ in self._stripe_tmp)):  # group-readable
            os.chown(path, -1, self.gid)
            os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
        fsync_dir(self.tmp)
        published = []
        try:
            for tmp, final in self._stripe_tmp:  # complete and fsynced: give them their final names
                target.rename_new(tmp, final)
                published.append(final)
            for d in self.stripe_dirs:
                fsync_dir(d)
            self._publish_dir()
        except BaseException:
            for final in published:
                final.unlink(missing_ok=True)
            raise
        self.tmp = None
        return manifest

    def _publish_dir(self) -> None:
        assert self.tmp is not None
        # what is there now (it may have changed while we wrote), and what replacing it removes
        removal = target.check_target(self.out, self.overwrite, stripe_dirs=self.stripe_dirs)
        target.publish(self.tmp, self.out, removal)
        fsync_dir(self.out.parent)


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise TableFormatError(f"group {group!r} does not exist on this host (give the daemon's group, "
                               "e.g. engram-store)") from None
