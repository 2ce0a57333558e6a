"""vLLM 0.33's own LongCat-Flash n-gram embedding on CPU through the engram-store plugin, one scenario a process.

    CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S python tests/support/vllm_longcat_plugin.py SCENARIO TABLES [PAGE]

``lookups``: vLLM's ``NgramEmbedding`` built with the plugin (``oe_embedder``'s rows the daemon's, resident or cached
as the daemon holds the table) runs ``embed_batched`` (what ``LongcatNgramModelState.prepare_inputs`` calls) on ids
of our hash (tests/test_longcat.py holds them equal to vLLM's): its output equals, bit for bit, that of vLLM's own
``NgramEmbedding`` (the plugin's replacements taken back out) whose table vLLM's own ``load_weight`` filled from
``TableSet.read_rows``, projections alike; the lookups ``oe_embedder`` returns equal ``read_rows``; on two simulated
TP ranks each rank's output equals vLLM's own rank's, and the two ranks' masked lookups sum to the whole; the model
config is checked (a mismatch named). ``PAGE``: a page of the table failing its checksum (flipped after the daemon
started): the lookups avoid it, then a step reading it raises ``CorruptRows`` naming layer 0 and the page from
``embed_batched``, before its rows are used.

CPU stand-ins, nothing else: the word embedding handed to ``NgramEmbedding`` (a small table: the model's own is
another module), vLLM's current config (``max_num_batched_tokens``, which sizes a cached table's staging) and, for
two TP ranks, the rank functions and all-reduce ``vocab_parallel_embedding`` imported (the test sums the ranks).
Prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.append(str(Path(__file__).resolve().parents[1] / "engines"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

NGRAM = "vllm.model_executor.models.longcat_flash_ngram"
VPE = "vllm.model_executor.layers.vocab_parallel_embedding"
MAX_TOKENS = 128
TOKENS = 96


def ok(what: str) -> None:
    print(f"OK {what}", flush=True)


def setup():
    """The plugin installed over vLLM, vLLM's gloo groups of one process; returns (patches, plugin)."""
    import vllm.config
    from vllm_engine import init_distributed

    from engram_store.integrations.vllm import patches

    plugin = patches.install(os.environ["ENGRAM_STORE_ADDR"])
    init_distributed()
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=MAX_TOKENS))
    vllm.config.get_current_vllm_config = lambda: config
    return patches, plugin


def hf_config(spec, **override):
    from transformers import LongcatFlashConfig

    k, n = spec.heads, spec.max_ngram
    fields = dict(vocab_size=spec.compressed_vocab, hidden_size=spec.row_format.dim * k * (n - 1),
                  eos_token_id=spec.pad_id, ngram_vocab_size_ratio=spec.table_base / spec.compressed_vocab,
                  emb_neighbor_num=n, emb_split_num=k, dtype="bfloat16")
    return LongcatFlashConfig(**(fields | override))


class Word(torch.nn.Module):
    """The word embedding ``NgramEmbedding`` fuses with (a 61-row stand-in of the model's)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.table = torch.randn(61, hidden, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    def forward(self, ids):
        return self.table[ids % 61]


def projections(spec) -> dict:
    """``post_projs.{e}.weight`` ``[hidden, oe_dim]`` (random, seeded), as the checkpoint holds them."""
    g = torch.Generator().manual_seed(11)
    hidden = spec.row_format.dim * spec.rows_per_token
    return {f"ngram_embeddings.post_projs.{e}.weight": (torch.randn(hidden, spec.row_format.dim, generator=g) / 16)
            .to(torch.bfloat16) for e in range(spec.rows_per_token)}


def build(L, spec, cls=None, **override):
    """An ``NgramEmbedding`` (``cls``: vLLM's own) built inside a model runner's load_model, its projections loaded."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from engram_store.integrations.vllm import runners

    config = hf_config(spec, **override)
    with runners.model_runner(object.__new__(GPUModelRunner)):
        ne = (cls or L.NgramEmbedding)(config, Word(config.hidden_size))
    for name, weight in projections(spec).items():
        ne.load_weight(name, weight)
    return ne


def stock(L, plugin):
    """vLLM's own ``NgramEmbedding``: the plugin's replacements taken back out."""
    o = plugin.originals
    return type("StockNgramEmbedding", (L.NgramEmbedding,), {
        "_init_ngram_embeddings": o["longcat_init"], "load_weight": o["longcat_load_weight"],
        "embed_batched": o["longcat_embed_batched"]})


def reference(L, plugin, spec, rows):
    """vLLM's own ``NgramEmbedding``, its table filled by its own ``load_weight`` from ``rows`` (``read_rows``)."""
    ref = build(L, spec, stock(L, plugin))
    off = ref._offsets
    for e in range(len(off) - 1):
        ref.load_weight(f"model.ngram_embeddings.embedders.{e}.weight",
                        torch.from_numpy(rows[off[e]:off[e + 1]].copy()).view(torch.bfloat16))
    return ref


def step_ids(spec, seed: int, avoid: int | None = None):
    """``(input_ids, oe_ids [T, 12])``: three requests with EOS, ids from our hash; ids of page ``avoid`` moved off it;
    the first row of each rank range's ends included."""
    from engram_store.format.layout import PAGE_BYTES
    from engram_store.models.hashing import row_ids_numpy

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, spec.compressed_vocab, TOKENS)
    tokens[rng.random(TOKENS) < 0.1] = spec.pad_id
    ids = row_ids_numpy(spec, 0, tokens, [0, 30, 31, TOKENS])
    total = spec.rows(0)
    half = -(-total // 64) * 64 // 2  # two TP ranks' boundary (vLLM pads the table to 64 rows)
    ids[1, :4] = [0, half - 1, half, total - 1]
    if avoid is not None:
        rpp = PAGE_BYTES // spec.row_bytes
        ids[ids // rpp == avoid] = (avoid + 1) * rpp if (avoid + 1) * rpp < total else 0
    return torch.from_numpy(tokens), torch.from_numpy(ids)


class Lookups:
    """Records what ``oe_embedder`` returns (the masked lookup, before ``bmm``)."""

    def __init__(self, *modules) -> None:
        self.out = []
        for m in modules:
            m.oe_embedder.register_forward_hook(lambda mod, args, output: self.out.append(output.clone()))


def refusal(attempt, error: type) -> str | None:
    """The message of the ``error`` that ``attempt()`` raises; None when it raises none."""
    try:
        attempt()
    except error as exc:
        return str(exc)
    return None


def tp_rank(rank: int, size: int):
    """vocab_parallel_embedding's rank functions and all-reduce (identity) as TP rank ``rank`` of ``size``."""
    import importlib

    V = importlib.import_module(VPE)
    V.get_tensor_model_parallel_rank = lambda: rank
    V.get_tensor_model_parallel_world_size = lambda: size
    V.tensor_model_parallel_all_reduce = lambda x: x


def scenario_lookups(tables_dir: str, page: str | None = None) -> None:
    import importlib

    from engram_store.errors import CorruptRows, ModelMismatch
    from engram_store.format.tableset import TableSet

    patches, plugin = setup()
    L = importlib.import_module(NGRAM)
    ts = TableSet.open(tables_dir)
    spec, tables = ts.spec, patches.tables()
    where = "resident" if tables.is_resident(0) else "cached"
    avoid = None if page is None else int(page)
    rows = ts.read_rows(0, np.arange(spec.rows(0)))
    input_ids, oe_ids = step_ids(spec, 3, avoid)
    want_rows = ts.read_rows(0, oe_ids.T.reshape(-1).numpy()).reshape(spec.rows_per_token, TOKENS, -1)

    tp_rank(0, 1)
    ne, ref = build(L, spec), reference(L, plugin, spec, rows)
    assert tables.owns(ne.oe_embedder.weight.data_ptr()), "oe_embedder's rows are not the daemon's"
    assert not tables.owns(ref.oe_embedder.weight.data_ptr()), "the reference reads the daemon's rows"
    assert ne.oe_embedder.weight.shape[0] == (spec.rows(0) if where == "resident" else MAX_TOKENS * 12)
    seen = Lookups(ne, ref)
    got, want = ne.embed_batched(input_ids, oe_ids), ref.embed_batched(input_ids, oe_ids)
    assert got.shape == (TOKENS, spec.row_format.dim * spec.rows_per_token) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "embed_batched differs from vLLM's own"
    np.testing.assert_array_equal(seen.out[0].view(torch.uint8).numpy(), want_rows)
    np.testing.assert_array_equal(seen.out[1].view(torch.uint8).numpy(), want_rows)
    assert ne.load_weight("model.ngram_embeddings.embedders.0.weight",
                          torch.zeros(spec.table_base + 1, spec.row_format.dim, dtype=torch.bfloat16)) \
        == "ngram_embeddings.oe_embedder.weight"  # the checkpoint's rows: never written over the daemon's
    assert torch.equal(ne.embed_batched(input_ids, oe_ids).view(torch.int16), want.view(torch.int16))
    ok(f"{where}: embed_batched of {TOKENS} tokens equals vLLM's own NgramEmbedding loaded from "
       "TableSet.read_rows, its lookups read_rows' bytes")

    parts, total = [], spec.rows(0)
    half = -(-total // 64) * 64 // 2
    for rank in (0, 1):
        tp_rank(rank, 2)
        ne, ref = build(L, spec), reference(L, plugin, spec, rows)
        index = ne.oe_embedder.shard_indices
        assert (index.org_vocab_start_index, index.org_vocab_end_index) == (rank * half, min((rank + 1) * half, total))
        seen = Lookups(ne, ref)
        got, want = ne.embed_batched(input_ids, oe_ids), ref.embed_batched(input_ids, oe_ids)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"rank {rank} differs from vLLM's own"
        assert torch.equal(seen.out[0].view(torch.int16), seen.out[1].view(torch.int16))
        parts.append(seen.out[0].view(torch.uint8).numpy().astype(np.int32))
    tp_rank(0, 1)
    assert not ((parts[0] > 0) & (parts[1] > 0)).any(), "both TP ranks gave bytes of one row"
    assert (parts[0] > 0).any() and (parts[1] > 0).any()
    np.testing.assert_array_equal((parts[0] + parts[1]).astype(np.uint8), want_rows)
    ok(f"{where}: 2 TP ranks own rows [0, {half}) and [{half}, {total}); each equals vLLM's own rank, their "
       "lookups sum to the whole")

    bigger = {"ngram_vocab_size_ratio": (spec.table_base + 64) / spec.compressed_vocab}
    for override, field in ((bigger, "rows of Engram layer 0"), ({"dtype": "float16"}, "LongCat table dtype")):
        message = refusal(lambda: build(L, spec, **override), ModelMismatch)
        assert message is not None and field in message, (override, message)
        ok(f"mismatch named: {message.split(';')[0]}")

    if avoid is None:
        return
    ne = build(L, spec)
    from engram_store.format.layout import PAGE_BYTES

    bad = oe_ids.clone()
    bad[5, 7] = avoid * (PAGE_BYTES // spec.row_bytes) + 1
    seen = Lookups(ne)
    try:
        ne.embed_batched(input_ids, bad)
    except CorruptRows as exc:
        assert exc.layer == 0 and avoid in exc.pages, exc
        assert not seen.out, "the failed fetch's rows were looked up"
        ok(f"CorruptRows from embed_batched before its rows were used: {exc}")
    else:
        raise AssertionError("a step reading a page that fails its checksum was not raised")


def scenario_hints(tables_dir: str) -> None:
    """A cached table's prompt hints equal the rows vLLM's later chunks fetch: each chunk's ids from vLLM's own
    ``LongcatNgramModelState`` (``add_request``, then ``_compute_oe_ids`` rolling the EOS-negated token table
    chunk after chunk; its id op the CPU stand-in of longcat_ref.py), looked up through the plugin's
    ``embed_batched``. The model state's runner-side base is a stand-in setting the sizes it reads."""
    import importlib

    from longcat_ref import register_standin
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm_ngram_hints import hinted_then_fetched

    from engram_store.format.tableset import TableSet

    patches, plugin = setup()
    L = importlib.import_module(NGRAM)
    spec = TableSet.open(tables_dir).spec
    assert not patches.tables().is_resident(0)
    tp_rank(0, 1)
    register_standin()
    ne = build(L, spec)
    served = ne.__dict__["_engram_store"]

    def runner_part(self, vllm_config, model, encoder_cache, device):
        self.model, self.device, self.dtype, self.max_num_reqs, self.max_num_tokens = model, device, torch.bfloat16, \
            4, MAX_TOKENS
        self.rope_state = self.prompt_embeds_state = None

    model = types.SimpleNamespace(config=ne.config, model=types.SimpleNamespace(ngram_embeddings=ne))
    real, DefaultModelState.__init__ = DefaultModelState.__init__, runner_part
    try:
        state = L.LongcatNgramModelState(None, model, None, torch.device("cpu"))
    finally:
        DefaultModelState.__init__ = real
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, spec.compressed_vocab, 300)
    prompt[rng.random(prompt.size) < 0.08] = spec.pad_id
    prompt[[63, 64, 127, 129]] = spec.pad_id  # EOS at the chunks' edges: grams cut across them, EOS rows at offsets
    request = list(map(int, prompt))
    state.add_request(0, types.SimpleNamespace(num_computed_tokens=0, prefill_token_ids=request,
                                               prompt_token_ids=request))
    done, steps = [0], []

    def ids(start: int, end: int):
        batch = types.SimpleNamespace(num_reqs=1, num_tokens=end - start, idx_mapping=torch.zeros(1, dtype=torch.int32),
                                      query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                                      input_ids=torch.from_numpy(prompt[start:end].astype(np.int32)))
        done[0] = end
        return batch.input_ids, state._compute_oe_ids(batch)

    def chunk(start: int, end: int) -> None:
        if done[0] < start:
            ids(done[0], start)  # the first chunk: its context rolls as vLLM's does (its rows are not checked)
        input_ids, oe_ids = ids(start, end)
        steps.append(oe_ids.reshape(-1))
        ne.embed_batched(input_ids, oe_ids)  # what prepare_inputs hands it

    def fetched():
        got = served.ids[: steps[-1].numel()].clone()
        assert torch.equal(got, steps[-1]), "the fetch job asked for other rows than vLLM's ids"
        return got.numpy()

    hinted_then_fetched(prompt, 64, chunk, fetched)


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](*sys.argv[2:])
