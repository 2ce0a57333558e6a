"""SGLang 0.5.23's own Engram code on CPU, through the engram-store plugin: the resident-layer
scenarios (lookup, mismatch, refusals, renamed, loader; ``resident`` runs all but renamed in one
process), and the shims and builders that ``tests/engines/sglang_engine_cached.py`` (a cached layer's
forward) and ``tests/engines/sglang_engine_scheduler.py`` (SGLang's scheduler with a cached layer) import.
Scenarios are run by ``tests/test_sglang_plugin.py``, each in a fresh process of ``.venv-sglang``
(SGLang installed ``--no-deps``; the shims below and the plugin's hooks must not leak).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \
        .venv-sglang/bin/python tests/engines/sglang_engine.py SCENARIO TABLES

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

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine_helpers import (  # noqa: E402
    evict, mismatch_named, model_config, ok, resident_pages, rows_off_by_one, snapshot)

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
    from engram_store.models.hashing import row_ids_numpy

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
    from engram_store.format.tableset import TableSet
    from engram_store.models.spec import get_spec

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
    rows = rows_off_by_one(spec)
    mismatch_named(lambda: E.EngramLayout.from_config(model_config(spec, engram_num_embeddings=rows)), spec, rows)


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


def scenario_resident(tables_dir: str, ckpt_dir: str) -> None:
    """Everything a resident daemon serves, in one process (SGLang takes seconds to import):
    lookup, mismatch, loader, then refusals (which leave settings changed)."""
    scenario_lookup(tables_dir)
    scenario_mismatch(tables_dir)
    scenario_loader(tables_dir, ckpt_dir)
    scenario_refusals(tables_dir)


SCENARIOS = {"resident": scenario_resident, "lookup": scenario_lookup, "mismatch": scenario_mismatch,
             "refusals": scenario_refusals, "renamed": scenario_renamed, "loader": scenario_loader}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
