"""SGLang 0.5.23's own Engram code on CPU with a cached layer (a mixed daemon: layer 1 resident, 14
cached), through the engram-store plugin, with the shims of ``tests/engines/sglang_engine.py`` (which this
module imports): scenarios run by ``tests/test_sglang_plugin.py``, each in a fresh process of
``.venv-sglang``.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \
        .venv-sglang/bin/python tests/engines/sglang_engine_cached.py SCENARIO TABLES [ADDRESS]

The rows issued a layer ahead by the hasher hook and taken by SGLang's EngramEmbedding and Engram
forward (cached), the order a chain issues its work in (chains), each TP rank's hash columns (ranks);
``mixed`` runs the three in one process. A scenario prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch
from engine_helpers import model_config, ok
from sglang_engine import build, load_plugin, ranks, reference, shim, token_ids


def hashed(spec, seed: int, tokens: int) -> torch.Tensor:
    """A step's hash ids as SGLang's EngramHasher returns them: ``[T, n_engram_layers, heads]``."""
    batch = token_ids(spec, seed=seed, tokens=tokens)
    return torch.from_numpy(np.stack([batch[layer] for layer in spec.layers], axis=1))


def rows_of(ts, spec, layer: int, indices: torch.Tensor) -> torch.Tensor:
    """bf16 ``[*indices.shape, dim]``: TableSet.read_rows of ``indices`` dequantized (the reference)."""
    return reference(ts.read_rows(layer, indices.numpy().reshape(-1)), spec).view(*indices.shape,
                                                                                   spec.row_format.dim)


def cached_engram(E, layout, tp_size: int = 1, tp_rank: int = 0):
    """SGLang's Engram module of layer 14 (its embedding built through the plugin), a random wkv."""
    with ranks(tp_size, tp_rank):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            engram = E.Engram(types.SimpleNamespace(hidden_size=64, hc_mult=2, rms_norm_eps=1e-6), 14, layout)
        finally:
            torch.set_default_dtype(default)
    torch.nn.init.normal_(engram.wkv.weight, std=0.02, generator=torch.Generator().manual_seed(tp_rank))
    return engram


def scenario_cached(tables_dir: str) -> None:
    """A mixed daemon (layer 1 resident, 14 cached behind a small cache): every layer's rows issued ahead
    by the hasher hook and taken at the layer by SGLang's EngramEmbedding.forward and Engram.forward,
    20 steps of new ids; inline (ids not the ones hashed ahead) too; scheduler staging turned off."""
    from sglang.srt.layers import engram_staging

    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import hooks, prefetch

    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    tables = hooks.tables()
    assert tables.placement == {1: "resident", 14: "cached"}, tables.placement
    layout = E.EngramLayout.from_config(model_config(spec))
    embeds = {1: build(E, layout, 0)}
    engram = cached_engram(E, layout)
    embeds[14] = engram.embed
    cached = embeds[14]._engram_store_cached
    assert cached is not None and embeds[1]._engram_store_cached is None and not cached.split
    assert embeds[14].weight.data_ptr() == cached.stagings[0].job.weight.ctypes.data, "layer 14 is not the staging"
    for step in range(20):
        hash_ids = hashed(spec, 2000 + step, 2 + (step * 7) % 8)  # the interpreter: a program a row
        prefetch.after_hasher(hash_ids, None, None, None)  # what the hook does after SGLang's hasher
        for index, layer in enumerate(spec.layers):
            indices = hash_ids[:, index]
            want = rows_of(ts, spec, layer, indices)
            ahead = embeds[layer]._engram_store_ahead
            if layer == 14 and step % 4 == 0:  # through SGLang's Engram module: wkv and the gate
                x = torch.randn(indices.shape[0], 2, 64, dtype=torch.bfloat16)
                got = engram.forward(x, indices, None, input_ids=torch.zeros(indices.shape[0], dtype=torch.long))
                kv, _ = engram.wkv(want.flatten(-2))
                assert torch.equal(got, E.engram_gate(x, kv, engram.q_weight, engram.k_weight, engram.eps,
                                                      engram.clamp_value)), "Engram.forward differs"
                continue
            got = embeds[layer](indices)
            assert ahead is not None and got is ahead.out, "the rows issued ahead were not used"
            assert torch.equal(got, want), f"layer {layer} step {step} differs from dequantize"
            if step % 10 == 0:  # ids that were not hashed ahead: gathered inline, the same rows
                assert torch.equal(embeds[layer](indices.clone()), want)
    stats = [job.stats() for job in cached.jobs]
    assert sum(s["daemon_steps"] for s in stats) >= 20 and not any(s["direct_steps"] for s in stats), stats
    ok(f"20 steps, layer 1 gathered ahead from the arena, layer 14 through its fetch jobs ({stats[0]['rows']} rows "
       f"in {stats[0]['steps']} runs), EngramEmbedding.forward and Engram.forward equal TableSet.read_rows / "
       "dequantize, ahead and inline")
    model = torch.nn.ModuleList(embeds.values())
    assert engram_staging.EngramRowStager.from_model(model, None, torch.device("cpu")) is None
    ok("scheduler staging is off with a cached layer")
    # which steps get chains at hash time, by SGLang's own predicates
    import sglang.srt.layers.cp.utils as cp
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
        enable_breakable_cuda_graph)

    def batch(mode, staged=None):
        return types.SimpleNamespace(forward_mode=mode, engram_staged_rows=staged, input_ids=torch.zeros(64))

    ahead = prefetch._ahead_of_layers
    assert ahead(batch(ForwardMode.DECODE)) and ahead(batch(ForwardMode.EXTEND)) and ahead(batch(ForwardMode.IDLE))
    assert not ahead(batch(ForwardMode.EXTEND, staged=[]))
    with enable_breakable_cuda_graph():
        assert not ahead(batch(ForwardMode.EXTEND)) and ahead(batch(ForwardMode.DECODE))
    strategy, cp.get_cp_strategy = cp.get_cp_strategy, lambda: types.SimpleNamespace(can_apply=lambda n, fb: True)
    try:
        assert not ahead(batch(ForwardMode.EXTEND)) and ahead(batch(ForwardMode.DECODE))
    finally:
        cp.get_cp_strategy = strategy
    ok("no chains at hash time for staged, breakable-graph and context-parallel extends; decode steps get them")


def scenario_chains(tables_dir: str) -> None:
    """The order a cached layer's chain issues its work in, run as CUDA streams may run it
    (tests/engines/sglang_lanes.py: each lane in order, lanes interleaved by a policy, only the chain's markers
    between them), with stagings of 4 tokens: an inline chain issued while the chain hashed ahead is still queued,
    both exact; a prefill of 3 pieces and a remainder, exact, its pieces double-buffered. Each with its wrong order
    as a control that fails."""
    from sglang_lanes import POLICIES, SCHEDULES, Streams

    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import chain, lanes, prefetch

    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    chain.PIECE_TOKENS = 4  # read when the layer is built: stagings of 4 tokens x 24 heads
    layout = E.EngramLayout.from_config(model_config(spec))
    emb = build(E, layout, 1)  # layer 14, cached; the only layer in the prefetch (index 1 of the hash ids)
    cached = emb._engram_store_cached
    assert cached.piece_tokens == 4 and cached.stagings[0].job is not cached.stagings[1].job
    engram = E

    def streams(policy: str) -> Streams:
        st = Streams(policy, cached.jobs)
        prefetch.lanes_for = lambda device: st.lanes
        return st

    # 1. inline while the chain hashed ahead is still queued, other ids: both exact under every policy
    for policy in POLICIES:
        st = streams(policy)
        a, b = hashed(spec, 4000, 6), hashed(spec, 4001, 7)  # 2 pieces each
        prefetch.after_hasher(a, None, None, None)
        ahead = emb._engram_store_ahead.out
        got = emb(b[:, 1])  # not the ids hashed ahead: the chain runs here
        assert emb._engram_store_ahead is None and st.log == [], "work ran when issued"
        st.drain()
        assert torch.equal(got, rows_of(ts, spec, 14, b[:, 1])), f"{policy}: inline rows differ"
        assert torch.equal(ahead, rows_of(ts, spec, 14, a[:, 1])), f"{policy}: rows issued ahead differ"
    ok(f"inline chain issued while the chain hashed ahead is queued: both exact under {', '.join(POLICIES)}")
    wrong = []  # control: the inline chain on the main lane alone, unordered with the queued one
    for policy in SCHEDULES:
        st = streams(policy)
        a, b = hashed(spec, 4000, 6), hashed(spec, 4001, 7)
        prefetch.after_hasher(a, None, None, None)
        ahead = emb._engram_store_ahead.out
        got = emb.new_rows(b[:, 1])
        chain.issue(engram, cached, b[:, 1], got, lanes.Lanes(st.main, st.main, st.main))
        st.drain()
        if not (torch.equal(got, rows_of(ts, spec, 14, b[:, 1])) and torch.equal(ahead, rows_of(ts, spec, 14, a[:, 1]))):
            wrong.append(policy)
            break  # one schedule giving wrong rows shows the check sees the order
    assert wrong, "an inline chain on the main stream alone gave exact rows under every policy: the check is blind"
    ok(f"control: the inline chain on the main stream alone, unordered, gives wrong rows under schedule {wrong[0]} "
       f"(the {SCHEDULES.index(wrong[0]) + 1}th of {len(SCHEDULES)} tried in order)")

    # 2. a prefill of 14 tokens: pieces of 4, 4, 4 and 2, alternating stagings, ahead and inline
    prefill = hashed(spec, 4100, 14)
    want = rows_of(ts, spec, 14, prefill[:, 1])
    for policy in POLICIES:
        for how in ("ahead", "inline"):
            st = streams(policy)
            prefetch.after_hasher(prefill, None, None, None)
            got = emb(prefill[:, 1] if how == "ahead" else prefill[:, 1].clone())
            st.drain()
            assert torch.equal(got, want), f"{policy} {how}: the prefill's rows differ"
            fetches = [e for e in st.log if e[0] == "fetch"][-4:]
            assert [(job, rows) for _, job, rows in fetches] == [(0, 96), (1, 96), (0, 96), (1, 48)], fetches
            fetch_at, gather_at = st.order("fetch")[-4:], st.order("gather")[-4:]
            assert all(fetch_at[k + 2] > gather_at[k] for k in range(2)), f"{policy}: a staging refilled before its gather"
            if policy == "fetch-first":
                assert all(fetch_at[k + 1] < gather_at[k] for k in range(3)), st.log  # piece k+1 fetched during k's gather
    prefetch.lanes_for = lanes.for_device
    emb._engram_store_ahead = None
    assert torch.equal(emb(prefill[:, 1].clone()), want)  # the CPU's own lanes
    ok("prefill of 3 pieces and a remainder: exact under every policy, ahead and inline, and on the CPU lanes; "
       "piece k+1 fetched into the other staging while piece k is gathered, a staging refilled only after its gather")
    single = chain.Cached((cached.stagings[0], cached.stagings[0]), cached.heads, cached.columns)
    st = streams("fetch-first")
    got = emb.new_rows(prefill[:, 1])
    chain.issue(engram, single, prefill[:, 1], got, st.lanes)
    st.drain()
    assert not torch.equal(got, want), "one staging for every piece gave exact rows: the check is blind"
    ok("control: one staging for every piece, fetched ahead of its gathers, gives wrong rows")


def scenario_ranks(tables_dir: str, address: str) -> None:
    """Per-rank hash columns of a cached layer at TP=2 and TP=4 (ranks built in one process through SGLang's
    get_parallel().override; SGLang's all-reduce recorded): each rank's rows are exact in its columns and zero
    elsewhere, and their sum is every row. The daemon's rows per step, all ranks together, against every rank
    fetching every head (attention DP: ranks with tokens of their own)."""
    from engram_store.client.client import EngramClient
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import hooks, prefetch

    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    tables = hooks.tables()
    layout = E.EngramLayout.from_config(model_config(spec))
    reduced: list = []
    E.tensor_model_parallel_all_reduce = lambda values: reduced.append(values.clone()) or values
    steps = [hashed(spec, 5000 + s, 3 + s) for s in range(3)]
    tokens = sum(h.shape[0] for h in steps)
    heads = len(tables.head_sizes(14))
    for tp in (2, 4):
        measured = {}
        for split in (True, False):
            with EngramClient.connect(address) as client:
                before = client.stats()["store_rows"]
            sums = [torch.zeros(*h[:, 1].shape, spec.row_format.dim) for h in steps]
            job_rows = 0
            for rank in range(tp):
                prefetch._embeddings.clear()
                emb = build(E, layout, 1, tp, rank, attn_dp_size=1 if split else tp)
                cached = emb._engram_store_cached
                share = heads // tp
                first, end = (rank * share, (rank + 1) * share) if split else (0, cached.heads)
                assert cached.columns == (first, end) and cached.split == split, cached.columns
                for step, hash_ids in enumerate(steps):
                    indices = hash_ids[:, 1]
                    if step != 1:  # step 1 inline: no chain at hash time, as for a context-parallel prefill
                        prefetch.after_hasher(hash_ids, None, None, None)
                    reduced.clear()
                    got = emb(indices if step != 1 else indices.clone())
                    want = rows_of(ts, spec, 14, indices)
                    if not split:
                        assert not reduced and torch.equal(got, want), f"TP={tp} rank {rank}: all heads differ"
                        continue
                    assert len(reduced) == 1 and got is not None, "SGLang's all-reduce was not called once"
                    mine = reduced[0]
                    assert torch.equal(mine[:, first:end], want[:, first:end]), f"TP={tp} rank {rank} columns differ"
                    assert not mine[:, :first].any() and not mine[:, end:].any(), f"TP={tp} rank {rank}: not zeros"
                    sums[step] += mine.float()
                job_rows += sum(job.stats()["rows"] for job in cached.jobs)
                for job in cached.jobs:
                    job.close()
                    tables._jobs.remove(job)
            if split:
                for step, hash_ids in enumerate(steps):
                    assert torch.equal(sums[step].to(torch.bfloat16), rows_of(ts, spec, 14, hash_ids[:, 1])), step
            with EngramClient.connect(address) as client:
                daemon_rows = client.stats()["store_rows"] - before
            assert job_rows == tokens * heads * (1 if split else tp), (job_rows, tokens)
            measured[split] = (job_rows, daemon_rows)
        print(f"MEASURE TP={tp}: {len(steps)} steps of {tokens} tokens: rows the ranks asked the daemon for: "
              f"per-rank heads {measured[True][0]}, every rank every head {measured[False][0]}; daemon store_rows "
              f"{measured[True][1]:.0f} and {measured[False][1]:.0f}", flush=True)
        ok(f"TP={tp}: each rank's rows exact in its hash columns and zero elsewhere, their sum every row; the ranks "
           f"asked the daemon for {measured[True][0]} rows, {tp}x fewer than with every head on every rank")


def scenario_mixed(tables_dir: str, address: str) -> None:
    """What a mixed daemon (layer 1 resident, 14 cached) serves, in one process: the layer-ahead steps, per-rank
    hash columns, then the chains' order (which leaves stagings of 4 tokens)."""
    from engram_store.integrations.sglang import prefetch

    scenario_cached(tables_dir)
    prefetch._embeddings.clear()
    scenario_ranks(tables_dir, address)
    prefetch._embeddings.clear()
    scenario_chains(tables_dir)


SCENARIOS = {"mixed": scenario_mixed, "cached": scenario_cached, "chains": scenario_chains, "ranks": scenario_ranks}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
