"""``engram-store status ADDR``: what a running daemon holds and serves, on one screen.

Reads the daemon's Info and Stats over ``unix://`` or ``grpc[s]://``, or its metrics page over
``http://HOST:PORT`` (the Prometheus names throughout: :mod:`engram_store.wire.metric_names`),
and says: version, uptime, the model its tables are (spec name, family, row format: :func:`describe_model`),
mode, each layer's placement, rows and bytes, huge pages, how rows are read
(the arena's fill; cached layers into the engines' pinned staging, O_DIRECT where the daemon is away: no
GPUDirect Storage on that path, so the same on CUDA and ROCm), bad pages, unavailable layers, clients,
hit rate, and whether vLLM / SGLang can use the daemon as it stands
(:func:`~engram_store.client.engine_fit.engine_fit`). ``collect`` returns a plain dict (the
``--json`` output); ``render`` the human table.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .. import errors
from ..native.pagesizes import format_page
from ..wire.metric_names import PREFIX, prometheus_samples
from .engine_fit import ENGINES, engine_fit
from .http_get import get

METRICS_TIMEOUT = 10.0  # seconds for the whole metrics page (connect, headers, body), however it trickles
METRICS_MAX_BYTES = 16 << 20  # largest metrics page read (a daemon's is tens of KiB)
BULK_READERS = {"posix": "O_DIRECT reads (no GPUDirect Storage)", "kvikio-cufile": "kvikio with cuFile (GPUDirect "
                "Storage)", "kvikio-compat": "kvikio in compatibility mode (POSIX reads, no GPUDirect Storage)"}
CACHED_PATH = ("the engines' fetch jobs, into pinned staging: daemon lookups, or their own O_DIRECT page reads while "
               "the daemon is away (no GPUDirect Storage on this path: the same on CUDA and ROCm)")


PAYLOADS = {"float8_e4m3fn": "FP8 E4M3", "bfloat16": "BF16", "float4_e2m1fn": "NVFP4 (E2M1)"}
SCALES = {"float8_e8m0fnu": "E8M0", "float8_e4m3fn": "E4M3"}


def describe_model(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """What model a table set is, from its spec (``ModelSpec.to_dict()``, as Info carries it): ``name``,
    ``family`` (DeepSeek-V4.1 Engram, Qwen4Exp PLE n-gram, LongCat-Flash n-gram), ``row_format`` in words
    (``FP8 E4M3 + E8M0 scale per 32 values``, ``FP8 E4M3 + one FP32 table scale``, ``BF16``, ``NVFP4 (E2M1) + E4M3
    scale per 16 values + one FP32 table scale``), ``row_bytes`` and ``rows_per_token``; None without a spec."""
    if not spec:
        return None
    from ..models.spec import ModelSpec

    try:
        model = ModelSpec.from_dict(spec)
    except errors.EngramStoreError:
        return {"name": spec.get("name", "?"), "family": "?", "row_format": "?", "row_bytes": None,
                "rows_per_token": None}
    fmt = model.row_format
    parts = [PAYLOADS.get(fmt.payload_dtype, fmt.payload_dtype)]
    if fmt.scale_block:
        parts.append(f"{SCALES.get(fmt.scale_dtype, fmt.scale_dtype)} scale per {fmt.scale_block} values")
    if fmt.table_scale_dtype:
        parts.append(f"one {fmt.table_scale_dtype.replace('float', 'FP')} table scale")
    return {"name": model.name, "family": model.family,
            "row_format": " + ".join(parts), "row_bytes": fmt.row_bytes, "rows_per_token": model.rows_per_token}


def model_words(model: dict[str, Any]) -> str:
    """``qwen3.8-flash-next (Qwen4Exp PLE n-gram): FP8 E4M3 + one FP32 table scale, 160 B a row, 16 rows a
    token``"""
    return (f"{model['name']} ({model['family']}): {model['row_format']}, {model['row_bytes']} B a row, "
            f"{model['rows_per_token']} rows a token")


def metrics_url(address: str) -> str:
    url = address.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def read_metrics(address: str, timeout: float = METRICS_TIMEOUT, max_bytes: int = METRICS_MAX_BYTES) -> dict[str, float]:
    """Every sample of the metrics page at ``address`` (``http://H:P[/metrics]``), ``name{labels}`` -> value,
    read within ``timeout`` seconds in all and ``max_bytes`` at most. Unreachable, too slow, too large or
    not a metrics page: :class:`~engram_store.errors.Unavailable` (DeadlineExceeded) in one line."""
    from prometheus_client.parser import text_string_to_metric_families

    url = metrics_url(address)
    resp = get(url, timeout, max_bytes)
    if resp.status != 200:
        raise errors.Unavailable(f"{url}: HTTP {resp.status} {resp.reason} (is this the daemon's metrics address?)")
    text = resp.body.decode(errors="replace")
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    except ValueError as exc:
        raise errors.Unavailable(f"{url} is not a Prometheus metrics page: {exc}") from None
    return values


def read_stats(address: str, connect: Callable[[], Any], timeout: float = METRICS_TIMEOUT) -> dict[str, float]:
    """The daemon's counters under their Prometheus names, whatever the transport."""
    if address.startswith(("http://", "https://")):
        return read_metrics(address, timeout)
    with connect() as client:
        return prometheus_samples(client.stats())


def _labelled(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: value}`` of the samples of ``name`` that carry only ``label``."""
    head = f'{name}{{{label}="'
    return {k[len(head):-2]: v for k, v in samples.items() if k.startswith(head) and k.endswith('"}')}


def _info_from_metrics(samples: dict[str, float]) -> dict[str, Any]:
    """What Info says, rebuilt from the metrics page (it carries every fact ``status`` shows)."""
    mode = next((m for m, v in _labelled(samples, PREFIX + "info", "mode").items() if v), "")
    placement = {layer: "resident" if v else "cached"
                 for layer, v in _labelled(samples, PREFIX + "layer_resident", "layer").items()}
    rows = {layer: int(v) for layer, v in _labelled(samples, PREFIX + "layer_rows", "layer").items()}
    layer_bytes = {layer: int(v) for layer, v in _labelled(samples, PREFIX + "layer_bytes", "layer").items()}
    bad = {layer: int(v) for layer, v in _labelled(samples, PREFIX + "bad_pages", "layer").items() if v}
    missing = {layer: "see the daemon's log" for layer in placement if layer not in rows}
    version = next(iter(_labelled(samples, PREFIX + "build_info", "version")), "")
    start = samples.get("process_start_time_seconds")
    return {"mode": mode, "placement": placement, "rows": rows, "layer_bytes": layer_bytes, "bad_pages": bad,
            "layers_unavailable": missing, "version": version, "pid": None,
            "uptime_seconds": time.time() - start if start else samples.get(PREFIX + "uptime_seconds")}


def collect(address: str, connect: Callable[[], Any], timeout: float = METRICS_TIMEOUT) -> dict[str, Any]:
    """The status document of the daemon at ``address`` (``connect()`` opens a client for unix/grpc)."""
    if address.startswith(("http://", "https://")):
        samples = read_metrics(address, timeout)
        info = _info_from_metrics(samples)
        transport = "metrics"
    else:
        with connect() as client:
            info, samples = client.info(), prometheus_samples(client.stats())
        transport = info.get("transport", "")
        row_bytes = int(info.get("row_bytes", 0))
        info["layer_bytes"] = {str(layer): int(n) * row_bytes for layer, n in info.get("rows", {}).items()}
        info.setdefault("uptime_seconds", samples.get(PREFIX + "uptime_seconds"))
        if "layers_unavailable" not in info:  # gRPC's Info leaves them out: the layers placed but not served
            info["layers_unavailable"] = {str(layer): "see the daemon's log" for layer in info.get("placement", {})
                                          if int(layer) not in {int(x) for x in info.get("rows", {})}}
    kinds = _labelled(samples, PREFIX + "arena_huge_pages", "kind")
    arena_bytes = samples.get(PREFIX + "arena_bytes", 0.0)
    huge = next((k for k, v in kinds.items() if v), "none") if arena_bytes else None
    rows = {str(k): int(v) for k, v in info.get("rows", {}).items()}
    layer_bytes = {str(k): int(v) for k, v in info.get("layer_bytes", {}).items()}
    bad = {str(k): _bad_entry(v) for k, v in (info.get("bad_pages") or {}).items() if v}
    layers = [{"layer": int(layer), "placement": where, "rows": rows.get(str(layer)),
               "bytes": layer_bytes.get(str(layer)), "bad_pages": bad.get(str(layer), {}).get("pages", 0)}
              for layer, where in sorted(info.get("placement", {}).items(), key=lambda kv: int(kv[0]))]
    fit = engine_fit({"placement": info.get("placement", {}),
                      "bad_pages": {layer: [[0, e["pages"]]] for layer, e in bad.items()},
                      "layers_unavailable": info.get("layers_unavailable") or {},
                      "arena": {"huge_pages": huge} if huge else None})
    slots = samples.get(PREFIX + "cache_slots", 0.0)
    return {
        "address": address, "transport": transport, "version": info.get("version", ""), "pid": info.get("pid"),
        "model": describe_model(info.get("spec")),  # not on the metrics page
        "uptime_seconds": info.get("uptime_seconds"), "mode": info.get("mode", ""), "layers": layers,
        "arena_bytes": int(arena_bytes), "huge_pages": huge,
        "huge_page_bytes": (info.get("arena") or {}).get("huge_page_bytes") if huge else None,
        "reads": {"arena_fill": info.get("bulk_reader") if arena_bytes else None,  # absent on the metrics page
                  "cached_layers": CACHED_PATH if any(e["placement"] != "resident" for e in layers) else None},
        "cache_bytes": int(samples.get(PREFIX + "cache_bytes", 0)),
        "cache_slots_used_ratio": samples.get(PREFIX + "cache_slots_used", 0.0) / slots if slots else None,
        "bad_pages": bad, "layers_unavailable": {str(k): v for k, v in (info.get("layers_unavailable") or {}).items()},
        "clients": int(samples.get(PREFIX + 'connected_clients{transport="unix"}', 0)) - (transport == "unix"),
        "hit_ratio": samples.get(PREFIX + "hit_ratio"),
        "lookups": int(samples.get(PREFIX + "lookups_total", 0)),
        "hints": _hints(samples, slots),
        "engines": {"names": list(ENGINES)} | fit.to_dict(),
    }


def _hints(samples: dict[str, float], slots: float) -> dict[str, Any]:
    """Hinted rows since start (received, read ahead, hit by a lookup, dropped), queued now, and the share
    of the cache's slots they hold (and may hold)."""
    get = lambda name: int(samples.get(PREFIX + name, 0))  # noqa: E731
    return {"received": get("hint_rows_received_total"), "read": get("hint_rows_read_total"),
            "hit": get("hint_rows_hit_total"), "queued": get("hint_rows_queued"),
            "dropped": int(sum(_labelled(samples, PREFIX + "hint_rows_dropped_total", "reason").values())),
            "share": get("hint_cache_slots_used") / slots if slots else None,
            "share_limit": get("hint_cache_slots_limit") / slots if slots else None}


def _bad_entry(value: Any) -> dict[str, Any]:
    """Info's page ranges ``[[first, end), ...]`` or the metrics page's count -> ``{pages, ranges}``."""
    if isinstance(value, (int, float)):
        return {"pages": int(value), "ranges": None}
    return {"pages": sum(int(b) - int(a) for a, b in value), "ranges": [[int(a), int(b)] for a, b in value]}


def healthy(doc: dict[str, Any]) -> bool:
    """No bad pages and no unavailable layer."""
    return not doc["bad_pages"] and not doc["layers_unavailable"]


def format_bytes(n: int | None) -> str:
    """``1.5 GiB``, ``803.0 KiB``, ``12 B`` (``-`` for None)."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d}d {h}h {m}m" if d else f"{h}h {m}m" if h else f"{m}m {s % 60}s"


def render(doc: dict[str, Any]) -> str:
    """The human table of a :func:`collect` document."""
    pid = f"pid {doc['pid']}, " if doc.get("pid") else ""
    lines = [f"engram-store {doc['version'] or '?'} at {doc['address']} ({pid}up {_duration(doc['uptime_seconds'])})",
             f"{'model':<12}{model_words(doc['model']) if doc.get('model') else '- (not on the metrics page)'}",
             f"{'mode':<12}{doc['mode']}",
             f"{'layers':<12}{'layer':>6}  {'placement':<10}{'rows':>15}  {'bytes':>10}  bad pages"]
    for e in doc["layers"]:
        rows = "unavailable" if e["rows"] is None else f"{e['rows']:,}"
        lines.append(f"{'':<12}{e['layer']:>6}  {e['placement']:<10}{rows:>15}  {format_bytes(e['bytes']):>10}  "
                     f"{e['bad_pages'] or '-'}")
    ratio = doc["cache_slots_used_ratio"]
    dram = [f"arena {format_bytes(doc['arena_bytes'])}" if doc["arena_bytes"] else "",
            f"cache {format_bytes(doc['cache_bytes'])} ({ratio:.0%} of slots used)" if ratio is not None else ""]
    lines.append(f"{'DRAM':<12}{', '.join(x for x in dram if x) or '-'}")
    page = f" ({format_page(doc['huge_page_bytes'])} pages)" if doc.get("huge_page_bytes") else ""
    lines.append(f"{'huge pages':<12}{doc['huge_pages'] + page if doc['huge_pages'] else '- (no resident arena)'}")
    reads = doc.get("reads") or {}
    fill = reads.get("arena_fill")
    parts = ([f"arena filled by {BULK_READERS.get(fill, fill or '- (not on the metrics page)')}"] if doc["arena_bytes"]
             else []) + ([f"cached layers through {reads['cached_layers']}"] if reads.get("cached_layers") else [])
    lines.append(f"{'reads':<12}{'; '.join(parts) or '-'}")
    bad = "; ".join(f"layer {layer}: {e['pages']} page(s)" + (" " + ", ".join(f"[{a}, {b})" for a, b in e["ranges"][:4])
                    + (" ..." if len(e["ranges"]) > 4 else "") if e["ranges"] else "")
                    for layer, e in sorted(doc["bad_pages"].items()))
    lines.append(f"{'bad pages':<12}{bad or 'none'}")
    gone = "; ".join(f"layer {layer}: {why}" for layer, why in sorted(doc["layers_unavailable"].items()))
    lines.append(f"{'unavailable':<12}{gone or 'none'}")
    lines.append(f"{'clients':<12}{doc['clients']} on the Unix socket (besides this query)")
    hit = doc["hit_ratio"]
    lines.append(f"{'hit rate':<12}{'-' if hit is None else f'{hit:.3f}'} of rows from DRAM over "
                 f"{doc['lookups']:,} lookups since start")
    hints = doc.get("hints") or {}
    if hints.get("share_limit"):  # a cached layer: hints are read into its cache
        lines.append(f"{'hints':<12}{hints['received']:,} rows received, {hints['read']:,} read ahead, {hints['hit']:,} "
                     f"hit, {hints['dropped']:,} dropped, {hints['queued']:,} queued; {hints['share']:.1%} of the "
                     f"cache's slots hinted (at most {hints['share_limit']:.0%})")
    fit = doc["engines"]
    lines.append(f"{'engines':<12}{' / '.join(fit['names'])}: {fit['summary']}")
    lines.extend(f"{'':<12}note: {w}" for w in fit["warnings"])
    return "\n".join(lines)
