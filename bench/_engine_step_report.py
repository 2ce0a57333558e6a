"""bench/engine_step.py's report: the figures of every case summarized per (batch, cache share), the
sizing table, and the human table. Plain functions of the JSON document the bench builds."""

from __future__ import annotations

import numpy as np

SLACK_LAYERS = {"in_14_layers": 14, "in_1_layer": 1}  # layer 14 has 14 layers ahead of it, a cached first layer 1
T_LAYER_MS = (0.5, 1.0, 2.0)  # per-layer compute times of the sizing table


def spread(values) -> dict:
    v = np.asarray(values, dtype=float)
    if not v.size:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(cases: list[dict]) -> list[dict]:
    """One row per (batch, share): each figure's median and range over the repeats (fio ratios over every
    block of every repeat; step and chunk latencies also pooled over all repeats)."""
    rows = []
    case_key = lambda c: (c["batch"], c["share_percent"], c.get("tree", "this"))  # noqa: E731
    for key in dict.fromkeys(case_key(c) for c in cases):
        group = [c for c in cases if case_key(c) == key]
        dec = [c["decode"] for c in group]
        ms = [x for d in dec for x in d["step_ms"]]
        blocks = [b for d in dec for b in d["blocks"]]
        row = {"batch": key[0], "share_percent": key[1], "tree": key[2], "repeats": len(group),
               "rows_per_step": group[0]["rows_per_step"],
               "hit_rate": spread([d["hit_rate_distinct"] for d in dec]),
               "hit_rate_simulated": dec[0]["hit_rate_simulated"],
               "cache_fill_after_warm_up": spread([c["warm"]["cache_fill"] for c in group]),
               "misses_per_step": spread([d["misses_per_step"]["median"] for d in dec]),
               "misses_per_step_p99": spread([d["misses_per_step_p99"] for d in dec]),
               "pages_per_step": spread([d["pages_per_step"]["median"] for d in dec]),
               "fetch_p50_ms": spread([d["p50_ms"] for d in dec]), "fetch_p99_ms": spread([d["p99_ms"] for d in dec]),
               "fetch_p99_ms_pooled": pct(ms, 99), "steps_pooled": len(ms),
               "pages_per_s": spread([b["pages_per_s"] for b in blocks]),
               "reader_pages_per_s": spread([b["reader_pages_per_s"] for b in blocks]),
               "reader_ratio_vs_fio": spread([b["reader_ratio"] for b in blocks if b["reader_ratio"]]),
               "daemon_lookup_p50_ms": spread([d["daemon_lookup_ms"]["median"] for d in dec]),
               "nvme_read_p50_ms": spread([d["nvme_read_ms"]["median"] for d in dec]),
               "fio_iops": spread([b["fio_iops"] for b in blocks if b["fio_iops"]]),
               "ratio_vs_fio": spread([b["ratio"] for b in blocks if b["ratio"]]),
               "all_hit_p50_ms": spread([c["all_hit"]["p50_ms"] for c in group if c["all_hit"]["steps"]]),
               "all_hit_p99_ms": spread([c["all_hit"]["p99_ms"] for c in group if c["all_hit"]["steps"]]),
               "all_hit_daemon_lookup_p99_ms": spread([c["all_hit"]["daemon_lookup_p99_ms"] for c in group
                                                       if c["all_hit"]["steps"]]),
               "not_all_hit": sum(c["all_hit"]["not_all_hit"] for c in group)}
        python = [c["all_hit_python"] for c in group if c.get("all_hit_python", {}).get("steps")]
        if python:  # the same steps with every Unix lookup in Python (--no-unix-native), same run
            row["all_hit_python_p50_ms"] = spread([p["p50_ms"] for p in python])
            row["all_hit_python_p99_ms"] = spread([p["p99_ms"] for p in python])
            row["all_hit_p99_vs_python"] = spread([c["all_hit"]["p99_ms"] / c["all_hit_python"]["p99_ms"] for c in group
                                                   if c["all_hit"]["steps"] and c.get("all_hit_python", {}).get("steps")])
        p99 = row["fetch_p99_ms"]["median"]
        row["hidden_below_ms"] = {k: p99 / v for k, v in SLACK_LAYERS.items()}
        chunks = [c["prefill"] for c in group if c.get("prefill")]
        if chunks:
            cms = [x for p in chunks for x in p["chunk_ms"]]
            row["prefill"] = {"rows": chunks[0]["rows"], "chunks": len(cms), "ms": spread(cms),
                              "misses": spread([x for p in chunks for x in p["chunk_misses"]]),
                              "pages_per_s": spread([x for p in chunks for x in p["chunk_pages_per_s"]]),
                              "lookup_ms": spread([x for p in chunks for x in p["chunk_lookup_ms"]]),
                              "nvme_read_ms": spread([x for p in chunks for x in p["chunk_nvme_read_ms"]]),
                              "hidden_below_ms": {k: {"median": float(np.median(cms)) / v, "worst": max(cms) / v}
                                                  for k, v in SLACK_LAYERS.items()}}
        rows.append(row)
    return rows


def sizing(summary: list[dict], slack: int = 14) -> list[dict]:
    """Per batch and share: the pages a step reads (median), the step's fixed cost besides its NVMe reads
    as measured here (fetch p50 - the daemon's NVMe read p50), and the 4 KiB reads/s that get the step's
    fetch done within ``slack`` layers of each per-layer time (the cached layer's index: V4.1's layer 14 is
    fetched while layers 0-13 run, Qwen3.8-Flash-Next's PLE layer 1 while layer 0 runs):
    pages / (slack t - fixed); None when the fixed cost alone does not fit."""
    out = []
    for r in summary:
        pages = r["pages_per_step"]["median"]
        fixed = r["fetch_p50_ms"]["median"] - r["nvme_read_p50_ms"]["median"]
        out.append({"batch": r["batch"], "share_percent": r["share_percent"], "tree": r["tree"], "pages_per_step": pages,
                    "fixed_ms": fixed, "slack_layers": slack, "iops_to_hide_in_slack": {
                        f"{t:g}ms": pages / ((slack * t - fixed) / 1e3) if slack * t > fixed else None
                        for t in T_LAYER_MS}})
    return out


def _r(s: dict, spec: str = ".2f") -> str:
    """median [min..max]"""
    if s.get("median") is None:
        return "-"
    return f"{format(s['median'], spec)} [{format(s['min'], spec)}..{format(s['max'], spec)}]"


def print_report(doc: dict) -> None:
    compared = any(r.get("tree", "this") != "this" for r in doc["summary"])

    def _tree(row: dict) -> str:
        """"" or, with ``--compare-tree``, " (this)" / " (DIR's name)": whose daemon a row measured."""
        tree = row.get("tree", "this")
        return "" if not compared else f" ({tree if tree == 'this' else tree.rstrip('/').rsplit('/', 1)[-1]})"

    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    t = doc["tables"]
    print(f"{doc['model']} (scale {doc['scale']:g}), layer {doc['layer']}: {doc['layer_rows']:,} rows; fetch job -> "
          f"daemon (both layers cached, S3-FIFO, QD {doc['queue_depth']}); {doc['corpus']['tokens']:,} tokens of "
          f"{', '.join(doc['corpus']['names'])}; {doc['repeats']} repeat(s) per case; load average "
          f"{doc['load_average_start'][0]:.1f} at start, {doc['load_average_end'][0]:.1f} at the end "
          f"({doc['cpus']} CPUs)")
    print(f"table set: {t['logical_bytes'] / 2**30:.1f} GiB logical, {t['allocated_bytes'] / 2**30:.2f} GiB on disk "
          f"({t['pages_written']:,} pages written in {t['write_seconds']:.0f} s, removed in "
          f"{f(t.get('remove_seconds'), '.0f')} s)")
    print("\nmedian [min..max] over repeats (fio ratio: over every block); hit: distinct rows of the measured steps "
          "found in DRAM, sim: the store's S3-FIFO simulated on the same trace")
    print(f"{'batch':>5} {'cache':>5} {'hit':>5} {'sim':>5} {'misses/step':>11} {'p99':>6} {'fetch p50 ms':>20} "
          f"{'fetch p99 ms':>20} {'pages/s':>8} {'fio IOPS':>8} {'pages/s / fio':>17} {'hidden >= ms /14':>16} "
          f"{'/1':>6}")
    for r in doc["summary"]:
        h = list(r["hidden_below_ms"].values())
        print(f"{r['batch']:>5} {r['share_percent']:>4g}%{_tree(r)} {r['hit_rate']['median']:>5.3f} "
              f"{f(r['hit_rate_simulated'], '.3f'):>5} {r['misses_per_step']['median']:>11,.0f} "
              f"{r['misses_per_step_p99']['median']:>6,.0f} {_r(r['fetch_p50_ms']):>20} {_r(r['fetch_p99_ms']):>20} "
              f"{r['pages_per_s']['median']:>8,.0f} {f(r['fio_iops']['median'], ',.0f'):>8} "
              f"{_r(r['ratio_vs_fio']):>17} {h[0]:>16.2f} {h[1]:>6.1f}")
    print("\nwhere a step's time goes (medians over repeats of per-step medians, ms): the job's fetch = the daemon's "
          "store lookup (its NVMe reads inside) + transport and copies; the reader's own rate over its reads vs fio")
    for r in doc["summary"]:
        print(f"{r['batch']:>5} {r['share_percent']:>4g}%{_tree(r)}: fetch {r['fetch_p50_ms']['median']:.2f} = store lookup "
              f"{r['daemon_lookup_p50_ms']['median']:.2f} (NVMe reads {r['nvme_read_p50_ms']['median']:.2f}, the rest "
              f"{r['daemon_lookup_p50_ms']['median'] - r['nvme_read_p50_ms']['median']:.2f}) + "
              f"{r['fetch_p50_ms']['median'] - r['daemon_lookup_p50_ms']['median']:.2f}; reader "
              f"{r['reader_pages_per_s']['median']:,.0f} pages/s = {_r(r['reader_ratio_vs_fio'])} x fio")
    print("\nall-hit steps (each fetched twice, the second timed; every row in the daemon's DRAM), p99 ms:")
    for r in doc["summary"]:
        print(f"{r['batch']:>5} {r['share_percent']:>4g}%{_tree(r)} {r['rows_per_step']:>6,} rows: fetch p50 "
              f"{_r(r['all_hit_p50_ms'], '.3f')}, p99 {_r(r['all_hit_p99_ms'], '.3f')}; the daemon's store lookup p99 "
              f"{_r(r['all_hit_daemon_lookup_p99_ms'], '.3f')}; {r['not_all_hit']} steps not all hits")
        if "all_hit_python_p99_ms" in r:
            print(f"{'':>12} Python path (--no-unix-native, same steps): fetch p50 {_r(r['all_hit_python_p50_ms'], '.3f')}, "
                  f"p99 {_r(r['all_hit_python_p99_ms'], '.3f')}; native p99 / Python p99 {_r(r['all_hit_p99_vs_python'], '.2f')}")
    prof = doc.get("store_profile")
    if prof:
        print(f"\ninside the store (TieredStore in this process, same files, cache {prof['share_percent']:g}%, batch "
              f"{prof['batch']}: {prof['rows']:,} rows a step), ms p50 / p99 of each part of a lookup:")
        for what, key in (("steps with misses", "miss_steps_ms"), ("all-hit steps", "all_hit_ms")):
            print(f"  {what}: " + "; ".join(f"{k} {v['p50']:.3f} / {v['p99']:.3f}" for k, v in prof[key].items()))
    for r in doc["summary"]:
        p = r.get("prefill")
        if p:
            h = p["hidden_below_ms"][next(iter(SLACK_LAYERS))]
            print(f"prefill chunk of {p['rows'] // doc['rows_per_token']:,} tokens ({p['rows']:,} rows), cache "
                  f"{r['share_percent']:g}%{_tree(r)}: fetch {_r(p['ms'], '.0f')} ms over {p['chunks']} chunk fetches, "
                  f"{p['misses']['median']:,.0f} misses, {p['pages_per_s']['median']:,.0f} pages/s (store lookups "
                  f"{p['lookup_ms']['median']:.0f} ms, their NVMe reads {p['nvme_read_ms']['median']:.0f} ms, summed "
                  f"over the daemon's pieces); hidden in 14 "
                  f"layers if a layer takes >= {h['median']:.1f} ms (worst chunk {h['worst']:.1f} ms)")
    slack = doc["sizing"][0]["slack_layers"] if doc["sizing"] else doc["layer"]
    print(f"\nsizing: 4 KiB NVMe reads/s (QD {doc['queue_depth']}) one engine (all its ranks) needs so that layer "
          f"{doc['layer']}'s fetch ends within {slack} layers of t ms each = pages per step / (slack t - the step's "
          "fixed cost measured here); "
          f"a node needs the sum over its engines; this disk: fio {f(doc['fio_iops_median'], ',.0f')} IOPS")
    print(f"{'batch':>5} {'cache':>5} {'pages/step':>10} {'fixed ms':>8} "
          + " ".join(f"{'t=' + format(t, 'g') + ' ms':>9}" for t in T_LAYER_MS))
    for z in doc["sizing"]:
        print(f"{z['batch']:>5} {z['share_percent']:>4g}%{_tree(z)} {z['pages_per_step']:>10,.0f} {z['fixed_ms']:>8.2f} "
              + " ".join(f"{f(v, ',.0f'):>9}" for v in z["iops_to_hide_in_slack"].values()))
    bad = sum(c["decode"]["rows_not_equal_synth_steps"] + c.get("prefill", {}).get("rows_not_equal_synth_chunks", 0)
              for c in doc["cases"])
    print(f"\nrows checked against synth_rows: every measured step and chunk, {bad} not equal; fetch job direct "
          f"(fallback) steps: {sum(c['job']['direct_steps'] for c in doc['cases'])}; wall {doc['seconds']:.0f} s")
