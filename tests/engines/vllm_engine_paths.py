"""vLLM 0.33's own code on the paths a cached layer takes by default, through the engram-store plugin:
scenarios run by ``tests/test_vllm_plugin.py``, each in a fresh process, with the shims of
``tests/engines/vllm_engine.py`` and the step helpers of ``tests/engines/vllm_engine_cached.py`` (which this
module imports).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_STORE_ADDR=unix://S \
        python tests/engines/vllm_engine_paths.py SCENARIO ...

Blackwell's lookup thresholds and Engram batching (streams and events recorded on the CPU), the model
runners' host-visible points after a failed fetch, the failure board across processes, and prompt hints
from both runners' ``execute_model``. A scenario prints ``OK <what>`` lines and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import torch
from engine_helpers import model_config, ok
from vllm_engine import build, init_distributed, load_plugin, plugin_layer, shim, token_batch
from vllm_engine_cached import step_batch, step_reading_flipped_page


class FakeStreams:
    """CUDA's stream and event calls as vLLM's Engram code and runners make them, recorded on the CPU:
    which stream is current, what waited on what, where events were recorded."""

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.waited = name, []

        def wait_stream(self, other) -> None:
            self.waited.append(other.name)

        def wait_event(self, event) -> None:
            self.waited.append(event)

    class Event:
        def __init__(self, *args, **kwargs) -> None:
            self.stream = None

        def record(self, stream=None) -> None:
            self.stream = (stream or FakeStreams.current).name

        def synchronize(self) -> None:
            pass

    current: "FakeStreams.Stream"

    @classmethod
    def install(cls) -> None:
        import contextlib

        cls.current = cls.Stream("main")

        @contextlib.contextmanager
        def stream(s):
            before, cls.current = cls.current, s
            try:
                yield
            finally:
                cls.current = before

        def set_stream(s) -> None:
            cls.current = s

        torch.cuda.current_stream = lambda device=None: cls.current
        torch.cuda.stream, torch.cuda.set_stream, torch.cuda.Event = stream, set_stream, cls.Event


class RecordedIds(torch.Tensor):
    """Hash ids whose ``record_stream`` (CUDA-only) is recorded."""

    streams: list = []

    def record_stream(self, stream) -> None:
        RecordedIds.streams.append(stream.name)


class NoLaunch:
    """A Triton kernel's launch (``kernel[grid](...)``) that runs nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def scenario_blackwell_paths(tables_dir: str) -> None:
    """With Blackwell's lookup thresholds (steps of 4,096+ tokens inline on the main stream, 36,864+ rows
    sorted): a 5,000-token step of the cached layer goes through Engram._start_prefetch on the Engram side
    stream, unsorted and exact, while a resident layer's runs inline and sorted as vLLM decides (its kernel not
    launched); and EngramBatch.create leaves cached layers to their own prefetch (its peer exchange reads the
    staging with global ids), resident ones to vLLM."""
    import logging

    from engram_store.format.tableset import TableSet
    from engram_store.integrations.vllm import cached

    load_plugin()
    ts = TableSet.open(tables_dir)
    spec = ts.spec
    init_distributed()
    E = shim(max_tokens=5120)
    E._engram_lookup_thresholds = lambda device: (36864, 4096)  # vLLM's figures for capability family 100
    FakeStreams.install()
    layout = E.EngramLayout(model_config(spec))
    tokens = 5000
    ids = token_batch(spec, seed=11, tokens=tokens)
    lookups, sorts = [], []
    inner_lookup, inner_sort = E.ParallelEngramEmbedding.lookup, torch.Tensor.sort

    def lookup_spy(self, indices, out, background=False):
        lookups.append((cached.is_cached(self), FakeStreams.current.name))
        # vLLM's stream and sort decisions and the fetch into the staging are what is checked; its kernel over
        # the arena or the staging (exact in test_plugin_patches_and_vllm_reads_the_arena and
        # test_cached_layer_is_fetched_a_layer_ahead_through_vllms_lookup) is not launched (120,000 rows interpreted)
        kernel, E._engram_lookup_kernel = E._engram_lookup_kernel, NoLaunch()
        try:
            return inner_lookup(self, indices, out, background)
        finally:
            E._engram_lookup_kernel = kernel

    def sort_spy(self, *args, **kwargs):
        sorts.append(self.numel())
        return inner_sort(self, *args, **kwargs)

    E.ParallelEngramEmbedding.lookup, torch.Tensor.sort = lookup_spy, sort_spy
    engrams = {}
    for index, layer in enumerate(spec.layers):
        engram = object.__new__(E.Engram)
        torch.nn.Module.__init__(engram)
        engram.embed_tokens = build(E, layout, index)
        engram._prefetch_stream, engram._prefetch_done = FakeStreams.Stream(f"engram-{layer}"), FakeStreams.Event()
        engram.layer_hash_index, engram.wkv = index, torch.nn.Identity()
        engrams[layer] = engram
    for layer, engram in engrams.items():
        lookups.clear(), sorts.clear()
        rows = torch.empty((tokens, 24, spec.row_bytes), dtype=torch.uint8)
        RecordedIds.streams.clear()
        engram._start_prefetch(torch.from_numpy(ids[layer]).as_subclass(RecordedIds), rows)
        (is_cached, stream), = lookups
        side = f"engram-{layer}"
        if is_cached:
            want = ts.read_rows(layer, ids[layer].reshape(-1))  # staging row i holds the step's i-th id
            job, n, width = engram.embed_tokens._engram_store.job, want.shape[0], spec.row_format.payload_bytes
            np.testing.assert_array_equal(job.weight[:n], want[:, :width])
            np.testing.assert_array_equal(job.scales[:n], want[:, width:])
            assert stream == side and engram._prefetch_done.stream == side and RecordedIds.streams == [side], \
                (stream, engram._prefetch_done.stream, RecordedIds.streams)
            assert engram._prefetch_stream.waited == ["main"] and not sorts, (engram._prefetch_stream.waited, sorts)
            ok(f"cached layer {layer}: a {tokens}-token step fetched on the Engram side stream, ids unsorted, staged "
               "rows equal TableSet.read_rows")
        else:
            assert stream == "main" and sorts and set(sorts) == {tokens * 24}, (stream, sorts)
            ok(f"resident layer {layer}: vLLM's own choice for {tokens} tokens on Blackwell (inline, sorted)")
    fuse_calls = []
    E.can_fuse_query_quant = lambda wkvs: fuse_calls.append(len(wkvs)) or False
    for engram in engrams.values():
        engram.embed_tokens.dp_size = 2  # an Engram DP-sharded table: what EngramBatch batches
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(cached.__name__).addHandler(handler)
    logging.getLogger(cached.__name__).setLevel(logging.INFO)
    resident = [e for e in engrams.values() if not cached.is_cached(e.embed_tokens)]
    assert E.EngramBatch.create(resident, 64) is None and fuse_calls == [len(resident)], fuse_calls
    assert E.EngramBatch.create(list(engrams.values()), 64) is None and fuse_calls == [len(resident)], fuse_calls
    assert any("EngramBatch" in r.getMessage() for r in records), [r.getMessage() for r in records]
    ok("EngramBatch.create: vLLM decides for resident layers; with a cached layer it is off before vLLM builds "
       "anything (no peer exchange over the staging), said in one INFO line")


def scenario_output_points(tables_dir: str, page: str) -> None:
    """A model runner the plugin does not know, or one overriding sample_tokens, is refused at model build;
    after a failed fetch, vLLM's own AsyncGPUModelRunnerOutput.get_output (V1) and AsyncOutput.get_output
    (V2), and V2's sample_tokens, raise before returning tokens."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

    from engram_store.errors import CorruptRows, EngineUnsupported
    from engram_store.format.layout import PageLayout
    from engram_store.format.tableset import TableSet
    from engram_store.integrations.vllm import runners

    load_plugin()
    spec = TableSet.open(tables_dir).spec
    init_distributed()
    E = shim()
    FakeStreams.install()
    layout = E.EngramLayout(model_config(spec))

    class OwnSampling(GPUModelRunner):
        def sample_tokens(self, grammar_output):
            return None

    for runner, named in ((None, "not being built by a vLLM model runner"),
                          (object.__new__(OwnSampling), "OwnSampling, has its own sample_tokens")):
        try:
            with runners.model_runner(runner):
                E.Engram._create_embedding(object(), layout, 1)
        except EngineUnsupported as exc:
            assert named in str(exc), str(exc)
            ok(f"refused at model build: {str(exc)[:150]}")
        else:
            raise AssertionError(f"a cached layer was built under {runner!r}")
    resident = E.Engram._create_embedding(object(), layout, 0)  # no runner needed: nothing is fetched
    assert not hasattr(resident, "_engram_store")
    emb = build(E, layout, 1)

    def outputs():
        tokens = torch.tensor([[7], [9]])
        v1 = AsyncGPUModelRunnerOutput(ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}),
                                       tokens, None, [], FakeStreams.Stream("copy"), 100)
        sampled = SamplerOutput(tokens, None, None, torch.tensor([1, 1]), torch.tensor([0, 0]))
        v2 = AsyncOutput(ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}), sampled,
                         torch.tensor([1, 1]), FakeStreams.Stream("main"), FakeStreams.Stream("copy"), False, None)
        return {"V1 AsyncGPUModelRunnerOutput.get_output": v1.get_output, "V2 AsyncOutput.get_output": v2.get_output}

    for what, get in outputs().items():
        assert get().sampled_token_ids == [[7], [9]], what
    ok("before any failure, both runners' outputs return their tokens through the patched get_output")
    ids = step_batch(spec, 7)[14]
    ids[1, 0] = int(page) * PageLayout(spec.rows(14), spec.row_bytes).rows_per_page
    emb.lookup(torch.from_numpy(ids), torch.empty((ids.shape[0], 24, spec.row_bytes), dtype=torch.uint8))
    checks = outputs() | {"V2 GPUModelRunner.sample_tokens": lambda: GPUModelRunner.sample_tokens(
        types.SimpleNamespace(execute_model_state=None, eplb=types.SimpleNamespace(step=lambda **kw: None)), None)}
    for what, call in checks.items():
        try:
            result = call()
        except CorruptRows as exc:
            assert exc.layer == 14 and int(page) in exc.pages, str(exc)
            ok(f"{what} raises CorruptRows instead of returning the step's tokens")
        else:
            raise AssertionError(f"{what} returned {result!r} after a failed fetch")


def scenario_fail_quietly(tables_dir: str, page: str) -> None:
    """A rank that returns no tokens: a step of the cached layer reads a flipped page, and this process
    never checks (the test reads the failure board this process shares with it)."""
    step_reading_flipped_page(tables_dir, page, token=2)
    ok(f"a step read page {page} in process {os.getpid()}; nothing checked here")


def scenario_hints(tables_dir: str) -> None:
    """Both model runners' execute_model (patched) hint a new request's later chunks to the daemon before the
    step, for this rank's heads of the cached layer, once per request; a finished request withdraws. vLLM's
    own SchedulerOutput / NewRequestData; vLLM's execute_model bodies then fail on the stub runner."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    from engram_store.client.client import EngramClient
    from engram_store.integrations.prompt_hints import pending_rows
    from engram_store.integrations.vllm import patches, prompt_hints
    from engram_store.models.tokens import raw_ids_for

    E, ts, emb = plugin_layer(tables_dir, 1, tp_size=2, tp_rank=1)  # rank 1 of TP=2: heads 12..24
    spec = ts.spec
    columns = slice(emb.head_start, emb.head_start + emb.part_n_hash_cols)
    tokens = np.random.default_rng(8).integers(0, 129_280, 300)

    def output(new, finished=()):
        reqs = [NewRequestData(req_id=r, prompt_token_ids=list(map(int, tokens)), mm_features=[], sampling_params=None,
                               pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
                               prefill_token_ids=list(map(int, tokens))) for r in new]
        return SchedulerOutput(scheduled_new_reqs=reqs, scheduled_cached_reqs=CachedRequestData.make_empty(),
                               num_scheduled_tokens={r: 64 for r in new}, total_num_scheduled_tokens=64 * len(new),
                               scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                               finished_req_ids=set(finished), free_encoder_mm_hashes=[])

    stub = types.SimpleNamespace(eplb=types.SimpleNamespace(step=lambda **kw: None))
    for runner, so in ((V2, output(["r1"])), (V1, output(["r1"])), (V1, output([], finished=["r1"]))):
        try:
            runner.execute_model(stub, so)
        except Exception:  # vLLM's own body on a stub runner: the plugin's part ran before it
            pass
    hints = prompt_hints.RANK.hints(patches.tables)
    assert hints is not None and hints.flush(60), "the hints were not sent"
    raw = raw_ids_for(spec, patches.tables().info, None, block_images=True)
    want = pending_rows(spec, 14, tokens, 64, raw=raw, columns=columns)
    with EngramClient.connect(patches.tables().address) as client:
        received = sum(v for k, v in client.stats().items() if "hint_rows_received" in k)
    assert hints.stats.requests == 1 and hints.stats.hints_sent == 1 and hints.stats.rows_sent == len(want), hints.stats
    assert received == len(want), (received, len(want))
    assert hints.stats.withdrawals == 1, hints.stats
    ok(f"execute_model of both runners hinted request r1 once: {len(want)} rows of layer 14's heads {columns.start}.."
       f"{columns.stop} after its first 64 tokens (the daemon received them), withdrawn when it finished")


SCENARIOS = {"blackwell-paths": scenario_blackwell_paths, "output-points": scenario_output_points,
             "fail-quietly": scenario_fail_quietly, "hints": scenario_hints}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
