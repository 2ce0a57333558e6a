"""What the benches share: the same output flags everywhere, the storage benches' table set and scratch dir,
a daemon started for a run.

Every bench takes ``--help``, ``--quick`` (a smoke run of seconds) and ``--json [PATH]``
(:func:`add_report_args`): the report as one JSON document written to PATH, or to stdout
when PATH is ``-`` or left out, in which case stdout carries the JSON only and the human
table goes to stderr (:class:`JsonReport`). The storage benches (lookup.py,
nvme_throughput.py, the load benches) also take ``--tables``, ``--workdir``, ``--model`` and ``--scale``
(:func:`add_table_args`). The benches that start a daemon do it with :func:`start_daemon`.
bench/ is on ``sys.path`` when they run as scripts, so they import this as ``_common``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

JSON_HELP = ("write the report as one JSON document to PATH; '-' or no PATH: to stdout, which then carries "
             "the JSON only (the table goes to stderr)")


def add_report_args(ap: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick`` and ``--json [PATH]``, the same in every bench."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help=JSON_HELP)


def add_model_args(ap: argparse.ArgumentParser, scale: float, scale_help: str = "table scale") -> None:
    """``--model`` (a spec name, default deepseek-v4.1-flash) and ``--scale`` (default ``scale``)."""
    ap.add_argument("--model", default="deepseek-v4.1-flash")
    ap.add_argument("--scale", type=float, default=scale, help=scale_help)


def add_table_args(ap: argparse.ArgumentParser, scale: float, scale_help: str = "table scale", workdir: str = ".",
                   workdir_help: str = "where to synthesize/cache the bench table set") -> None:
    """``--tables``, ``--workdir``, ``--model`` and ``--scale``: what :func:`ensure_tables` reads."""
    ap.add_argument("--tables", help="existing table set (default: synthesize one in --workdir)")
    ap.add_argument("--workdir", default=workdir, help=workdir_help)
    add_model_args(ap, scale, scale_help)


class JsonReport:
    """Where a bench's output goes, as a context manager around the whole run.

    With ``--json -`` (or a bare ``--json``) everything printed while it is open, by Python
    or by a child process sharing file descriptor 1, goes to stderr, and the JSON document
    given to :meth:`emit` is written to the real stdout when it closes: stdout carries that
    document and nothing else. With ``--json PATH`` the table goes to stdout and the JSON to
    PATH; without ``--json``, the table only.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.path: str | None = args.json
        self.doc: Any = None
        self._stdout = None
        self._saved_fd: int | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "JsonReport":
        if self.path == "-":
            self._stdout = sys.stdout
            self._stdout.flush()
            try:
                self._saved_fd = os.dup(1)
                os.dup2(2, 1)
            except OSError:  # no fd 1 (an embedding host): Python's own output is still redirected
                self._saved_fd = None
            self._stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        return self

    def emit(self, doc: Any, table: Callable[[], None] | None = None) -> None:
        """Print the human ``table`` (to stderr under ``--json -``) and keep ``doc`` for the JSON."""
        if table is not None:
            table()
            sys.stdout.flush()
        self.doc = doc

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stack.close()
        if self._saved_fd is not None:
            os.dup2(self._saved_fd, 1)
            os.close(self._saved_fd)
        if exc_type is not None or self.path is None or self.doc is None:
            return
        text = json.dumps(self.doc, indent=1, default=str)
        if self.path == "-":
            self._stdout.write(text + "\n")
            self._stdout.flush()
        else:
            Path(self.path).write_text(text + "\n")


def report_run(args: argparse.Namespace, measure: Callable[[], Any], table: Callable[[Any], None]) -> Any:
    """``measure()`` inside a :class:`JsonReport`; its document is emitted with the human ``table(doc)``
    and returned."""
    with JsonReport(args) as out:
        doc = measure()
        out.emit(doc, lambda: table(doc))
    return doc


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (a bench's repeated runs)."""
    return {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def ensure_tables(args: argparse.Namespace, name: str) -> Path:
    """``--tables`` if given; else a synthetic ``--model`` table set at ``--scale`` in
    ``--workdir``/``<name>-<spec>-<scale>``, written once and reused by later runs."""
    from engram_store.models.spec import get_spec
    from engram_store.tools.synth import write_synthetic

    if args.tables:
        return Path(args.tables)
    spec = get_spec(args.model, args.scale)
    out = Path(args.workdir) / f"{name}-{spec.name}-{args.scale:g}"
    if not (out / "manifest.json").exists():
        print(f"synthesizing {spec.name} at scale {args.scale:g} into {out} ...", file=sys.stderr)
        write_synthetic(out, spec, seed=1, overwrite=True)
    return out


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc`` (a daemon the bench started) and wait up to ``timeout`` seconds, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_token_file(workdir: Path) -> Path:
    """``workdir/grpc.token``, written once: a random gRPC token, mode 0600 (the daemon refuses one others may
    read); give it to the daemon as ``--grpc-token-file`` and to gRPC clients as ``token_file=``."""
    path = workdir / "grpc.token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def start_daemon(serve_args: list[str], workdir: Path, timeout: float, *, isolated: bool = False,
                 **popen: Any) -> tuple[subprocess.Popen, dict]:
    """``engram-store serve`` (log level WARNING, then ``serve_args``) as a subprocess logging to
    ``workdir/daemon.log``; waits for the ready file it writes once it serves (``workdir/ready.json``).

    Returns the process and the ready file's contents (the real addresses). A daemon that exits or is not
    ready within ``timeout`` seconds is stopped and RuntimeError raised with its log's tail. ``isolated``:
    without this environment's ``ENGRAM_STORE_*`` variables (only the arguments configure it); ``popen``:
    more ``subprocess.Popen`` arguments (``cwd``, ``preexec_fn``)."""
    ready, log_path = workdir / "ready.json", workdir / "daemon.log"
    cmd = [sys.executable, "-m", "engram_store.daemon", "serve", "--ready-file", str(ready), "--log-level", "WARNING",
           *serve_args]
    if isolated:
        popen["env"] = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    with open(log_path, "ab") as log:  # the daemon holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 10)
            raise RuntimeError(f"daemon did not start: {log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.02)  # polling the ready file
    return proc, json.loads(ready.read_text())


def stop_daemon(proc: subprocess.Popen, workdir: Path) -> str:
    """Stop a daemon :func:`start_daemon` started in the scratch folder ``workdir`` and remove the folder; the
    last 1,000 characters of its log."""
    stop_process(proc, 30)
    tail = (workdir / "daemon.log").read_text(errors="replace")[-1000:]
    shutil.rmtree(workdir, ignore_errors=True)
    return tail


def run_in_workdir(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace, name: str) -> Any:
    """``run(args)``; a ``--quick`` run given neither ``--tables`` nor ``--workdir`` works in a
    scratch directory (``<name>-*`` under the temp dir) that is removed afterwards."""
    scratch = None
    if args.quick and not args.tables and args.workdir == ".":
        scratch = args.workdir = tempfile.mkdtemp(prefix=f"{name}-")
    try:
        return run(args)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def check_row(check: str, ok: bool | None, value: str = "", note: str = "") -> dict:
    """One row of a check table (bench/device_check.py): status ok / FAIL / skipped (ok None)."""
    return {"check": check, "status": {True: "ok", False: "FAIL", None: "skipped"}[ok], "value": value, "note": note}
