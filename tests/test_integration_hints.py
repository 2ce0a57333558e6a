"""The plugins' prompt hints (engram_store/integrations/prompt_hints.py): the rows of a prompt's chunks not computed yet
equal ``engram_store.models.hashing`` of the whole prompt from there on (raw ids through a token map, lookback, this
rank's columns); a prefix-cache hit hints fewer rows; one hint per request, at its first scheduled chunk, through
vLLM's own SchedulerOutput / NewRequestData and SGLang-shaped requests, to a real daemon; a withdrawal when the
request finishes."""

from __future__ import annotations

import os
import subprocess
import time
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.client.client import EngramClient
from engram_store.models.hashing import row_ids_numpy
from engram_store.integrations.prompt_hints import (PromptHints, hint_key, pending_rows, sglang_finished,
                                                  sglang_prefill_batch, vllm_scheduler_output)
from engram_store.models.spec import get_spec
from engram_store.storage.placement import slot_bytes
from engram_store.models.tokens import RawIds, TokenMap

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
RAW_VOCAB = 129_280


@pytest.fixture(scope="module")
def raw() -> RawIds:
    ids = np.random.default_rng(0).integers(0, SPEC.compressed_vocab, RAW_VOCAB)
    ids[2] = SPEC.pad_id  # the raw pad id maps to the compressed pad, as V4.1's map does
    return RawIds(TokenMap.from_array(ids, SPEC.compressed_vocab), SPEC.image_token_id, True, 2)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, RAW_VOCAB, n)


def first_occurrences(rows: np.ndarray) -> np.ndarray:
    _, first = np.unique(rows, return_index=True)
    return rows[np.sort(first)]


@pytest.mark.parametrize("start", [0, 1, 2, 3, 500, 1023])
@pytest.mark.parametrize("columns", [None, slice(8, 16)])
def test_pending_rows_are_the_whole_prompts_rows_from_start(raw, start, columns):
    tokens = prompt(1, 1024)
    tokens[700] = SPEC.image_token_id  # a blocked token inside: its n-grams pad as the engine's do
    for layer in SPEC.layers:
        whole = row_ids_numpy(SPEC, layer, tokens, raw=raw)[start:]
        want = first_occurrences((whole if columns is None else whole[:, columns]).reshape(-1))
        np.testing.assert_array_equal(pending_rows(SPEC, layer, tokens, start, raw=raw, columns=columns), want)


def test_nothing_pending_at_the_end_and_compressed_ids_work_too(raw):
    tokens = prompt(2, 64)
    assert len(pending_rows(SPEC, SPEC.layers[0], tokens, 64, raw=raw)) == 0
    comp = raw.compress_numpy(tokens)
    np.testing.assert_array_equal(pending_rows(SPEC, 14, comp, 10), pending_rows(SPEC, 14, tokens, 10, raw=raw))


def test_keys_are_stable_63_bit_numbers():
    assert hint_key("req-1") == hint_key("req-1") != hint_key("req-2")
    assert 0 <= hint_key("x" * 1000) < 1 << 63


class FakeClient:
    """Records what a PromptHints sends (the daemon's side is tested below with a real one)."""

    def __init__(self) -> None:
        self.hints, self.withdrawn = [], []

    def hint(self, layer, rows, key):
        self.hints.append((layer, np.asarray(rows).copy(), key))
        return len(rows)

    def withdraw(self, key):
        self.withdrawn.append(key)
        return 0


def test_one_hint_per_request_at_its_first_chunk_and_a_prefix_hit_hints_fewer_rows(raw):
    client = FakeClient()
    hints = PromptHints(client, SPEC, {1: None, 14: slice(0, 12)}, raw)
    tokens = prompt(3, 3000)
    try:
        assert hints.scheduled("a", tokens, computed=0, scheduled=1024)
        assert not hints.scheduled("a", tokens, computed=1024, scheduled=1024)  # its next chunk: nothing more
        assert hints.scheduled("b", tokens, computed=2048, scheduled=512)  # a prefix-cache hit of 2,048 tokens
        assert not hints.scheduled("c", tokens[:900], computed=0, scheduled=900)  # the whole prompt in one step
        assert hints.flush()
        sent = {(layer, key): rows for layer, rows, key in client.hints}
        for req, start in (("a", 1024), ("b", 2560)):
            for layer, columns in ((1, None), (14, slice(0, 12))):
                np.testing.assert_array_equal(sent[(layer, hint_key(req))],
                                              pending_rows(SPEC, layer, tokens, start, raw=raw, columns=columns))
        assert len(sent[(14, hint_key("b"))]) < len(sent[(14, hint_key("a"))])
        assert len(client.hints) == 4
        hints.finished(["a", "b", "c", "unknown"])
        assert hints.flush()
        assert sorted(client.withdrawn) == sorted([hint_key("a"), hint_key("b")])  # c sent no hint
    finally:
        hints.close()


def test_a_full_backlog_drops_hints_and_a_failing_client_never_raises_into_the_engine(raw, caplog):
    class Broken(FakeClient):
        def hint(self, layer, rows, key):
            raise ConnectionError("daemon away")

    hints = PromptHints(Broken(), SPEC, {14: None}, raw, max_backlog=1)
    try:
        for i in range(50):
            hints.scheduled(f"r{i}", prompt(4, 600), computed=0, scheduled=100)
        assert hints.flush()
        assert hints.stats.failed + hints.stats.dropped == 50 and hints.stats.failed >= 1
        assert sum("could not be sent" in r.message for r in caplog.records) == 1  # logged once
    finally:
        hints.close()


# --- through a real daemon, with vLLM's own scheduler output --------------------------------------
@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=9)


def daemon(tables, tmp_path) -> DaemonProcess:
    return DaemonProcess(tables.directory, tmp_path, dram_bytes=str(90_000 * slot_bytes(SPEC.row_bytes, "s3fifo")),
                         extra=["--store-mode", "cached", "--scrub-bytes-per-second", "0", "--hint-queue-depth", "1"])


def daemon_stats(client: EngramClient) -> dict[str, float]:
    return {k[len("store_"):]: v for k, v in client.stats().items() if k.startswith("store_")}


def vllm_output(new: list, scheduled: dict[str, int], finished: set[str], runner: str = "v1"):
    """vLLM's own SchedulerOutput of a step; the V2 model runner's new requests also carry prefill_token_ids."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    reqs = [NewRequestData(req_id=r, prompt_token_ids=list(map(int, toks)), mm_features=[], sampling_params=None,
                           pooling_params=None, block_ids=([],), num_computed_tokens=computed, lora_request=None,
                           prefill_token_ids=list(map(int, toks)) if runner == "v2" else None)
            for r, toks, computed in new]
    return SchedulerOutput(scheduled_new_reqs=reqs, scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=finished,
                           free_encoder_mm_hashes=[])


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllm_scheduler_output_hints_a_daemon_once_and_withdraws_at_finish(tables, tmp_path, raw, runner):
    pytest.importorskip("vllm.v1.core.sched.output")
    tokens = prompt(5, 4096)
    layers = {1: slice(0, 12), 14: slice(12, 24)}  # this rank's hash columns (vLLM: its heads)
    with daemon(tables, tmp_path) as d, EngramClient.connect(d.unix) as watcher:
        hints = PromptHints(lambda: EngramClient.connect(d.unix), SPEC, layers, raw)
        try:
            vllm_scheduler_output(hints, vllm_output([("req-0", tokens, 1024)], {"req-0": 1024}, set(), runner))
            assert hints.flush()
            want = sum(len(pending_rows(SPEC, layer, tokens, 2048, raw=raw, columns=cols)) for layer, cols in layers.items())
            st = daemon_stats(watcher)
            assert st["hint_requests"] == 2 and st["hint_rows_received"] == want == hints.stats.rows_sent
            # the same request again as new (a second rank's view, or a repeat): nothing more is sent
            vllm_scheduler_output(hints, vllm_output([("req-0", tokens, 1024)], {"req-0": 1024}, set(), runner))
            assert hints.flush() and daemon_stats(watcher)["hint_rows_received"] == want
            vllm_scheduler_output(hints, vllm_output([], {}, {"req-0"}))  # finished (or aborted)
            assert hints.flush() and hints.stats.withdrawals == 1
            deadline = time.monotonic() + 60
            while (st := daemon_stats(watcher))["hint_rows_pending"]:
                assert time.monotonic() < deadline, st
                time.sleep(0.02)
            assert st["hint_rows_dropped_withdrawn"] > 0  # the queue held more than the batch being read
        finally:
            hints.close()


def test_sglang_requests_hint_after_their_chunk_and_withdraw_when_finished(raw):
    client = FakeClient()
    hints = PromptHints(client, SPEC, {14: None}, raw)
    tokens = prompt(6, 2000)

    def req(rid: str, prefix: int, end: int, done: bool = False):
        return SimpleNamespace(rid=rid, origin_input_ids=array("q", tokens.tolist()), prefix_len=prefix, extend_end=end,
                               finished=lambda: done)

    try:
        sglang_prefill_batch(hints, SimpleNamespace(reqs=[req("s", 256, 1280)]))  # 256 tokens hit the radix cache
        sglang_prefill_batch(hints, SimpleNamespace(reqs=[req("s", 1280, 2000)]))  # its last chunk: already hinted
        sglang_prefill_batch(hints, None)  # nothing planned
        assert hints.flush() and len(client.hints) == 1
        np.testing.assert_array_equal(client.hints[0][1], pending_rows(SPEC, 14, tokens, 1280, raw=raw))
        sglang_finished(hints, [req("s", 2000, 2001, done=False)])
        sglang_finished(hints, [req("s", 2000, 2001, done=True)])
        assert hints.flush() and client.withdrawn == [hint_key("s")]
    finally:
        hints.close()


SGLANG_SCRIPT = r"""
import sys, types
import numpy as np, torch
torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from array import array
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from engram_store.integrations.prompt_hints import (PromptHints, hint_key, pending_rows, sglang_finished,
                                                  sglang_prefill_batch)
from engram_store.models.spec import get_spec
spec = get_spec("deepseek-v4.1-flash", 0.0002)
tokens = np.random.default_rng(7).integers(0, spec.compressed_vocab, 3000)
sent, withdrawn = [], []
client = types.SimpleNamespace(hint=lambda layer, rows, key: sent.append((layer, np.asarray(rows), key)) or len(rows),
                               withdraw=lambda key: withdrawn.append(key) or 0)
hints = PromptHints(client, spec, {14: slice(0, 8)})
req = Req("sg-1", "", array("q", tokens.tolist()), SamplingParams(max_new_tokens=4))
req.prefix_len, req.extend_end = 512, 512 + 1024  # what the scheduler's PrefillAdder sets: a radix hit, a chunk
sglang_prefill_batch(hints, types.SimpleNamespace(reqs=[req]))
req.prefix_len, req.extend_end = 1536, 2560  # the next chunk: no second hint
sglang_prefill_batch(hints, types.SimpleNamespace(reqs=[req]))
assert hints.flush() and len(sent) == 1 and sent[0][2] == hint_key("sg-1")
assert np.array_equal(sent[0][1], pending_rows(spec, 14, tokens, 1536, columns=slice(0, 8)))
sglang_finished(hints, [req])  # not finished: nothing withdrawn
req.finished_reason = object()  # SGLang sets a finish reason when a request ends or is aborted
sglang_finished(hints, [req])
assert hints.flush() and withdrawn == [hint_key("sg-1")]
hints.close()
print("OK sglang Req: one hint after the first chunk, rows exact, withdrawn when finished")
"""


@pytest.mark.engine
def test_sglang_own_req_through_the_adapters(tmp_path):
    venv = REPO / ".venv-sglang" / "bin" / "python"
    if not venv.exists():
        pytest.skip("no .venv-sglang (make engine-test builds it; SGLANG=0 skips it)")
    script = tmp_path / "sglang_hints.py"
    script.write_text(SGLANG_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")} | {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([str(venv), str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0 and "OK sglang Req" in res.stdout, res.stderr[-3000:]
