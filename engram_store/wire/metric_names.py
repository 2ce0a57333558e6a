"""One naming scheme for the daemon's counters, over every transport: the Prometheus names.

The Stats request (Unix socket and gRPC) answers flat keys (``store_rows_dram``,
``unix_requests``, ``unix_errors_unauthenticated``, ...); ``/metrics`` exports families
(``engram_store_tier_rows_total{tier="dram"}``). :data:`FAMILIES` declares each family once
(name, type, help, labels) with the Stats key its samples come from: the exporter
(``engram_store.daemon.http.exporter``) builds its families from it, and ``engram-store stats``
renames a Stats answer with :func:`prometheus_samples`, so both name every value alike.
:data:`NOT_EXPORTED` lists the Stats keys derived from others; a test checks that every key a
daemon answers is in one of the two.

Only ``/metrics`` has what the Stats answer does not carry: the daemon's facts
(``engram_store_info{mode}``, ``engram_store_build_info{version}``, per layer placement, bytes
and bad pages), latency histogram buckets and the process collector's ``process_*`` metrics.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

PREFIX = "engram_store_"
TRANSPORTS = ("unix", "grpc")
HUGE_PAGE_KINDS = ("none", "thp", "hugetlb")  # the store's arena_huge_pages value is the index
_ANY = "[a-z0-9_]+?"


@dataclass(frozen=True)
class Family:
    """A Prometheus family and the Stats keys of its samples.

    ``key`` is a Stats key in which each label appears as ``{label}``; ``labels`` gives each
    label's allowed values (empty: any ``[a-z0-9_]`` text). ``kind`` ``state``: a gauge with
    one sample per value of its single label, 1 for the value the Stats key indexes.
    ``exported`` False: part of a family the exporter builds otherwise (a histogram's sum).
    """

    name: str
    kind: str  # "counter", "gauge" or "state"
    help: str
    key: str
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()
    exported: bool = True

    @property
    def sample(self) -> str:
        """The sample name (a counter's carries ``_total``, as prometheus_client writes it)."""
        return self.name + "_total" if self.kind == "counter" else self.name

    @functools.cached_property
    def _pattern(self) -> re.Pattern[str]:
        text = re.escape(self.key)
        for label, values in self.labels:
            alt = "|".join(map(re.escape, values)) if values else _ANY
            text = text.replace(re.escape("{" + label + "}"), f"(?P<{label}>{alt})")
        return re.compile(text)

    def match(self, key: str) -> dict[str, str] | None:
        """The label values if ``key`` is one of this family's Stats keys, else None."""
        m = self._pattern.fullmatch(key)
        return None if m is None else m.groupdict()

    def samples(self, key: str, value: float) -> Iterator[tuple[str, dict[str, str], float]]:
        """(sample name, labels, value) of the Stats entry ``key`` (which must match)."""
        labels = self.match(key) or {}
        if self.kind == "state":
            (label, values), = self.labels
            for i, v in enumerate(values):
                yield self.sample, {label: v}, float(int(value) == i)
        else:
            yield self.sample, labels, float(value)


def _c(name: str, help_: str, key: str, **labels: tuple[str, ...]) -> Family:
    return Family(PREFIX + name, "counter", help_, key, tuple(labels.items()))


def _g(name: str, help_: str, key: str, **labels: tuple[str, ...]) -> Family:
    return Family(PREFIX + name, "gauge", help_, key, tuple(labels.items()))


_T = {"transport": TRANSPORTS}
FAMILIES: tuple[Family, ...] = (
    # per transport (the daemon's DaemonStats)
    _c("requests", "Lookup requests received, by transport", "{transport}_requests", **_T),
    _c("native_requests", "Of those, requests answered by the native Unix path (resident layers)",
       "{transport}_native_requests", **_T),
    _c("rows", "Rows served, by transport", "{transport}_rows", **_T),
    _c("bytes", "Row bytes served, by transport", "{transport}_bytes", **_T),
    _c("request_errors", "Failed requests, by transport and status code", "{transport}_errors_{code}",
       transport=TRANSPORTS, code=()),
    _g("connected_clients", "Connected Unix-socket clients (gRPC keeps no connection state)",
       "{transport}_connected_clients", transport=("unix",)),
    Family(PREFIX + "request_latency_seconds_sum", "gauge", "Sum of request latencies (the histogram's _sum)",
           "{transport}_latency_sum_seconds", (("transport", TRANSPORTS),), exported=False),
    _c("dropped_clients", "Unix clients refused or dropped by a bound, by reason",
       "unix_dropped_clients_{reason}", reason=()),
    _c("protocol_errors", "Unix connections closed for garbage frames", "protocol_errors"),
    _g("uptime_seconds", "Seconds since the daemon started", "uptime_seconds"),
    _g("hit_ratio", "Share of rows served from DRAM (1 before any lookup and with every layer resident)",
       "hit_ratio"),
    # the store (its stats(), "store_" in the Stats answer)
    _c("lookups", "Lookups served by the store, all transports", "store_requests"),
    _c("lookup_errors", "Lookups the store failed", "store_request_errors"),
    _c("lookup_seconds", "Time the store spent in lookups", "store_lookup_seconds"),
    _c("tier_rows", "Rows served, by tier", "store_rows_{tier}", tier=("dram", "nvme")),
    _c("tier_bytes", "Row bytes served, by tier", "store_bytes_{tier}", tier=("dram", "nvme")),
    _c("nvme_reads", "Read calls to the NVMe tier (adjacent pages coalesced)", "store_nvme_reads"),
    _c("nvme_pages_read", "4 KiB pages read from the NVMe tier", "store_nvme_pages_read"),
    _c("nvme_read_bytes", "Bytes read from the NVMe tier", "store_nvme_bytes_read"),
    _c("nvme_read_seconds", "Time spent in NVMe reads", "store_nvme_read_seconds"),
    _c("nvme_rows_read", "Distinct rows read from the NVMe tier", "store_nvme_rows_distinct"),
    _c("nvme_rows_shared", "Rows a lookup took from a concurrent lookup's NVMe read of them (read once for both)",
       "store_nvme_rows_shared"),
    _c("cache_admitted_rows", "Rows admitted into the DRAM cache", "store_cache_admitted_rows"),
    _c("cache_evicted_rows", "Rows evicted from the DRAM cache", "store_cache_evicted_rows"),
    _c("cache_not_admitted_rows", "Rows read from NVMe and not admitted (policy or admission limit)",
       "store_cache_not_admitted_rows"),
    _g("cache_slots", "Row slots of the DRAM cache", "store_cache_slots"),
    _g("cache_slots_used", "Row slots of the DRAM cache holding a row", "store_cache_slots_used"),
    _g("cache_bytes", "Bytes of the DRAM cache's row slots", "store_cache_bytes"),
    _g("cache_metadata_bytes", "Bytes of the DRAM cache's policy metadata (inside dram_bytes)",
       "store_cache_metadata_bytes"),
    _g("arena_bytes", "Bytes of the resident arena", "store_arena_bytes"),
    Family(PREFIX + "arena_huge_pages", "state", "Pages backing the resident arena: 1 for the kind in use "
           "(none: 4 KiB pages, thp: transparent huge pages, hugetlb: reserved huge pages)",
           "store_arena_huge_pages", (("kind", HUGE_PAGE_KINDS),)),
    _g("dram_bytes", "Bytes of DRAM the store holds (arena, cache slots and their metadata)", "store_dram_bytes"),
    _g("table_bytes", "Bytes of the table set on disk", "store_table_bytes"),
    _g("row_map_bytes", "Bytes of the cache's row-to-slot maps (beyond dram_bytes)", "store_row_map_bytes"),
    _g("staging_bytes", "Bytes of NVMe staging buffers (beyond dram_bytes)", "store_staging_bytes"),
    _g("page_crc_bytes", "Bytes of the page checksums held in memory (beyond dram_bytes)", "store_page_crc_bytes"),
    _g("beyond_dram_bytes", "Bytes the store holds beyond dram_bytes", "store_beyond_dram_bytes"),
    _g("beyond_dram_ratio", "Bytes held beyond dram_bytes, as a share of the table set", "store_beyond_dram_fraction"),
    _g("resident_layers", "Layers served whole from the resident arena", "store_resident_layers"),
    _g("cached_layers", "Layers served through the DRAM cache in front of NVMe", "store_cached_layers"),
    _g("layers_unavailable", "Layers of the table set the daemon cannot serve (file missing or truncated)",
       "store_layers_unavailable"),
    _c("corrupt_pages", "Distinct 4 KiB pages found not matching their crc32c (their rows are refused)",
       "store_corrupt_pages"),
    _c("corrupt_rows_refused", "Rows of lookups refused because their page is corrupt", "store_corrupt_rows_refused"),
    _c("scrub_bytes", "Bytes read and checked by the background scrub", "store_scrub_bytes"),
    _c("scrub_passes", "Complete scrub passes over the cached layers", "store_scrub_passes"),
    _c("plan_requests", "Plan lookups answered", "store_plan_requests"),
    _c("plan_rows", "Row positions of plan lookups", "store_plan_rows"),
    _c("plan_rows_dram", "Plan-lookup positions written from the DRAM cache", "store_plan_rows_dram"),
    _c("plan_rows_planned", "Plan-lookup positions left to the client's read plan", "store_plan_rows_planned"),
    _c("plan_rows_served", "Plan-lookup positions served by the daemon instead", "store_plan_rows_served"),
    _c("plan_pages_planned", "Distinct pages in the read plans sent", "store_plan_pages_planned"),
    _c("plan_admit_queued_rows", "Planned rows queued for background admission", "store_plan_admit_queued_rows"),
    _c("plan_admit_dropped_rows", "Planned rows not admitted because the background queue was full",
       "store_plan_admit_dropped_rows"),
    _c("plan_admitted_rows", "Planned rows read, checked and admitted into the cache in the background",
       "store_plan_admitted_rows"),
    _c("plan_admit_read_bytes", "Bytes the background admission read from NVMe", "store_plan_admit_bytes_read"),
    # hints: rows engines will look up soon, read ahead behind the lookups (rows of hints, duplicates included)
    _c("hint_requests", "Hints received (one per layer and client)", "store_hint_requests"),
    _c("hint_rows_received", "Rows in the hints received", "store_hint_rows_received"),
    _c("hint_rows_attached", "Hinted rows equal to a hint the same client had queued under the same key (not queued "
       "again)", "store_hint_rows_attached"),
    _c("hint_rows_skipped", "Hinted rows repeated within their hint, or found in DRAM or being read by a lookup when "
       "their turn came (not read)", "store_hint_rows_skipped"),
    _c("hint_rows_read", "Hinted rows read from NVMe into the cache's hinted share", "store_hint_rows_read"),
    _c("hint_rows_hit", "Hinted rows a lookup read before they aged (then kept as any cached row)",
       "store_hint_rows_hit"),
    _c("hint_rows_dropped", "Hinted rows not used, by reason: queue_full (the hint queue's bounds), rate (the "
       "client's hint_rows_per_second), withdrawn, aged (unread after hint_max_age_seconds), expired (read, never "
       "looked up), no_room (read when the hinted share was full or no slot was free or cold: hinted rows never "
       "take a row lookups keep hitting)",
       "store_hint_rows_dropped_{reason}", reason=("queue_full", "rate", "withdrawn", "aged", "expired", "no_room")),
    _c("hint_pages_read", "4 KiB pages read for hints", "store_hint_pages_read"),
    _c("hint_read_bytes", "Bytes read from NVMe for hints", "store_hint_bytes_read"),
    _c("hint_read_seconds", "Time the hint reader spent in NVMe reads", "store_hint_read_seconds"),
    _g("hint_rows_queued", "Hinted rows waiting to be read", "store_hint_rows_queued"),
    _g("hint_rows_pending", "Hinted rows received and not yet read, skipped or dropped (queued or being read)",
       "store_hint_rows_pending"),
    _g("hint_queued_bytes", "Bytes of memory the queued hints hold (8 a row, 768 a hint: what "
       "hint_max_queued_rows counts)", "store_hint_queued_bytes"),
    _g("hint_cache_slots_used", "Cache slots holding hinted rows no lookup has read yet (the hinted share)",
       "store_hint_cache_slots_used"),
    _g("hint_cache_slots_limit", "Cache slots hinted rows may hold at most (hint_cache_share of the slots)",
       "store_hint_cache_slots_limit"),
)

# Stats keys left out on purpose: each is derived from exported ones.
NOT_EXPORTED: dict[str, str] = {
    **{f"{t}_errors": f"sum of {PREFIX}request_errors_total{{transport=\"{t}\"}}" for t in TRANSPORTS},
    "grpc_connected_clients": "always 0: gRPC keeps no connection state",
    "store_rows": f"sum of {PREFIX}tier_rows_total",
    "store_hit_rate": f"{PREFIX}hit_ratio (which is 1 rather than 0 before any lookup)",
    "store_cache_admitted": f"the lookups' share of {PREFIX}cache_admitted_rows_total",
    "store_resident": f"{PREFIX}info{{mode=\"resident\"}}",
}


@functools.lru_cache(maxsize=4096)
def family_of(key: str) -> Family | None:
    """The family whose samples the Stats key ``key`` gives, or None (remembered: a scrape asks for every key)."""
    for family in FAMILIES:
        if family.match(key) is not None:
            return family
    return None


def sample_text(name: str, labels: Mapping[str, str]) -> str:
    """``name{a="x",b="y"}`` as Prometheus writes a sample (labels sorted), or ``name``."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def prometheus_samples(stats: Mapping[str, float]) -> dict[str, float]:
    """A Stats answer under the Prometheus sample names ``/metrics`` gives the same values.

    Keys of :data:`NOT_EXPORTED` are dropped; a key no family declares (a daemon newer than
    this client) is kept as ``engram_store_<key>`` rather than lost."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if key in NOT_EXPORTED:
            continue
        family = family_of(key)
        if family is None:
            out[PREFIX + key] = float(value)
            continue
        for name, labels, v in family.samples(key, value):
            out[sample_text(name, labels)] = v
    return out
