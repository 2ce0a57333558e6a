"""One layer's data file as both tiers see it, and how it is opened.

A layer whose data or checksum file is missing, truncated or unreadable is
returned as a broken :class:`LayerFile` (logged, with the reason) so that the
other layers keep serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TableFormatError
from ..format.layout import PageLayout
from ..format.manifest import load_page_crcs
from ..native.syscalls import OpenedFile, open_direct

log = logging.getLogger(__name__)


@dataclass
class LayerFile:
    """One layer's data file as the NVMe tier sees it."""

    layer: int
    path: str
    layout: PageLayout
    file: OpenedFile | None  # None when the layer cannot be served
    error: str | None = None
    crcs: np.ndarray | None = None  # expected crc32c of every page (uint32); None: pages are not checked


def open_layer(directory: Path, entry) -> LayerFile:
    path = directory / entry.file
    layout = entry.layout
    try:
        opened = open_direct(path)
    except FileNotFoundError:
        return broken(entry, path, layout, f"data file {path} is missing; re-import or re-synth the table set")
    except OSError as exc:
        return broken(entry, path, layout, f"cannot open {path}: {exc}")
    if opened.size != entry.file_bytes:
        opened.close()
        return broken(entry, path, layout, f"{path} has {opened.size} bytes, the manifest says {entry.file_bytes} "
                                            "(truncated?); re-import or re-synth the table set")
    try:
        crcs = load_page_crcs(directory, entry)
    except TableFormatError as exc:
        opened.close()
        return broken(entry, path, layout, str(exc))
    return LayerFile(entry.layer, str(path), layout, opened, crcs=crcs)


def broken(entry, path: Path, layout, why: str) -> LayerFile:
    log.error("layer %d unavailable: %s", entry.layer, why)
    return LayerFile(entry.layer, str(path), layout, None, why)
