"""The prompt hints of a cached n-gram table through vLLM 0.33's own scheduler output, shared by the Qwen4Exp and
LongCat plugin scenarios (``vllm_qwen4exp_plugin.py hints``, ``vllm_longcat_plugin.py hints``; run from
tests/test_vllm_ngram_hints.py): what a request's first scheduled chunk hints to the daemon is what its later
chunks' fetches ask for, and the daemon has read it ahead."""

from __future__ import annotations

import types

import numpy as np


def hint_counters(address: str) -> dict:
    """The daemon's hint counters (``hint_*``)."""
    from engram_store.client.client import EngramClient

    with EngramClient.connect(address) as client:
        return {k.split("hint_", 1)[1]: v for k, v in client.stats().items() if "hint_" in k}


def hinted_then_fetched(prompt, first: int, chunk, fetched) -> None:
    """The prompt hints of a cached table, shared by the Qwen4Exp and LongCat scenarios: vLLM's own
    ``SchedulerOutput`` (``NewRequestData``: the prompt, its first chunk of ``first`` tokens scheduled) through
    the V2 model runner's patched ``execute_model``; the daemon reads the hinted rows ahead; then
    ``chunk(start, end)`` runs each later chunk as vLLM's model runs it, and ``fetched()`` gives the row ids the
    cached table's fetch job asked for in that chunk. The hinted rows equal the fetched ones (first occurrences,
    in order), and every row read ahead is a hit of those fetches."""
    import time

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

    from engram_store.integrations.prompt_hints import hint_key
    from engram_store.integrations.vllm import patches, prompt_hints

    address = patches.tables().address
    new = NewRequestData(req_id="p1", prompt_token_ids=list(map(int, prompt)), mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
                         prefill_token_ids=list(map(int, prompt)))
    output = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={"p1": first}, total_num_scheduled_tokens=first,
                             scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                             free_encoder_mm_hashes=[])
    sent = []
    hints = prompt_hints.RANK.hints(patches.tables)
    assert hints is not None, "no prompt hints for the cached table"
    client = hints._connection()
    real_hint = client.hint
    client.hint = lambda layer, rows, key: sent.append((layer, np.array(rows), key)) or real_hint(layer, rows, key)
    try:
        V2.execute_model(types.SimpleNamespace(eplb=types.SimpleNamespace(step=lambda **kw: None)), output)
    except Exception:  # vLLM's own body on a stub runner: the plugin's part ran before it
        pass
    assert hints.flush(60) and len(sent) == 1 and sent[0][2] == hint_key("p1"), (hints.stats, sent)
    hinted = sent[0][1]
    deadline = time.monotonic() + 60
    while (before := hint_counters(address))["rows_pending"]:
        assert time.monotonic() < deadline, before
        time.sleep(0.02)
    assert before["rows_received"] == len(hinted) and before["rows_read"] > 0, before
    asked = []
    for start in range(first, len(prompt), first):
        chunk(start, min(start + first, len(prompt)))
        asked.append(fetched())
    flat = np.concatenate(asked)
    _, once = np.unique(flat, return_index=True)
    np.testing.assert_array_equal(hinted, flat[np.sort(once)])
    deadline = time.monotonic() + 60  # the daemon counts the hits when it settles its hinted share (4 times a second)
    while (after := hint_counters(address))["rows_hit"] - before["rows_hit"] < before["rows_read"]:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert after["rows_hit"] - before["rows_hit"] == before["rows_read"], (before, after)
    print(f"OK hints: {len(hinted)} rows of the prompt's chunks after its first {first} tokens hinted through "
       f"execute_model, {int(before['rows_read'])} read ahead by the daemon, all hit by the {len(asked)} later "
       "chunks' fetches, which asked for exactly the hinted rows", flush=True)
