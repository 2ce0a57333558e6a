"""bench/device_check.py's checks of model families other than DeepSeek-V4.1: LongCat-Flash-Lite's row ids
on the device (torch against numpy) and, on CUDA, against vLLM 0.33's compiled ``ngram_compute_n_gram_ids`` op;
Qwen4Exp's and LongCat's cached tables fetched as the engine plugins fetch them (``RankRows``), on CUDA from a
host function on the stream and from a CUDA graph."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import check_row as row

from engram_store import get_spec
from engram_store.models.hashing import row_ids, row_ids_torch

REPO = Path(__file__).resolve().parent.parent


def check_longcat(device, cpu_only: bool) -> list[dict]:
    """LongCat-Flash-Lite's ids: the torch twin on ``device`` vs numpy over EOS-rich requests; on CUDA,
    vLLM 0.33's own model state and compiled id op (a fresh process) vs row_ids at every step."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.longcat_ref import lookback, make_script, run_reference

    spec = get_spec("longcat-flash-lite")
    script = make_script(np.random.default_rng(39), spec.compressed_vocab, spec.pad_id)
    steps = []
    for rows_ in script["plan"]:
        tokens = np.concatenate([script["seqs"][r][s:s + n] for r, s, n in rows_])
        steps.append((tokens, np.concatenate([[0], np.cumsum([n for _, _, n in rows_])]),
                      lookback(script["seqs"], rows_, spec.history_len)))
    want = [row_ids(spec, 0, t, cu, lb) for t, cu, lb in steps]
    twin = sum(np.array_equal(row_ids_torch(spec, 0, torch.from_numpy(t).to(device), torch.from_numpy(cu).to(device),
                                            lookback=torch.from_numpy(lb).to(device)).cpu().numpy(), w)
               for (t, cu, lb), w in zip(steps, want))
    out = [row("longcat hash", twin == len(steps), f"{twin}/{len(steps)} steps equal", f"torch on {device} vs numpy")]
    if cpu_only:
        return out + [row("longcat-op", None, "", "no CUDA (tests/test_longcat.py runs it over a CPU stand-in)")]
    try:
        import vllm._custom_ops  # noqa: F401  (loads the compiled ops)
    except Exception as exc:  # noqa: BLE001  (any import failure is the reason for the skip)
        return out + [row("longcat-op", None, "", f"vLLM does not import: {exc}")]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ref = run_reference({"vocab": spec.compressed_vocab, "hidden": 3072, "eos": spec.pad_id,
                                 "n": spec.max_ngram, "k": spec.heads, "ratios": [78], "max_num_reqs": 8,
                                 "events": script["events"]}, Path(tmp), "cuda")
        except AssertionError as exc:  # the reference process failed: its output's last line says why
            return out + [row("longcat-op", False, "", str(exc).strip().splitlines()[-1][:200])]
    same = sum(np.array_equal(ref[f"s{k}"], w) for k, w in enumerate(want))
    ok = same == len(want) and not ref["standin"]
    return out + [row("longcat-op", ok, f"{same}/{len(want)} steps equal",
                      "vLLM's compiled op" if not ref["standin"] else "the CPU stand-in ran: the compiled op is absent")]


def check_rank_rows(device, workdir: Path) -> list[dict]:
    """Qwen4Exp's (FP8) and LongCat's (BF16) cached tables fetched as both engines' plugins fetch them
    (``RankRows.fetch``: the second of two ranks; on CUDA queued on the stream as a host function, and once
    more replayed from a CUDA graph): the staging's rows equal ``read_rows`` for the ids the rank owns, zeros
    for the others, and the positional ids are ``start + i``."""
    from e2e import Daemon

    from engram_store import TableSet
    from engram_store.integrations.rank_rows import RankRows
    from engram_store.integrations.tables import EngramStoreTables
    from engram_store.tools.synth import write_synthetic

    out = []
    for name, scale, layer in (("qwen3.8-flash-next", 0.0002, 1), ("longcat-flash-lite", 0.0005, 0)):
        spec = get_spec(name, scale)
        tables_dir = workdir / f"{name}-tables"
        write_synthetic(tables_dir, spec, seed=1)
        # the socket in a short temp dir: a Unix socket path holds 107 bytes, and workdir may be deep
        with tempfile.TemporaryDirectory(prefix="es-") as run_dir, Daemon(tables_dir, Path(run_dir), "1MiB") as daemon:
            ts, tables = TableSet.open(tables_dir), EngramStoreTables.connect(daemon.ready["unix"])
            if device.type == "cuda":
                tables.register_cuda()
            rows = spec.rows(layer)
            job = tables.fetch_job(layer, 4096)
            rank = RankRows(name, layer, tables, rows // 2, rows, job, tables.job_tensors(job)[0])
            staging = torch.from_numpy(job.weight)
            rng, good, steps = np.random.default_rng(7), 0, 4

            def staged_ok(ids: np.ndarray, positions) -> bool:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                tables.check_fetches()
                owned = (ids >= rank.start) & (ids < rank.end)
                want = np.zeros((ids.size, spec.row_bytes), np.uint8)
                want[owned] = ts.read_rows(layer, ids[owned])
                return (np.array_equal(staging[: ids.size].numpy(), want)
                        and np.array_equal(positions.cpu().numpy(), rank.start + np.arange(ids.size)))

            for _ in range(steps):
                ids = rng.integers(0, rows, 1000)
                good += staged_ok(ids, rank.fetch(torch.from_numpy(ids).to(device), "the check's 4096 rows"))
            note = "CPU: the job runs at once" if device.type != "cuda" else "host function on the stream"
            if device.type == "cuda":
                static = torch.from_numpy(rng.integers(0, rows, 1000)).to(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    positions = rank.fetch(static, "the check's 4096 rows")
                for _ in range(steps):
                    ids = rng.integers(0, rows, 1000)
                    static.copy_(torch.from_numpy(ids))
                    graph.replay()
                    good += staged_ok(ids, positions)
                steps *= 2
                note += ", then replayed from a CUDA graph"
            job.close()
            ts.close()
        out.append(row(f"{name} rank rows", good == steps, f"{good}/{steps} steps exact", note))
    return out
