"""SGLang 0.5.23's own Engram code on CPU, through the engram-store plugin: scenarios run by
``tests/test_sglang_plugin.py``, each in a fresh process of ``.venv-sglang`` (SGLang
installed ``--no-deps``; the shims below and the plugin's hooks must not leak).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \
        .venv-sglang/bin/python tests/sglang_engine.py SCENARIO TABLES

Triton's interpreter runs SGLang's gather kernel on CPU tensors. CPU shims, nothing else:

* ``torchvision::nms`` / ``torchvision::qnms`` op schemas: PyPI has only CUDA builds of
  torchvision, whose C ops do not load beside a CPU torch, and torchvision's Python
  package registers fake kernels for these two ops at import (SGLang imports
  torchvision through its vision configs). Nothing here calls them.
* ``torch.cuda.current_device`` (read by ``EngramEmbedding`` for the host table) and
  ``engram._sorted_host_reads`` (asks the CUDA driver whether the GPU has ATS): 0 and
  True, a GPU without ATS, the case where SGLang enables scheduler staging.
* ``torch.cuda.Stream`` while ``EngramRowStager`` is built (its copy stream), and
  ``torch.empty(pin_memory=True)`` in its gather (pinned memory needs a GPU): plain.

Ranks come from SGLang's own ``get_parallel().override``. Everything else is SGLang's
code and the plugin's. A scenario prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine_helpers import evict, model_config, ok, resident_pages, snapshot  # noqa: E402

torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

ENGRAM = "sglang.srt.layers.engram"
WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"


def load_plugin() -> set:
    """Import what the plugin hooks, then run SGLang's own plugin loader; returns what changed."""
    import sglang.srt.layers.engram  # noqa: F401
    import sglang.srt.layers.engram_staging  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.model_loader.loader  # noqa: F401
    from sglang.srt.plugins import load_plugins

    before = snapshot("sglang")
    load_plugins()
    after = snapshot("sglang")
    return {key for key, value in after.items() if key in before and before[key] != value}


def shim():
    import importlib

    E = importlib.import_module(ENGRAM)
    torch.cuda.current_device = lambda: 0
    E._sorted_host_reads = lambda device: True
    E.engram_gather = cpu_engram_gather
    return E


def cpu_engram_gather(w_ptr, s_ptr, ids, out, dim, block, row_lo=0, row_hi=2**62, sort_ids=False):
    """SGLang's engram_gather without its CUDA-ids assertion: its kernel, one program per row, under
    Triton's interpreter (sort_ids only reorders the reads)."""
    import sglang.kernels.ops.embeddings.engram_gather as G

    if ids.numel():
        G._engram_gather_kernel[(ids.numel(),)](w_ptr, s_ptr, ids, ids, out, row_lo, row_hi, DIM=dim, BLK=block,
                                                E8M0_ZERO=G._E8M0_ZERO, HAS_DST=False)
    return out


def build(E, layout, index: int, tp_size: int = 1, tp_rank: int = 0, attn_dp_size: int = 1):
    """One Engram layer's EngramEmbedding as SGLang's Engram module builds it, on TP rank ``tp_rank``
    (``attn_dp_size`` > 1: attention DP, the ranks holding tokens of their own)."""
    with ranks(tp_size, tp_rank, attn_dp_size):
        return E.EngramEmbedding(layout.num_embeddings[index], layout.head_dim, layout.layer_ids[index],
                                 column_bounds=layout.column_bounds(index))


def ranks(tp_size: int = 1, tp_rank: int = 0, attn_dp_size: int = 1):
    """SGLang's parallel context of TP rank ``tp_rank`` of ``tp_size`` in this process (no process group)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_size=tp_size, tp_rank=tp_rank, tp_group=None, attn_dp_size=attn_dp_size,
                                   attn_cp_size=1, pp_size=1, pp_rank=0)


def token_ids(spec, seed: int, tokens: int = 48):
    from engram_store.hashing import row_ids_numpy

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, spec.compressed_vocab, tokens)
    cu = np.array([0, tokens // 3, tokens])  # two requests
    return {layer: row_ids_numpy(spec, layer, toks, cu) for layer in spec.layers}


def rows_at(ptr: int, ids: np.ndarray, stride: int) -> np.ndarray:
    """Rows ``ids`` of a ``stride``-byte-row table at address ``ptr``, as SGLang's kernel addresses them."""
    import ctypes

    return np.stack([np.frombuffer((ctypes.c_uint8 * stride).from_address(ptr + int(i) * stride), np.uint8)
                     for i in ids.reshape(-1)])


def reference(rows: np.ndarray, spec) -> torch.Tensor:
    """bf16 ``[N, dim]`` of 264-byte rows ``[N, row_bytes]`` by gpu_client.dequantize (the reference)."""
    from gpu_client.dequant import dequantize

    return dequantize(torch.from_numpy(rows).unsqueeze(1), spec)


def gather_kernel(E, w_ptr: int, s_ptr: int, ids: np.ndarray, dim: int, row_lo: int = 0, row_hi: int = 2**62):
    """SGLang's ``_engram_gather_kernel`` (what ``engram_gather`` launches; the wrapper asserts
    CUDA ids) under Triton's interpreter: bf16 rows of ``ids`` read at the two addresses."""
    import sglang.kernels.ops.embeddings.engram_gather as G

    idx = torch.from_numpy(ids.reshape(-1).astype(np.int64))
    out = torch.full((idx.numel(), dim), 7.0, dtype=torch.bfloat16)
    G._engram_gather_kernel[(idx.numel(),)](w_ptr, s_ptr, idx, idx, out, row_lo, row_hi, DIM=dim,
                                            BLK=int(E.FP8_BLOCK_SIZE), E8M0_ZERO=G._E8M0_ZERO, HAS_DST=False)
    return out


# --- scenarios -----------------------------------------------------------------------------
def scenario_lookup(tables_dir: str) -> None:
    """Discovery, exact hooks, the arena as the shared host table (TP=1 and TP=2), SGLang's kernel
    at _table_ptrs(), its scheduler staging gather, _load_rows a no-op."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import hooks

    changed = load_plugin()
    engram_cls = f"{ENGRAM}.EngramEmbedding"
    expected = {(f"{ENGRAM}.EngramLayout", "from_config"), (engram_cls, "__init__"), (engram_cls, "_init_host_table"),
                (engram_cls, "_load_rows"), (engram_cls, "forward"), (f"{ENGRAM}.EngramHasher", "forward"),
                ("sglang.srt.layers.engram_staging.EngramRowStager", "from_model"),
                ("sglang.srt.managers.scheduler.Scheduler", "process_batch_result"),
                ("sglang.srt.managers.scheduler.Scheduler", "get_new_batch_prefill")}
    for name in ("safetensors_weights_iterator", "buffered_multi_thread_safetensors_weights_iterator",
                 "fastsafetensors_weights_iterator", "instanttensor_weights_iterator", "_prefetch_all_checkpoints",
                 "initialize_dummy_weights", "initialize_capture_safe_weights"):
        expected.add((WEIGHT_UTILS, name))
        expected.add(("sglang.srt.model_loader.loader", name))  # its `from weight_utils import ...` copies
    changed = {key for key in changed if not key[0].startswith("sglang.srt.plugins")}
    assert changed == expected, f"hooked {sorted(changed - expected)}, not hooked {sorted(expected - changed)}"
    assert set(hooks.targets()) <= HookRegistry._patched, sorted(set(hooks.targets()) - HookRegistry._patched)
    assert hooks.installed_address() == os.environ["ENGRAM_STORE_ADDR"]
    ok(f"SGLang's load_plugins found the entry point and HookRegistry hooked exactly {len(expected)} names")

    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    tables = hooks.tables()
    base = tables.view.array.ctypes.data
    layout = E.EngramLayout.from_config(model_config(spec))
    batches = token_ids(spec, seed=1)
    dim, sdim = spec.row_format.dim, spec.row_format.dim // spec.row_format.scale_block
    embeds = {}
    for tp_size in (1, 2):
        for tp_rank in range(tp_size):
            for index, layer in enumerate(spec.layers):
                emb = build(E, layout, index, tp_size, tp_rank)
                a = tables.view.layout.layer(layer)
                w_ptr, s_ptr = emb._table_ptrs()
                assert (w_ptr, s_ptr) == (base + a.weight_offset, base + a.scale_offset), "pointers not the arena's"
                assert emb.weight.data_ptr() == w_ptr and emb.scale.data_ptr() == s_ptr, "parameters not in the arena"
                assert emb.weight.shape == (spec.rows(layer), dim) and emb.weight.dtype == torch.float8_e4m3fn
                assert emb.scale.shape == (spec.rows(layer), sdim) and emb.scale.dtype == torch.float8_e8m0fnu
                assert emb._shared and emb.shared_host_table_without_ats, "not SGLang's shared host table"
                ids = batches[layer]
                want = ts.read_rows(layer, ids.reshape(-1))
                np.testing.assert_array_equal(rows_at(w_ptr, ids, dim), want[:, :dim])
                np.testing.assert_array_equal(rows_at(s_ptr, ids, sdim), want[:, dim:])
                got = gather_kernel(E, w_ptr, s_ptr, ids, dim)
                assert torch.equal(got, reference(want, spec)), "kernel differs from dequantize"
                embeds[layer] = emb
            ok(f"TP={tp_size} rank {tp_rank}: every layer's shared host table is the arena; rows at _table_ptrs() "
               "(strides dim, dim//32) and SGLang's gather kernel equal TableSet.read_rows / dequantize")
    # SGLang's kernel over a rank's row range (row_lo/row_hi, as _owned_rows passes them): unowned rows are zero
    layer = spec.layers[-1]
    lo, hi = spec.rows(layer) // 3, spec.rows(layer)
    weight, scales = tables.views(layer, lo, hi)
    ids = np.random.default_rng(2).integers(lo, hi, 40)
    ids[0] = lo - 1
    got = gather_kernel(E, weight.data_ptr(), scales.data_ptr(), ids, dim, row_lo=lo, row_hi=hi)
    want = reference(ts.read_rows(layer, np.clip(ids, lo, None)), spec)
    want[0] = 0
    assert torch.equal(got, want), "kernel over a row range differs"
    ok("SGLang's gather kernel over EngramStoreTables.views of a row range (row_lo/row_hi) equals TableSet.read_rows")

    # scheduler staging: EngramRowStager's tables and its CPU gather (torch.index_select) over the arena
    from sglang.srt.layers import engram_staging

    stream, torch.cuda.Stream = torch.cuda.Stream, lambda *a, **k: None
    try:
        stager = engram_staging.EngramRowStager(None, [embeds[layer] for layer in spec.layers], torch.device("cpu"))
    finally:
        torch.cuda.Stream = stream
    empty = torch.empty
    engram_staging.torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)
    try:
        for layer, (w_table, s_table) in zip(spec.layers, stager.tables):
            assert w_table.data_ptr() == embeds[layer]._table_ptrs()[0], "stager's table is not the arena"
            ids = batches[layer]
            want = ts.read_rows(layer, ids.reshape(-1))
            flat = torch.from_numpy(ids.reshape(-1))
            np.testing.assert_array_equal(stager._gather(w_table, flat).numpy(), want[:, :dim])
            np.testing.assert_array_equal(stager._gather(s_table, flat).numpy(), want[:, dim:])
    finally:
        engram_staging.torch.empty = empty
        stager.pool.shutdown()
    ok("EngramRowStager's tables are the arena and its _gather equals TableSet.read_rows")

    # _load_rows: the checkpoint's rows go nowhere (the arena is read-only: a write would fault)
    emb = embeds[spec.layers[0]]
    before = ts.read_rows(spec.layers[0], np.arange(4))
    junk = torch.zeros_like(emb.weight.data, dtype=torch.uint8).view(torch.float8_e4m3fn)
    emb.weight.weight_loader(emb.weight, junk)
    emb.scale.weight_loader(emb.scale, torch.zeros_like(emb.scale.data, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    np.testing.assert_array_equal(rows_at(emb._table_ptrs()[0], np.arange(4), dim), before[:, :dim])
    emb.finish_load(label="layer 1")
    ok("_load_rows of Engram tensors is a no-op (arena unchanged), finish_load passes")


def scenario_mismatch(tables_dir: str) -> None:
    """SGLang's EngramLayout of a V4.1 config equals our spec; a row count off by one is named."""
    from engram_store.errors import ModelMismatch
    from engram_store.format.tableset import TableSet
    from engram_store.spec import get_spec

    load_plugin()
    E = shim()
    spec = TableSet.open(tables_dir).spec
    full = get_spec("deepseek-v4.1-flash")
    import sglang.srt.layers.engram as plain

    layout = plain.EngramLayout.from_config.__wrapped__(plain.EngramLayout, model_config(full))  # SGLang's own
    for index, layer in enumerate(full.layers):
        assert tuple(p for order in layout.primes[index] for p in order) == tuple(full.primes(layer).reshape(-1))
        assert layout.num_embeddings[index] == full.rows(layer) == full.expected_rows[layer]
    ok("SGLang's EngramLayout of the V4.1 config equals engram-store's deepseek-v4.1-flash spec")
    rows = [spec.rows(layer) for layer in spec.layers]
    rows[-1] += 1
    try:
        E.EngramLayout.from_config(model_config(spec, engram_num_embeddings=rows))
    except ModelMismatch as exc:
        message = str(exc)
        assert f"rows of Engram layer {spec.layers[-1]}" in message and str(rows[-1]) in message \
            and str(rows[-1] - 1) in message, message
        ok(f"mismatch named: {message.split(';')[0]}")
    else:
        raise AssertionError("a config with a row count off by one was accepted")


def scenario_refusals(tables_dir: str) -> None:
    """Peer shards, a disabled host table, dummy weights and whole-file loaders are refused."""
    from engram_store.errors import EngineUnsupported
    from engram_store.format.tableset import TableSet

    load_plugin()
    E = shim()
    spec = TableSet.open(tables_dir).spec
    layout = E.EngramLayout.from_config(model_config(spec))

    def refused(what: str, attempt, word: str) -> None:
        try:
            attempt()
        except EngineUnsupported as exc:
            assert word in str(exc), str(exc)
            ok(f"{what} refused: {str(exc)[:90]}")
        else:
            raise AssertionError(f"{what} was not refused")

    for env, value in (("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS", "1"), ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "0")):
        saved = os.environ.get(env)
        os.environ[env] = value
        try:
            refused(f"{env}={value}", lambda: build(E, layout, 0, 2, 0), env)
        finally:
            os.environ.pop(env) if saved is None else os.environ.__setitem__(env, saved)
    os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = "per_rank"
    emb = build(E, layout, 0, 2, 1)
    assert emb._shared, "per_rank was not overridden"
    ok("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=per_rank overridden: the shared arena")
    from sglang.srt.model_loader import loader, weight_utils

    model = torch.nn.ModuleList([emb, torch.nn.Linear(4, 4)])
    refused("--load-format dummy", lambda: loader.initialize_dummy_weights(model), "read-only arena")
    refused("capture-safe fill", lambda: weight_utils.initialize_capture_safe_weights(model), "read-only arena")
    plain = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    weight_utils.initialize_capture_safe_weights(plain, 0.5)
    assert bool((plain[0].weight == 0.5).all()), "other models are no longer filled"
    refused("fastsafetensors", lambda: list(loader.fastsafetensors_weights_iterator([])), "fastsafetensors")
    refused("prefetch", lambda: loader._prefetch_all_checkpoints([], num_threads=1), "prefetch")
    refused("disable mmap", lambda: list(loader.safetensors_weights_iterator([], disable_mmap=True)), "mmap")
    ok("write paths and whole-file loaders refused with the plugin's message; other models unaffected")
    from engram_store.integrations.sglang import hooks

    changed = lambda self, param, loaded_weight, shard: None  # noqa: E731 - _load_rows of an SGLang that changed
    refused("a changed signature", lambda: hooks._check_signature(f"{ENGRAM}.EngramEmbedding._load_rows", changed,
                                                                  hooks.targets()[f"{ENGRAM}.EngramEmbedding._load_rows"][2]),
            "takes ('self', 'param', 'loaded_weight', 'shard')")


def scenario_renamed(tables_dir: str, how: str) -> None:
    """An SGLang that changed: the plugin stops the process (SGLang's load_plugins swallows Exceptions)."""
    import sglang.srt.layers.engram as E

    if how == "missing":
        del E.EngramEmbedding._init_host_table
    elif how == "signature":
        E.EngramEmbedding._load_rows = lambda self, param, loaded_weight, shard: None
    elif how == "version":
        import sglang.version

        sglang.version.__version__ = "0.5.24"
    elif how == "not-applied":  # HookRegistry could not apply a hook: the next model build raises
        load_plugin()
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry._patched.discard(f"{ENGRAM}.EngramEmbedding._load_rows")
        E.EngramEmbedding._load_rows = E.EngramEmbedding._load_rows.__wrapped__
        from engram_store.format.tableset import TableSet

        E.EngramLayout.from_config(model_config(TableSet.open(tables_dir).spec))
        raise AssertionError("a half-hooked SGLang built a layout")
    load_plugin()
    raise AssertionError("load_plugins returned")


def scenario_loader(tables_dir: str, ckpt_dir: str) -> None:
    """SGLang's loader iterators (the default multi-threaded one, and the single-threaded one) through
    the plugin yield every other tensor, unchanged, and never read the Engram ones."""
    from sglang.srt.model_loader import loader

    load_plugin()
    shards = sorted(os.path.join(ckpt_dir, f) for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    engram_shard = next(p for p in shards if "engram" in p)
    for name, iterate in (("buffered multi-thread", lambda: loader.buffered_multi_thread_safetensors_weights_iterator(
            shards, max_workers=2)), ("single-thread", lambda: loader.safetensors_weights_iterator(shards))):
        evict(shards)
        names = {n: float(t.float().sum()) for n, t in iterate()}
        assert names and not any(".engram.embed." in n for n in names), sorted(names)
        assert "model.layers.1.engram.wkv.weight" in names and names["model.layers.0.attn.wq_a.weight"] == 64.0
        resident, pages = resident_pages(engram_shard)
        # safe_open's header read brings in 4-8 MiB of read-ahead here; reading the tables would bring all 53 MB
        assert resident <= pages // 4, f"{resident} of {pages} pages of the Engram shard were read"
        ok(f"{name} iterator yielded {sorted(names)}; Engram shard {resident} of {pages} pages in the page cache "
           "(never read)")


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
    """The order a cached layer's chain issues its work in, run as CUDA streams may run it (tests/sglang_lanes.py:
    each lane in order, lanes interleaved by a policy, only the chain's markers between them), with stagings of 4
    tokens: an inline chain issued while the chain hashed ahead is still queued, both exact; a prefill of 3 pieces
    and a remainder, exact, its pieces double-buffered. Each with its wrong order as a control that fails."""
    from sglang_lanes import POLICIES, SCHEDULES, Streams

    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import chain, hooks, lanes, prefetch

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
    from engram_store.integrations.sglang import chain, hooks, prefetch

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


class _Processor:
    """Stands where SGLang's SchedulerBatchResultProcessor is: what it was handed (the tokens it would
    append to the requests and stream)."""

    def __init__(self, events: list) -> None:
        self.events = events

    def process_batch_result_decode(self, batch, result) -> None:
        self.events.append(("processed", batch.step, result.next_token_ids.tolist()))


class _CopyDone:
    """The overlap scheduler's copy_done: when the tokens' copy to the host was waited for."""

    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        self.events.append(("synchronized",))


def scenario_failed_step(tables_dir: str, pages: str) -> None:
    """Pages of cached layer 14 flipped on disk: SGLang's Scheduler.process_batch_result (its own method, the
    plugin's hook around it) hands a good step's tokens on and raises CorruptRows naming layer and page for a
    step whose rows read a flipped page, before any of its tokens reach SGLang's result processing; in the
    normal loop (right after the forward) and in the overlap loop (one step late, after its copy_done)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from engram_store.errors import CorruptRows
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import hooks, prefetch

    bad = [int(p) for p in pages.split(",")]
    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    layout = E.EngramLayout.from_config(model_config(spec))
    build(E, layout, 0)
    engram = cached_engram(E, layout)
    rows_per_page = int(hooks.tables().info["layer_files"]["14"]["rows_per_page"])
    events: list = []
    scheduler = Scheduler.__new__(Scheduler)  # what process_batch_result reads before it dispatches
    scheduler.scheduler_stage_metrics = None
    scheduler.publish_load_snapshot = lambda force=False: None
    scheduler.load_publisher = types.SimpleNamespace(publish_load_stat=lambda *a, **k: None)
    scheduler.load_inquirer = types.SimpleNamespace(get_loads=None)
    scheduler.batch_result_processor = _Processor(events)
    scheduler.tree_cache = types.SimpleNamespace(flush_pending_backups=lambda: None)
    scheduler._record_step_counters = lambda batch, result: None
    scheduler.metrics_reporter = types.SimpleNamespace(log_batch_result_stats=lambda batch, result: None,
                                                       update_device_timer=lambda: None)
    scheduler.enable_fpm = False
    scheduler._maybe_clear_mm_inputs = lambda batch: None
    scheduler.maybe_send_health_check_signal = lambda: None

    def step(n: int, page: int | None, overlap: bool):
        """A decode step through the hasher hook and SGLang's Engram module; its result as run_batch returns it."""
        hash_ids = hashed(spec, 6000 + n, 5)
        if page is not None:
            hash_ids[2, 1, 0] = page * rows_per_page + 3  # a row of the flipped page, in head 0's table
        prefetch.after_hasher(hash_ids, None, None, None)
        x = torch.randn(5, 2, 64, dtype=torch.bfloat16)
        y = engram.forward(x, hash_ids[:, 1], None, input_ids=torch.zeros(5, dtype=torch.long))
        tokens = y.float().sum((1, 2)).argsort()  # stands for sampling
        batch = types.SimpleNamespace(step=n, reqs=[], forward_mode=ForwardMode.DECODE)
        return batch, types.SimpleNamespace(copy_done=_CopyDone(events) if overlap else None, next_token_ids=tokens)

    def failed(batch, result, page: int) -> None:
        try:
            scheduler.process_batch_result(batch, result)
        except CorruptRows as exc:
            assert exc.layer == 14 and exc.pages == (page,) and "layer 14" in str(exc) and str(page) in str(exc), exc
            ok(f"step {batch.step}: {type(exc).__name__}: {str(exc)[:150]}")
        else:
            raise AssertionError(f"step {batch.step} read page {page} of layer 14, flipped, and was processed")

    with ranks():
        scheduler.process_batch_result(*step(1, None, False))  # normal loop: a good step, processed
        assert events == [("processed", 1, events[0][2])], events
        failed(*step(2, bad[0], False), bad[0])
        assert [e[0] for e in events] == ["processed"], events  # nothing of step 2 reached the processor
        ok("normal loop: a good step's tokens processed; the step that read a flipped page raised before SGLang "
           "processed any of its tokens")
        events.clear()
        late = step(3, bad[1], True)  # overlap loop: step 3's result is processed after step 4 ran
        following = step(4, None, True)
        failed(*late, bad[1])
        assert events == [("synchronized",)], events  # its copy waited for, then the raise: no tokens
        scheduler.process_batch_result(*following)
        assert [e[0] for e in events] == ["synchronized", "synchronized", "processed"] and events[-1][1] == 4, events
    ok("overlap loop: the failed step raised after its copy_done, before SGLang processed its tokens; the next "
       "step's tokens were processed")


def scenario_resident(tables_dir: str, ckpt_dir: str) -> None:
    """Everything a resident daemon serves, in one process (SGLang takes seconds to import):
    lookup, mismatch, loader, then refusals (which leave settings changed)."""
    scenario_lookup(tables_dir)
    scenario_mismatch(tables_dir)
    scenario_loader(tables_dir, ckpt_dir)
    scenario_refusals(tables_dir)


def scenario_mixed(tables_dir: str, address: str) -> None:
    """What a mixed daemon (layer 1 resident, 14 cached) serves, in one process: the layer-ahead steps, per-rank
    hash columns, then the chains' order (which leaves stagings of 4 tokens)."""
    from engram_store.integrations.sglang import prefetch

    scenario_cached(tables_dir)
    prefetch._embeddings.clear()
    scenario_ranks(tables_dir, address)
    prefetch._embeddings.clear()
    scenario_chains(tables_dir)


def scenario_hints(tables_dir: str) -> None:
    """A cached layer built on TP rank 1 of 2 (its share of the hash columns): a prefill the scheduler plans
    (SGLang's own Req, its NextBatchPlan, through the plugin's hook functions) hints the daemon once, the
    rows of the rank's columns after the planned chunk; a finished request's hints are withdrawn when its
    batch's result is processed."""
    from array import array

    from sglang.srt.managers.schedule_batch import NextBatchPlan, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from engram_store.client.client import EngramClient
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.hints import pending_rows
    from engram_store.integrations.sglang import hinting, hooks
    from engram_store.tokens import raw_ids_for

    load_plugin()
    spec = TableSet.open(tables_dir).spec
    E = shim()
    layout = E.EngramLayout.from_config(model_config(spec))
    build(E, layout, 1, tp_size=2, tp_rank=1)
    columns = hinting.RANK.columns[14]
    assert columns == slice(12, 24), columns  # plain TP: rank 1 fetches its half of the columns
    tokens = np.random.default_rng(9).integers(0, 129_280, 2000)
    req = Req("sg-hint", "", array("q", tokens.tolist()), SamplingParams(max_new_tokens=4))
    req.prefix_len, req.extend_end = 256, 256 + 512  # a radix-cache hit, then the first planned chunk
    hinting.after_prefill_plan(NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[req]), running_batch=None))
    req.prefix_len, req.extend_end = 768, 1280  # the next chunk: no second hint
    hinting.after_prefill_plan(NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[req]), running_batch=None))
    hints = hinting.RANK.hints(hooks.tables)
    assert hints is not None and hints.flush(60)
    raw = raw_ids_for(spec, hooks.tables().info, None, block_images=False)
    want = pending_rows(spec, 14, tokens, 768, raw=raw, columns=columns)
    with EngramClient.connect(hooks.tables().address) as client:
        received = sum(v for k, v in client.stats().items() if "hint_rows_received" in k)
    assert hints.stats.requests == 1 and hints.stats.rows_sent == len(want) == received, (hints.stats, received)
    req.finished_reason = object()  # SGLang's mark of a finished or aborted request
    hinting.after_results(types.SimpleNamespace(reqs=[req]))
    assert hints.flush(60) and hints.stats.withdrawals == 1, hints.stats
    ok(f"a planned prefill hinted the daemon once: {len(want)} rows of layer 14's columns 12..24 after its first "
       "chunk (received); withdrawn when it finished")


SCENARIOS = {"resident": scenario_resident, "mixed": scenario_mixed, "lookup": scenario_lookup, "mismatch": scenario_mismatch,
             "refusals": scenario_refusals, "renamed": scenario_renamed, "loader": scenario_loader,
             "cached": scenario_cached, "chains": scenario_chains, "ranks": scenario_ranks,
             "failed_step": scenario_failed_step, "hints": scenario_hints}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
