"""What the storage benches (lookup.py, nvme_throughput.py) share: their table set and their --quick scratch dir.

Both take ``--tables``, ``--workdir``, ``--model``, ``--scale`` and ``--quick``;
bench/ is on ``sys.path`` when they run as scripts, so they import this as ``_common``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable


def ensure_tables(args: argparse.Namespace, name: str) -> Path:
    """``--tables`` if given; else a synthetic ``--model`` table set at ``--scale`` in
    ``--workdir``/``<name>-<spec>-<scale>``, written once and reused by later runs."""
    from engram_store.spec import get_spec
    from engram_store.tools.synth import write_synthetic

    if args.tables:
        return Path(args.tables)
    spec = get_spec(args.model, args.scale)
    out = Path(args.workdir) / f"{name}-{spec.name}-{args.scale:g}"
    if not (out / "manifest.json").exists():
        print(f"synthesizing {spec.name} at scale {args.scale:g} into {out} ...", file=sys.stderr)
        write_synthetic(out, spec, seed=1, overwrite=True)
    return out


def run_in_workdir(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, name: str) -> int:
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
