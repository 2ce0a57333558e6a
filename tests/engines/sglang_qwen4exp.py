"""SGLang 0.5.23's own Qwen4Exp PLE n-gram code on CPU through the engram-store plugin, one daemon a process.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \\
        .venv-sglang/bin/python tests/engines/sglang_qwen4exp.py serve TABLES [PAGE]

``serve`` (a daemon of three PLE layers, 1 resident, 3 and 5 cached): SGLang's ``Qwen4ExpNGramEmbedding``
built with the plugin from a Qwen4Exp config of the daemon's spec, for each served layer and each storage
path (``ple_offload_embedding``: ``Qwen4ExpPinnedHostEmbedding``'s gather, directly and through
``Qwen4ExpPLELayer.start_prefetch`` / ``_consume_prefetched_embeddings``; without it: the inline masked
lookup), its embeddings of a step equal, bit for bit, SGLang's own ``Qwen4ExpNGramEmbedding`` (built by the
original ``__init__``, inline path) loaded with the rows of ``TableSet.read_rows`` and the daemon's table
scale; its gathered rows equal ``read_rows``; two TP ranks own disjoint rows that sum to the whole; its ids
(SGLang's ``_prepare_ple_batch`` and ``compute_ngram_ids``) equal engram-store's spec hash over thousands of
positions; config, hash and checkpoint mismatches are refused, the checkpoint's table tensors skipped; a
prefill SGLang's scheduler plans (its own ``Req``) hints the cached layers' rows of the prompt's later
chunks, which are the rows those chunks fetch by SGLang's ids, read ahead and hit (``check_hints``); with
PAGE, a step of layer 5 reading that flipped page raises ``CorruptRows`` in ``Scheduler.process_batch_result``
before SGLang's own. ``refuse`` (an NVFP4 daemon): the build is refused.

CPU stand-ins, nothing else: the ``torchvision`` op schemas (see ``sglang_engine.py``); the server's
request pool (``get_req_to_token_pool``: each request's n-gram history) and a ``ForwardBatch``'s fields
that ``_prepare_ple_batch`` reads; for the prefetch seam, ``torch.cuda`` streams as no-ops (one CPU
stream); for two TP ranks, SGLang's ``get_parallel().override`` (no process group: the test sums the
ranks' gathers itself). Prints ``OK <what>`` lines and exits 0, or raises. Over 400 lines: one process
checks every path against one daemon, as SGLang's import is most of a run's time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

QWEN = "sglang.srt.models.qwen4_exp"
NGRAM_INIT = f"{QWEN}.Qwen4ExpNGramEmbedding.__init__"
PREFIX = "model.layers.{}.ple.ple_embedding"
BATCH_TOKENS = 48  # a lookup step (Triton's interpreter runs one program a row)


def ok(what: str) -> None:
    print(f"OK {what}", flush=True)


def load_plugin():
    """SGLang's plugin loader over the modules the plugin hooks; returns the installed plugin."""
    import sglang.srt.layers.engram  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.model_loader.loader  # noqa: F401
    import sglang.srt.models.qwen4_exp  # noqa: F401
    from sglang.srt.plugins import load_plugins

    from engram_store.integrations.install import installed

    load_plugins()
    plugin = installed("SGLang")
    assert plugin is not None, "the plugin did not install"
    return plugin


def config(spec, offload: bool, **override):
    """A Qwen4Exp text config's PLE fields for ``spec`` (what SGLang's Qwen4ExpNGramEmbedding reads)."""
    fields = dict(ple_layer_ids=[layer + 1 for layer in spec.layers], ngram_size=spec.max_ngram,
                  heads_per_ngram=spec.heads, ngram_vocab_size_base=spec.table_base, seed=spec.seed,
                  make_ngram_vocab_size_divisible_by=spec.row_pad_to, vocab_size=spec.compressed_vocab,
                  eos_token_id=spec.pad_id, ple_offload_embedding=offload, ple_offload_backend="pinned",
                  ple_offload_dir=None,
                  ple_embedding_dtype="float8_e4m3fn" if spec.row_format.payload_dtype == "float8_e4m3fn" else None)
    return types.SimpleNamespace(**(fields | override))


def ranks(tp_size: int = 1, tp_rank: int = 0):
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_size=tp_size, tp_rank=tp_rank, tp_group=None, attn_dp_size=1,
                                   attn_tp_size=tp_size, attn_tp_rank=tp_rank, attn_cp_size=1, pp_size=1, pp_rank=0)


def build(spec, layer: int, offload: bool, tp=(1, 0), original=None, **override):
    """SGLang's Qwen4ExpNGramEmbedding of ``layer`` (through the plugin's hook, or ``original``'s __init__)."""
    import sglang.srt.models.qwen4_exp as Q

    cfg = config(spec, offload, **override)
    with ranks(*tp):
        if original is None:
            return Q.Qwen4ExpNGramEmbedding(cfg, spec.rows_per_token * spec.row_format.dim,
                                            ple_layer_index=spec.layers.index(layer), prefix=PREFIX.format(layer))
        module = Q.Qwen4ExpNGramEmbedding.__new__(Q.Qwen4ExpNGramEmbedding)
        original(module, cfg, spec.rows_per_token * spec.row_format.dim, ple_layer_index=spec.layers.index(layer),
                 prefix=PREFIX.format(layer))
        return module


# --- a step, as SGLang's model runner hands it ---------------------------------------------------
class Pool:
    """The server's request pool as ``_prepare_ple_batch`` reads it: each request slot's n-gram history."""

    def __init__(self, history: np.ndarray) -> None:
        self.history = torch.from_numpy(history.astype(np.int64))
        self.ple_window_cache = None

    def get_mamba_indices(self, req_pool_indices):
        return req_pool_indices

    def get_ngram_context(self, indices):
        return self.history[indices]


def step(spec, seed: int, lengths: list[int], eos_share: float = 0.1):
    """``(tokens, cu_seqlens, history)`` of one extend step: requests of ``lengths``, about ``eos_share``
    EOS tokens, the first at its start (EOS history), the others past theirs."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, spec.compressed_vocab, sum(lengths))
    tokens[rng.random(tokens.size) < eos_share] = spec.pad_id
    history = rng.integers(0, spec.compressed_vocab, (len(lengths), spec.max_ngram - 1))
    history[rng.random(history.shape) < eos_share] = spec.pad_id
    history[0] = spec.pad_id
    return tokens, np.concatenate([[0], np.cumsum(lengths)]), history


@contextlib.contextmanager
def sglang_step(tokens: np.ndarray, cu: np.ndarray, history: np.ndarray, eos: int):
    """SGLang's ``_PLEBatch`` of an extend step (its own ``_prepare_ple_batch``) and the forward batch."""
    import sglang.srt.models.qwen4_exp as Q
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lengths = np.diff(cu)
    fb = types.SimpleNamespace(
        tbo_parent_token_range=None, spec_algorithm=None, spec_info=None, _original_forward_mode=None,
        forward_mode=ForwardMode.EXTEND, global_num_token_non_padded_cpu=None,
        extend_seq_lens=torch.from_numpy(lengths), extend_seq_lens_cpu=lengths.tolist(),
        req_pool_indices=torch.arange(lengths.size), out_cache_loc=None, mamba_track_indices=None,
        mamba_track_mask=None)
    real = Q.get_req_to_token_pool
    Q.get_req_to_token_pool = lambda pool=Pool(history): pool
    try:
        yield Q._prepare_ple_batch(torch.from_numpy(tokens.astype(np.int64)), fb, ngram_size=history.shape[1] + 1,
                                   ngram_eos_token_id=eos), fb
    finally:
        Q.get_req_to_token_pool = real


class CpuStream:
    """``torch.cuda.Stream`` on the CPU: one stream, so every wait is already satisfied."""

    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def cpu_streams():
    """The ``torch.cuda`` stream calls of SGLang's PLE prefetch as CPU no-ops (restored after)."""
    saved = torch.cuda.current_stream, torch.cuda.stream, torch.Tensor.record_stream
    torch.cuda.current_stream = lambda *a, **k: CpuStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.stream, torch.Tensor.record_stream = saved


def prefetched(module, batch, fb):
    """SGLang's ``Qwen4ExpPLELayer.start_prefetch`` then ``_consume_prefetched_embeddings`` of ``module``'s
    layer (its prefetch state and stream as ``Qwen4ExpPLELayer.__init__`` sets them with offload)."""
    import sglang.srt.models.qwen4_exp as Q

    layer = Q.Qwen4ExpPLELayer.__new__(Q.Qwen4ExpPLELayer)
    torch.nn.Module.__init__(layer)
    layer.ple_embedding, layer.ple_embed_dim = module, module.ngram_embed_dim
    layer._prefetch_stream, layer._graph_prefetch_buffers = CpuStream(), {}
    layer._eager_prefetch_buffer = layer._prefetch_state = None
    with cpu_streams():
        layer.start_prefetch(batch, fb)
        assert layer._prefetch_state is not None, "start_prefetch issued no gather"
        return layer._consume_prefetched_embeddings(fb)


# --- references ----------------------------------------------------------------------------------
def reference(original, spec, ts, layer: int):
    """SGLang's own Qwen4ExpNGramEmbedding (inline path, built by the original ``__init__``) loaded with
    ``layer``'s rows from ``TableSet.read_rows`` through SGLang's weight loader, its scale the daemon's."""
    module = build(spec, layer, offload=False, original=original)
    emb = module.ngram_embedding
    rows = ts.read_rows(layer, np.arange(spec.rows(layer)))
    emb.weight_loader(emb.weight, torch.from_numpy(rows).view(emb.weight.dtype))
    if ts.table_scale(layer) is not None:
        emb.weight_scale.fill_(ts.table_scale(layer))
    return module


def as_rows(raw: np.ndarray, dtype) -> torch.Tensor:
    """``read_rows`` bytes as SGLang's gather emits them: the row values in bf16."""
    return torch.from_numpy(raw).view(dtype).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


# --- scenarios -----------------------------------------------------------------------------------
def check_ids(spec, tables_layers) -> None:
    """SGLang's ids (``_prepare_ple_batch``, ``compute_ngram_ids``: its torch path) against the spec hash."""
    from engram_store.models.hashing import row_ids_numpy

    lengths = [700, 1, 900, 2, 450, 1000, 3]
    tokens, cu, history = step(spec, seed=5, lengths=lengths, eos_share=0.08)
    positions = 0
    for layer, module in tables_layers:
        with sglang_step(tokens, cu, history, spec.pad_id) as (batch, _):
            ids = module.compute_ngram_ids(batch).numpy()
        want = row_ids_numpy(spec, layer, tokens, cu, history)
        np.testing.assert_array_equal(ids, want, err_msg=f"layer {layer}: SGLang's ids differ from the spec hash")
        positions += tokens.size
    ok(f"ids {positions} positions ({len(tables_layers)} layers, {len(lengths)} requests, "
       f"{int((tokens == spec.pad_id).sum())} EOS tokens, EOS and continued histories) equal the spec hash")


def check_layer(plugin, spec, ts, layer: int, where: str) -> None:
    tokens, cu, history = step(spec, seed=7 + layer, lengths=[20, 1, BATCH_TOKENS - 21])
    ref = reference(plugin.originals[NGRAM_INIT], spec, ts, layer)
    fmt = spec.row_format.payload_dtype
    dtype = ref.ngram_embedding.weight.dtype
    with sglang_step(tokens, cu, history, spec.pad_id) as (batch, fb):
        ids = ref.compute_ngram_ids(batch)
        want = ref.forward(batch, fb)
        raw = ts.read_rows(layer, ids.numpy().reshape(-1))
        for offload in (True, False):
            module = build(spec, layer, offload)
            emb = module.ngram_embedding
            assert plugin.tables().owns(emb.weight.data_ptr()), "the table is not the daemon's"
            assert float(emb.weight_scale[0]) == float(ref.ngram_embedding.weight_scale[0])
            if offload:
                rows = emb.gather(ids)
                assert same(rows.view(-1, spec.row_format.dim), as_rows(raw, dtype)), "gathered rows != read_rows"
                assert same(module.forward(batch, fb), want), "offload forward differs from SGLang's own"
                ok(f"layer {layer} {where} {fmt} offload gather: equal to SGLang's own and read_rows")
                assert same(prefetched(module, batch, fb), want), "the prefetch seam differs from SGLang's own"
                ok(f"layer {layer} {where} {fmt} offload prefetch seam: equal to SGLang's own")
            else:
                assert same(module.forward(batch, fb), want), "inline forward differs from SGLang's own"
                ok(f"layer {layer} {where} {fmt} inline lookup: equal to SGLang's own")
    full = as_rows(raw, dtype).view(*ids.shape, -1)
    bounds = []
    for rank in (0, 1):
        emb = build(spec, layer, True, tp=(2, rank)).ngram_embedding
        start, end = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
        bounds.append((start, end))
        out = torch.empty(*ids.shape, spec.row_format.dim, dtype=torch.bfloat16)
        emb.gather(ids, out=out)
        mine = (ids >= start) & (ids < end)
        assert mine.any() and (~mine).any(), "a rank owns all or none of the step's rows"
        assert same(out[mine], full[mine]) and not out[~mine].view(torch.int16).any(), f"TP rank {rank}'s rows"
    assert bounds[0][0] == 0 and bounds[0][1] == bounds[1][0] and bounds[1][1] == spec.rows(layer), bounds
    ok(f"layer {layer} {where} {fmt}: 2 TP ranks own rows {bounds}: each its rows exact, zeros elsewhere")


def refused(what: str, call) -> None:
    from engram_store.errors import EngineUnsupported, ModelMismatch

    try:
        call()
    except (ModelMismatch, EngineUnsupported) as exc:
        ok(f"refused ({what}): {type(exc).__name__}: {exc}")
    else:
        raise AssertionError(f"{what} was accepted")


def holder(module, layer: int):
    """A model holding ``module`` where SGLang's checkpoint names put it (for ``_load_qwen4_exp_ple_buffer``)."""
    root = cur = torch.nn.Module()
    for part in PREFIX.format(layer).split(".")[:-1]:
        cur.add_module(part, torch.nn.Module())
        cur = getattr(cur, part)
    cur.add_module("ple_embedding", module)
    return root


def check_refusals(spec, ts, tmp: Path) -> None:
    import safetensors.torch
    import sglang.srt.models.qwen4_exp as Q
    from sglang.srt.model_loader import weight_utils

    layer = spec.layers[0]
    refused("another prime base", lambda: build(spec, layer, True, ngram_vocab_size_base=spec.table_base + 1000))
    other = None if spec.row_format.payload_dtype == "float8_e4m3fn" else "float8_e4m3fn"
    refused("another row format", lambda: build(spec, layer, True, ple_embedding_dtype=other))
    refused("another seed", lambda: build(spec, layer, True, seed=spec.seed + 1))
    refused("the file backend", lambda: build(spec, layer, True, ple_offload_backend="file"))
    check_staging_size(spec)
    module = build(spec, layer, True)
    model = holder(module, layer)
    refused("--load-format dummy", lambda: weight_utils.initialize_dummy_weights(model))
    buffers = dict(model.named_buffers())
    name = f"{PREFIX.format(layer)}.ngram_embedding.weight_scale"
    load = Q.Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer
    scale = ts.table_scale(layer)
    if scale is not None:
        assert load(model, name, torch.tensor([scale], dtype=torch.bfloat16), buffers, set())
        refused("another checkpoint scale", lambda: load(model, name, torch.tensor([scale * 2], dtype=torch.bfloat16),
                                                         buffers, set()))
    mults = module.layer_multipliers.clone()
    refused("other checkpoint multipliers", lambda: load(model, f"{PREFIX.format(layer)}.layer_multipliers",
                                                         mults + 2, buffers, set()))
    module.layer_multipliers.copy_(mults)
    p = "model.language_model.layers.1.ple.ple_embedding."
    tensors = {p + "ngram_embedding.shard_0.weight": torch.zeros(4, 8, dtype=torch.uint8),
               p + "ngram_embedding.weight_scale": torch.ones(1, dtype=torch.bfloat16),
               p + "layer_multipliers": mults, "model.language_model.layers.1.ple.key_proj.weight": torch.ones(2, 2)}
    path = tmp / "ckpt.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    for got in (dict(weight_utils.safetensors_weights_iterator([str(path)])),
                dict(weight_utils.buffered_multi_thread_safetensors_weights_iterator([str(path)], max_workers=1))):
        assert set(got) == set(tensors) - {p + "ngram_embedding.shard_0.weight"}, sorted(got)
    ok("checkpoint's PLE table tensors skipped (never read), its scale and hash buffers read")


def check_staging_size(spec) -> None:
    """A cached layer's staging as SGLang's published schedule sizes a step (a prefill chunk, grown by a
    quarter, beside each running request's draft tokens); chunked prefill off refused at build."""
    import types

    import sglang.srt.runtime_context as rc

    from engram_store.integrations.install import installed
    from engram_store.integrations.sglang.qwen4exp import served

    cached = [layer for layer in spec.layers if not installed("SGLang").tables().is_resident(layer)]
    if not cached:
        return
    real = rc.get_schedule, rc.get_spec
    rc.get_spec = lambda: types.SimpleNamespace(speculative_num_draft_tokens=3)
    try:
        rc.get_schedule = lambda: types.SimpleNamespace(chunked_prefill_size=64, max_prefill_tokens=32,
                                                        max_running_requests=5)
        got = served(build(spec, cached[0], True).ngram_embedding).job.max_rows
        want = min((80 + 5 * 3) * spec.rows_per_token, spec.rows(cached[0]))
        assert want <= got < want + 512, (got, want)  # the fetch job rounds its rows up
        ok(f"cached layer {cached[0]}: staging of {got} rows >= (1.25 x 64 + 5 x 3 tokens) x {spec.rows_per_token}")
        rc.get_schedule = lambda: types.SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=16384,
                                                        max_running_requests=5)
        refused("chunked prefill off with a cached layer", lambda: build(spec, cached[0], True))
    finally:
        rc.get_schedule, rc.get_spec = real


def check_corrupt(spec, plugin, layer: int, page: int) -> None:
    """A step of cached ``layer`` reading flipped ``page``: its rows zero, then SGLang's
    ``Scheduler.process_batch_result`` raises CorruptRows before its own result processing."""
    from support.qwen4exp_batch import batch as vllm_batch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from engram_store.errors import CorruptRows
    from engram_store.format.layout import PAGE_BYTES

    processed = []
    scheduler = Scheduler.__new__(Scheduler)  # what process_batch_result reads around its dispatch
    scheduler.__dict__.update(
        scheduler_stage_metrics=None, publish_load_snapshot=lambda force=False: None, enable_fpm=False,
        load_publisher=types.SimpleNamespace(publish_load_stat=lambda *a, **k: None),
        load_inquirer=types.SimpleNamespace(get_loads=None), disaggregation_mode=None,
        batch_result_processor=types.SimpleNamespace(process_batch_result_prefill=lambda b, r: processed.append(b)),
        tree_cache=types.SimpleNamespace(flush_pending_backups=lambda: None),
        _record_step_counters=lambda batch, result: None, _maybe_clear_mm_inputs=lambda batch: None,
        metrics_reporter=types.SimpleNamespace(log_batch_result_stats=lambda b, r: None,
                                               update_device_timer=lambda: None),
        maybe_send_health_check_signal=lambda: None)
    step_batch = types.SimpleNamespace(reqs=[], forward_mode=ForwardMode.EXTEND, is_dllm=lambda: False)
    result = types.SimpleNamespace(copy_done=None, next_token_ids=torch.zeros(1, dtype=torch.int64))
    scheduler.process_batch_result(step_batch, result)  # a good step (layer 3's): SGLang's own runs
    assert processed, "a good step's result was not processed"
    tokens, cu, history = vllm_batch(spec, seed=11)  # the step the test flipped a page of
    module = build(spec, layer, True)
    with sglang_step(tokens, cu, history, spec.pad_id) as (b, fb):
        ids = module.compute_ngram_ids(b)
        got = module.forward(b, fb)
    bad = (ids // (PAGE_BYTES // spec.row_bytes)) == page
    assert bad.any(), f"the step reads no row of page {page}"
    assert not got.view(*ids.shape, -1)[bad].view(torch.int16).any(), "a row of the failed page is not zero"
    processed.clear()
    try:
        scheduler.process_batch_result(step_batch, result)
    except CorruptRows as exc:
        assert exc.layer == layer and page in exc.pages and not processed, exc
        ok(f"CorruptRows at process_batch_result: layer {layer}, page {page}, before SGLang's own: {exc}")
    else:
        raise AssertionError("a step reading a page that fails its checksum was not raised")


# --- prompt hints ----------------------------------------------------------------------------------
def check_hints(spec, layers, avoid=None) -> None:
    """The cached PLE ``layers``' prompt hints (``support/sglang_ngram_hints.py``; ``avoid``: a layer's flipped
    page the prompt must not read): each chunk's ids are SGLang's (``_prepare_ple_batch`` over the prompt's
    look-back, ``compute_ngram_ids``), fetched through the inline lookup of the plugin's layer."""
    from support.sglang_ngram_hints import hint_prompt, sglang_hints

    first = 40
    prompt = hint_prompt(spec, avoid, first=first)
    modules = {layer: build(spec, layer, False) for layer in layers}
    h = spec.history_len

    def chunk(start: int, end: int) -> dict:
        context = np.concatenate([np.full(h, spec.pad_id), prompt[:start]])[-h:][None]  # EOS before the prompt
        out = {}
        for layer, module in modules.items():
            with sglang_step(prompt[start:end], np.array([0, end - start]), context, spec.pad_id) as (batch, fb):
                ids = module.compute_ngram_ids(batch).numpy()
                module.forward(batch, fb)
            served = module.ngram_embedding.__dict__["_engram_store_ple"]
            out[layer] = ids, served.ids[: ids.size].numpy().copy()
        return out

    sglang_hints(prompt, first, chunk)


def scenario_serve(tables_dir: str, page: str | None = None) -> None:
    import tempfile

    from engram_store.format.tableset import TableSet

    plugin = load_plugin()
    ts = TableSet.open(tables_dir)
    spec, tables = ts.spec, plugin.tables()
    with ranks():  # TP rank 0 of 1 (two ranks: build's own)
        check_ids(spec, [(layer, build(spec, layer, True)) for layer in spec.layers])
        for layer in spec.layers[:2]:
            check_layer(plugin, spec, ts, layer, "resident" if tables.is_resident(layer) else "cached")
        with tempfile.TemporaryDirectory() as tmp:
            check_refusals(spec, ts, Path(tmp))
        check_hints(spec, [layer for layer in spec.layers if not tables.is_resident(layer)],
                    None if page is None else (spec.layers[2], int(page)))
        if page is not None:
            check_corrupt(spec, plugin, spec.layers[2], int(page))


def scenario_refuse(tables_dir: str) -> None:
    from engram_store.format.tableset import TableSet

    load_plugin()
    spec = TableSet.open(tables_dir).spec
    refused("an NVFP4 table", lambda: build(spec, spec.layers[0], True, ple_embedding_dtype="float8_e4m3fn"))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](*sys.argv[2:])
