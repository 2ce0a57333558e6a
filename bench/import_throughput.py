#!/usr/bin/env python3
"""Import throughput: `engram-store import` MB/s next to a plain copy of the same bytes.

Generates a synthetic safetensors checkpoint (random FP8 tables of the chosen
model and scale), then alternates a plain copy of the checkpoint's table bytes
(read + write + fsync) with an import of it, evicting the source from the page
cache before each run. Reports the best of ``--reps`` runs of each and their
ratio (import MB/s / copy MB/s), both measured on the same bytes in one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_args, add_report_args, report_run  # noqa: E402


def make_checkpoint(path: Path, spec, seed: int = 0) -> int:
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    fmt = spec.row_format
    total = 0
    for i, layer in enumerate(spec.layers):
        n = spec.rows(layer)
        w = rng.integers(0, 256, (n, fmt.dim), dtype=np.uint8)
        s = rng.integers(100, 150, (n, fmt.scale_count), dtype=np.uint8)
        save_file({f"model.layers.{layer}.engram.embed.weight": torch.from_numpy(w).view(torch.float8_e4m3fn),
                   f"model.layers.{layer}.engram.embed.scale": torch.from_numpy(s).view(torch.float8_e8m0fnu)},
                  str(path / f"model-{i:05d}.safetensors"))
        total += w.nbytes + s.nbytes
    return total


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_copy(src_files, dst_dir: Path) -> float:
    dst_dir.mkdir()
    t0 = time.perf_counter()
    for src in src_files:
        with open(src, "rb") as fi, open(dst_dir / src.name, "wb") as fo:
            shutil.copyfileobj(fi, fo, 16 << 20)
            fo.flush()
            os.fsync(fo.fileno())
    return time.perf_counter() - t0


def verify_import(ckpt: Path, tables: Path, spec, rows_per_layer: int = 2000) -> int:
    """Compare sampled rows of the imported table set with the checkpoint's tensors; returns
    how many rows matched (raises on the first mismatch: a bench of a wrong import is void)."""
    import torch
    from safetensors import safe_open

    from engram_store.format.tableset import TableSet

    ts = TableSet.open(tables)
    checked = 0
    try:
        for i, layer in enumerate(spec.layers):
            with safe_open(str(ckpt / f"model-{i:05d}.safetensors"), framework="pt") as f:  # numpy has no fp8
                w = f.get_slice(f"model.layers.{layer}.engram.embed.weight")
                s = f.get_slice(f"model.layers.{layer}.engram.embed.scale")
                n = spec.rows(layer)
                ids = np.unique(np.random.default_rng(layer).integers(0, n, min(rows_per_layer, n)))
                lo, hi = int(ids[0]), int(ids[-1]) + 1
                want = torch.cat([w[lo:hi].view(torch.uint8), s[lo:hi].view(torch.uint8)], 1).numpy()
                got = ts.read_rows(layer, ids)
                if not np.array_equal(got, want[ids - lo]):
                    raise SystemExit(f"import bench: layer {layer}: imported rows differ from the checkpoint")
                checked += len(ids)
    finally:
        ts.close()
    return checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, 0.004, "table scale (0.004 of V4.1 = ~0.8 GB)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory on the disk to measure (default: a temp dir here)")
    add_report_args(ap, "smoke size: the tiny model, 1 rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.scale, args.reps = "tiny", 1.0, 1
    report_run(args, lambda: measure(args), print_table)
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Copy and import the same synthetic checkpoint ``--reps`` times each; the result document."""
    from engram_store.models.spec import get_spec
    from engram_store.tools.importer import import_checkpoint

    spec = get_spec(args.model, args.scale)
    work = Path(tempfile.mkdtemp(prefix="import-bench-", dir=args.dir or Path.cwd()))
    try:
        ckpt = work / "ckpt"
        table_bytes = make_checkpoint(ckpt, spec)
        shards = sorted(ckpt.glob("*.safetensors"))
        copy_s, import_s = [], []
        for rep in range(args.reps):
            evict(shards)
            copy_s.append(plain_copy(shards, work / f"copy{rep}"))
            shutil.rmtree(work / f"copy{rep}")
            evict(shards)
            t0 = time.perf_counter()
            import_checkpoint(ckpt, work / f"out{rep}", spec)
            import_s.append(time.perf_counter() - t0)
            if rep == 0:
                verified = verify_import(ckpt, work / "out0", spec)
            shutil.rmtree(work / f"out{rep}")
        copy_mb_s = table_bytes / 1e6 / min(copy_s)
        import_mb_s = table_bytes / 1e6 / min(import_s)
        result = {"model": spec.name, "scale": args.scale, "table_bytes": table_bytes, "reps": args.reps,
                  "copy_mb_s": round(copy_mb_s, 1), "import_mb_s": round(import_mb_s, 1),
                  "import_over_copy": round(import_mb_s / copy_mb_s, 3), "verified_rows": verified,
                  "copy_seconds": copy_s, "import_seconds": import_s}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def print_table(result: dict) -> None:
    print(f"{'what':<10}{'MB/s':>10}")
    print(f"{'copy':<10}{result['copy_mb_s']:>10.1f}")
    print(f"{'import':<10}{result['import_mb_s']:>10.1f}")
    print(f"import/copy = {result['import_over_copy']:.3f}  ({result['table_bytes'] / 1e9:.2f} GB of table bytes, "
          f"best of {result['reps']})")


if __name__ == "__main__":
    sys.exit(main())
