"""vLLM 0.33's own LongCat-Flash-Lite n-gram ids as an independent reference, run in a fresh process.

    CUDA_VISIBLE_DEVICES= python tests/support/longcat_ref.py SCRIPT.json OUT.npz [--device cuda]

(:func:`run_reference` runs it so from a test.) ``SCRIPT.json`` holds the config values (``vocab``, ``hidden``, ``eos``, ``n``, ``k``), ``ratios``
(``ngram_vocab_size_ratio`` values, one ``NgramEmbedding`` built per ratio), ``max_num_reqs`` and
``events``, replayed on one ``LongcatNgramModelState`` built for the first ratio:

- ``["add", slot, num_computed, prefill_token_ids, request]``: ``add_request`` (a fresh,
  prefix-cached or resumed request in that slot);
- ``["step", [[slot, tokens], ...]]``: one batch, in that order (``idx_mapping``), through
  ``_compute_oe_ids``, which builds the EOS-negated token table, runs the id op and rolls the
  slots' contexts.

``OUT.npz`` gets per ratio ``r{i}_sizes``, ``_exclusive`` (``exclusive_sizes``), ``_weights``
(``ne_weights``), ``_mods``, ``_oe_dim``, ``_rows`` (the table's ``org_vocab_size``), ``_dtype``;
per step ``s{k}`` (the ids ``[T, (n-1)*k]``); and ``standin`` (1 when the CPU stand-in ran).

What is not vLLM's own here: the id op ``torch.ops._C.ngram_compute_n_gram_ids`` is compiled CUDA
that vLLM's CPU builds lack, so without it a CPU stand-in is registered under its name and schema
(:func:`kernel_ids`, a direct loop reading of the kernel's definition); on a GPU host with vLLM's
compiled ops (``--device cuda``) the real op runs instead. The table is built on the meta device
with a single-rank tensor-parallel stand-in (rank 0 of 1), so the 122.7M-row table allocates
nothing; the model state's runner-side base (``DefaultModelState.__init__``: rope and prompt-embeds
state, neither used by a text model) is a stand-in setting the sizes it reads.

:func:`kernel_ids` with ``eos`` is SGLang 0.5.23's ``ComputeNGramIdsKernel`` read the same way
(EOS stored as is, a break on EOS only looking back); tests/test_longcat.py runs it in-process.
:func:`make_script` and :func:`lookback` are the tests' scheduling; used by tests/test_longcat.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

SCHEMA = ("ngram_compute_n_gram_ids(int ne_n, int ne_k, Tensor(a!) ne_weights, Tensor(b!) ne_mods, "
          "Tensor(c!) exclusive_ne_embedder_size_sums, Tensor(d!) exclusive_req_len_sums, Tensor(e!) ne_token_table, "
          "Tensor(f!) row_indices, Tensor(g!) column_starts, Tensor(h!) n_gram_ids) -> ()")
_LIBRARY = None  # the stand-in's registration, kept alive


def kernel_ids(ne_n, ne_k, weights, mods, exclusive, qsl, table, row_indices, column_starts, eos=None) -> list:
    """``ComputeNGramIdsKernel``, one position and table at a time: for request r's i-th token at
    column ``column_starts[r] + i`` of table row ``row_indices[r]``, order index n and split k, sum
    ``(token * weights[n][k][j]) % mods[n][k]`` over j = 0..n+1 tokens back, stopping before the
    row's start and at a negative token (and, with ``eos``, at ``eos`` when j > 0: SGLang's rule);
    then ``% mods[n][k] + exclusive[n*ne_k + k]``. Arguments are nested lists; returns ``[T][E]``."""
    out = []
    for r in range(len(qsl) - 1):
        row = table[row_indices[r]]
        for i in range(qsl[r + 1] - qsl[r]):
            col = column_starts[r] + i
            ids = []
            for n in range(ne_n - 1):
                for k in range(ne_k):
                    acc = 0
                    for j in range(n + 2):
                        if col - j < 0:
                            break
                        token = row[col - j]
                        if token < 0 or (eos is not None and j > 0 and token == eos):
                            break
                        acc += token * weights[n][k][j] % mods[n][k]
                    ids.append(acc % mods[n][k] + exclusive[n * ne_k + k])
            out.append(ids)
    return out


def _standin(ne_n, ne_k, ne_weights, ne_mods, exclusive, qsl, table, row_indices, column_starts, n_gram_ids):
    import torch

    got = kernel_ids(ne_n, ne_k, ne_weights.tolist(), ne_mods.tolist(), exclusive.tolist(), qsl.tolist(),
                     table.tolist(), row_indices.tolist(), column_starts.tolist())
    if got:
        n_gram_ids.copy_(torch.tensor(got, dtype=torch.int32))


def register_standin() -> bool:
    """Register :func:`_standin` as ``torch.ops._C.ngram_compute_n_gram_ids`` on CPU unless the op
    exists (vLLM's compiled op on a GPU host); True when the stand-in was registered."""
    global _LIBRARY
    import torch

    if hasattr(torch.ops._C, "ngram_compute_n_gram_ids"):
        return False
    _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    _LIBRARY.define(SCHEMA)
    _LIBRARY.impl("ngram_compute_n_gram_ids", _standin, "CPU")
    return True


# --------------------------------------------------------------------------- the tests' scheduling
def make_script(rng: np.random.Generator, vocab: int, eos: int, n_requests: int = 24, slots: int = 8) -> dict:
    """Requests (EOS about 10% of tokens, runs of it, token 0 and vocab-1) scheduled as a runner
    would: chunked prefill, one-token decode, mixed batches in shuffled slot order, slots reused,
    prefix-cached starts and preempted requests resumed (with their KV or recomputed from 0).
    ``events`` for the reference; ``plan``: per step ``[(request, start, length)]`` in batch order;
    ``seqs``: each request's tokens."""
    seqs = []
    for r in range(n_requests):
        seq = rng.integers(0, vocab, int(rng.integers(4, 320)))
        seq[rng.random(seq.size) < 0.1] = eos
        seq[rng.random(seq.size) < 0.01] = 0
        seq[rng.random(seq.size) < 0.01] = vocab - 1
        if r % 5 == 2:
            seq[1:4] = eos
        seqs.append([int(x) for x in seq])
    prompt = [int(rng.integers(max(1, len(s) - 24), len(s) + 1)) for s in seqs]  # decode: up to 24 steps
    done = [0] * n_requests
    waiting, running, free = list(range(n_requests)), {}, list(range(slots))
    events, plan = [], []
    while waiting or running:
        while waiting and free and rng.random() < 0.7:
            r = waiting.pop(0)
            if done[r] == 0 and rng.random() < 0.3:  # a prefix-cache hit (or a resumed one's KV)
                done[r] = int(rng.integers(0, prompt[r]))
            slot = free.pop(int(rng.integers(0, len(free))))
            running[r] = slot
            events.append(["add", slot, done[r], seqs[r][:max(done[r], prompt[r])], r])
        batch = [r for r in running if rng.random() < 0.8] or list(running)[:1]
        if not batch:
            continue
        rng.shuffle(batch)
        step, rows = [], []
        for r in batch:
            length = int(rng.integers(1, 65)) if done[r] < prompt[r] else 1
            length = min(length, max(prompt[r] - done[r], 1), len(seqs[r]) - done[r])
            step.append([running[r], seqs[r][done[r]:done[r] + length]])
            rows.append((r, done[r], length))
            done[r] += length
        events.append(["step", step])
        plan.append(rows)
        for r in batch:
            if done[r] == len(seqs[r]):
                free.append(running.pop(r))
            elif rng.random() < 0.03:  # preempted: resumed later with all it has so far, its KV kept or not
                free.append(running.pop(r))
                prompt[r] = max(prompt[r], done[r])
                done[r] = done[r] if rng.random() < 0.5 else 0
                waiting.append(r)
    return {"events": events, "plan": plan, "seqs": seqs}


def lookback(seqs: list, rows: list, width: int) -> np.ndarray:
    """``[B, width]``: per (request, start, length) the tokens before ``start``, newest first, -1 before 0."""
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for b, (r, start, _) in enumerate(rows):
        for j in range(min(width, start)):
            out[b, j] = seqs[r][start - 1 - j]
    return out


def run_reference(script: dict, tmp: Path, device: str = "cpu") -> dict:
    """This file's ``main`` in a fresh process over ``script`` (the SCRIPT.json fields); its OUT.npz as a dict."""
    inp, out = tmp / "script.json", tmp / "out.npz"
    inp.write_text(json.dumps(script))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, __file__, str(inp), str(out), "--device", device], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return dict(np.load(out))


# --------------------------------------------------------------------------- the subprocess
def _build(L, VPE, config):
    """vLLM's NgramEmbedding of ``config``, its table on the meta device, on one TP rank."""
    import torch

    VPE.get_tensor_model_parallel_rank = lambda: 0
    VPE.get_tensor_model_parallel_world_size = lambda: 1
    real = L.VocabParallelEmbedding

    def on_meta(*args, **kwargs):
        with torch.device("meta"):
            return real(*args, **kwargs)

    L.VocabParallelEmbedding = on_meta
    try:
        return L.NgramEmbedding(config, torch.nn.Identity())
    finally:
        L.VocabParallelEmbedding = real


def main(script_path: str, out: str, device_name: str = "cpu") -> None:
    import torch
    from transformers import LongcatFlashConfig
    from vllm.model_executor.layers import vocab_parallel_embedding as VPE
    from vllm.model_executor.models import longcat_flash_ngram as L
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    s = json.load(open(script_path))
    standin = register_standin()
    result = {"standin": int(standin)}
    embeddings = []
    for i, ratio in enumerate(s["ratios"]):
        config = LongcatFlashConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], eos_token_id=s["eos"],
                                    ngram_vocab_size_ratio=ratio, emb_neighbor_num=s["n"], emb_split_num=s["k"],
                                    dtype="bfloat16")
        ne = _build(L, VPE, config)
        embeddings.append((config, ne))
        result |= {f"r{i}_sizes": np.asarray(ne._sizes), f"r{i}_exclusive": ne.exclusive_sizes.numpy(),
                   f"r{i}_weights": ne.ne_weights.numpy(), f"r{i}_mods": ne.ne_mods.numpy(), f"r{i}_oe_dim": ne.oe_dim,
                   f"r{i}_rows": ne.oe_embedder.org_vocab_size, f"r{i}_dtype": str(ne.oe_embedder.weight.dtype)}

    device = torch.device(device_name)
    config, ne = embeddings[0]
    for name in ("ne_weights", "ne_mods", "exclusive_sizes"):  # the id op's inputs; the table stays on meta
        setattr(ne, name, getattr(ne, name).to(device))
    max_tokens = max(sum(len(t) for _, t in e[1]) for e in s["events"] if e[0] == "step")

    def runner_base(self, vllm_config, model, encoder_cache, device):  # the runner's part, as a text model has it
        self.model, self.device, self.dtype = model, device, torch.bfloat16
        self.max_num_reqs, self.max_num_tokens = s["max_num_reqs"], max_tokens
        self.rope_state = self.prompt_embeds_state = None

    model = types.SimpleNamespace(config=config, model=types.SimpleNamespace(ngram_embeddings=ne))
    real_init, DefaultModelState.__init__ = DefaultModelState.__init__, runner_base
    try:
        state = L.LongcatNgramModelState(None, model, None, device)
    finally:
        DefaultModelState.__init__ = real_init
    k = 0
    for event in s["events"]:
        if event[0] == "add":
            slot, computed, tokens = event[1:4]
            state.add_request(slot, types.SimpleNamespace(num_computed_tokens=computed, prefill_token_ids=tokens,
                                                          prompt_token_ids=tokens))
            continue
        chunks = event[1]
        lengths = [len(t) for _, t in chunks]
        batch = types.SimpleNamespace(
            num_reqs=len(chunks), num_tokens=sum(lengths),
            idx_mapping=torch.tensor([slot for slot, _ in chunks], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device),
            input_ids=torch.tensor([x for _, t in chunks for x in t], dtype=torch.int32, device=device))
        result[f"s{k}"] = state._compute_oe_ids(batch).cpu().numpy()
        k += 1
    np.savez(out, **result)
    print(f"OK {k} steps, {sum(result[f's{j}'].shape[0] for j in range(k))} positions, stand-in {standin}", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    device_arg = argv[3] if argv[2:3] == ["--device"] else "cpu"
    if device_arg == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(argv[0], argv[1], device_arg)
