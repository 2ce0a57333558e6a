"""The resident fill's progress in the daemon's log: a line every few seconds with rate and time left.

The fill runs inside the store (``TieredStore.open`` -> ``ResidentArena.build``: ~190 GiB for
V4.1, minutes) and says nothing until it is done. The daemon watches it from outside: the arena
is a memfd named ``engram-arena`` whose allocated blocks grow as the fill writes it (shmem and
hugetlbfs both count them), measured against the arena size the placement plans for ``config``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from ..errors import EngramStoreError
from ..format.manifest import Manifest
from ..progress import Progress
from ..storage.placement import RESIDENT, parse_placement, plan_store
from ..storage.resident import resident_layout
from .config import DaemonConfig

ARENA_NAME = "engram-arena"  # the name storage/resident.py gives the arena's memfd
EVERY_SECONDS = 5.0


def planned_arena_bytes(config: DaemonConfig) -> int:
    """Bytes of the resident arena ``config`` gives its table set (0: no layer resident)."""
    manifest = Manifest.load(config.tables)
    plan = plan_store(manifest, dram_bytes=config.dram_bytes, mode=config.store_mode, policy=config.cache_policy,
                      placement=parse_placement(config.placement))
    resident = [(e.layer, e.rows) for e in manifest.layers if plan[e.layer] == RESIDENT]
    return resident_layout(resident, manifest.spec.row_format).size if resident else 0


def arena_bytes_filled(name: str = ARENA_NAME, fd_dir: str = "/proc/self/fd") -> int:
    """Bytes allocated so far in this process's memfd ``name`` (the arena; 0 before it exists)."""
    link = f"/memfd:{name}"
    for fd in os.listdir(fd_dir):
        path = os.path.join(fd_dir, fd)
        try:
            target = os.readlink(path)
            if target == link or target.startswith(link + " "):  # "... (deleted)": memfds have no path
                return os.stat(path).st_blocks * 512
        except OSError:  # an fd closed while we looked
            continue
    return 0


@contextlib.contextmanager
def logged_fill(config: DaemonConfig, log: logging.Logger, every: float = EVERY_SECONDS,
                interval: float = 0.5) -> Iterator[None]:
    """Log the fill's progress every ``every`` s (sampled every ``interval`` s) while the block
    (opening the store) runs."""
    try:
        total = planned_arena_bytes(config) if config.tables else 0
    except EngramStoreError as exc:  # the store's own open reports a bad config; progress is only a courtesy
        log.debug("no fill progress: %s", exc)
        total = 0
    if not total:
        yield
        return
    bar = Progress("resident fill", total, enabled=False, log=log, every=every)
    with bar.watch(arena_bytes_filled, interval):
        yield
