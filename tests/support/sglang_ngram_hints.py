"""The prompt hints of a cached n-gram table through SGLang 0.5.23's own scheduler objects, shared by the Qwen4Exp
and LongCat scenarios (``tests/engines/sglang_qwen4exp.py``, ``tests/engines/sglang_longcat.py``): what a planned
prefill hints to the daemon is what the request's later chunks fetch, by SGLang's ids, and the daemon has read it
ahead (its hint counters, :func:`support.vllm_ngram_hints.hint_counters`)."""

from __future__ import annotations

import types

import numpy as np


def hint_prompt(spec, avoid=None, length: int = 160, first: int = 40):
    """A prompt with EOS tokens (some at the edges of chunks of ``first`` tokens); with ``avoid`` (a layer, a
    page), tokens changed until no row of that layer (``spec``'s hash) lands on that page."""
    from engram_store.format.layout import PAGE_BYTES
    from engram_store.models.hashing import row_ids_numpy

    rng = np.random.default_rng(17)
    prompt = rng.integers(1, spec.compressed_vocab, length)
    prompt[rng.random(length) < 0.08] = spec.pad_id
    prompt[[first - 1, first, 2 * first - 1, 2 * first + 1]] = spec.pad_id
    while avoid is not None:
        hit = (row_ids_numpy(spec, avoid[0], prompt) // (PAGE_BYTES // spec.row_bytes) == avoid[1]).any(axis=1)
        if not hit.any():
            break
        prompt[int(np.argmax(hit))] = rng.integers(1, spec.compressed_vocab)
    return prompt


def sglang_hints(prompt, first: int, chunk) -> None:
    """The prompt hints of the cached tables built in this process, through SGLang's own ``Req`` and
    ``NextBatchPlan``: the scheduler plans the prompt's first chunk of ``first`` tokens (``prefix_len`` 0,
    ``extend_end`` as its ``PrefillAdder`` sets them for a chunked prefill) and the plugin's hook hints the
    daemon once, one hint per cached layer; a second plan of the same request hints nothing. Then
    ``chunk(start, end)`` runs each chunk as SGLang runs it and returns ``{layer: (SGLang's row ids
    [tokens, columns], the ids the layer's fetch job asked for)}``. Checked: the hinted rows of each layer are
    SGLang's ids of the chunks after the first (first occurrences, in token order), the fetch jobs asked for
    exactly SGLang's ids, every row the daemon read ahead is a hit of those fetches, and the request's hints
    are withdrawn when its batch's result shows it finished."""
    import time
    from array import array

    from sglang.srt.managers.schedule_batch import NextBatchPlan, Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from support.vllm_ngram_hints import hint_counters

    from engram_store.integrations.prompt_hints import hint_key
    from engram_store.integrations.sglang import hooks, prompt_hints

    layers = sorted(prompt_hints.RANK.columns)
    hints = prompt_hints.RANK.hints(hooks.tables)
    assert layers and hints is not None, "no prompt hints for the cached tables"
    client, sent = hints._connection(), []
    real_hint = client.hint
    client.hint = lambda layer, rows, key: sent.append((layer, np.array(rows), key)) or real_hint(layer, rows, key)
    req = Req("sg-ngram-hint", "", array("q", map(int, prompt)), SamplingParams(max_new_tokens=4))
    for extend_end in (first, 2 * first):  # the first planned chunk hints; the next one does not
        req.prefix_len, req.extend_end = extend_end - first, extend_end
        prompt_hints.after_prefill_plan(
            hooks.tables, NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[req]), running_batch=None))
    assert hints.flush(60) and sorted(layer for layer, _, _ in sent) == layers, (hints.stats, sent)
    assert {key for _, _, key in sent} == {hint_key(req.rid)}, sent
    address, deadline = hooks.tables().address, time.monotonic() + 60
    while (before := hint_counters(address))["rows_pending"]:
        assert time.monotonic() < deadline, before
        time.sleep(0.02)
    hinted = {layer: rows for layer, rows, _ in sent}
    assert before["rows_received"] == sum(map(len, hinted.values())) and before["rows_read"] > 0, before
    later = {layer: [] for layer in layers}
    for start in range(0, len(prompt), first):
        for layer, (ids, asked) in chunk(start, min(start + first, len(prompt))).items():
            np.testing.assert_array_equal(np.sort(asked), np.sort(ids.reshape(-1)),
                                          err_msg=f"layer {layer}'s fetch job asked for other rows than SGLang's ids")
            if start:
                later[layer].append(ids.reshape(-1))
    for layer in layers:
        flat = np.concatenate(later[layer])
        _, once = np.unique(flat, return_index=True)
        np.testing.assert_array_equal(hinted[layer], flat[np.sort(once)], err_msg=f"layer {layer}'s hinted rows")
    deadline = time.monotonic() + 60  # the daemon counts the hits when it settles its hinted share
    while (after := hint_counters(address))["rows_hit"] - before["rows_hit"] < before["rows_read"]:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert after["rows_hit"] - before["rows_hit"] == before["rows_read"], (before, after)
    withdrawals = hints.stats.withdrawals
    req.finished_reason = object()  # SGLang's mark of a finished or aborted request
    prompt_hints.after_results(hooks.tables, types.SimpleNamespace(reqs=[req]))
    assert hints.flush(60) and hints.stats.withdrawals == withdrawals + 1, hints.stats
    print(f"OK hints: {sum(map(len, hinted.values()))} rows of layers {layers} after the prompt's first {first} tokens "
          f"hinted once through SGLang's planned prefill, {int(before['rows_read'])} read ahead by the daemon, all "
          "hit by the later chunks' fetches, which asked for exactly the hinted rows (SGLang's ids); withdrawn when "
          "it finished", flush=True)
