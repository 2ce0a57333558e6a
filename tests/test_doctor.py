"""`engram-store doctor`: real configs and table sets, host facts from fixture files where the host cannot vary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.daemon_helpers import make_tables

from engram_store.daemon.config import load_config
from engram_store.daemon.host import MemoryLimit
from engram_store.format.manifest import Manifest
from engram_store.native.pagesizes import HugePagePool, PageSizes
from engram_store.ops import doctor
from engram_store.ops.access import User, blocked_at
from engram_store.ops.probes import page_sizes
from engram_store.models.spec import get_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = get_spec("tiny")
NOBODY = User("nobody-test", 4242, frozenset({4242}))  # no such uid owns anything here


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    make_tables(d)
    return d


def config_file(tmp_path: Path, **keys) -> Path:
    path = tmp_path / "engram-store.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    return subprocess.run([sys.executable, "-m", "engram_store", "doctor", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def plan_of(tables: Path, **keys) -> doctor.Plan:
    config = load_config(keys | {"tables": str(tables)}, environ={})
    return doctor.make_plan(config, Manifest.load(tables))


def test_a_good_config_deploys(tables, tmp_path):
    cfg = config_file(tmp_path, tables=str(tables), dram_bytes="64MiB", socket=str(tmp_path / "run" / "s.sock"))
    res = run_cli("--config", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("deploy: yes")
    names = {line.split(":")[0].split(None, 1)[1] for line in lines if line[:4] in ("PASS", "WARN", "FAIL", "SKIP")}
    assert {"config", "tables", "placement", "engines", "memory", "huge pages", "disk", "NVMe reads", "socket",
            "memlock", "CUDA"} <= names
    doc = json.loads(run_cli("--config", str(cfg), "--json").stdout)
    assert doc["deploy"] is True and all(c["status"] in ("PASS", "WARN", "SKIP") for c in doc["checks"])


def test_the_tables_check_names_the_model(tables, tmp_path):
    from engram_store.tools.synth import write_synthetic

    qwen = tmp_path / "qwen"
    write_synthetic(qwen, get_spec("qwen3.8-flash-next-nvfp4", 0.0002), seed=1)
    for path, words in ((tables, f"tiny (DeepSeek-V4.1 Engram): FP8 E4M3 + E8M0 scale per 32 values, "
                                 f"{64 + 64 // 32} B a row, {3 * 4} rows a token"),
                        (qwen, "qwen3.8-flash-next-nvfp4 (Qwen4Exp PLE n-gram): NVFP4 (E2M1) + E4M3 scale per 16 "
                               "values + one FP32 table scale, 90 B a row, 16 rows a token")):
        cfg = config_file(tmp_path, tables=str(path), dram_bytes="64MiB", socket=str(tmp_path / "run" / "s.sock"))
        doc = json.loads(run_cli("--config", str(cfg), "--json").stdout)
        check = next(c for c in doc["checks"] if c["check"] == "tables")
        assert check["status"] == "PASS" and words in check["found"], check


def test_a_table_set_that_does_not_fit_fails(tables, tmp_path):
    cfg = config_file(tmp_path, tables=str(tables), dram_bytes="128KiB", store_mode="resident",
                      socket=str(tmp_path / "s.sock"))
    res = run_cli("--config", str(cfg))
    assert res.returncode == 1 and "FAIL  placement" in res.stdout and "deploy: NO" in res.stdout, res.stdout
    assert "fix: raise dram_bytes" in res.stdout


def test_bad_config_and_missing_tables_fail_naming_why(tmp_path):
    res = run_cli("--config", str(config_file(tmp_path, dram_bytes="lots")))
    assert res.returncode == 1 and "FAIL  config" in res.stdout and "dram_bytes" in res.stdout
    res = run_cli("--config", str(config_file(tmp_path, tables=str(tmp_path / "none"))))
    assert res.returncode == 1 and "FAIL  tables" in res.stdout and "manifest" in res.stdout


def test_placement_vs_engines(tables):
    assert doctor.check_placement(plan_of(tables, dram_bytes="64MiB"))[1].status == doctor.PASS
    first, second = SPEC.layers
    mixed = doctor.check_placement(plan_of(tables, dram_bytes="64MiB", placement=f"{first}=resident,{second}=cached"))
    assert mixed[1].status == doctor.WARN and "fetch path" in mixed[1].found and f'{second} = "resident"' in mixed[1].fix


def test_memory_against_the_tightest_limit(tables):
    plan = plan_of(tables, dram_bytes="64MiB")
    need = plan.dram_bytes
    roomy = [MemoryLimit("MemAvailable", "/proc/meminfo", 100 * need, "")]
    tight = roomy + [MemoryLimit("cgroup memory.max", "/sys/fs/cgroup/x/memory.max", need // 2, "memory.max ...")]
    restart = [MemoryLimit("MemAvailable", "/proc/meminfo", need + plan.arena_bytes // 2, "")]
    assert doctor.check_memory(plan, roomy).status == doctor.PASS
    failed = doctor.check_memory(plan, tight)
    assert failed.status == doctor.FAIL and "cgroup memory.max" in failed.found and "memory.max" in failed.fix
    assert doctor.check_memory(plan, restart).status == doctor.WARN  # a restart holds two arenas


def test_huge_pages_against_the_arena(tables, tmp_path):
    plan = plan_of(tables, dram_bytes="64MiB")
    need = -(-plan.arena_bytes // (2 << 20))
    hp = lambda free, shmem: PageSizes(4096, (HugePagePool(2 << 20, free, free),), 2 << 20, 2 << 20, "madvise",  # noqa: E731
                                       shmem)
    assert doctor.check_huge_pages(plan, hp(need, "never")).status == doctor.PASS
    assert doctor.check_huge_pages(plan, hp(0, "advise")).status == doctor.PASS
    small = doctor.check_huge_pages(plan, hp(need - 1, "never"))
    assert small.status == doctor.WARN and f"`sysctl -w vm.nr_hugepages={need}`" in small.fix  # one more page
    assert f"the arena takes {need} pages of 2 MiB" in small.fix
    cached = plan_of(tables, dram_bytes="64MiB", store_mode="cached")
    assert doctor.check_huge_pages(cached, hp(0, "never")).status == doctor.SKIP
    (tmp_path / "thp").mkdir()
    (tmp_path / "thp" / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    (tmp_path / "thp" / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "thp" / "hpage_pmd_size").write_text("2097152\n")
    (tmp_path / "meminfo").write_text("HugePages_Total:     512\nHugePages_Free:      500\nHugepagesize:    2048 kB\n")
    read = page_sizes(page_bytes=4096, hugepages_dir=tmp_path / "none", meminfo=tmp_path / "meminfo",
                      thp_dir=tmp_path / "thp")
    assert read == PageSizes(4096, (HugePagePool(2 << 20, 512, 500),), 2 << 20, 2 << 20, "madvise", "advise")
    assert read.shmem_thp


@pytest.fixture
def open_dir():
    """A scratch directory every user may search, on a path every user may search (pytest's own
    base directory is private to its user, so it cannot stand in for a deploy's)."""
    with tempfile.TemporaryDirectory(prefix="engram-doctor-") as d:
        path = Path(d)
        if any(not os.stat(p).st_mode & 0o001 for p in path.parents):
            pytest.skip(f"{path.parent} is not searchable by every user")
        os.chmod(path, 0o755)
        yield path


def test_engine_user_access(open_dir):
    tables = open_dir / "tables"
    make_tables(tables)
    plan = plan_of(tables, dram_bytes="64MiB")
    os.chmod(tables, 0o750)
    table_files = doctor.check_table_files(plan, NOBODY)
    assert table_files.status == doctor.WARN and f"{tables} (mode 0750" in table_files.found
    os.chmod(tables, 0o755)
    for f in tables.iterdir():
        os.chmod(f, 0o644)
    assert doctor.check_table_files(plan, NOBODY).status == doctor.PASS
    run = open_dir / "run"
    run.mkdir(mode=0o700)
    os.chmod(run, 0o700)
    config = load_config({"tables": str(tables), "socket": str(run / "s.sock")}, environ={})
    blocked = doctor.check_socket(config, NOBODY)
    assert blocked.status == doctor.FAIL and str(run) in blocked.found and "usermod" in blocked.fix
    os.chmod(run, 0o755)
    assert doctor.check_socket(config, NOBODY).status == doctor.WARN  # no socket_group: it depends on the daemon
    assert doctor.check_socket(config, None).status == doctor.PASS
    grouped = load_config({"tables": str(tables), "socket": str(run / "s.sock"), "socket_group": "root"}, environ={})
    assert doctor.check_socket(grouped, User("member", 4242, frozenset({4242, 0}))).status == doctor.PASS
    outsider = doctor.check_socket(grouped, NOBODY)
    assert outsider.status == doctor.FAIL and "not in group root" in outsider.found
    assert blocked_at(User("root", 0, frozenset({0})), run / "s.sock", os.R_OK) is None


def test_unknown_engine_user_fails(tables, tmp_path):
    cfg = config_file(tmp_path, tables=str(tables), dram_bytes="64MiB", socket=str(tmp_path / "s.sock"))
    res = run_cli("--config", str(cfg), "--engine-user", "no-such-user-engram")
    assert res.returncode == 1 and "FAIL  engine user" in res.stdout
