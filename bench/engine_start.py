#!/usr/bin/env python3
"""Engine start: how long until a fresh engine process has its Engram tables, and what they cost in memory.

Two ways, on the same tables in one run:

* ``checkpoint`` (what vLLM does today): a fresh process reads every Engram
  tensor of a safetensors checkpoint (``layers.L.engram.embed.weight`` /
  ``.scale``) into host tensors of its own. The checkpoint is evicted from the
  page cache before each cold run (``--warm`` also times runs with it cached).
* ``daemon`` (the vLLM plugin's way): a fresh process maps the engram-store
  daemon's arena (``EngramStoreTables.connect(...).views(...)`` for every
  layer) and touches one byte per 4 KiB page, as pinning it for the GPU
  (``cudaHostRegister``) would; ``map-only`` is the time before the touch.

Then 4 such processes of each way are started and held, and their PSS
(proportional set size: shared pages split between the processes mapping them)
is read from ``/proc/PID/smaps_rollup``. Each process is this script run with
``--child``; timings are taken inside it, after its imports (``ready_seconds``),
and from its start by the parent (``wall_seconds``, Python and torch start-up
included).

    python bench/engine_start.py --scale 0.01 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from _common import add_model_args, add_report_args, report_run  # noqa: E402


# --- the child processes -----------------------------------------------------------------
def child_checkpoint(ckpt: Path) -> dict:
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    held, nbytes = [], 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if ".engram.embed." not in name:
                    continue
                src = f.get_tensor(name)
                dst = torch.empty(src.shape, dtype=src.dtype)  # vLLM: pinned host memory on a GPU host
                dst.copy_(src)
                del src
                held.append(dst)
                nbytes += dst.numel() * dst.element_size()
    return {"ready_seconds": time.perf_counter() - t0, "bytes": nbytes, "held": held}


def child_daemon(address: str) -> dict:
    import torch  # noqa: F401  (an engine has it loaded; the checkpoint way imports it before its clock too)

    import engram_store.client.unix_transport  # noqa: F401
    from engram_store.integrations.tables import EngramStoreTables

    t0 = time.perf_counter()
    tables = EngramStoreTables.connect(address)
    held, nbytes = [], 0
    for layer in tables.layers:
        weight, scales = tables.views(layer, 0, tables.rows(layer))
        held += [weight, scales]
        nbytes += weight.numel() + scales.numel()
    mapped = time.perf_counter() - t0
    tables.view.array[::4096].sum()  # one byte per page: what cudaHostRegister's pinning faults in
    return {"ready_seconds": time.perf_counter() - t0, "map_seconds": mapped, "bytes": nbytes, "held": held}


def run_child(args) -> int:
    result = child_checkpoint(Path(args.child_ckpt)) if args.child == "checkpoint" else child_daemon(args.child_addr)
    held = result.pop("held")
    print(json.dumps(result), flush=True)
    sys.stdin.read()  # hold the tables until the parent closes our stdin
    del held
    return 0


# --- the parent ----------------------------------------------------------------------------
class Child:
    def __init__(self, way: str, ckpt: Path, address: str) -> None:
        self.t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--child", way, "--child-ckpt", str(ckpt), "--child-addr", address]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        self.wall = time.perf_counter() - self.t0
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{way} child exited with {self.proc.returncode} before it was ready")
        self.result = json.loads(line) | {"wall_seconds": self.wall}

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(60)


def pss_of(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, 0.01, "table size as a share of the model's (0.01: ~2 GB)")
    p.add_argument("--reps", type=int, default=3, help="timed starts of one process, each way")
    p.add_argument("--processes", type=int, default=4, help="processes held at once for the PSS figure")
    p.add_argument("--warm", action="store_true", help="also time checkpoint starts with the checkpoint in the page cache")
    p.add_argument("--workdir", help="where the checkpoint and tables go (default: a temp dir, removed after)")
    add_report_args(p, "smoke size: tiny model, 1 rep, 2 processes")
    p.add_argument("--child", choices=["checkpoint", "daemon"], help=argparse.SUPPRESS)
    p.add_argument("--child-ckpt", help=argparse.SUPPRESS)
    p.add_argument("--child-addr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return run_child(args)
    if args.quick:
        args.model, args.scale, args.reps, args.processes = "tiny", 1.0, 1, 2
    report_run(args, lambda: measure(args), print_table)
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Time the starts and hold the processes for PSS; the report document."""
    from support.daemon_helpers import DaemonProcess
    from import_throughput import evict, make_checkpoint

    from engram_store.models.spec import get_spec
    from engram_store.tools.importer import import_checkpoint

    spec = get_spec(args.model, args.scale)
    tmp = tempfile.TemporaryDirectory(prefix="engine-start-", dir=args.workdir)
    work = Path(tmp.name)
    ckpt, tables = work / "ckpt", work / "tables"
    table_bytes = make_checkpoint(ckpt, spec)
    import_checkpoint(ckpt, tables, spec)
    shards = sorted(ckpt.glob("*.safetensors"))
    daemon = DaemonProcess(tables, work, dram_bytes=str(4 * table_bytes + (64 << 20)), extra=["--grpc", ""])
    report: dict = {"model": spec.name, "scale": args.scale, "table_bytes": table_bytes, "processes": args.processes}
    try:
        daemon.start()
        address = daemon.unix
        times: dict[str, list[dict]] = {"checkpoint_cold": [], "daemon": []}
        if args.warm:
            times["checkpoint_warm"] = []
        for _ in range(args.reps):  # alternate the ways, so that a noisy moment hits both
            evict(shards)
            c = Child("checkpoint", ckpt, address)
            times["checkpoint_cold"].append(c.result)
            c.stop()
            if args.warm:
                c = Child("checkpoint", ckpt, address)
                times["checkpoint_warm"].append(c.result)
                c.stop()
            c = Child("daemon", ckpt, address)
            times["daemon"].append(c.result)
            c.stop()
        for way, runs in times.items():
            report[way] = {"ready_seconds": summary([r["ready_seconds"] for r in runs]),
                           "wall_seconds": summary([r["wall_seconds"] for r in runs])}
        report["daemon"]["map_seconds"] = summary([r["map_seconds"] for r in times["daemon"]])
        for way in ("checkpoint", "daemon"):
            evict(shards)
            held = [Child(way, ckpt, address) for _ in range(args.processes)]
            try:
                report[f"pss_{way}"] = {"per_process_bytes": [pss_of(c.proc.pid) for c in held]}
                report[f"pss_{way}"]["total_bytes"] = sum(report[f"pss_{way}"]["per_process_bytes"])
                if way == "daemon":
                    report[f"pss_{way}"]["daemon_bytes"] = pss_of(daemon.pid)
            finally:
                for c in held:
                    c.stop()
        cold, warm_daemon = report["checkpoint_cold"], report["daemon"]
        report["ratio_ready_checkpoint_over_daemon"] = cold["ready_seconds"]["median"] / warm_daemon["ready_seconds"]["median"]
        with_daemon = report["pss_daemon"]["total_bytes"] + report["pss_daemon"]["daemon_bytes"]
        report["ratio_pss_checkpoint_over_daemon"] = report["pss_checkpoint"]["total_bytes"] / with_daemon
    finally:
        daemon.stop()
        tmp.cleanup()

    return report


def print_table(report: dict) -> None:
    gib = 2**30
    print(f"engine start, {report['model']} scale {report['scale']}: {report['table_bytes'] / gib:.2f} GiB of Engram tables")
    print(f"{'way':<18}{'ready s (median)':>18}{'min..max':>18}{'wall s':>10}")
    for way in [w for w in ("checkpoint_cold", "checkpoint_warm", "daemon") if w in report]:
        r = report[way]["ready_seconds"]
        print(f"{way:<18}{r['median']:>18.3f}{r['min']:>9.3f}..{r['max']:<7.3f}{report[way]['wall_seconds']['median']:>10.3f}")
    print(f"daemon map only: {report['daemon']['map_seconds']['median'] * 1e3:.1f} ms")
    print(f"ready: checkpoint / daemon = {report['ratio_ready_checkpoint_over_daemon']:.1f}x")
    print(f"PSS of {report['processes']} processes: checkpoint {report['pss_checkpoint']['total_bytes'] / gib:.2f} GiB, "
          f"daemon way {report['pss_daemon']['total_bytes'] / gib:.2f} GiB + the daemon itself "
          f"{report['pss_daemon']['daemon_bytes'] / gib:.2f} GiB: {report['ratio_pss_checkpoint_over_daemon']:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
