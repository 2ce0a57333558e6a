"""Opening a table set for ``TieredStore``: the open arguments checked, each layer file opened.

A layer whose data or checksum file is missing, truncated or unreadable is returned as
a broken ``LayerFile`` (logged, with the reason) so that the other layers keep serving.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import ConfigError, TableFormatError
from ..manifest import load_page_crcs
from .nvme import LayerFile
from .policy import POLICIES
from .syscalls import open_direct

log = logging.getLogger(__name__)

MODES = ("auto", "resident", "cached")
GDS_CHOICES = ("auto", "on", "off")
MAX_QUEUE_DEPTH = 256
MAX_COALESCE_PAGES = 64


def check_open_args(*, mode: str, policy: str, gds: str, dram_bytes, queue_depth, max_coalesce_pages,
                    scrub_bytes_per_second) -> None:
    """Raise ConfigError naming the first argument of ``TieredStore.open`` that is out of range."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if gds not in GDS_CHOICES:
        raise ConfigError(f"gds must be one of {', '.join(GDS_CHOICES)}, got {gds!r}")
    if not isinstance(dram_bytes, int) or dram_bytes < 0:
        raise ConfigError(f"dram_bytes must be a non-negative integer, got {dram_bytes!r}")
    if not isinstance(queue_depth, int) or not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ConfigError(f"queue_depth must be an integer in 1..{MAX_QUEUE_DEPTH}, got {queue_depth!r}")
    if not isinstance(max_coalesce_pages, int) or not 1 <= max_coalesce_pages <= MAX_COALESCE_PAGES:
        raise ConfigError(f"max_coalesce_pages must be an integer in 1..{MAX_COALESCE_PAGES}, got {max_coalesce_pages!r}")
    if not isinstance(scrub_bytes_per_second, int) or scrub_bytes_per_second < 0:
        raise ConfigError(f"scrub_bytes_per_second must be a non-negative integer, got {scrub_bytes_per_second!r}")


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
