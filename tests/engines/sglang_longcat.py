"""SGLang 0.5.23's own LongCat-Flash n-gram embedding on CPU through the engram-store plugin, one process a run.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \
        .venv-sglang/bin/python tests/engines/sglang_longcat.py TABLES [PAGE]

SGLang's ``NgramEmbedding`` is built with the plugin (``oe_embeder``'s rows the daemon's, resident or cached as
the daemon holds the table) and fed as SGLang feeds it: its ``NgramEmbeddingManager.prepare_for_forward`` fills the
per-request token table for chunked extends (fresh, prefix < n and prefix >= n chunks, reused slots), its
``update_ngram_token_table_after_sampling`` writes each decoded token, and ``forward`` computes the ids and the
embeddings. Checked:

* the ids SGLang computes (several thousand positions, EOS about 10% of tokens, request starts) equal
  engram-store's hash with SGLang's EOS rule (``eos_current = "rehash"``), and ``oe_embeder`` returns
  ``TableSet.read_rows``' bytes for them;
* ``forward`` equals, bit for bit, that of SGLang's own ``NgramEmbedding`` (the plugin's hooks taken back out)
  whose table SGLang's own ``load_weight`` filled from ``TableSet.read_rows``; on two simulated TP ranks each rank's
  output equals SGLang's own rank's and the ranks' lookups sum to the whole;
* a config the daemon does not serve is refused naming the field; DP attention is refused;
* cached table: a prefill SGLang's scheduler plans (its own ``Req``) hints the rows of the prompt's later chunks
  (SGLang's EOS rule), which are the rows those chunks fetch by SGLang's ids, read ahead and hit; the hints are
  withdrawn when the request finishes (``tests/support/sglang_ngram_hints.py``); a resident table hints nothing;
* ``PAGE`` (cached table, that page flipped after the daemon started): the steps above never read it (their
  tokens are chosen so); then a step reading it computes on, and SGLang's ``Scheduler.process_batch_result``
  (the plugin's hook) raises ``CorruptRows`` naming layer 0 and the page before SGLang's own result processing.

CPU stand-ins, nothing else (SGLang's id and token-table ops are CUDA-only JIT kernels, ``kDLGPU``):
``compute_n_gram_ids`` is tests/support/longcat_ref.py's ``kernel_ids`` with SGLang's EOS rule (a loop reading of
SGLang's ``ComputeNGramIdsKernel``), ``update_token_table`` a slice copy (``UpdateTokenTableKernel`` without ignored
tokens), ``NgramEmbedding``'s ``device="cuda"`` buffer made on the CPU; ranks come from SGLang's
``get_parallel().override`` and the all-reduce is the identity (the test sums the ranks); ``n_gram_embedding``'s
``torch.bmm`` multiplies in float32 and rounds to bfloat16 (CPU bfloat16 bmm takes seconds a step), in the plugin's
and the reference's forward alike.
Prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang_engine import load_plugin, ranks  # noqa: E402  (also the CPU op schemas SGLang's import needs)
from engine_helpers import ok  # noqa: E402
from support.longcat_ref import kernel_ids  # noqa: E402

NGRAM = "sglang.srt.layers.n_gram_embedding"
MANAGER = "sglang.srt.model_executor.model_runner_components.ngram_embedding_manager"
VPE = "sglang.srt.layers.vocab_parallel_embedding"
CHUNK, SLOTS, CONTEXT = 512, 8, 1024  # chunked_prefill_size, request slots, context_len
WORD_ROWS = 61  # rows of the word-embedding stand-in


# --- CPU stand-ins ------------------------------------------------------------------------------
class _CpuTorch(types.ModuleType):
    """``torch`` for ``n_gram_embedding``: its ``device="cuda"`` buffer on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kw):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)

    @staticmethod
    def bmm(a, b, *, out):
        return out.copy_(torch.bmm(a.float(), b.float()))  # CPU bf16 bmm takes seconds; float32, then rounded


def compute_n_gram_ids(ne_n, ne_k, ne_weights, ne_mods, exclusive_ne_embedder_size_sums, tokens,
                       exclusive_req_len_sums, ne_token_table, row_indices, column_starts, n_gram_ids, eos_token_id):
    got = kernel_ids(ne_n, ne_k, ne_weights.tolist(), ne_mods.tolist(), exclusive_ne_embedder_size_sums.tolist(),
                     exclusive_req_len_sums.tolist(), ne_token_table.tolist(), row_indices.tolist(),
                     column_starts.tolist(), eos=eos_token_id)
    if got:
        n_gram_ids[: len(got)] = torch.tensor(got, dtype=torch.int32)


def update_token_table(tokens, ne_token_table, row_indices, column_starts, req_lens, ignore_tokens=None):
    at = 0
    for row, col, n in zip(row_indices.tolist(), column_starts.tolist(), req_lens.tolist()):
        ne_token_table[row, col: col + n] = tokens[at: at + n]
        at += n


def setup():
    from engram_store.integrations.install import installed

    importlib.import_module(NGRAM)  # before the plugin loads: the snapshot sees what its hooks change
    changed = load_plugin()
    assert (NGRAM + ".NgramEmbedding", "__init__") in changed, "the plugin's LongCat hooks are not in place"
    NG, M, V = (importlib.import_module(name) for name in (NGRAM, MANAGER, VPE))
    NG.torch = _CpuTorch("torch")
    NG.compute_n_gram_ids = compute_n_gram_ids
    M.update_token_table = update_token_table
    V.tensor_model_parallel_all_reduce = lambda x: x
    return NG, M, installed("SGLang")


# --- the requests, as SGLang's scheduler hands them over ----------------------------------------
def requests(spec, rng, avoid_page=None):
    """Four requests' tokens (EOS ~10%, a run of EOS, token 0 and vocab-1); with ``avoid_page``, tokens changed
    until no id of our hash (SGLang's rule) lands on that page."""
    from engram_store.format.layout import PAGE_BYTES
    from engram_store.models.hashing import row_ids_numpy

    rehash = dataclasses.replace(spec, eos_current="rehash")
    seqs = []
    for length in (900, 300, 700, 650):
        seq = rng.integers(0, spec.compressed_vocab, length)
        seq[rng.random(length) < 0.1] = spec.pad_id
        seq[5:8] = spec.pad_id
        seq[rng.random(length) < 0.01] = 0
        seq[rng.random(length) < 0.01] = spec.compressed_vocab - 1
        while avoid_page is not None:
            hit = (row_ids_numpy(rehash, 0, seq) // (PAGE_BYTES // spec.row_bytes) == avoid_page).any(axis=1)
            if not hit.any():
                break
            seq[int(np.argmax(hit))] = rng.integers(1, spec.compressed_vocab)
        seqs.append(seq)
    return seqs


def plan(seqs):
    """Steps: ``("extend", [(request, start, end)])`` chunks of at most CHUNK tokens, then decode steps."""
    steps = [[(0, 0, 200), (1, 0, 2), (2, 0, 300)],  # fresh requests; request 1 stops at 2 tokens (< n)
             [(0, 200, 500), (1, 2, 200)],  # a prefix >= n, a prefix < n
             [(0, 500, 880), (3, 0, 120)],
             [(2, 300, 680), (3, 120, 250)],
             [(1, 200, 290), (3, 250, 630)]]
    prompt = {r: max(end for step in steps for q, _, end in step if q == r) for r in range(len(seqs))}
    decodes = min(len(s) - prompt[r] for r, s in enumerate(seqs))
    return [("extend", step) for step in steps] + [("decode", prompt, d) for d in range(decodes)]


class Feed:
    """SGLang's manager and forward batches for one ``NgramEmbedding`` (its own token table)."""

    def __init__(self, M, seqs, n: int) -> None:
        self.seqs = seqs
        self.manager = M.NgramEmbeddingManager(enabled=True, table=torch.zeros(SLOTS, CONTEXT, dtype=torch.int32), n=n)
        self.M = M
        self.slots = [3, 0, 5, 1]  # req_pool_idx of each request

    def batch(self, step):
        from sglang.srt.managers.schedule_batch import ForwardMode
        from sglang.srt.model_executor.forward_batch_info import NgramEmbeddingInfo

        if step[0] == "extend":
            chunks = step[1]
            reqs = [types.SimpleNamespace(origin_input_ids=self.seqs[r][:end].tolist(), output_ids=[])
                    for r, _, end in chunks]
            pool = torch.tensor([self.slots[r] for r, _, _ in chunks])
            schedule = types.SimpleNamespace(reqs=reqs, prefix_lens=[s for _, s, _ in chunks], req_pool_indices=pool,
                                             extend_lens=[e - s for _, s, e in chunks], forward_mode=ForwardMode.EXTEND)
            self.manager.prepare_for_forward(schedule, chunked_req=None)
            tokens = np.concatenate([self.seqs[r][s:e] for r, s, e in chunks])
            info = NgramEmbeddingInfo.create(self.manager.table, len(chunks), "cpu",
                                             column_starts=torch.tensor([s for _, s, _ in chunks], dtype=torch.int32),
                                             req_lens=torch.tensor([e - s for _, s, e in chunks], dtype=torch.int32))
            mode, positions = ForwardMode.EXTEND, [(r, s, e) for r, s, e in chunks]
        else:
            _, prompt, d = step
            order = list(range(len(self.seqs)))
            pool = torch.tensor([self.slots[r] for r in order])
            at = torch.tensor([prompt[r] + d for r in order], dtype=torch.int32)  # the column the decoded token fills
            tokens = np.array([self.seqs[r][prompt[r] + d] for r in order])
            info = NgramEmbeddingInfo.create(self.manager.table, len(order), "cpu")
            self.M.update_ngram_token_table_after_sampling(ngram_embedding_info=info, next_token_ids=torch.from_numpy(
                tokens), req_pool_indices=pool, seq_lens=at, batch_size=len(order))  # sampled, written by SGLang
            info.column_starts[:] = at  # the decode forward: seq_lens - 1
            info.req_lens[:] = 1
            mode, positions = ForwardMode.DECODE, [(r, prompt[r] + d, prompt[r] + d + 1) for r in order]
        fb = types.SimpleNamespace(forward_mode=mode, ngram_embedding_info=info, req_pool_indices=pool,
                                   batch_size=len(positions))
        return torch.from_numpy(tokens.astype(np.int64)), fb, positions


# --- the models -----------------------------------------------------------------------------------
def build(NG, spec, cls=None, tp=(1, 0), **override):
    """An ``NgramEmbedding`` (``cls``: SGLang's own) on TP rank ``tp[1]`` of ``tp[0]``, its buffers made, the word
    embedding and projections loaded (seeded, the same for every build)."""
    args = dict(num_embeddings=spec.compressed_vocab, embedding_dim=spec.row_format.dim * spec.rows_per_token,
                over_embedding_m=spec.table_base, over_embedding_k=spec.heads, over_embedding_n=spec.max_ngram,
                eos_token_id=spec.pad_id) | override
    torch.set_default_dtype(torch.bfloat16)  # SGLang builds the model in its dtype
    try:
        with ranks(*tp):
            ne = (cls or NG.NgramEmbedding)(**args)
    finally:
        torch.set_default_dtype(torch.float32)
    ne.init_buffers(max_running_requests=SLOTS, chunked_prefill_size=CHUNK, device="cpu")
    g = torch.Generator().manual_seed(11)
    ne.word_embeder = Word(torch.randn(WORD_ROWS, args["embedding_dim"], generator=g).to(torch.bfloat16))
    for e in range(spec.rows_per_token):
        proj = (torch.randn(args["embedding_dim"], spec.row_format.dim, generator=g) / 16).to(torch.bfloat16)
        ne.load_weight(None, f"model.ngram_embeddings.post_projs.{e}.weight", proj)
    return ne


def stock(NG, plugin):
    """SGLang's own ``NgramEmbedding``: the plugin's hooks taken back out."""
    o = plugin.originals
    cls = f"{NGRAM}.NgramEmbedding"
    return type("StockNgramEmbedding", (NG.NgramEmbedding,), {
        "__init__": o[f"{cls}.__init__"], "init_buffers": o[f"{cls}.init_buffers"],
        "load_weight": o[f"{cls}.load_weight"]})


def reference(NG, plugin, spec, rows, tp=(1, 0)):
    """SGLang's own ``NgramEmbedding``, its table filled by its own ``load_weight`` from ``rows`` (``read_rows``)."""
    ref = build(NG, spec, stock(NG, plugin), tp)
    off = ref.exclusive_oe_embedder_size_sums.tolist()
    for e in range(len(off) - 1):
        ref.load_weight(None, f"model.ngram_embeddings.embedders.{e}.weight",
                        torch.from_numpy(rows[off[e]:off[e + 1]].copy()).view(torch.bfloat16))
    return ref


class Word(torch.nn.Module):
    """The word embedding ``NgramEmbedding`` fuses with: a 61-row stand-in of the model's (131,072 x 3,072)."""

    def __init__(self, table) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids):
        return self.table[ids % WORD_ROWS]


class Lookups:
    """What ``oe_embeder`` returns (SGLang's masked lookup, before ``bmm``)."""

    def __init__(self, ne) -> None:
        self.out = []
        ne.oe_embeder.register_forward_hook(lambda module, args, output: self.out.append(output.clone()))


def run(ne, feed, steps, tp=(1, 0)):
    """Each step's (ids [T, 12], lookups [12, T, dim], output [T, hidden]) through ``ne``'s forward."""
    seen = Lookups(ne)
    out = []
    for step in steps:
        tokens, fb, positions = feed.batch(step)
        with ranks(*tp):
            hidden = ne.forward(tokens, fb)
        out.append((ne.oe_n_gram_ids[: len(tokens)].clone().long(), seen.out[-1], hidden, positions))
    return out


def check_hints(NG, M, spec, avoid: int | None) -> None:
    """A cached table's prompt hints (``support/sglang_ngram_hints.py``: SGLang's own ``Req`` planned, the daemon's
    counters): each chunk's ids are SGLang's (its manager's token table, ``forward``'s id computation), fetched
    through the plugin's ``oe_embeder``; the prompt avoids the flipped page ``avoid`` (SGLang's EOS rule)."""
    from support.sglang_ngram_hints import hint_prompt, sglang_hints

    first = 32
    prompt = hint_prompt(dataclasses.replace(spec, eos_current="rehash"), None if avoid is None else (0, avoid),
                         first=first)
    ne = build(NG, spec)
    served, feed = ne.__dict__["_engram_store"], Feed(M, [prompt], spec.max_ngram)

    def chunk(start: int, end: int) -> dict:
        ((ids, _, _, _),) = run(ne, feed, [("extend", [(0, start, end)])])
        return {0: (ids.numpy(), served.ids[: ids.numel()].numpy().copy())}

    sglang_hints(prompt, first, chunk)


def main(tables_dir: str, page: str | None = None) -> None:
    from engram_store.errors import CorruptRows, EngineUnsupported, ModelMismatch
    from engram_store.format.layout import PAGE_BYTES
    from engram_store.format.tableset import TableSet
    from engram_store.models.hashing import row_ids_numpy

    NG, M, plugin = setup()
    ts = TableSet.open(tables_dir)
    spec, tables = ts.spec, plugin.tables()
    where = "resident" if tables.is_resident(0) else "cached"
    avoid = None if page is None else int(page)
    rows = ts.read_rows(0, np.arange(spec.rows(0)))
    seqs = requests(spec, np.random.default_rng(39), avoid)
    steps = plan(seqs)
    rehash = dataclasses.replace(spec, eos_current="rehash")
    want_ids = [row_ids_numpy(rehash, 0, s) for s in seqs]

    # one rank: every step's ids, lookups and embeddings
    ne = build(NG, spec)
    assert tables.owns(ne.oe_embeder.weight.data_ptr()), "oe_embeder's rows are not the daemon's"
    assert ne.oe_embeder.weight.shape[0] == (spec.rows(0) if where == "resident" else CHUNK * spec.rows_per_token)
    got = run(ne, Feed(M, seqs, spec.max_ngram), steps)
    positions = eos = 0
    for ids, looked, _, where_in in got:
        want = np.concatenate([want_ids[r][s:e] for r, s, e in where_in])
        np.testing.assert_array_equal(ids.numpy(), want)
        np.testing.assert_array_equal(looked.view(torch.uint8).numpy(),
                                      ts.read_rows(0, want.T.reshape(-1)).reshape(spec.rows_per_token, len(want), -1))
        positions += len(want)
        eos += sum(int((seqs[r][s:e] == spec.pad_id).sum()) for r, s, e in where_in)
    assert positions > 2000 and eos > 150, (positions, eos)
    ok(f"{where}: SGLang's ids of {positions} positions ({eos} EOS, {len(steps)} steps: chunked extends, decodes) "
       "equal engram-store's hash with SGLang's EOS rule; oe_embeder returned read_rows' bytes for them")

    # SGLang's own NgramEmbedding over read_rows: one rank and two
    few = steps[:2] + steps[-2:]
    ref = reference(NG, plugin, spec, rows)
    assert not tables.owns(ref.oe_embeder.weight.data_ptr()), "the reference reads the daemon's rows"
    one = run(build(NG, spec), Feed(M, seqs, spec.max_ngram), few)
    for (_, _, mine, _), (_, _, theirs, _) in zip(one, run(ref, Feed(M, seqs, spec.max_ngram), few)):
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), "forward differs from SGLang's own"
    ok(f"{where}: forward equals SGLang's own NgramEmbedding loaded from TableSet.read_rows, bit for bit")
    parts, total = [], spec.rows(0)
    for rank in (0, 1):
        tp = (2, rank)
        ne = build(NG, spec, tp=tp)
        index = ne.oe_embeder.shard_indices
        mine, theirs = run(ne, Feed(M, seqs, spec.max_ngram), few, tp), run(reference(NG, plugin, spec, rows, tp), Feed(M, seqs, spec.max_ngram),
                                                               few, tp)
        for a, b in zip(mine, theirs):
            assert torch.equal(a[2].view(torch.int16), b[2].view(torch.int16)), f"rank {rank} differs from SGLang's own"
            assert torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))
        parts.append((index.org_vocab_start_index, index.org_vocab_end_index,
                      [a[1].view(torch.uint8).numpy().astype(np.int32) for a in mine]))
    assert parts[0][0] == 0 and parts[0][1] == parts[1][0] and parts[1][1] == total, parts[:2]
    for k, (ids, *_) in enumerate(one):
        a, b = parts[0][2][k], parts[1][2][k]
        assert not ((a > 0) & (b > 0)).any() and (a > 0).any() and (b > 0).any(), "the ranks' rows overlap or miss"
        np.testing.assert_array_equal((a + b).astype(np.uint8), ts.read_rows(0, ids.numpy().T.reshape(-1)).reshape(
            a.shape))
    ok(f"{where}: 2 TP ranks own rows [0, {parts[0][1]}) and [{parts[1][0]}, {total}); each equals SGLang's own "
       "rank, their lookups sum to the whole")

    # refusals
    for override, field in (({"over_embedding_m": spec.table_base + 8}, "rows of Engram layer 0"),
                            ({"num_embeddings": spec.compressed_vocab + 64}, "vocab_size")):
        try:
            build(NG, spec, **override)
        except ModelMismatch as exc:
            assert field in str(exc), (field, exc)
            ok(f"mismatch named: {str(exc).split(';')[0]}")
        else:
            raise AssertionError(f"{override} was served")
    NG.is_dp_attention_enabled, dp = (lambda: True), NG.is_dp_attention_enabled
    try:
        build(NG, spec)
    except EngineUnsupported as exc:
        assert "--enable-dp-attention" in str(exc), exc
        ok(f"refused: {str(exc).split(':')[0]}")
    else:
        raise AssertionError("DP attention was served")
    finally:
        NG.is_dp_attention_enabled = dp
    if where == "cached":
        check_hints(NG, M, spec, avoid)
    else:
        from engram_store.integrations.sglang import prompt_hints

        assert not prompt_hints.RANK.columns, "a resident table registered prompt hints"
    tables.check_fetches()  # nothing failed so far

    if avoid is None:
        return
    # a fresh request whose first token reads the flipped page: SGLang's result processing stops there
    from sglang.srt.managers.scheduler import Scheduler

    row = avoid * (PAGE_BYTES // spec.row_bytes) + 1
    e = int(np.searchsorted(spec.offsets(0).reshape(-1), row, side="right")) - 1
    token = row - int(spec.offsets(0).reshape(-1)[e])
    ne = build(NG, spec)
    bad = [np.array([token, 7, 9])]
    out = run(ne, Feed(M, bad, spec.max_ngram), [("extend", [(0, 0, 3)])])
    assert int(out[0][0][0, e]) == row, (out[0][0][0], row)
    result = types.SimpleNamespace(copy_done=None, next_token_ids=torch.zeros(1, dtype=torch.int64))
    try:
        with ranks(1, 0):
            Scheduler.process_batch_result(object(), types.SimpleNamespace(reqs=[]), result)
    except CorruptRows as exc:
        assert exc.layer == 0 and avoid in exc.pages, exc
        ok(f"CorruptRows at Scheduler.process_batch_result, before SGLang processed the step's tokens: {exc}")
    else:
        raise AssertionError("a step reading a page that fails its checksum was not raised")


if __name__ == "__main__":
    main(*sys.argv[1:])
