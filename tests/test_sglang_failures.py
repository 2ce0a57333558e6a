"""The SGLang plugin's step check across TP ranks (``engram_store.integrations.sglang.failures.check``):
two rank processes in a gloo group (a FileStore in a temp dir), each with its own fetch job against a
real daemon whose cached layer has a page flipped on disk. Only rank 1 reads the flipped page (as with
per-rank hash columns); both ranks must raise at the step's check, rank 0 naming rank 1, the layer and
the page, and neither at a good step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess
from support.storage_helpers import flip

from engram_store.models.spec import get_spec
from engram_store.storage.resident import resident_layout
from engram_store.tools.synth import write_synthetic

torch = pytest.importorskip("torch")

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
DRAM = resident_layout([(FIRST, SPEC.rows(FIRST))], SPEC.row_format).size + (2 << 20)
WORLD = 2
BAD_PAGE = 33
TIMEOUT = 180


def rank_main(rank: int, store: str, address: str, bad_row: int) -> None:
    """One TP rank: a good step, then a step whose rows on rank 1 include ``bad_row``; prints what each
    step's check did, as JSON. With ``ENGRAM_STORE_FAILURE_BOARD`` set (the ranks of one server), the
    jobs write failures on that board; a barrier after each step stands for the model's collectives,
    which in an engine bring every rank's rows to the streaming rank after its fetch. Without a barrier
    before each step, rank 1 could run step 2 before rank 0 checked step 1, and rank 0 would then stop
    at step 1 (the board holds failures, not steps: stopping a step early is the safe side)."""
    import torch.distributed as dist

    from engram_store import errors
    from engram_store.integrations import failures as board
    from engram_store.integrations.sglang import failures
    from engram_store.integrations.tables import EngramStoreTables

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    tables = EngramStoreTables.connect(address)
    shared = bool(os.environ.get(board.ENV))
    if shared:
        tables.failure_board = board.board()
    job = tables.fetch_job(CACHED, 64)
    results = []
    for step in (1, 2):
        dist.barrier()  # every rank starts a step together, as the scheduler's broadcast of it makes them
        ids = np.random.default_rng(100 * step + rank).integers(0, SPEC.rows(CACHED), 64)
        ids = ids[ids // 15 != BAD_PAGE]  # 15 rows a page: only the row put in below is on the flipped page
        if step == 2 and rank == 1:
            ids[3] = bad_row
        job.ids[: ids.size] = ids
        job.run(ids.size)
        if shared:
            dist.barrier()
        try:
            failures.check(tables, [dist.group.WORLD], rank)
            results.append({"step": step, "raised": None})
        except errors.CorruptRows as exc:
            results.append({"step": step, "raised": "CorruptRows", "message": str(exc), "layer": exc.layer,
                            "pages": list(exc.pages)})
    job.close()
    dist.barrier()  # both ranks done with the step's collectives before either tears its group down
    dist.destroy_process_group()
    print(json.dumps(results), flush=True)
    # Leave without the interpreter's teardown: torch's gloo threads abort it now and then (libstdc++'s
    # "terminate called without an active exception", SIGABRT, about 1 run in 10 here, with or without
    # engram-store's fetch job), which says nothing about how a step's failure reaches the ranks.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("shared_board", [False, True], ids=["agreed-per-step", "failure-board"])
def test_a_failure_on_one_rank_stops_every_rank_at_the_steps_check(tmp_path, shared_board):
    from engram_store.integrations import failures as board

    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=31)
    rows_per_page = 4096 // SPEC.row_bytes
    assert rows_per_page == 15
    (tmp_path / "d").mkdir()
    with DaemonProcess(directory, tmp_path / "d", dram_bytes=str(DRAM),
                       extra=["--placement", f"{FIRST}=resident,{CACHED}=cached"]) as d:
        flip(directory, CACHED, BAD_PAGE)
        # a 30 s fetch deadline: what is checked is how a failure reaches every rank (a loaded host once took a
        # healthy first step past the default 2 s, and rank 0 failed on its own deadline instead)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]),
                   ENGRAM_STORE_FETCH_DEADLINE_SECONDS="30")
        env.pop(board.ENV, None)
        made = board.Board.create() if shared_board else None
        if made is not None:
            env[board.ENV] = made.name
        code = "import sys, test_sglang_failures as t; t.rank_main(int(sys.argv[1]), *sys.argv[2:4], int(sys.argv[4]))"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(tmp_path / "store"), d.unix,
                                   str(BAD_PAGE * rows_per_page + 4)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in range(WORLD)]
        try:
            outs = [p.communicate(timeout=TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if made is not None:
                made.remove()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"stdout: {out[-2000:]}\nstderr: {err[-4000:]}"
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for rank, results in enumerate(ranks):
        assert results[0] == {"step": 1, "raised": None}, results
        second = results[1]
        assert second["raised"] == "CorruptRows" and second["layer"] == CACHED and second["pages"] == [BAD_PAGE], second
        assert f"layer {CACHED}: 1 page(s)" in second["message"], second
    if shared_board:  # rank 1's run function wrote it; rank 0 read it, no collective
        assert ranks[0][1]["message"].startswith("engram-store: a fetch job of process "), ranks[0]
    else:
        assert ranks[0][1]["message"].startswith("TP rank 1: engram-store fetch job:"), ranks[0]
        assert "this rank's rows were exact" in ranks[0][1]["message"]
    assert not ranks[1][1]["message"].startswith(("TP rank", "engram-store: a fetch job of process")), ranks[1]
