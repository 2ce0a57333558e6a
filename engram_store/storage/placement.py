"""Per-layer placement: which Engram layers live whole in DRAM (resident) and which are cached.

A *resident* layer sits densely in the sealed arena, in the engines' layout, so
any process can map it and gather its rows itself (the engine plugins, the
prefetcher's UVA path, the daemon's native fast path). A *cached* layer is
served from a slot cache in DRAM over its NVMe file.

Chosen once, at open, by :func:`plan_placement`:

- ``mode="resident"`` / ``"cached"``: every layer so (``resident`` needs the
  dense table set to fit ``dram_bytes``);
- ``mode="auto"``: layers named in ``placement`` as asked; the others resident
  in ascending layer order, *earliest first*, while the arena fits ``dram_bytes``
  and what is left still gives the cached layers a cache of at least
  :data:`MIN_CACHE_FRACTION` of their rows. Early layers go first on purpose: an
  early Engram layer (V4.1's layer 1) has almost no compute ahead of it to hide an
  NVMe read, while layer 14 has thirteen layers of slack.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..errors import ConfigError
from ..format.manifest import Manifest
from .policies import policy_bytes_per_slot
from .resident import resident_layout

RESIDENT, CACHED = "resident", "cached"
PLACEMENTS = (RESIDENT, CACHED)
MIN_CACHE_FRACTION = 0.01  # auto: a cache below this share of the cached layers' rows is not worth a layer's DRAM


def parse_placement(text: str | Mapping) -> dict[int, str]:
    """``"1=resident,14=cached"`` (or a TOML table ``{1 = "resident"}``) as ``{1: "resident", 14: "cached"}``;
    ConfigError naming what is wrong."""
    items = text.items() if isinstance(text, Mapping) else \
        (part.split("=", 1) if "=" in part else (part, "") for part in str(text).split(",") if part.strip())
    out: dict[int, str] = {}
    for layer, where in items:
        try:
            key = int(str(layer).strip())
        except ValueError:
            raise ConfigError(f"placement: {layer!r} is not a layer id (expected e.g. \"1=resident,14=cached\")") from None
        value = str(where).strip().lower()
        if value not in PLACEMENTS:
            raise ConfigError(f"placement: layer {key}: {where!r} is not one of {', '.join(PLACEMENTS)}")
        if key in out:
            raise ConfigError(f"placement: layer {key} is given twice")
        out[key] = value
    return out


def format_placement(placement: Mapping[int, str]) -> str:
    return ",".join(f"{layer}={where}" for layer, where in sorted(placement.items()))


def plan_placement(layer_rows: Mapping[int, int], *, dram_bytes: int, mode: str, asked: Mapping[int, str],
                   arena_bytes: Callable[[list[tuple[int, int]]], int], slot_bytes: int) -> dict[int, str]:
    """``{layer: "resident" | "cached"}`` for every layer of ``layer_rows`` (layer -> rows).

    ``arena_bytes(layer_rows)``: bytes the resident arena needs for those layers;
    ``slot_bytes``: DRAM one cache slot costs (row, bookkeeping, policy). ConfigError
    naming the layer and the bytes when the asked placement cannot fit ``dram_bytes``."""
    unknown = sorted(set(asked) - set(layer_rows))
    if unknown:
        raise ConfigError(f"placement names layer(s) {unknown} that the table set does not hold "
                          f"(layers {sorted(layer_rows)})")
    if mode != "auto":
        clash = sorted(layer for layer, where in asked.items() if where != mode)
        if clash:
            raise ConfigError(f"placement puts layer(s) {clash} against mode={mode!r}; use mode 'auto' for a mix")
    if mode in PLACEMENTS:
        plan = {layer: mode for layer in layer_rows}
    else:
        plan = dict(asked)
        for layer in sorted(set(layer_rows) - set(asked)):  # earliest first
            trial = plan | {layer: RESIDENT}
            if _fits(trial, layer_rows, dram_bytes, arena_bytes, slot_bytes, MIN_CACHE_FRACTION):
                plan[layer] = RESIDENT
            else:
                plan[layer] = CACHED
        plan = dict(sorted(plan.items()))
    resident = [(layer, layer_rows[layer]) for layer, where in plan.items() if where == RESIDENT]
    need = arena_bytes(resident) if resident else 0
    if need > dram_bytes:
        raise ConfigError(f"placement: resident layer(s) {[layer for layer, _ in resident]} need {need} bytes of "
                          f"DRAM (their dense blocks), dram_bytes is {dram_bytes}; raise dram_bytes or cache some")
    if any(where == CACHED for where in plan.values()) and dram_bytes - need < slot_bytes:
        raise ConfigError(f"placement: after {need} bytes of resident layers, dram_bytes={dram_bytes} leaves no "
                          f"cache slot ({slot_bytes} bytes each) for the cached layers")
    return plan


def cache_slots(plan: Mapping[int, str], layer_rows: Mapping[int, int], dram_bytes: int, arena: int,
                slot_bytes: int) -> int:
    """Cache slots for the cached layers of ``plan``: what ``dram_bytes`` leaves after the arena,
    never more than their rows."""
    rows = sum(layer_rows[layer] for layer, where in plan.items() if where == CACHED)
    return min(max(0, dram_bytes - arena) // slot_bytes, rows)


def _fits(plan: Mapping[int, str], layer_rows: Mapping[int, int], dram_bytes: int,
          arena_bytes: Callable[[list[tuple[int, int]]], int], slot_bytes: int, min_fraction: float) -> bool:
    resident = [(layer, layer_rows[layer]) for layer, where in plan.items() if where == RESIDENT]
    need = arena_bytes(resident)
    if need > dram_bytes:
        return False
    cached_rows = sum(rows for layer, rows in layer_rows.items() if plan.get(layer) != RESIDENT)
    return cached_rows == 0 or (dram_bytes - need) // slot_bytes >= max(1, int(cached_rows * min_fraction))


CACHE_BYTES_PER_SLOT = 8 + 4 + 1  # slot key + free-stack entry + hint state, besides the policy's own



def slot_bytes(row_bytes: int, policy: str) -> int:
    """DRAM one cache slot costs: the row, its key and free-stack entry, the policy's state."""
    return row_bytes + CACHE_BYTES_PER_SLOT + policy_bytes_per_slot(policy)


def plan_store(manifest: Manifest, *, dram_bytes: int, mode: str, policy: str,
               placement: Mapping[int, str] | None = None) -> dict[int, str]:
    """Each layer's placement for ``open`` (and for the daemon's config checks, before any
    table byte is read); ConfigError when it cannot fit ``dram_bytes``."""
    row_format = manifest.spec.row_format
    return plan_placement({e.layer: e.rows for e in manifest.layers}, dram_bytes=dram_bytes, mode=mode,
                          asked=dict(placement or {}),
                          arena_bytes=lambda layer_rows: resident_layout(layer_rows, row_format).size,
                          slot_bytes=slot_bytes(manifest.spec.row_bytes, policy))
