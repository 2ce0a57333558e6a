"""One layer's data file as both tiers see it, and how it is opened.

A layer whose data or checksum file is missing, truncated or unreadable is
returned as a broken :class:`LayerFile` (logged, with the reason) so that the
other layers keep serving.

A striped layer (see :mod:`engram_store.format.manifest`) opens every stripe;
``LayerFile.stripes`` then holds one LayerFile per stripe file: its own
descriptor, a layout covering its pages and the expected crc32c of its pages
(``crcs[k::K]`` of the layer's), so that the readers (NVMe tier, resident fill,
scrub) read each stripe as they would a layer file and map its local page
``q`` back to layer page ``k + K * q`` (:meth:`LayerFile.layer_pages`). One
missing or truncated stripe makes the whole layer unavailable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TableFormatError
from ..format.layout import PAGE_BYTES, PageLayout
from ..format.manifest import load_page_crcs
from ..native.syscalls import OpenedFile, open_direct

log = logging.getLogger(__name__)


@dataclass
class LayerFile:
    """One layer's data file (or one stripe of it) as the NVMe tier sees it."""

    layer: int
    path: str  # the data file; for a striped layer, its first stripe's
    layout: PageLayout  # of the layer; of a stripe view, rows covering that stripe's pages only
    file: OpenedFile | None  # None when the layer cannot be served; a striped layer's first stripe
    error: str | None = None
    crcs: np.ndarray | None = None  # expected crc32c of every page (uint32); None: pages are not checked
    stripes: tuple["LayerFile", ...] = ()  # a striped layer's K >= 2 stripe views, in order; () when unstriped
    stripe: int = 0  # a stripe view: its index k (layer page k + K * local page)
    stripe_count: int = 1  # a stripe view: K

    def layer_pages(self, local: np.ndarray) -> np.ndarray:
        """Layer page numbers of this (stripe) file's ``local`` pages (int64)."""
        return self.stripe + self.stripe_count * np.asarray(local, dtype=np.int64)

    def parts(self) -> tuple["LayerFile", ...]:
        """The files to read: the stripe views of a striped layer, else this one."""
        return self.stripes or (self,)

    def close(self) -> None:
        for part in self.parts():
            if part.file is not None:
                part.file.close()


def open_layer(directory: Path, entry) -> LayerFile:
    if entry.stripes:
        return _open_striped(directory, entry)
    path = directory / entry.file
    layout = entry.layout
    opened, why = _open_checked(path, entry.file_bytes)
    if opened is None:
        return broken(entry, path, layout, why)
    try:
        crcs = load_page_crcs(directory, entry)
    except TableFormatError as exc:
        opened.close()
        return broken(entry, path, layout, str(exc))
    return LayerFile(entry.layer, str(path), layout, opened, crcs=crcs)


def _open_checked(path: Path, file_bytes: int) -> tuple[OpenedFile | None, str]:
    """Open ``path`` with O_DIRECT and check its size: (file, "") or (None, why not)."""
    try:
        opened = open_direct(path)
    except FileNotFoundError:
        return None, f"data file {path} is missing; re-import or re-synth the table set"
    except OSError as exc:
        return None, f"cannot open {path}: {exc}"
    if opened.size != file_bytes:
        opened.close()
        return None, (f"{path} has {opened.size} bytes, the manifest says {file_bytes} (truncated?); re-import or "
                      "re-synth the table set")
    return opened, ""


def _open_striped(directory: Path, entry) -> LayerFile:
    paths = entry.stripe_paths(directory)
    layout = entry.layout
    k_total = len(paths)
    opened: list[OpenedFile] = []

    def fail(why: str) -> LayerFile:
        for f in opened:
            f.close()
        return broken(entry, paths[0], layout, why)

    for path, st in zip(paths, entry.stripes):
        f, why = _open_checked(path, st.file_bytes)
        if f is None:
            return fail(f"stripe {len(opened)} of {k_total}: {why}")
        opened.append(f)
    try:
        crcs = load_page_crcs(directory, entry)
    except TableFormatError as exc:
        return fail(str(exc))
    views = tuple(
        LayerFile(entry.layer, str(path), PageLayout(f.size // PAGE_BYTES * layout.rows_per_page, layout.row_bytes), f,
                  crcs=np.ascontiguousarray(crcs[k::k_total]), stripe=k, stripe_count=k_total)
        for k, (path, f) in enumerate(zip(paths, opened)))
    return LayerFile(entry.layer, str(paths[0]), layout, opened[0], crcs=crcs, stripes=views)


def broken(entry, path: Path, layout, why: str) -> LayerFile:
    log.error("layer %d unavailable: %s", entry.layer, why)
    return LayerFile(entry.layer, str(path), layout, None, why)
