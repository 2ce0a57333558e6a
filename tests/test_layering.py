"""The package layers, checked: no module imports upward, the daemon imports no client code, and no
modules import each other, directly or in a loop.

Every ``import`` and ``from ... import`` of every module (lazy ones inside functions
included; imports under ``if TYPE_CHECKING:`` are annotations only and skipped) is
resolved to the group of the module it names, and each group may depend only on the
groups below it:

    version, errors, progress              nothing of ours
    models                                 errors (model specs, row-id hashing, token maps)
    native                                 errors
    format                                 errors, models, native
    wire                                   errors, models, format, native
    storage                                the base layers above
    tools                                  the base layers (import, synth)
    daemon                                 the base layers, storage
    client                                 the base layers (models, format, wire, native), never storage
    fetch                                  the base layers, client (the engine-side fetch job)
    gpu_client                             the base layers, client
    integrations                           the base layers, client, fetch, gpu_client
    ops                                    the base layers, storage, daemon, client (doctor)
    engram_store (package), cli, __main__  anything (entry points and re-exports)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BASE = {"version", "errors", "progress", "models", "native", "format", "wire"}
ALLOWED = {
    "version": set(),
    "errors": set(),
    "progress": set(),
    "models": {"errors"},
    "native": {"errors"},
    "format": {"errors", "models", "native"},
    "wire": {"errors", "models", "format", "native"},
    "storage": BASE,
    "tools": BASE,
    "daemon": BASE | {"storage"},
    "client": BASE,
    "fetch": BASE | {"client"},
    "gpu_client": BASE | {"client"},
    "integrations": BASE | {"client", "fetch", "gpu_client"},
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


def imports_of(module: str, path: Path, annotations: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ours in ``path``; those under ``if TYPE_CHECKING:`` only
    with ``annotations``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if annotations else _type_checking_only(tree)
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


def circles() -> list[list[str]]:
    """Every set of modules that import each other, directly or in a loop (lazy imports included): the
    strongly connected components of more than one module in the import graph. Imports for annotations
    only (``if TYPE_CHECKING:``) count: they too say which module depends on which. A package's
    ``__init__`` counts as the package's module."""
    names = {module for module, _ in modules()}
    edges = {module: sorted({t for _, t in imports_of(module, path, annotations=True)
                             if t in names and t != module})
             for module, path in modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative (the tree is deep enough to matter)
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(edges[child])))
            elif child in stack:
                low[node] = min(low[node], index[child])

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_import_circles():
    assert circles() == []


def test_the_check_sees_a_circle(tmp_path, monkeypatch):
    """The circle finder itself: a loop of three modules, one edge of it lazy and one for annotations, is one circle; a package
    importing its own submodule that imports nothing back is none."""
    fake = tmp_path / "engram_store"
    (fake / "storage").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "storage" / "__init__.py").write_text("from . import d\n")
    (fake / "storage" / "a.py").write_text("from . import b\n")
    (fake / "storage" / "b.py").write_text("def f():\n    from .c import x\n")
    (fake / "storage" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from .a import y\n")
    (fake / "storage" / "d.py").write_text("")
    (tmp_path / "gpu_client").mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert circles() == [["engram_store.storage.a", "engram_store.storage.b", "engram_store.storage.c"]]


DOC = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- layers: made by `python tests/test_layering.py --write-docs` -->", "<!-- end of layers -->"


UTILITIES = {"errors", "version", "progress"}  # importable from anywhere: left out of the picture


def layer_picture() -> str:
    """The packages and who imports whom, drawn from the code: the block of docs/design.md between BEGIN
    and END, a Mermaid graph (top layers first, each package with its folders). An arrow a --> b: a
    module of a imports one of b, drawn only where no other arrow path already leads from a to b; the
    utilities (errors, version, progress) are left out."""
    edges: set[tuple[str, str]] = set()
    folders: dict[str, set[str]] = {}
    for module, path in modules():
        mine = group(module)
        if mine in TOP | UTILITIES:
            continue
        parts = path.relative_to(ROOT).parts
        depth = 2 if parts[0] == "engram_store" else 1
        if len(parts) > depth + 1:
            folders.setdefault(mine, set()).add(parts[depth])
        for _, target in imports_of(module, path):
            theirs = group(target)
            if theirs != mine and theirs not in TOP | UTILITIES:
                edges.add((mine, theirs))

    def reaches(a: str, b: str, skip: tuple[str, str]) -> bool:
        todo, seen = [a], set()
        while todo:
            x = todo.pop()
            for e in edges:
                if e != skip and e[0] == x and e[1] not in seen:
                    if e[1] == b:
                        return True
                    seen.add(e[1])
                    todo.append(e[1])
        return False

    drawn = sorted(e for e in edges if not reaches(e[0], e[1], skip=e))
    order = sorted(set(ALLOWED) - UTILITIES, key=lambda g: (-len(_below(g)), g))
    lines = [BEGIN, "```mermaid", "flowchart TD"]
    for g in order:
        inside = sorted(folders.get(g, ()))
        label = g + (f"<br/><small>{', '.join(f + '/' for f in inside)}</small>" if inside else "")
        lines.append(f'    {g}["{label}"]')
    lines += [f"    {a} --> {b}" for a, b in sorted(drawn, key=lambda e: (order.index(e[0]), order.index(e[1])))]
    lines += ["```", END]
    return "\n".join(lines)


def _below(g: str) -> set[str]:
    seen: set[str] = set()
    todo = list(ALLOWED[g])
    while todo:
        h = todo.pop()
        if h not in seen:
            seen.add(h)
            todo += ALLOWED[h]
    return seen


def test_the_design_doc_draws_the_layers_as_they_are():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} has no generated layer picture"
    drawn = text[text.index(BEGIN): text.index(END) + len(END)]
    assert drawn == layer_picture(), "the layers changed: run `python tests/test_layering.py --write-docs`"


@pytest.mark.parametrize("name", ["EngramClient", "LocalClient", "MemoryTables", "EngramPrefetcher", "Step",
                                  "dequantize"])
def test_public_imports_of_the_readme_keep_working(name):
    import gpu_client

    assert getattr(gpu_client, name).__name__ == name


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-docs"]:
        sys.exit("usage: python tests/test_layering.py --write-docs  (redraws the layers in docs/design.md)")
    text = DOC.read_text()
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + layer_picture() + text[text.index(END) + len(END):]
    else:
        sys.exit(f"{DOC}: put the two marker lines where the picture goes:\n{BEGIN}\n{END}")
    DOC.write_text(text)
