"""Ranks that share a batch agree on a step's fetch failures (``integrations.agreement``, and the vLLM
plugin's step settle in ``integrations.vllm.runners``), in two rank processes of a gloo group that
share no failure board (as on two nodes, under Ray or ``external_launcher``).

The failure of rank 1 lands after rank 0 has already entered the step's settle (the race that a check
inside the forward lost: one rank left the forward while the other waited in its collective); both
ranks must raise ``CorruptRows`` naming the layer and page, at once, and neither at a good step. The
survey picks the mode: ranks with private boards agree per step, even when only one of them serves a
cached layer; ranks mapping one board read it; ranks without cached layers do nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO

pytest.importorskip("torch")
WORLD = 2
LAYER, PAGE = 14, 77
LATE = 0.5  # seconds rank 1's failure lands after rank 0 entered the settle
TIMEOUT = 120


def rank_main(rank: int, store: str, cached_ranks: str, fail_rank: int) -> None:
    import gc
    import time
    import weakref

    import torch.distributed as dist

    from engram_store import errors
    from engram_store.integrations import failures
    from engram_store.integrations.vllm import ranks, runners

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    world = weakref.ref(dist.group.WORLD)
    ranks.batch_groups = lambda: ((dist.group.WORLD,), rank)  # vLLM's TP group, here the whole world
    # no KV connector (test_kv_gate covers the gate); importing vLLM to learn that would keep the group alive
    # (a reference of its own) and hide one of ours
    runners.kv_gate.ensure = lambda settle, passthrough: None
    if str(rank) in cached_ranks.split(","):
        ranks.serve_cached(LAYER)
    step_state = {"step": 0}

    class Tables:  # this rank's fetch jobs: step 2 fails on fail_rank, after its peer entered the settle
        def check_fetches(self) -> None:
            if rank == fail_rank and step_state["step"] == 2:
                time.sleep(LATE)
                raise errors.CorruptRows(f"a page of layer {LAYER} failed its checksum", LAYER, (PAGE,))

    tables = Tables()
    results = []
    for step in (1, 2, 3):
        step_state["step"] = step
        runners.begin_step(lambda: tables)
        dist.barrier()
        start = time.monotonic()
        try:
            runners.settle(lambda: tables)
            results.append({"step": step, "raised": None})
        except errors.StorageError as exc:
            results.append({"step": step, "raised": type(exc).__name__, "message": str(exc),
                            "layer": getattr(exc, "layer", None), "pages": list(getattr(exc, "pages", ())),
                            "seconds": time.monotonic() - start})
    results.append({"mode": ranks.known().name, "board": failures.board().path})
    dist.destroy_process_group()
    gc.collect()
    # nothing of the plugin holds the group past its destruction (a kept failure's traceback did, and freeing
    # a gloo group at the interpreter's exit aborts the process)
    results[-1]["group_alive"] = world() is not None
    print(json.dumps(results), flush=True)


def run_ranks(tmp_path, cached_ranks: str, fail_rank: int = -1, shared_board: bool = False) -> list[list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'tests'}:{REPO}")
    env.pop("ENGRAM_STORE_FAILURE_BOARD", None)
    if shared_board:
        from engram_store.integrations import failures

        board = failures.Board.create()
        env["ENGRAM_STORE_FAILURE_BOARD"] = board.name
    code = "import sys, test_rank_agreement as t; t.rank_main(int(sys.argv[1]), *sys.argv[2:4], int(sys.argv[4]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(store), cached_ranks, str(fail_rank)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
            assert outs[-1][-1]["group_alive"] is False, "the plugin keeps the process group alive"
    finally:
        for p in procs:
            p.kill()
        if shared_board:
            board.remove()
    return outs


def test_a_late_failure_on_one_rank_stops_both_at_once_without_a_shared_board(tmp_path):
    outs = run_ranks(tmp_path, cached_ranks="0,1", fail_rank=1)
    for rank, out in enumerate(outs):
        steps, meta = out[:3], out[3]
        assert meta["mode"] == "AGREE"
        assert steps[0]["raised"] is None, steps
        failed = steps[1]
        assert failed["raised"] == "CorruptRows" and failed["layer"] == LAYER and failed["pages"] == [PAGE], failed
        assert failed["seconds"] < LATE + 1.0, failed  # waited for its peer, never for a timeout
        assert steps[2]["raised"] == "CorruptRows", "a failure is sticky: the next step raises too"
    assert "rank 1:" in outs[0][1]["message"], outs[0][1]
    assert outs[0][3]["board"] != outs[1][3]["board"]


def test_a_rank_without_a_cached_layer_still_agrees(tmp_path):
    outs = run_ranks(tmp_path, cached_ranks="1", fail_rank=1)
    assert [out[3]["mode"] for out in outs] == ["AGREE", "AGREE"]
    assert [out[1]["raised"] for out in outs] == ["CorruptRows", "CorruptRows"]


def test_the_survey_picks_the_board_or_nothing(tmp_path):
    outs = run_ranks(tmp_path / "board", cached_ranks="0,1", shared_board=True)
    assert [out[3]["mode"] for out in outs] == ["BOARD", "BOARD"]
    assert all(step["raised"] is None for out in outs for step in out[:3])
    outs = run_ranks(tmp_path / "none", cached_ranks="")
    assert [out[3]["mode"] for out in outs] == ["NONE", "NONE"]
