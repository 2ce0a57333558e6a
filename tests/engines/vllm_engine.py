"""vLLM 0.33's own Engram code on CPU, through the engram-store plugin: the resident-layer
scenarios (lookup, write-paths, mismatch, loader, hold, load; ``resident`` runs the first four in
one process), and the shims and builders that ``tests/engines/vllm_engine_cached.py`` (a cached layer's
steps) and ``tests/engines/vllm_engine_paths.py`` (the paths a cached layer takes) import. Scenarios are
run by ``tests/test_vllm_plugin.py``, each in a fresh process (the shims below and the plugin's
patches must not leak into other tests).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S \
        python tests/engines/vllm_engine.py SCENARIO TABLES

Triton's interpreter runs vLLM's kernels on CPU tensors. CPU shims, nothing else:
``torch.accelerator.current_device_index`` and ``torch.cuda.get_device_properties``
(read in ``ParallelEngramEmbedding.__init__``), ``is_uva_available`` and
``get_accelerator_view_from_cpu_tensor`` (identity: on a GPU host it gives the UVA
view of the pinned arena), ``get_current_vllm_config`` (a VllmConfig with an
EngramConfig needs a whole V4.1 model config), and for TP=2 the rank functions
the engram module imported. Everything else is vLLM's code and the plugin's.
A scenario prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine_helpers import (  # noqa: E402
    evict, mismatch_named, model_config, ok, resident_pages, rows_off_by_one, snapshot)

ENGRAM = "vllm.models.deepseek_v41.common.engram"


def load_plugin() -> set:
    """Import what the plugin patches, then run vLLM's own plugin loader; returns what changed."""
    import vllm.model_executor.model_loader.default_loader  # noqa: F401
    import vllm.model_executor.model_loader.dummy_loader  # noqa: F401
    import vllm.model_executor.model_loader.reload.inplace  # noqa: F401
    import vllm.model_executor.model_loader.weight_checksum  # noqa: F401
    import vllm.models.deepseek_v41.common.engram  # noqa: F401
    import vllm.plugins
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.gpu.async_utils  # noqa: F401
    import vllm.v1.worker.gpu.model_runner  # noqa: F401
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    before = snapshot("vllm")
    vllm.plugins.load_general_plugins()
    after = snapshot("vllm")
    return {key for key, value in after.items() if key in before and before[key] != value}


MAX_TOKENS = 64  # the shimmed config's max_num_batched_tokens: sizes cached layers' staging


def shim(tp_size: int = 1, tp_rank: int = 0, max_tokens: int = MAX_TOKENS) -> types.ModuleType:
    import importlib

    from vllm.config import EngramConfig

    E = importlib.import_module(ENGRAM)
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=4)
    E.is_uva_available = lambda: True
    E.get_accelerator_view_from_cpu_tensor = lambda t: t
    config = types.SimpleNamespace(engram_config=EngramConfig(cpu_offload=True, dp_shared_memory=False),
                                   scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens),
                                   lora_config=None)
    E.get_current_vllm_config = lambda: config
    E.get_tensor_model_parallel_world_size = lambda: tp_size
    E.get_tensor_model_parallel_rank = lambda: tp_rank
    return E


def init_distributed() -> None:
    """A real gloo process group of world size 1 and vLLM's own model-parallel groups."""
    import tempfile

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if torch.distributed.is_initialized():  # an earlier scenario of this process made them
        return
    store = tempfile.mktemp(prefix="engram-vllm-pg-")
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method="file://" + store,
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")


def build(E, layout, index: int, runner=None):
    """An Engram layer's embedding as vLLM builds it: through Engram._create_embedding, inside a model
    runner's load_model (the plugin's patched load_model names the runner; by default vLLM's V2 runner,
    vLLM 0.33's default)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from engram_store.integrations.vllm import runners

    with runners.model_runner(object.__new__(GPUModelRunner) if runner is None else runner):
        return E.Engram._create_embedding(object(), layout, index)


def plugin_layer(tables_dir: str, index: int, **shim_args):
    """The plugin loaded, vLLM's distributed state and config shimmed (``shim_args``), and Engram layer
    ``index``'s embedding built through the plugin: returns the shimmed module, the table set and the
    embedding."""
    from engram_store.format.tableset import TableSet

    load_plugin()
    ts = TableSet.open(tables_dir)
    init_distributed()
    E = shim(**shim_args)
    return E, ts, build(E, E.EngramLayout(model_config(ts.spec)), index)


def token_batch(spec, seed: int, tokens: int = 48):
    from engram_store.models.hashing import row_ids_numpy

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, spec.compressed_vocab, tokens)
    cu = np.array([0, tokens // 3, tokens])  # two requests
    return {layer: row_ids_numpy(spec, layer, toks, cu) for layer in spec.layers}


# --- scenarios -----------------------------------------------------------------------------
def scenario_lookup(tables_dir: str) -> None:
    """Discovery, exact patches, zero-copy views, vLLM's lookup/forward and raw kernel, TP=1 and TP=2."""
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.vllm import patches
    from gpu_client.dequant import dequantize

    changed = load_plugin()
    expected = {
        (f"{ENGRAM}.Engram", "_create_embedding"), (f"{ENGRAM}.ParallelEngramEmbedding", "_allocate_weights"),
        (ENGRAM, "can_share_engram_tables"),
        ("vllm.model_executor.model_loader.weight_utils", "should_skip_weight"),
        ("vllm.model_executor.model_loader.weight_utils", "safetensors_weights_iterator"),
        ("vllm.model_executor.model_loader.default_loader", "safetensors_weights_iterator"),
        ("vllm.model_executor.model_loader.default_loader.DefaultModelLoader", "track_weights_loading"),
        ("vllm.model_executor.model_loader.weight_utils", "initialize_single_dummy_weight"),
        ("vllm.model_executor.model_loader.dummy_loader", "initialize_single_dummy_weight"),
        ("vllm.model_executor.model_loader.weight_checksum", "zero_weights"),
        ("vllm.model_executor.model_loader.reload.inplace", "reload_weights"),
        (f"{ENGRAM}.ParallelEngramEmbedding", "lookup"), (f"{ENGRAM}.Engram", "_start_prefetch"),
        (f"{ENGRAM}.EngramBatch", "create"),
        ("vllm.v1.worker.gpu_model_runner", "reload_weights"),  # the runners' by-name imports, rebound too
        ("vllm.v1.worker.gpu.model_runner", "reload_weights"),
        ("vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput", "get_output"),
        ("vllm.v1.worker.gpu.async_utils.AsyncOutput", "get_output"),
        ("vllm.v1.worker.cpu_model_runner.CPUModelRunner", "load_model"),
    }
    for runner in ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "vllm.v1.worker.gpu.model_runner.GPUModelRunner"):
        expected |= {(runner, name) for name in ("execute_model", "sample_tokens", "load_model")}
    for name in ("multi_thread_safetensors_weights_iterator", "fastsafetensors_weights_iterator",
                 "instanttensor_weights_iterator"):
        expected |= {("vllm.model_executor.model_loader.weight_utils", name),
                     ("vllm.model_executor.model_loader.default_loader", name)}
    expected.add(("vllm.model_executor.model_loader.ep_weight_filter", "should_skip_weight"))  # where it is defined
    for model in ("vllm.models.deepseek_v41.nvidia.model", "vllm.models.deepseek_v41.amd.model"):
        if model in sys.modules:  # loaded already: its by-name import is rebound too
            expected.add((model, "can_share_engram_tables"))
    changed = {key for key in changed if key[1] != "plugins_loaded" and not key[0].startswith("vllm.plugins")}
    assert changed == expected, f"patched {sorted(changed - expected)}, not patched {sorted(expected - changed)}"
    assert patches.installed_address() == os.environ["ENGRAM_STORE_ADDR"]
    ok(f"vLLM's load_general_plugins found the entry point and patched exactly {len(expected)} names")

    ts = TableSet.open(tables_dir)
    spec = ts.spec
    tables = patches.tables()
    base = tables.view.array.ctypes.data
    batches = token_batch(spec, seed=1)
    init_distributed()
    for tp_size, ranks in ((1, (0,)), (2, (0, 1)), (8, (0, 7))):  # TP=8: 3 of the 24 heads per rank
        for tp_rank in ranks:
            E = shim(tp_size, tp_rank)
            layout = E.EngramLayout(model_config(spec))
            for index, layer in enumerate(spec.layers):
                emb = build(E, layout, index)
                a = tables.view.layout.layer(layer)
                start, end = emb.vocab_start_idx, emb.vocab_end_idx
                assert emb.weight.data_ptr() == base + a.weight_offset + start * a.weight_bytes, "weight not in arena"
                assert emb.weight_scale_inv.data_ptr() == base + a.scale_offset + start * a.scale_bytes, "scales not in arena"
                assert emb.weight.shape == (end - start, 256) and emb.weight.dtype == torch.float8_e4m3fn
                assert emb.weight_scale_inv.shape == (end - start, 8) and emb.weight_scale_inv.dtype == torch.uint8
                ids = batches[layer]
                h0, heads = emb.head_start, emb.part_n_hash_cols
                mine = ids[:, h0:h0 + heads]
                want = ts.read_rows(layer, mine.reshape(-1)).reshape(mine.shape + (spec.row_bytes,))
                packed = torch.full((ids.shape[0], heads, spec.row_bytes), 0xAB, dtype=torch.uint8)
                emb.lookup(torch.from_numpy(ids), packed)
                np.testing.assert_array_equal(packed.numpy(), want)
                bf16 = torch.empty((ids.shape[0], heads, spec.row_format.dim), dtype=torch.bfloat16)
                emb.lookup(torch.from_numpy(ids), bf16)
                reference = dequantize(torch.from_numpy(want), spec).view(bf16.shape)
                assert torch.equal(bf16, reference), "bf16 lookup differs from gpu_client.dequantize"
                if tp_size == 1:
                    out = emb.forward(torch.from_numpy(ids))
                    assert torch.equal(out, reference), "forward differs from gpu_client.dequantize"
            ok(f"TP={tp_size} rank {tp_rank}: arena views at the rank's offsets; lookup (packed, bf16)"
               f"{' and forward' if tp_size == 1 else ''} equal TableSet.read_rows / dequantize")
    # vLLM's kernel, unmodified, over views(...) of a row range that starts mid-table
    E = shim()
    layer = spec.layers[-1]
    rows = spec.rows(layer)
    lo, hi = rows // 3, rows
    weight, scales = tables.views(layer, lo, hi)
    ids = np.random.default_rng(2).integers(lo, hi, (40, 24))
    ids[0, 0] = lo - 1  # not this range's row: the kernel writes zeros
    out = torch.full((40, 24, spec.row_bytes), 0xAB, dtype=torch.uint8)
    idx = torch.from_numpy(ids)
    grid = 4
    E._engram_lookup_kernel[(grid,)](weight, scales, idx, idx, out, lo, hi, ids.size, *idx.stride(), HEAD_START=0,
                                     LOCAL_HEADS=24, TOTAL_HEADS=24, DIM=256, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid,
                                     SORTED=False, PACKED=True, OUT_STRIDE=out.stride(0), PEER_ROWS=0)
    want = ts.read_rows(layer, np.clip(ids, lo, None).reshape(-1)).reshape(out.shape)
    want[0, 0] = 0
    np.testing.assert_array_equal(out.numpy(), want)
    ok("vLLM's _engram_lookup_kernel over EngramStoreTables.views equals TableSet.read_rows")


def scenario_write_paths(tables_dir: str) -> None:
    """--load-format dummy, weight reset and in-place reload are refused for arena views."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import dummy_loader, weight_checksum
    from vllm.model_executor.model_loader.reload import inplace

    from engram_store.errors import EngineUnsupported

    E, _, emb = plugin_layer(tables_dir, 0)
    model = torch.nn.ModuleList([emb, torch.nn.Linear(4, 4)])
    attempts = {
        "--load-format dummy": lambda: dummy_loader.DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(model, None),
        "resetting the weights": lambda: weight_checksum.zero_weights(model),
        "reloading the weights in place": lambda: inplace.reload_weights(None, model, iter(()), None, False),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
        except EngineUnsupported as exc:
            assert what in str(exc) and "read-only arena" in str(exc), str(exc)
        else:
            raise AssertionError(f"{what} was not refused")
    plain = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    dummy_loader.DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(plain, None)  # other models still load
    weight_checksum.zero_weights(plain)
    assert not plain[0].weight.any()
    ok("dummy load, weight reset and in-place reload are refused with the plugin's message; other models unaffected")


def scenario_mismatch(tables_dir: str) -> None:
    """vLLM's EngramLayout of a V4.1 config equals our spec; a row count off by one is named."""
    from engram_store.format.tableset import TableSet
    from engram_store.models.spec import get_spec

    load_plugin()
    E = shim()
    full = get_spec("deepseek-v4.1-flash")
    layout = E.EngramLayout(model_config(full))
    for index, layer in enumerate(full.layers):
        assert tuple(s for order in layout.primes[index] for s in order) == tuple(full.primes(layer).reshape(-1))
        assert layout.num_embeddings[index] == full.rows(layer) == full.expected_rows[layer]
    ok("vLLM's EngramLayout of the V4.1 config equals engram-store's deepseek-v4.1-flash spec")
    spec = TableSet.open(tables_dir).spec
    rows = rows_off_by_one(spec)
    bad = E.EngramLayout(model_config(spec, engram_num_embeddings=rows))
    mismatch_named(lambda: build(E, bad, 0), spec, rows)


def scenario_loader(tables_dir: str, ckpt_dir: str) -> None:
    """vLLM's default loader through the plugin yields the checkpoint's other tensors and
    never reads the Engram ones (their pages stay out of the page cache); eager is refused."""
    import mmap

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from engram_store.errors import EngineUnsupported

    load_plugin()
    shards = sorted(os.path.join(ckpt_dir, f) for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    evict(shards)
    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    source = DefaultModelLoader.Source(ckpt_dir, revision=None, prefix="")
    names = {name: tensor.sum().item() for name, tensor in loader._get_weights_iterator(source)}
    assert names and not any(".engram.embed." in n for n in names), sorted(names)
    ok(f"default loader yielded {sorted(names)} and no Engram tensor")
    engram_shard = next(p for p in shards if "engram" in p)
    resident, pages = resident_pages(engram_shard)
    assert resident * mmap.PAGESIZE <= 4 << 20, f"{resident} of {pages} pages of the Engram shard were read"
    ok(f"Engram shard: {resident} of {pages} pages in the page cache after loading (never read)")
    eager = DefaultModelLoader(LoadConfig(load_format="safetensors", safetensors_load_strategy="eager"))
    try:
        list(eager._get_weights_iterator(source))
    except EngineUnsupported as exc:
        assert "eager" in str(exc), str(exc)
        ok("eager loading refused")
    else:
        raise AssertionError("eager loading was not refused")


def scenario_hold(tables_dir: str) -> None:
    """Map through the plugin, answer, then wait: after the test restarts the daemon on other
    tables, this process's views must still hold the rows it mapped (read on stdin's word)."""
    E, ts, emb = plugin_layer(tables_dir, 0)
    spec = ts.spec
    ids = token_batch(spec, seed=3)[spec.layers[0]]
    want = ts.read_rows(spec.layers[0], ids.reshape(-1)).reshape(ids.shape + (spec.row_bytes,))

    def check(when: str) -> None:
        out = torch.empty((ids.shape[0], 24, spec.row_bytes), dtype=torch.uint8)
        emb.lookup(torch.from_numpy(ids), out)
        np.testing.assert_array_equal(out.numpy(), want)
        ok(f"views correct {when}")

    check("before the restart")
    sys.stdin.readline()
    check("after the daemon restarted")


def scenario_resident(tables_dir: str, ckpt_dir: str) -> None:
    """The resident-layer scenarios in one process (vLLM imports in about 10 s): lookups, refused write paths,
    the model config checked, the checkpoint loader."""
    scenario_lookup(tables_dir)
    scenario_write_paths(tables_dir)
    scenario_mismatch(tables_dir)
    scenario_loader(tables_dir, ckpt_dir)


def scenario_load() -> None:
    """vLLM's plugin loader and nothing else (the plugin probes the daemon when it loads)."""
    load_plugin()
    ok("plugin loaded")


SCENARIOS = {"lookup": scenario_lookup, "write-paths": scenario_write_paths, "mismatch": scenario_mismatch,
             "loader": scenario_loader, "hold": scenario_hold, "load": scenario_load, "resident": scenario_resident}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
