"""SGLang 0.5.23's scheduler with a cached Engram layer, through the engram-store plugin's hooks on
``Scheduler``, with the shims of ``tests/engines/sglang_engine.py`` and the cached layer of
``tests/engines/sglang_engine_cached.py`` (which this module imports): scenarios run by
``tests/test_sglang_plugin.py``, each in a fresh process of ``.venv-sglang`` against a mixed daemon.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S SGLANG_PLUGINS=engram_store \
        .venv-sglang/bin/python tests/engines/sglang_engine_scheduler.py SCENARIO TABLES [PAGES]

A step whose rows read a flipped page stops before SGLang processes its tokens (failed_step); a planned
prefill hints the daemon and a finished request withdraws its hints (hints). A scenario prints
``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch
from engine_helpers import model_config, ok
from sglang_engine import build, load_plugin, ranks, shim
from sglang_engine_cached import cached_engram, hashed


class _Processor:
    """Stands where SGLang's SchedulerBatchResultProcessor is: what it was handed (the tokens it would
    append to the requests and stream)."""

    def __init__(self, events: list) -> None:
        self.events = events

    def process_batch_result_decode(self, batch, result) -> None:
        self.events.append(("processed", batch.step, result.next_token_ids.tolist()))


class _CopyDone:
    """The overlap scheduler's copy_done: when the tokens' copy to the host was waited for."""

    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        self.events.append(("synchronized",))


def scenario_failed_step(tables_dir: str, pages: str) -> None:
    """Pages of cached layer 14 flipped on disk: SGLang's Scheduler.process_batch_result (its own method, the
    plugin's hook around it) hands a good step's tokens on and raises CorruptRows naming layer and page for a
    step whose rows read a flipped page, before any of its tokens reach SGLang's result processing; in the
    normal loop (right after the forward) and in the overlap loop (one step late, after its copy_done)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from engram_store.errors import CorruptRows
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.sglang import hooks, prefetch

    bad = [int(p) for p in pages.split(",")]
    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    E = shim()
    layout = E.EngramLayout.from_config(model_config(spec))
    build(E, layout, 0)
    engram = cached_engram(E, layout)
    rows_per_page = int(hooks.tables().info["layer_files"]["14"]["rows_per_page"])
    events: list = []
    scheduler = Scheduler.__new__(Scheduler)  # what process_batch_result reads before it dispatches
    scheduler.scheduler_stage_metrics = None
    scheduler.publish_load_snapshot = lambda force=False: None
    scheduler.load_publisher = types.SimpleNamespace(publish_load_stat=lambda *a, **k: None)
    scheduler.load_inquirer = types.SimpleNamespace(get_loads=None)
    scheduler.batch_result_processor = _Processor(events)
    scheduler.tree_cache = types.SimpleNamespace(flush_pending_backups=lambda: None)
    scheduler._record_step_counters = lambda batch, result: None
    scheduler.metrics_reporter = types.SimpleNamespace(log_batch_result_stats=lambda batch, result: None,
                                                       update_device_timer=lambda: None)
    scheduler.enable_fpm = False
    scheduler._maybe_clear_mm_inputs = lambda batch: None
    scheduler.maybe_send_health_check_signal = lambda: None

    def step(n: int, page: int | None, overlap: bool):
        """A decode step through the hasher hook and SGLang's Engram module; its result as run_batch returns it."""
        hash_ids = hashed(spec, 6000 + n, 5)
        if page is not None:
            hash_ids[2, 1, 0] = page * rows_per_page + 3  # a row of the flipped page, in head 0's table
        prefetch.after_hasher(hash_ids, None, None, None)
        x = torch.randn(5, 2, 64, dtype=torch.bfloat16)
        y = engram.forward(x, hash_ids[:, 1], None, input_ids=torch.zeros(5, dtype=torch.long))
        tokens = y.float().sum((1, 2)).argsort()  # stands for sampling
        batch = types.SimpleNamespace(step=n, reqs=[], forward_mode=ForwardMode.DECODE)
        return batch, types.SimpleNamespace(copy_done=_CopyDone(events) if overlap else None, next_token_ids=tokens)

    def failed(batch, result, page: int) -> None:
        try:
            scheduler.process_batch_result(batch, result)
        except CorruptRows as exc:
            assert exc.layer == 14 and exc.pages == (page,) and "layer 14" in str(exc) and str(page) in str(exc), exc
            ok(f"step {batch.step}: {type(exc).__name__}: {str(exc)[:150]}")
        else:
            raise AssertionError(f"step {batch.step} read page {page} of layer 14, flipped, and was processed")

    with ranks():
        scheduler.process_batch_result(*step(1, None, False))  # normal loop: a good step, processed
        assert events == [("processed", 1, events[0][2])], events
        failed(*step(2, bad[0], False), bad[0])
        assert [e[0] for e in events] == ["processed"], events  # nothing of step 2 reached the processor
        ok("normal loop: a good step's tokens processed; the step that read a flipped page raised before SGLang "
           "processed any of its tokens")
        events.clear()
        late = step(3, bad[1], True)  # overlap loop: step 3's result is processed after step 4 ran
        following = step(4, None, True)
        failed(*late, bad[1])
        assert events == [("synchronized",)], events  # its copy waited for, then the raise: no tokens
        scheduler.process_batch_result(*following)
        assert [e[0] for e in events] == ["synchronized", "synchronized", "processed"] and events[-1][1] == 4, events
    ok("overlap loop: the failed step raised after its copy_done, before SGLang processed its tokens; the next "
       "step's tokens were processed")


def scenario_hints(tables_dir: str) -> None:
    """A cached layer built on TP rank 1 of 2 (its share of the hash columns): a prefill the scheduler plans
    (SGLang's own Req, its NextBatchPlan, through the plugin's hook functions) hints the daemon once, the
    rows of the rank's columns after the planned chunk; a finished request's hints are withdrawn when its
    batch's result is processed."""
    from array import array

    from sglang.srt.managers.schedule_batch import NextBatchPlan, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from engram_store.client.client import EngramClient
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.prompt_hints import pending_rows
    from engram_store.integrations.sglang import hooks, prompt_hints
    from engram_store.models.tokens import raw_ids_for

    load_plugin()
    spec = TableSet.open(tables_dir).spec
    E = shim()
    layout = E.EngramLayout.from_config(model_config(spec))
    build(E, layout, 1, tp_size=2, tp_rank=1)
    columns = prompt_hints.RANK.columns[14]
    assert columns == slice(12, 24), columns  # plain TP: rank 1 fetches its half of the columns
    tokens = np.random.default_rng(9).integers(0, 129_280, 2000)
    req = Req("sg-hint", "", array("q", tokens.tolist()), SamplingParams(max_new_tokens=4))
    req.prefix_len, req.extend_end = 256, 256 + 512  # a radix-cache hit, then the first planned chunk
    prompt_hints.after_prefill_plan(hooks.tables,
                                    NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[req]), running_batch=None))
    req.prefix_len, req.extend_end = 768, 1280  # the next chunk: no second hint
    prompt_hints.after_prefill_plan(hooks.tables,
                                    NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[req]), running_batch=None))
    hints = prompt_hints.RANK.hints(hooks.tables)
    assert hints is not None and hints.flush(60)
    raw = raw_ids_for(spec, hooks.tables().info, None, block_images=False)
    want = pending_rows(spec, 14, tokens, 768, raw=raw, columns=columns)
    with EngramClient.connect(hooks.tables().address) as client:
        received = sum(v for k, v in client.stats().items() if "hint_rows_received" in k)
    assert hints.stats.requests == 1 and hints.stats.rows_sent == len(want) == received, (hints.stats, received)
    req.finished_reason = object()  # SGLang's mark of a finished or aborted request
    prompt_hints.after_results(hooks.tables, types.SimpleNamespace(reqs=[req]))
    assert hints.flush(60) and hints.stats.withdrawals == 1, hints.stats
    ok(f"a planned prefill hinted the daemon once: {len(want)} rows of layer 14's columns 12..24 after its first "
       "chunk (received); withdrawn when it finished")


SCENARIOS = {"failed_step": scenario_failed_step, "hints": scenario_hints}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
