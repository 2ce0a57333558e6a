"""Opening a table set: the arguments of ``TieredStore.open`` checked before any file is opened
(:func:`check_open_args`), then the store's shared parts built (:func:`open_parts`; each layer file
opened by :func:`.layer_file.open_layer`) and its background scrub started (:func:`start_scrub`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from ..format.manifest import Manifest
from ..native.gather import Gatherer
from ..native.readers import open_reader
from .close_gate import CloseGate
from .gds import make_bulk_reader
from .inflight import InFlight
from .integrity import PageHealth
from .layer_file import LayerFile, open_layer
from .nvme import DEFAULT_CHUNK_PAGES, NvmeTier
from .overlap import ReadOverlap
from .parts import StoreParts
from .placement import CACHED, RESIDENT, cache_slots, plan_store, slot_bytes
from .policies import POLICIES
from .profile import AccessSampler
from .resident import ResidentArena
from .row_cache import RowCache
from .scrub import Scrubber
from .stats import StoreCounters

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


def _disk_paths(files: dict[int, LayerFile]) -> dict[int, str | list[str]]:
    """Each layer's data file, or its stripe files in order (for messages naming a bad page)."""
    return {k: [part.path for part in lf.stripes] if lf.stripes else lf.path for k, lf in files.items()}


def open_parts(directory: str | os.PathLike, *, dram_bytes: int, mode: str, queue_depth: int, policy: str,
               huge_pages: bool, gds: str, reader: str, max_coalesce_pages: int, profile_capacity: int,
               gather_threads: int | None, placement: Mapping[int, str] | None) -> tuple[StoreParts, str]:
    """The shared parts of a store of the table set in ``directory`` (arguments: those of
    ``TieredStore.open``, checked already), and the name of the bulk reader that filled the arena
    (``none`` when no layer is resident). Raises what opening raises, with nothing left open."""
    try:
        page_reader = open_reader(queue_depth, reader)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    directory = Path(directory)
    manifest = Manifest.load(directory)
    files = {e.layer: open_layer(directory, e) for e in manifest.layers}
    health = PageHealth({k: lf.layout for k, lf in files.items()}, _disk_paths(files))
    table_pages = sum(e.layout.pages for e in manifest.layers)
    nvme = NvmeTier(files, page_reader, max_coalesce_pages=max_coalesce_pages,
                    chunk_pages=min(DEFAULT_CHUNK_PAGES, max(256, table_pages // 64)))
    healthy = [lf for lf in files.values() if lf.file is not None]
    row_bytes = manifest.spec.row_bytes
    arena = cache = None
    bulk_name = "none"
    try:
        plan = plan_store(manifest, dram_bytes=dram_bytes, mode=mode, policy=policy, placement=placement)
        resident = [lf for lf in healthy if plan[lf.layer] == RESIDENT]
        if resident:
            bulk, bulk_name = make_bulk_reader(page_reader, gds)
            arena = ResidentArena.build(resident, manifest.spec.row_format, bulk, huge=huge_pages, on_bad=health.mark)
        cached = {e.layer: e.rows for e in manifest.layers if plan[e.layer] == CACHED}
        if cached:
            n_slots = cache_slots(plan, {e.layer: e.rows for e in manifest.layers}, dram_bytes,
                                  arena.nbytes if arena is not None else 0, slot_bytes(row_bytes, policy))
            cache = RowCache(cached, row_bytes, n_slots, policy, huge=huge_pages)
    except BaseException:
        if arena is not None:
            arena.close()
        nvme.close()
        raise
    total_rows = sum(e.rows for e in manifest.layers)
    sampler = AccessSampler(min(profile_capacity, max(1024, total_rows // 64)))
    threads = gather_threads if gather_threads is not None else min(8, os.cpu_count() or 1)
    gatherer = Gatherer(threads)
    parts = StoreParts(directory=directory, manifest=manifest, files=files, placement=dict(plan),
                       resident=frozenset(arena.blocks) if arena is not None else frozenset(), nvme=nvme,
                       arena=arena, cache=cache, gather=gatherer, overlap=ReadOverlap(gatherer.threads),
                       inflight=InFlight(), health=health, sampler=sampler, counters=StoreCounters(),
                       gate=CloseGate())
    return parts, bulk_name


def start_scrub(parts: StoreParts, bytes_per_second: int) -> Scrubber | None:
    """The background scrub of the cached layers' pages at ``bytes_per_second``, started; None when
    there is nothing to scrub (rate 0, or no cached layer)."""
    if not bytes_per_second or parts.cache is None:
        return None
    cached = [lf for lf in parts.files.values() if lf.file is not None and parts.placement[lf.layer] == CACHED]
    return Scrubber(cached, parts.nvme.reader, parts.health, bytes_per_second).start()
