"""deploy/ against the real tools and the code's own declarations.

The shipped configs load and document every key; the engine-ready one places V4.1 resident and
the cached one caches layer 14 (checked with the store's own planner at full V4.1 size); the
systemd unit passes `systemd-analyze verify`, its sysusers.d and tmpfiles.d files are applied by
the real systemd-sysusers/systemd-tmpfiles in a scratch root; the kustomize base and the example
overlay render with `kubectl kustomize` and pass `kubernetes-validate --strict`, and the
manifests agree with the config (paths, ports, probes, uids, memory). A tool that is missing
skips its test with the tool's name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from engram_store.daemon.config import KEYS, DaemonConfig, load_config, parse_size
from engram_store.models.spec import get_spec
from engram_store.storage.placement import parse_placement, plan_placement, slot_bytes
from engram_store.storage.resident import resident_layout

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "engram-store.service"
CONFIGS = [DEPLOY / "engram-store.toml", DEPLOY / "engram-store-cached.toml", DEPLOY / "k8s" / "engram-store.toml"]
V41 = get_spec("deepseek-v4.1-flash")


def _plan(cfg: DaemonConfig) -> dict[int, str]:
    """The store's placement of the full V4.1 table set under ``cfg`` (no table files needed)."""
    return plan_placement({layer: V41.rows(layer) for layer in V41.layers}, dram_bytes=cfg.dram_bytes,
                          mode=cfg.store_mode, asked=parse_placement(cfg.placement),
                          arena_bytes=lambda rows: resident_layout(rows, V41.row_format).size,
                          slot_bytes=slot_bytes(V41.row_bytes, cfg.cache_policy))


def _arena_bytes() -> int:
    return resident_layout([(layer, V41.rows(layer)) for layer in V41.layers], V41.row_format).size


def _unit_value(key: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^{key}=(.*)$", UNIT.read_text(), re.M)]


# --- configs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_config_loads_and_every_key_is_documented(path):
    load_config(config_file=path, environ={})  # unknown keys and bad values raise
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\w+) = ", line)
        if m and m.group(1) not in ("grpc_tls_key",):  # documented together with grpc_tls_cert
            assert lines[i - 1].startswith("#"), f"{path.name}: {m.group(1)} has no comment above it"


def test_engine_ready_config_lists_every_key_and_serves_v41_resident():
    path = DEPLOY / "engram-store.toml"
    raw = tomllib.loads(path.read_text())
    assert set(raw) == set(KEYS), set(raw) ^ set(KEYS)
    cfg = load_config(config_file=path, environ={})
    defaults = DaemonConfig()
    changed = {f.name for f in fields(DaemonConfig) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    assert changed == {"tables", "dram_bytes", "store_mode"}, changed  # what its header says
    assert cfg.store_mode == "resident" and cfg.huge_pages
    assert _plan(cfg) == {1: "resident", 14: "resident"}
    assert cfg.dram_bytes >= _arena_bytes()
    assert "188.8 GiB" in path.read_text() and f"{_arena_bytes() / 2**30:.1f}" == "188.8"  # the sizing comment
    with pytest.raises(Exception, match="resident"):  # the old 8GiB could not: the planner says so
        _plan(load_config({"dram_bytes": "8GiB"}, config_file=path, environ={}))


def test_cached_example_keeps_layer_1_resident_and_caches_layer_14():
    cfg = load_config(config_file=DEPLOY / "engram-store-cached.toml", environ={})
    assert _plan(cfg) == {1: "resident", 14: "cached"}
    arena = resident_layout([(1, V41.rows(1))], V41.row_format).size
    cache_rows = (cfg.dram_bytes - arena) // slot_bytes(V41.row_bytes, cfg.cache_policy)
    share = cache_rows / V41.rows(14)
    assert 0.02 <= share <= 0.10, share  # its comment: 5.3% of layer 14's rows
    assert f"{share:.1%}" == "5.3%" and "5.3%" in (DEPLOY / "engram-store-cached.toml").read_text()
    assert cfg.warmup_profile == cfg.save_profile


def test_paths_agree_across_config_unit_tmpfiles_and_readme():
    cfg = load_config(config_file=DEPLOY / "engram-store.toml", environ={})
    assert cfg.tables == "/var/lib/engram-store/tables"
    assert _unit_value("ReadOnlyPaths") == ["-" + cfg.tables]
    assert _unit_value("Environment") == [f"ENGRAM_STORE_SOCKET={cfg.socket}"]
    assert _unit_value("ExecStart") == ["/opt/engram-store/bin/engram-store serve --config "
                                        "/etc/engram-store/engram-store.toml"]
    tmpfiles = (DEPLOY / "systemd" / "tmpfiles.d" / "engram-store.conf").read_text()
    made = {line.split()[1] for line in tmpfiles.splitlines() if line.startswith("d ")}
    assert {os.path.dirname(cfg.socket), "/var/lib/engram-store", "/etc/engram-store"} <= made
    assert set(_unit_value("ReadWritePaths")[0].split()) == {"-" + os.path.dirname(cfg.socket), "-/var/lib/engram-store"}
    readme = (REPO / "README.md").read_text()
    for path in (cfg.tables, cfg.socket, "/etc/engram-store/engram-store.toml", "/opt/engram-store/bin/engram-store"):
        assert path in readme, path
    assert "/data/engram-tables" not in readme


# --- systemd ----------------------------------------------------------------------------------------
def _scratch_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)  # sysinit.target ...
    for sub in ("etc/systemd/system", "etc/sysusers.d", "etc/tmpfiles.d"):
        (root / sub).mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system")
    shutil.copy(DEPLOY / "systemd/sysusers.d/engram-store.conf", root / "etc/sysusers.d")
    shutil.copy(DEPLOY / "systemd/tmpfiles.d/engram-store.conf", root / "etc/tmpfiles.d")
    return root


def _install_entry_point(root: Path) -> None:
    """What `python3 -m venv /opt/engram-store && pip install ...` leaves: an executable engram-store."""
    exe = root / _unit_value("ExecStart")[0].split()[0].lstrip("/")
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!/bin/sh\nexec {Path(sys.executable).with_name('engram-store')} \"$@\"\n")
    exe.chmod(0o755)


@pytest.mark.skipif(not (Path("/usr/lib/systemd/system").is_dir() and shutil.which("systemd-analyze")),
                    reason="systemd-analyze (package systemd) is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    root = _scratch_root(tmp_path)
    verify = ["systemd-analyze", "verify", f"--root={root}", "engram-store.service"]
    missing = subprocess.run(verify, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "/opt/engram-store/bin/engram-store" in missing.stderr  # verify checks it
    _install_entry_point(root)
    result = subprocess.run(verify, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "engram-store.service" not in result.stderr, result.stderr  # no warning about our unit either


@pytest.mark.skipif(not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")),
                    reason="systemd-sysusers/systemd-tmpfiles (package systemd) are not installed")
def test_sysusers_and_tmpfiles_make_the_user_and_directories(tmp_path):
    root = _scratch_root(tmp_path)
    for cmd in (["systemd-sysusers", f"--root={root}"], ["systemd-tmpfiles", f"--root={root}", "--create"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (cmd, result.stderr)
    users = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (root / "etc/group").read_text().splitlines()}
    uid, gid = int(users["engram-store"][2]), int(groups["engram-store"][2])
    assert users["engram-store"][5] == "/var/lib/engram-store" and int(users["engram-store"][3]) == gid
    for path, mode, owner in (("run/engram-store", 0o750, uid), ("var/lib/engram-store", 0o750, uid),
                              ("etc/engram-store", 0o750, 0)):
        st = (root / path).stat()
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, owner, gid), path


# --- Kubernetes -------------------------------------------------------------------------------------
def _tool(name: str) -> str | None:
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else shutil.which(name)


needs_kubectl = pytest.mark.skipif(_tool("kubectl") is None, reason="kubectl is not installed")
needs_validate = pytest.mark.skipif(_tool("kubernetes-validate") is None,
                                    reason="kubernetes-validate is not installed (pip install kubernetes-validate)")


def _render(directory: Path) -> str:
    result = subprocess.run([_tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _validate(text: str) -> str:
    result = subprocess.run([_tool("kubernetes-validate"), "--strict", "-"], input=text, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _docs(text: str) -> dict[str, dict]:
    import yaml

    return {doc["kind"]: doc for doc in yaml.safe_load_all(text) if doc}


@needs_kubectl
@needs_validate
@pytest.mark.parametrize("directory", ["k8s", "k8s-example"])
def test_kustomize_renders_and_validates_strictly(directory):
    text = _render(DEPLOY / directory)
    out = _validate(text)
    for kind in ("namespace", "configmap", "priorityclass", "daemonset"):
        assert f"passed for resource {kind}/" in out, out


@needs_kubectl
def test_the_service_monitor_scrapes_the_daemons_metrics_port():
    docs = _docs(_render(DEPLOY / "k8s-example"))
    ds, service, monitor = docs["DaemonSet"], docs["Service"], docs["ServiceMonitor"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    daemon = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "engram-store")
    assert port["targetPort"] in [p["name"] for p in daemon["ports"]] and endpoint["path"] == "/metrics"


@needs_validate
def test_engine_example_validates():
    _validate((DEPLOY / "k8s" / "examples" / "engine.yaml").read_text())


@needs_kubectl
def test_daemonset_agrees_with_its_config_and_probes():
    docs = _docs(_render(DEPLOY / "k8s"))
    ds, cm = docs["DaemonSet"], docs["ConfigMap"]
    pod = ds["spec"]["template"]["spec"]
    daemon = next(c for c in pod["containers"] if c["name"] == "engram-store")
    cfg = load_config(config_file=DEPLOY / "k8s" / "engram-store.toml", environ={})
    assert tomllib.loads(cm["data"]["engram-store.toml"]) == tomllib.loads(
        (DEPLOY / "k8s" / "engram-store.toml").read_text())
    assert ds["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"] == cm["metadata"]["namespace"]
    assert pod["priorityClassName"] == docs["PriorityClass"]["metadata"]["name"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]) and pod["nodeSelector"]
    # probes: HTTP on the metrics port, /livez and /readyz
    port = next(p for p in daemon["ports"] if p["name"] == "metrics")["containerPort"]
    assert cfg.metrics == f"0.0.0.0:{port}" and cfg.metrics_allow_remote
    assert daemon["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert daemon["startupProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert daemon["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # volumes: the config, the tables and the socket directory where the config says
    mounts = {m["name"]: m for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["tables"]["mountPath"] == cfg.tables and mounts["tables"]["readOnly"]
    assert volumes["tables"]["hostPath"]["path"] == "/var/lib/engram-store/tables"
    assert mounts["run"]["mountPath"] == os.path.dirname(cfg.socket)
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert daemon["args"] == ["serve", "--config", mounts["config"]["mountPath"] + "/engram-store.toml"]
    for env in daemon.get("env", []):  # every variable it sets is a real key
        assert env["name"].startswith("ENGRAM_STORE_") and env["name"][13:].lower() in KEYS, env
    # the init container gives the hostPath socket directory to the daemon's uid and gid
    ctx = pod["securityContext"]
    init = next(c for c in pod["initContainers"] if c["name"] == "socket-dir")
    assert f"chown {ctx['runAsUser']}:{ctx['runAsGroup']} {mounts['run']['mountPath']}" in init["command"][-1]
    assert init["volumeMounts"][0]["mountPath"] == mounts["run"]["mountPath"]
    assert set(init["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
    assert daemon["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # no IPC_LOCK: nothing is mlocked
    # memory: the arena counts in the pod's memory (no huge pages in the base); the request holds it
    assert cfg.store_mode == "resident" and not cfg.huge_pages and _plan(cfg) == {1: "resident", 14: "resident"}
    resources = daemon["resources"]
    assert "hugepages-2Mi" not in resources["requests"]
    memory = parse_size(resources["requests"]["memory"].replace("Gi", "GiB"), "memory")
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    assert _arena_bytes() + cfg.max_total_client_shm_bytes <= memory <= _arena_bytes() + (16 << 30)


@needs_kubectl
def test_hugepages_component_moves_the_arena_out_of_memory():
    pod = _docs(_render(DEPLOY / "k8s-example"))["DaemonSet"]["spec"]["template"]["spec"]
    daemon = next(c for c in pod["containers"] if c["name"] == "engram-store")
    requests = daemon["resources"]["requests"]
    huge = parse_size(requests["hugepages-2Mi"].replace("Gi", "GiB"), "hugepages")
    memory = parse_size(requests["memory"].replace("Gi", "GiB"), "memory")
    assert huge >= _arena_bytes() and memory < _arena_bytes() / 10  # counted once, not twice
    env = {e["name"]: e["value"] for e in daemon["env"]}
    assert env["ENGRAM_STORE_HUGE_PAGES"] == "true"
    assert env["ENGRAM_STORE_GRPC_ALLOW_REMOTE"] == "true" and env["ENGRAM_STORE_GRPC_TOKEN_FILE"]
    for name in env:
        assert name[13:].lower() in KEYS, name
    assert daemon["image"].startswith("registry.example.com/")


def test_engine_example_mounts_the_socket_with_the_daemons_group():
    import yaml

    engine = yaml.safe_load((DEPLOY / "k8s" / "examples" / "engine.yaml").read_text())["spec"]["template"]["spec"]
    daemon_pod = yaml.safe_load((DEPLOY / "k8s" / "daemonset.yaml").read_text())["spec"]["template"]["spec"]
    cfg = load_config(config_file=DEPLOY / "k8s" / "engram-store.toml", environ={})
    assert daemon_pod["securityContext"]["runAsGroup"] in engine["securityContext"]["supplementalGroups"]
    volume = next(v for v in engine["volumes"] if "hostPath" in v)
    assert volume["hostPath"]["path"] == "/run/engram-store"
    container = engine["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ENGRAM_STORE_ADDR"] == f"unix://{mount['mountPath']}/{os.path.basename(cfg.socket)}"


# --- make -------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_keeps_a_given_torch(tmp_path):
    """`make TORCH_REQ= ...` (GPU hosts): the venv sees the system's torch and nothing installs another."""
    def plan(*args: str) -> str:
        result = subprocess.run(["make", "-n", "-B", f"VENV={tmp_path / 'v'}", *args, "venv"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    kept, pinned = plan("TORCH_REQ="), plan()
    assert "--system-site-packages" in kept and "import torch" in kept
    assert not re.search(r"pip install[^\n]*torch", kept), kept
    assert "--system-site-packages" not in pinned and re.search(r'pip install[^\n]*"torch==', pinned), pinned
