"""The package layers, checked: no module imports upward, the daemon imports no client code.

Every ``import`` and ``from ... import`` of every module (lazy ones inside functions
included; imports under ``if TYPE_CHECKING:`` are annotations only and skipped) is
resolved to the group of the module it names, and each group may depend only on the
groups below it:

    version, errors, progress              nothing of ours
    spec                                   errors
    native                                 errors
    format                                 errors, spec, native (and tokens' map files)
    tokens, hashing                        errors, spec, format
    wire                                   errors, spec, format, native
    storage                                the base layers above
    tools                                  the base layers (import, synth)
    daemon                                 the base layers, storage
    client                                 the base layers (format, spec, wire, native), never storage
    gpu_client                             the base layers, client
    integrations                           the base layers, client, gpu_client
    ops                                    the base layers, storage, daemon, client (doctor)
    engram_store (package), cli, __main__  anything (entry points and re-exports)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BASE = {"version", "errors", "progress", "spec", "native", "format", "tokens", "hashing", "wire"}
ALLOWED = {
    "version": set(),
    "errors": set(),
    "progress": set(),
    "spec": {"errors"},
    "native": {"errors"},
    "format": {"errors", "spec", "native", "tokens"},
    "tokens": {"errors", "spec", "format"},
    "hashing": {"errors", "spec", "format", "tokens"},
    "wire": {"errors", "spec", "format", "native"},
    "storage": BASE,
    "tools": BASE,
    "daemon": BASE | {"storage"},
    "client": BASE,
    "gpu_client": BASE | {"client"},
    "integrations": BASE | {"client", "gpu_client"},
    "ops": BASE | {"storage", "daemon", "client"},
}
TOP = {"engram_store", "cli", "__main__"}


def group(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "gpu_client":
        return "gpu_client"
    return parts[1] if len(parts) > 1 else "engram_store"


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted((ROOT / "engram_store").rglob("*.py")) + sorted((ROOT / "gpu_client").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        if "_proto" not in parts:
            found.append((".".join(parts), path))
    return found


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(n for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ours in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [f"{target}.{a.name}" for a in node.names]
            # `from pkg import submodule` names the submodule; `from mod import name` the module
            found += [(node.lineno, n if _is_module(n) else target) for n in names]
    return [(line, m) for line, m in found if m.split(".")[0] in ("engram_store", "gpu_client")]


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.is_dir() or p.with_suffix(".py").exists() or any(p.parent.glob(p.name + ".*.so")) \
        or p.with_suffix(".c").exists()


def violations() -> list[str]:
    bad = []
    for module, path in modules():
        mine = group(module)
        if mine in TOP:
            continue
        assert mine in ALLOWED, f"{module}: group {mine!r} has no place in the layering; add it to ALLOWED"
        for line, target in imports_of(module, path):
            theirs = group(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} ({mine}) imports {target} ({theirs})")
    return bad


def test_no_module_imports_upward():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The walker itself: a daemon module importing the client, and a client module
    importing storage, lazily inside a function, are both reported."""
    fake = tmp_path / "engram_store"
    (fake / "daemon").mkdir(parents=True)
    (fake / "client").mkdir()
    (fake / "storage").mkdir()
    for pkg in ("", "daemon", "client", "storage"):
        (fake / pkg / "__init__.py").write_text("")
    (fake / "client" / "x.py").write_text("")
    (fake / "storage" / "y.py").write_text("")
    (fake / "daemon" / "bad.py").write_text("from ..client import x\n")
    (fake / "client" / "bad.py").write_text("def f():\n    from engram_store.storage.y import Z\n")
    (fake / "client" / "ok.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ..storage.y import Z\n")
    (tmp_path / "gpu_client").mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    found = violations()
    assert len(found) == 2 and any("daemon.bad" in v and "(client)" in v for v in found) \
        and any("client.bad" in v and "(storage)" in v for v in found), found


@pytest.mark.parametrize("name", ["EngramClient", "LocalClient", "MemoryTables", "EngramPrefetcher", "Step",
                                  "dequantize"])
def test_public_imports_of_the_readme_keep_working(name):
    import gpu_client

    assert getattr(gpu_client, name).__name__ == name
