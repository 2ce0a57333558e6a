"""A vLLM KV connector is handed no KV of a step whose fetch failed (``integrations.vllm.kv_gate``).

One process with vLLM 0.33's own KV connector state (``kv_transfer_state``: what attention layers and
both model runners call) holding a connector of vLLM's base class that records what it is handed; the
plugin's step calls (``runners.begin_step``, the gate's ``wait_for_save``) run as the runners run them.
A healthy step's layer saves reach the connector, in order, before its ``wait_for_save``; a step whose
fetch failed raises ``CorruptRows`` at ``wait_for_save`` and the connector gets nothing of it, nor of any
later step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO

pytest.importorskip("torch")
LAYER, PAGE = 14, 99


def gate_main() -> None:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from engram_store import errors
    from engram_store.integrations.vllm import ranks, runners

    handed: list = []

    class Recorder(KVConnectorBase_V1):
        def start_load_kv(self, forward_context, **kwargs): pass
        def wait_for_layer_load(self, layer_name): pass
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): handed.append(("save", layer_name))
        def wait_for_save(self): handed.append(("wait",))
        def get_num_new_matched_tokens(self, request, num_computed_tokens): return 0, False
        def update_state_after_alloc(self, request, blocks, num_external_tokens): pass
        def build_connector_meta(self, scheduler_output): return None

    kv_transfer_state._KV_CONNECTOR_AGENT = object.__new__(Recorder)  # vLLM's __init__ wants a whole config
    ranks.batch_groups = lambda: ((), 0)  # one rank
    ranks.serve_cached(LAYER)
    state = {"fail": False}

    class Tables:
        def check_fetches(self):
            if state["fail"]:
                raise errors.CorruptRows(f"a page of layer {LAYER} failed its checksum", LAYER, (PAGE,))

    tables = Tables()
    report = []
    for step, fail in enumerate((False, True, False)):
        state["fail"] = fail
        runners.begin_step(lambda: tables)
        connector = kv_transfer_state.get_kv_transfer_group()
        for name in ("layers.0.attn", "layers.1.attn", "layers.2.attn"):
            connector.save_kv_layer(name, None, None)
        during = len(handed)
        try:
            connector.wait_for_save()
            raised = None
        except errors.StorageError as exc:
            raised = f"{type(exc).__name__}: {exc}"
        report.append({"step": step, "handed_during_forward": during, "handed": handed[:], "raised": raised})
        handed.clear()
    print(json.dumps({"mode": ranks.known().name, "steps": report}), flush=True)


def test_a_failed_steps_kv_never_reaches_the_connector():
    pytest.importorskip("vllm")
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'tests'}:{REPO}")
    env.pop("ENGRAM_STORE_FAILURE_BOARD", None)
    out = subprocess.run([sys.executable, "-c", "import test_kv_gate as t; t.gate_main()"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mode"] == "BOARD"
    healthy, failed, after = result["steps"]
    assert healthy["raised"] is None and healthy["handed_during_forward"] == 0
    assert healthy["handed"] == [["save", "layers.0.attn"], ["save", "layers.1.attn"], ["save", "layers.2.attn"],
                                 ["wait"]]
    assert failed["handed"] == [] and failed["raised"].startswith("CorruptRows") and f"layer {LAYER}" in failed["raised"]
    assert after["handed"] == [] and after["raised"].startswith("CorruptRows"), "a failed engine hands nothing on"
