"""Prompt hints for Qwen4Exp's and LongCat's cached tables in the vLLM plugin: a request's first scheduled chunk
(vLLM 0.33's own ``SchedulerOutput`` / ``NewRequestData`` through the V2 model runner's patched ``execute_model``)
hints the rows of its later chunks to a real daemon, which reads them ahead (its hint counters); the later chunks,
run as vLLM runs them (Qwen4Exp: ``Qwen4ExpModelState``'s ``ngram_context`` and ``compute_ngram_ids``; LongCat:
``LongcatNgramModelState``'s token table and ids), fetch exactly the hinted rows and hit every row read ahead.
The prompts carry EOS tokens, some at the chunks' edges. One scenario process per family
(``tests/support/vllm_qwen4exp_plugin.py hints``, ``tests/support/vllm_longcat_plugin.py hints``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

SCALE = 0.0005  # Qwen: 161,280 rows of 160 B (26 MB); LongCat: 61,488 rows of 512 B (31 MB)
DRAM = "12MiB"  # below either table (cached), a hinted share above a prompt's rows


@pytest.mark.parametrize("name, script", [("qwen3.8-flash-next", "vllm_qwen4exp_plugin.py"),
                                          ("longcat-flash-lite", "vllm_longcat_plugin.py")])
def test_a_prompts_hinted_rows_are_read_ahead_and_are_the_rows_its_later_chunks_fetch(name, script, tmp_path):
    directory = tmp_path / "tables"
    write_synthetic(directory, get_spec(name, SCALE), seed=23)
    with DaemonProcess(directory, tmp_path, dram_bytes=DRAM, extra=["--scrub-bytes-per-second", "0"]) as d:
        assert d.ready["mode"] == "cached", d.ready
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
        env |= {"ENGRAM_STORE_ADDR": d.unix, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
                "PYTHONUNBUFFERED": "1"}
        result = subprocess.run([sys.executable, str(REPO / "tests" / "support" / script), "hints", str(directory)],
                                cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "OK hints: " in out, out
