"""deploy/k8s/components/hugepages-64k: the arena in 512 MiB huge pages on 64 KiB-page kernels (Grace).

The component is rendered on the base with kubectl kustomize; its hugepages-512Mi allowance must hold
the arena the daemon makes on a 64 KiB kernel that has those pages reserved (arena_backings on that
kernel's sizes: 512 MiB pages, the size a whole number of them), be a whole number of pages, and
move the arena out of the pod's memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from engram_store.daemon.config import KEYS, parse_size
from engram_store.native.pagesizes import HugePagePool, PageSizes
from engram_store.models.spec import get_spec
from engram_store.storage.resident import arena_backings

ROOT = Path(__file__).resolve().parents[1]
V41 = get_spec("deepseek-v4.1-flash")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_64k_component_holds_the_arena_in_512mib_pages(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / "deploy" / "k8s", overlay)],
        "components": [os.path.relpath(ROOT / "deploy" / "k8s" / "components" / "hugepages-64k", overlay)]}))
    out = subprocess.run(["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    daemonset = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "DaemonSet")
    daemon = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "engram-store")
    requests, limits = daemon["resources"]["requests"], daemon["resources"]["limits"]
    assert "hugepages-2Mi" not in requests and requests["hugepages-512Mi"] == limits["hugepages-512Mi"]
    huge = parse_size(requests["hugepages-512Mi"].replace("Gi", "GiB"), "hugepages")
    grace = PageSizes(64 * KiB, (HugePagePool(2 * MiB, 0, 0), HugePagePool(512 * MiB, huge // (512 * MiB),
                                                                           huge // (512 * MiB)),
                                 HugePagePool(16 * GiB, 0, 0)), 512 * MiB, 512 * MiB, "madvise", "never")
    arena = arena_backings([(layer, V41.rows(layer)) for layer in V41.layers], V41.row_format, sizes=grace)[0]
    assert (arena.kind, arena.page_bytes) == ("hugetlb", 512 * MiB)  # the allowance holds the arena's pages
    assert huge % (512 * MiB) == 0 and arena.nbytes <= huge
    memory = parse_size(requests["memory"].replace("Gi", "GiB"), "memory")
    assert memory < arena.nbytes / 10  # counted once, in huge pages
    env = {e["name"]: e["value"] for e in daemon["env"]}
    assert env["ENGRAM_STORE_HUGE_PAGES"] == "true" and all(name[13:].lower() in KEYS for name in env)
