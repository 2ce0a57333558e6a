"""vLLM 0.33's own Qwen4Exp PLE n-gram embedding on CPU through the engram-store plugin, one scenario a process.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S \
        python tests/support/vllm_qwen4exp_plugin.py SCENARIO TABLES

``lookups``: vLLM's ``Qwen4ExpNGramEmbedding`` built with the plugin (its storage the daemon's, resident or cached
as the daemon holds the table) looks up ids from vLLM's own ``compute_ngram_ids``: through the prefetch seam
(``engram_config.cpu_offload`` on: ``start_prefetch`` then ``forward``) and inline (off: vLLM's device class);
row for row equal to vLLM's own device storage loaded from ``TableSet.read_rows`` through vLLM's shard loader,
and to ``read_rows`` itself; dequantized equal (the table scale); two ETP ranks whose rows sum to the whole; the
model config checked (a mismatch named). ``corrupt PAGE``: a step reading a page that fails its checksum gives
zero rows there and ``check_fetches`` raises ``CorruptRows`` naming it.

CPU stand-ins, nothing else: ``compressed_tensors`` (see ``vllm_qwen4exp_ref``), ``get_current_vllm_config``
of the Qwen4Exp module (an ``EngramConfig`` needs a whole model config) and, for two ETP ranks, the ETP and TP
groups the storage class reads (an all-reduce that returns its input: the test sums the ranks itself).
Prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.append(str(Path(__file__).resolve().parents[1] / "engines"))

import numpy as np  # noqa: E402
import qwen4exp_batch  # noqa: E402
import torch  # noqa: E402
from vllm_qwen4exp_ref import _StandIns  # noqa: E402

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
AMD = "vllm.models.qwen4_exp.amd.ple_layer"
PREFIX = "model.layers.1.ple.ple_embedding"
AMD_LAYER = "model.layers.1.ple"  # the AMD PLE layer's name, by which its custom ops find it
MAX_TOKENS = 96


def ok(what: str) -> None:
    print(f"OK {what}", flush=True)


def setup(rocm: bool = False):
    """The plugin installed over vLLM (stand-ins first, so that its Qwen4Exp code imports), vLLM's gloo
    groups of one process; returns (patches, plugin). ``rocm``: vLLM's platform says ROCm while the plugin
    installs (``current_platform.is_rocm()``, which is how vLLM picks ``amd/model.py``), so it patches the
    AMD copy of ``Qwen4ExpNGramEmbedding`` too; the rest of the scenario runs on vLLM's CPU paths."""
    sys.meta_path.append(_StandIns())
    torch.set_default_dtype(torch.bfloat16)  # the model's dtype, as vLLM sets it while it builds the model
    from vllm.platforms import current_platform
    from vllm_engine import init_distributed

    from engram_store.integrations.vllm import patches

    if rocm:  # the modules the plugin imports besides Qwen4Exp's, imported first as this (CPU) platform has them
        for name in (patches.ENGRAM, patches.WEIGHT_UTILS, patches.DEFAULT_LOADER, "vllm.v1.worker.gpu_model_runner",
                     "vllm.v1.worker.gpu.model_runner", NGRAM, COMMON):
            importlib.import_module(name)
        current_platform.is_rocm = lambda: True
    try:
        plugin = patches.install(os.environ["ENGRAM_STORE_ADDR"])
    finally:
        current_platform.__dict__.pop("is_rocm", None)
    init_distributed()
    return patches, plugin


def config(spec, **override):
    """A Qwen4Exp text config's PLE fields for ``spec`` (what vLLM's Qwen4ExpNGramEmbedding reads)."""
    fmt = spec.row_format.payload_dtype
    fields = dict(ple_layer_ids=[layer + 1 for layer in spec.layers], ngram_size=spec.max_ngram,
                  heads_per_ngram=spec.heads, ngram_vocab_size_base=spec.table_base, seed=spec.seed,
                  make_ngram_vocab_size_divisible_by=spec.row_pad_to, vocab_size=spec.compressed_vocab,
                  eos_token_id=spec.pad_id, split_ngram_parts=4,
                  ple_embedding_dtype={"float8_e4m3fn": "float8_e4m3fn", "float4_e2m1fn": "nvfp4"}.get(fmt))
    return types.SimpleNamespace(**(fields | override))


def build(spec, cpu_offload: bool, amd: bool = False, **override):
    """vLLM's Qwen4ExpNGramEmbedding of the first PLE layer, built inside a model runner's load_model:
    NVIDIA's (``nvidia/ngram_embedding.py``) or, with ``amd``, ROCm's copy (``amd/ple_layer.py``), each called
    as its PLE layer calls it."""
    import importlib

    from vllm.config import EngramConfig
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from engram_store.integrations.vllm import runners

    N = importlib.import_module(AMD if amd else NGRAM)
    cfg = types.SimpleNamespace(engram_config=EngramConfig(cpu_offload=cpu_offload))
    N.get_current_vllm_config = lambda: cfg
    c = config(spec, **override)
    dim = spec.rows_per_token * spec.row_format.dim
    with runners.model_runner(object.__new__(GPUModelRunner)):
        if amd:
            return N.Qwen4ExpNGramEmbedding(c, dim, 0, MAX_TOKENS, PREFIX, AMD_LAYER, data_parallel_rank=0,
                                            quant_config=None, params_dtype=torch.bfloat16)
        return N.Qwen4ExpNGramEmbedding(c, dim, 0, MAX_TOKENS, data_parallel_rank=0, prefix=PREFIX, quant_config=None)


def reference(plugin, module, ts, layer):
    """vLLM's own device storage of the table (the class the plugin replaced), loaded from ``read_rows``
    through vLLM's shard loader (4 shards), its global scale from the manifest."""
    Device = plugin.originals["qwen4exp_device"]
    emb = module.ngram_embedding
    ref = Device(emb.org_vocab_size, emb.embedding_dim, params_dtype=emb.params_dtype, padding_size=emb.padding_size,
                 prefix=emb.prefix + "-ref", embedding_method=emb.embedding_method,
                 num_ngram_heads=module.ngram_heads, max_total_tokens=MAX_TOKENS)
    rows = ts.read_rows(layer, np.arange(ts.spec.rows(layer)))
    fmt = ts.spec.row_format
    shard = -(-rows.shape[0] // 4)
    for k in range(4):
        part = torch.from_numpy(rows[k * shard:(k + 1) * shard].copy())
        weight = part[:, :fmt.payload_bytes].contiguous().view(ref.weight.dtype)
        ref.weight.weight_loader(ref.weight, weight, checkpoint_start=k * shard)
        if fmt.scale_count:
            scales = part[:, fmt.payload_bytes:].contiguous().view(ref.weight_scale.dtype)
            ref.weight_scale.weight_loader(ref.weight_scale, scales, checkpoint_start=k * shard)
    for name in ("weight_scale_2", "weight_scale"):
        param = ref._parameters.get(name)
        if param is not None and param.numel() == 1:
            param.weight_loader(param, torch.tensor(ts.table_scale(layer), dtype=torch.float32))
            break
    return ref


def batch(spec, seed: int):
    """The step's ``(input_ids, query_start_loc, ngram_context)`` as torch tensors (see qwen4exp_batch)."""
    return tuple(torch.from_numpy(a) for a in qwen4exp_batch.batch(spec, seed))


def step(module, tokens, qsl, ctx):
    """One step of the PLE layer as vLLM's model runs it: the prefetch started a layer ahead, then forward."""
    module.start_prefetch(tokens, qsl, ctx)
    return module.forward(torch.empty(0), tokens, qsl, ctx)


class OneOfTwo:
    """ETP rank ``rank`` of 2 (the group vLLM's storage reads): its all-reduce returns its input."""

    def __init__(self, rank: int) -> None:
        self.rank_in_group, self.world_size = rank, 2

    def all_reduce(self, x):
        return x


def amd_forward(module, tokens, qsl, ctx):
    """ROCm's ``Qwen4ExpNGramEmbedding.forward`` as vLLM runs it: its custom ops (ids, then the pinned
    storage's ``sync_lookup``) find their PLE layer in the forward context by name."""
    import importlib

    A = importlib.import_module(AMD)
    owner = object.__new__(A.Qwen4ExpPLELayer)  # the PLE layer its ops look up: only its ple_embedding is read
    torch.nn.Module.__init__(owner)
    owner.ple_embedding = module
    real = A.get_forward_context
    A.get_forward_context = lambda: types.SimpleNamespace(no_compile_layers={AMD_LAYER: owner})
    try:
        return module.forward(tokens, qsl, ctx)
    finally:
        A.get_forward_context = real


def amd_lookups(plugin, ts, tokens, qsl, ctx, ids, where: str) -> None:
    """ROCm's copy of Qwen4ExpNGramEmbedding (amd/ple_layer.py) with the plugin: its storage is the daemon's,
    its forward (inline, no prefetch) equals vLLM's own storage loaded from read_rows; its config is checked.
    NVFP4 is refused by vLLM's AMD code itself."""
    from engram_store.errors import ModelMismatch

    spec, layer = ts.spec, ts.spec.layers[0]
    tables = plugin.tables()
    if spec.row_format.payload_dtype == "float4_e2m1fn":
        try:
            build(spec, True, amd=True)
        except NotImplementedError as exc:
            assert "ROCm" in str(exc), exc
            ok(f"amd {where} float4_e2m1fn: vLLM's AMD PLE refuses NVFP4 tables itself ({exc})")
            return
        raise AssertionError("an NVFP4 PLE table was built on the AMD path")
    module = build(spec, True, amd=True)
    emb = module.ngram_embedding
    assert type(emb).__name__.startswith("EngramStore") and emb.supports_prefetch, type(emb)
    assert tables.owns(emb.weight.data_ptr()), "the AMD path's table is not the daemon's"
    got = amd_forward(module, tokens, qsl, ctx)
    ref = reference(plugin, module, ts, layer)
    want = ref(ids).flatten(-2)
    assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
        "the AMD path's rows differ from vLLM's own storage"
    try:
        build(spec, True, amd=True, ngram_vocab_size_base=spec.table_base + 1000)
    except ModelMismatch as exc:
        assert "rows of Engram layer" in str(exc), exc
    else:
        raise AssertionError("the AMD path accepted a config whose table differs from the daemon's")
    ok(f"amd {where} {spec.row_format.payload_dtype}: ROCm's Qwen4ExpNGramEmbedding.forward (its custom ops, "
       f"sync_lookup) over the daemon's table equals vLLM's own storage for {tokens.numel()} tokens; its config "
       "is checked")


def scenario_lookups(tables_dir: str) -> None:
    import importlib

    from engram_store.errors import ModelMismatch
    from engram_store.format.tableset import TableSet

    patches, plugin = setup(rocm=True)
    ts = TableSet.open(tables_dir)
    spec, layer = ts.spec, ts.spec.layers[0]
    tables = patches.tables()
    where = "resident" if tables.is_resident(layer) else "cached"
    tokens, qsl, ctx = batch(spec, seed=3)
    for cpu_offload in (True, False):
        module = build(spec, cpu_offload)
        emb = module.ngram_embedding
        assert type(emb).__name__.startswith("EngramStore") and emb.supports_prefetch is cpu_offload, type(emb)
        assert tables.owns(emb.weight.data_ptr()), "the table is not the daemon's"
        ids = module.compute_ngram_ids(tokens, qsl, ctx)  # vLLM's own ids (its CPU fallback)
        got = step(module, tokens, qsl, ctx) if cpu_offload else module.forward(torch.empty(0), tokens, qsl, ctx)
        ref = reference(plugin, module, ts, layer)
        want = ref(ids).flatten(-2)
        assert got.dtype == want.dtype and got.shape == (tokens.numel(), spec.rows_per_token * spec.row_format.dim)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "rows differ from vLLM's own storage"
        if spec.row_format.scale_count == 0:
            raw = ts.read_rows(layer, ids.numpy().reshape(-1)).reshape(tokens.numel(), -1)
            np.testing.assert_array_equal(got.view(torch.uint8).numpy(), raw)
        assert torch.equal(emb.dequantize(got, torch.bfloat16), ref.dequantize(want, torch.bfloat16))
        scale = ts.table_scale(layer)
        if scale is not None:
            param = emb.weight_scale_2 if spec.row_format.scale_count else emb.weight_scale
            param.weight_loader(param, torch.tensor(scale))  # the checkpoint's scale: the daemon's, accepted
            try:
                param.weight_loader(param, torch.tensor(scale * 2))
            except ModelMismatch as exc:
                assert "table scale" in str(exc), exc
            else:
                raise AssertionError("a checkpoint scale other than the daemon's was accepted")
        seam = "start_prefetch/finalize_prefetch" if cpu_offload else "inline forward"
        ok(f"{where} {spec.row_format.payload_dtype}: {tokens.numel()} tokens through the {seam} equal vLLM's "
           "own storage and TableSet.read_rows row for row, dequantized alike")
    amd_lookups(plugin, ts, tokens, qsl, ctx, module.compute_ngram_ids(tokens, qsl, ctx), where)

    C = importlib.import_module(COMMON)
    real_etp, real_tp = C.get_etp_group, C.get_tp_group
    parts = []
    try:
        for rank in (0, 1):
            C.get_etp_group = lambda rank=rank: OneOfTwo(rank)
            C.get_tp_group = lambda: types.SimpleNamespace(world_size=2)
            module = build(spec, True)
            emb = module.ngram_embedding
            half = spec.rows(layer) // 2
            assert (emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index) == \
                (rank * half, (rank + 1) * half)
            parts.append(step(module, tokens, qsl, ctx).view(torch.uint8).numpy().astype(np.int32))
    finally:
        C.get_etp_group, C.get_tp_group = real_etp, real_tp
    ids = module.compute_ngram_ids(tokens, qsl, ctx).numpy()
    both = (parts[0] > 0) & (parts[1] > 0)
    assert not both.any(), "both ETP ranks gave bytes of one row"
    assert (parts[0] > 0).any() and (parts[1] > 0).any()
    full = (parts[0] + parts[1]).astype(np.uint8)
    np.testing.assert_array_equal(full, ref(torch.from_numpy(ids)).flatten(-2).view(torch.uint8).numpy())
    ok(f"{where} {spec.row_format.payload_dtype}: 2 ETP ranks own rows [0, {half}) and [{half}, {2 * half}); "
       "their rows sum to the whole")

    for override, field in (({"ngram_vocab_size_base": spec.table_base + 1000}, "rows of Engram layer"),
                            ({"ple_embedding_dtype": None if config(spec).ple_embedding_dtype else "float8_e4m3fn"},
                             "PLE row format")):
        try:
            build(spec, True, **override)
        except ModelMismatch as exc:
            assert field in str(exc), exc
            ok(f"mismatch named: {str(exc).split(';')[0]}")
        else:
            raise AssertionError(f"a config with {override} was accepted")


def scenario_corrupt(tables_dir: str, page: str) -> None:
    from engram_store.errors import CorruptRows
    from engram_store.format.layout import PAGE_BYTES
    from engram_store.format.tableset import TableSet

    patches, plugin = setup()
    ts = TableSet.open(tables_dir)
    spec, layer, page = ts.spec, ts.spec.layers[0], int(page)
    tables = patches.tables()
    assert not tables.is_resident(layer)
    module = build(spec, True)
    tokens, qsl, ctx = batch(spec, seed=3)
    bad = (module.compute_ngram_ids(tokens, qsl, ctx) // (PAGE_BYTES // spec.row_bytes)) == page
    assert bad.any(), f"the step reads no row of page {page}"
    got = step(module, tokens, qsl, ctx).view(tokens.numel(), spec.rows_per_token, -1)
    assert not got[bad].view(torch.uint8).any(), "a row of the failed page is not zero"
    try:
        tables.check_fetches()
    except CorruptRows as exc:
        assert exc.layer == layer and page in exc.pages, exc
        ok(f"CorruptRows at the step's check: {exc}")
    else:
        raise AssertionError("a step reading a page that fails its checksum was not raised")


def scenario_hints(tables_dir: str) -> None:
    """A cached PLE table's prompt hints equal the rows vLLM's later chunks fetch: ``ngram_context`` from
    vLLM's own ``Qwen4ExpModelState._prepare_ngram_context`` (over the request's tokens and computed count),
    ids from its ``compute_ngram_ids``, through ``start_prefetch``/``forward``. The prompt has EOS tokens,
    some at the chunks' edges."""
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    from engram_store.format.tableset import TableSet

    patches, plugin = setup()
    ts = TableSet.open(tables_dir)
    spec, layer = ts.spec, ts.spec.layers[0]
    assert not patches.tables().is_resident(layer)
    module = build(spec, True)
    served = module.ngram_embedding.__dict__["_engram_store"]
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, spec.compressed_vocab, 300)
    prompt[rng.random(prompt.size) < 0.08] = spec.pad_id
    prompt[[63, 64, 127, 129]] = spec.pad_id  # EOS at the chunks' edges: the look-back cut across them
    eos = spec.pad_id
    state = types.SimpleNamespace(ngram_context=torch.full((1, spec.history_len), eos, dtype=torch.int32),
                                  ngram_eos_token_id=eos, ngram_context_offsets=torch.arange(-spec.history_len, 0))
    all_tokens = types.SimpleNamespace(gpu=torch.from_numpy(prompt.astype(np.int32))[None])
    steps = []

    def chunk(start: int, end: int) -> None:
        batch = types.SimpleNamespace(num_reqs=1, idx_mapping=torch.zeros(1, dtype=torch.int32))
        computed = types.SimpleNamespace(gpu=torch.tensor([start], dtype=torch.int32))
        ctx = Qwen4ExpModelState._prepare_ngram_context(
            state, batch, types.SimpleNamespace(num_computed_tokens=computed, all_token_ids=all_tokens)).clone()
        tokens = torch.from_numpy(prompt[start:end].astype(np.int32))
        qsl = torch.tensor([0, end - start], dtype=torch.int32)
        steps.append(module.compute_ngram_ids(tokens, qsl, ctx).reshape(-1))  # vLLM's ids of the chunk
        step(module, tokens, qsl, ctx)

    def fetched():
        ids = served.ids[: steps[-1].numel()].clone()
        assert torch.equal(ids, steps[-1]), "the fetch job asked for other rows than vLLM's ids"
        return ids.numpy()

    from vllm_ngram_hints import hinted_then_fetched

    hinted_then_fetched(prompt, 64, chunk, fetched)


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](*sys.argv[2:])
