"""The Prometheus exporter: reads the plain stats objects at scrape time, owns nothing else.

Every counter the Stats request answers is exported under the name
:data:`engram_store.wire.metric_names.FAMILIES` gives it, from the very same snapshot
(:func:`~engram_store.daemon.stats.combined_snapshot`), so ``/metrics`` and ``engram-store
stats unix://...`` cannot disagree. Beside them, only here: the daemon's facts
(``engram_store_info{mode}``, ``engram_store_build_info{version}``; per layer its placement,
rows, bytes and bad pages, from the daemon's Info), the request-latency histograms and the
process metrics of ``prometheus_client``'s own collectors (``process_*``: memory, CPU, file
descriptors, start time).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ...version import __version__
from ...wire.metric_names import FAMILIES, PREFIX, Family, family_of
from ..stats import DROP_REASONS, LATENCY_BUCKETS, DaemonStats, combined_snapshot


def _new(family: Family) -> Metric:
    labels = [label for label, _ in family.labels]
    if family.kind == "counter":
        return CounterMetricFamily(family.name, family.help, labels=labels)
    return GaugeMetricFamily(family.name, family.help, labels=labels)


def snapshot_families(snapshot: dict[str, float]) -> list[Metric]:
    """The Stats snapshot as Prometheus families, named by :data:`FAMILIES`."""
    built: dict[str, Metric] = {}
    for key in sorted(snapshot):
        family = family_of(key)
        if family is None or not family.exported:
            continue
        metric = built.get(family.name) or built.setdefault(family.name, _new(family))
        for _, sample_labels, value in family.samples(key, snapshot[key]):
            metric.add_metric([sample_labels[label] for label, _ in family.labels], value)
    # every drop reason, 0 until it happens, so that rate() and the alert see the series from the start
    dropped = built.get(_DROPPED.name) or built.setdefault(_DROPPED.name, _new(_DROPPED))
    seen = {s.labels["reason"] for s in dropped.samples}
    for reason in DROP_REASONS:
        if reason not in seen:
            dropped.add_metric([reason], 0.0)
    return list(built.values())


_DROPPED = next(f for f in FAMILIES if f.name == PREFIX + "dropped_clients")


class DaemonCollector:
    """A prometheus-client custom collector over DaemonStats, ``store_stats()`` and ``info()``."""

    def __init__(self, stats: DaemonStats, store_stats: Callable[[], dict[str, int | float]], mode: str,
                 placement: dict[int, str] | None = None, info: Callable[[], dict[str, Any]] | None = None) -> None:
        self.stats, self.store_stats, self.mode = stats, store_stats, mode
        self.placement = dict(placement or {})
        self.info = info
        self._process = (ProcessCollector(registry=None), PlatformCollector(registry=None))  # collected by this one

    def collect(self) -> Iterator[Metric]:
        store = self.store_stats()
        facts = GaugeMetricFamily(PREFIX + "info", "Daemon facts (value is always 1)", labels=["mode"])
        facts.add_metric([self.mode], 1)
        yield facts
        build = GaugeMetricFamily(PREFIX + "build_info", "The engram-store build serving (value is always 1)",
                                  labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        yield from self._layers()
        yield from snapshot_families(combined_snapshot(self.stats, store))
        yield self._latency()
        slots = float(store.get("cache_slots", 0) or 0)
        if slots:
            yield GaugeMetricFamily(PREFIX + "cache_occupancy_ratio", "Share of DRAM cache slots in use",
                                    value=float(store.get("cache_slots_used", 0)) / slots)
            yield GaugeMetricFamily(PREFIX + "hint_cache_share_ratio", "Share of DRAM cache slots holding hinted rows "
                                    "no lookup has read yet", value=float(store.get("hint_cache_slots_used", 0)) / slots)
        for collector in self._process:
            yield from collector.collect()

    def _layers(self) -> Iterator[Metric]:
        resident = GaugeMetricFamily(PREFIX + "layer_resident", "1 for a layer served whole from the resident arena, "
                                     "0 for a cached one", labels=["layer"])
        for layer, where in sorted(self.placement.items()):
            resident.add_metric([str(layer)], int(where == "resident"))
        yield resident
        if self.info is None:
            return
        info = self.info()
        rows = GaugeMetricFamily(PREFIX + "layer_rows", "Rows of each layer the daemon serves", labels=["layer"])
        nbytes = GaugeMetricFamily(PREFIX + "layer_bytes", "Row bytes of each layer the daemon serves",
                                   labels=["layer"])
        for layer, n in sorted(info.get("rows", {}).items(), key=lambda kv: int(kv[0])):
            rows.add_metric([str(layer)], int(n))
            nbytes.add_metric([str(layer)], int(n) * int(info.get("row_bytes", 0)))
        bad = GaugeMetricFamily(PREFIX + "bad_pages", "4 KiB pages of each layer failing their crc32c (their rows "
                                "are refused; a layer with any is not usable in place by engines)", labels=["layer"])
        ranges = info.get("bad_pages") or {}
        for layer in sorted(self.placement):
            bad.add_metric([str(layer)], sum(b - a for a, b in ranges.get(str(layer), ())))
        yield from (rows, nbytes, bad)

    def _latency(self) -> Metric:
        latency = HistogramMetricFamily(PREFIX + "request_latency_seconds", "Lookup latency in the daemon, by "
                                        "transport", labels=["transport"])
        for t in self.stats.transports():
            counts, total = t.histogram()
            cumulative, buckets = 0, []
            for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric([t.name], buckets, total)
        return latency
