"""vLLM 0.33's own Engram code on CPU with a cached layer (a mixed daemon: layer 1 resident, 14 cached),
through the engram-store plugin, with the shims of ``tests/engines/vllm_engine.py`` (which this module imports):
scenarios run by ``tests/test_vllm_plugin.py``, each in a fresh process.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S \
        python tests/engines/vllm_engine_cached.py SCENARIO TABLES [PID | PAGE]

Steps of new ids through vLLM's lookup and forward, TP=1 and TP=2, fetched by the layer's job (cached);
steps while the daemon is stopped, killed and restarted (cached-outage); a step reading a page flipped
on disk (cached-corrupt). ``tests/engines/vllm_engine_paths.py`` imports the step helpers. A scenario prints
``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from engine_helpers import model_config, ok
from vllm_engine import MAX_TOKENS, build, init_distributed, load_plugin, plugin_layer, shim, token_batch


def host_visible_check() -> None:
    """What the patched runners run where a step's tokens reach the host: raise a fetch failure."""
    from engram_store.integrations.vllm import patches, runners

    runners.check(patches.tables)


def check_step(emb, ts, spec, layer: int, ids: np.ndarray, tp_size: int, values: bool = True) -> None:
    """One step of ``layer`` through vLLM's lookup, packed and (``values``) bf16 and, at TP=1, forward: exact."""
    from gpu_client.dequant import dequantize

    h0, heads = emb.head_start, emb.part_n_hash_cols
    mine = ids[:, h0:h0 + heads]
    want = ts.read_rows(layer, np.clip(mine, 0, None).reshape(-1)).reshape(mine.shape + (spec.row_bytes,))
    want[mine < 0] = 0  # vLLM's dead ids read zeros
    packed = torch.full((ids.shape[0], heads, spec.row_bytes), 0xAB, dtype=torch.uint8)
    emb.lookup(torch.from_numpy(ids), packed)
    host_visible_check()
    np.testing.assert_array_equal(packed.numpy(), want)
    if not values:
        return
    bf16 = torch.empty((ids.shape[0], heads, spec.row_format.dim), dtype=torch.bfloat16)
    emb.lookup(torch.from_numpy(ids), bf16)
    reference = dequantize(torch.from_numpy(want), spec).view(bf16.shape)
    assert torch.equal(bf16, reference), "bf16 lookup differs from gpu_client.dequantize"
    if tp_size == 1:
        assert torch.equal(emb.forward(torch.from_numpy(ids)), reference), "forward differs from dequantize"


def step_batch(spec, step: int) -> dict:
    """A step of 1..MAX_TOKENS/2 tokens of new ids, some positions dead (-1), for every layer."""
    tokens = 1 + (step * 37) % (MAX_TOKENS // 2)
    batch = token_batch(spec, seed=1000 + step, tokens=max(3, tokens))
    for ids in batch.values():
        ids[: step % 3] = -1
    return {layer: ids[:tokens] for layer, ids in batch.items()}


def scenario_cached(tables_dir: str) -> None:
    """A mixed daemon (layer 1 resident, 14 cached behind a small cache): both layers through vLLM's
    lookup and forward, TP=1 and both ranks of TP=2, 20 steps of new ids each, every other step's
    fetch run from a native thread that never held the GIL."""
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.vllm import patches

    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    tables = patches.tables()
    assert tables.placement == {1: "resident", 14: "cached"}, tables.placement
    init_distributed()
    for tp_size, ranks in ((1, (0,)), (2, (0, 1))):
        for tp_rank in ranks:
            E = shim(tp_size, tp_rank)
            layout = E.EngramLayout(model_config(spec))
            embs = {layer: build(E, layout, index) for index, layer in enumerate(spec.layers)}
            resident, cached = embs[1], embs[14]
            assert tables.view.array.ctypes.data <= resident.weight.data_ptr() < tables.view.array.ctypes.data + \
                tables.view.size, "the resident layer is not read in place"
            job = cached._engram_store.job
            assert tables.owns(cached.weight.data_ptr()) and cached.weight.data_ptr() == job.weight.ctypes.data
            for step in range(20):
                job.run = job.native.run_in_native_thread if step % 2 else job.native.run
                for layer, ids in step_batch(spec, step).items():  # values (bf16, forward) every 5th step
                    check_step(embs[layer], ts, spec, layer, ids, tp_size, values=step % 5 == 0)
            stats = job.stats()
            assert stats["daemon_steps"] >= 20 and stats["direct_steps"] == 0, stats
            ok(f"TP={tp_size} rank {tp_rank}: layer 1 in the arena, layer 14 through its fetch job ({stats['rows']} "
               f"rows in {stats['steps']} runs); 20 steps of lookup (packed, bf16)"
               f"{' and forward' if tp_size == 1 else ''} equal TableSet.read_rows / dequantize")


def scenario_cached_outage(tables_dir: str, pid: str) -> None:
    """Steps of the cached layer while the daemon is stopped (SIGSTOP), killed, and after the test
    restarts it: every step exact, none waiting longer than the deadline plus its reads."""
    import signal
    import time

    E, ts, emb = plugin_layer(tables_dir, 1)
    spec = ts.spec
    job = emb._engram_store.job

    def steps(first: int, what: str) -> None:
        worst = 0.0
        for step in range(first, first + 5):
            t0 = time.monotonic()
            check_step(emb, ts, spec, 14, step_batch(spec, step)[14], 1, values=False)
            worst = max(worst, time.monotonic() - t0)
        ok(f"5 steps exact {what} (slowest {worst:.2f} s, deadline {job.deadline} s)")

    steps(0, "with the daemon")
    os.kill(int(pid), signal.SIGSTOP)
    try:
        steps(10, "with the daemon stopped")
    finally:
        os.kill(int(pid), signal.SIGCONT)
    print("KILL", flush=True)
    sys.stdin.readline()  # the test killed the daemon
    steps(20, "with the daemon killed")
    assert not job.connected and job.stats()["direct_steps"] >= 10, job.stats()
    print("RESTART", flush=True)
    sys.stdin.readline()  # the test restarted it
    deadline = time.monotonic() + 30
    while not job.connected:
        assert time.monotonic() < deadline, job.stats()
        time.sleep(0.05)
    before = job.stats()
    steps(30, "back on the restarted daemon")
    after = job.stats()
    # back on the daemon (a step may still be hedged to a direct read on a loaded host)
    assert after["daemon_steps"] - before["daemon_steps"] >= 3, (before, after)


def step_reading_flipped_page(tables_dir: str, page: str, token: int):
    """The plugin loaded and one Engram module built on the cached layer 14; one step run whose head 0 of
    ``token`` asks for a row of ``page`` (flipped on disk by the test). The chain runs; its failure is for the
    step's host-visible point. Returns the module, the table spec and the step's output."""
    from engram_store.format.layout import PageLayout

    E, ts, emb = plugin_layer(tables_dir, 1)
    spec = ts.spec
    ids = step_batch(spec, 7)[14]
    ids[token, 0] = int(page) * PageLayout(spec.rows(14), spec.row_bytes).rows_per_page
    out = torch.empty((ids.shape[0], 24, spec.row_bytes), dtype=torch.uint8)
    emb.lookup(torch.from_numpy(ids), out)
    return emb, spec, out


def scenario_cached_corrupt(tables_dir: str, page: str) -> None:
    """A step asking for a row of a page flipped on disk (never read before) raises CorruptRows from
    vLLM's lookup, naming the layer and the page; the next step is served."""
    from engram_store.errors import CorruptRows
    from engram_store.format.tableset import TableSet

    emb, spec, out = step_reading_flipped_page(tables_dir, page, token=1)
    assert not out[1, 0].any(), "a row of the flipped page reached the output"
    for attempt in ("the step's", "every later"):  # sticky: the engine stops, no later check lets tokens out
        try:
            host_visible_check()
        except CorruptRows as exc:
            assert exc.layer == 14 and int(page) in exc.pages and f"pages {page}" in str(exc), str(exc)
            ok(f"CorruptRows at {attempt} host-visible point: {str(exc)[:160]}")
        else:
            raise AssertionError(f"{attempt} check after a step reading a flipped page did not fail")
    ts = TableSet.open(tables_dir)
    ids = step_batch(spec, 8)[14]
    out = torch.empty((ids.shape[0], 24, spec.row_bytes), dtype=torch.uint8)
    emb.lookup(torch.from_numpy(ids), out)
    want = ts.read_rows(14, np.clip(ids, 0, None).reshape(-1)).reshape(out.shape)
    want[ids < 0] = 0
    np.testing.assert_array_equal(out.numpy(), want)
    ok("the next step's rows are exact (the board keeps the failure)")


SCENARIOS = {"cached": scenario_cached, "cached-outage": scenario_cached_outage,
             "cached-corrupt": scenario_cached_corrupt}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
