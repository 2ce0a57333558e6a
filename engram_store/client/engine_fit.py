"""Can an inference engine (vLLM, SGLang) use a daemon as it stands? One pure function, :func:`engine_fit`.

It reads only a daemon's Info (``placement``, ``bad_pages``, ``layers_unavailable``,
``arena.huge_pages``), so ``engram-store status`` (a running daemon), ``engram-store doctor``
(the placement a config would give) and the engine plugins phrase the same verdict:

- a *resident* layer is read in place from the daemon's arena (the engines' layout);
- a *cached* layer is served through the daemon's fetch path (a lookup per step, its misses
  read from NVMe);
- a layer the daemon cannot serve (file missing or truncated) or one with pages failing their
  checksums makes the daemon unusable for an engine, which needs every row of every Engram
  layer: the fix is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ENGINES = ("vLLM", "SGLang")


@dataclass(frozen=True)
class EngineFit:
    """The verdict: usable or not, how each layer is served, and why not (each with its fix)."""

    in_place: tuple[int, ...] = ()  # resident layers, read in place from the arena
    fetched: tuple[int, ...] = ()  # cached layers, served through the daemon's fetch path
    problems: tuple[str, ...] = ()  # each one stops an engine; the message says what to do
    warnings: tuple[str, ...] = field(default=())  # usable, but slower than it could be

    @property
    def usable(self) -> bool:
        return not self.problems and bool(self.in_place or self.fetched)

    def summary(self) -> str:
        """One line: ``usable: layers [1] in place, [14] through the daemon's fetch path`` or why not."""
        if not self.usable:
            return "NOT usable: " + "; ".join(self.problems or ("the daemon serves no layer",))
        parts = []
        if self.in_place:
            parts.append(f"layers {list(self.in_place)} in place from the arena")
        if self.fetched:
            parts.append(f"layers {list(self.fetched)} through the daemon's fetch path")
        return "usable: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"usable": self.usable, "in_place": list(self.in_place), "fetched": list(self.fetched),
                "problems": list(self.problems), "warnings": list(self.warnings), "summary": self.summary()}


def _ranges_pages(ranges: Any) -> int:
    return sum(int(b) - int(a) for a, b in ranges or ())


def engine_fit(info: Mapping[str, Any]) -> EngineFit:
    """The verdict for a daemon whose Info is ``info`` (keys may be str or int layer ids)."""
    placement = {int(layer): str(where) for layer, where in (info.get("placement") or {}).items()}
    unavailable = {int(layer): str(why) for layer, why in (info.get("layers_unavailable") or {}).items()}
    bad = {int(layer): _ranges_pages(r) for layer, r in (info.get("bad_pages") or {}).items() if _ranges_pages(r)}
    problems, warnings = [], []
    for layer, why in sorted(unavailable.items()):
        problems.append(f"layer {layer} is unavailable ({why}): an engine needs every Engram layer; restore the "
                        "table set's files and restart the daemon")
    for layer, pages in sorted(bad.items()):
        how = ("its rows are zeros in the arena and refused" if placement.get(layer) == "resident"
               else "lookups of their rows are refused")
        problems.append(f"layer {layer} has {pages} page(s) failing their checksums ({how}): repair the table set "
                        "(`engram-store verify DIR` names them; re-import or re-synth) and restart the daemon")
    served = {layer: where for layer, where in placement.items() if layer not in unavailable}
    in_place = tuple(sorted(layer for layer, where in served.items() if where == "resident"))
    fetched = tuple(sorted(layer for layer, where in served.items() if where != "resident"))
    huge = str((info.get("arena") or {}).get("huge_pages", "")) if info.get("arena") else ""
    if in_place and huge == "none":
        warnings.append("the arena is on 4 KiB pages: GPU reads of it in place take a TLB miss per row; reserve "
                        "huge pages (vm.nr_hugepages) or set shmem THP to advise, then restart the daemon")
    if fetched:
        warnings.append(f"cached layers {list(fetched)} cost a lookup through the daemon per step and NVMe reads "
                        "for rows missing from its cache")
    return EngineFit(in_place, fetched, tuple(problems), tuple(warnings))
