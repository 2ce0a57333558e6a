"""The operator subcommand ``doctor`` (``register(subparsers)`` adds it to the main ``engram-store`` CLI)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    doctor = subparsers.add_parser(
        "doctor", help="check this host before a deploy: PASS / WARN / FAIL per check, with the fix",
        description="Check this host for the daemon a config describes: memory and cgroup limits vs dram_bytes, "
        "huge pages, free disk, io_uring and O_DIRECT on the tables' file system, the placement vs the engines, "
        "the socket and table files for an engine's user, memlock, CUDA and kvikio. The config is read as "
        "`serve` reads it (--config, ENGRAM_STORE_* variables, defaults). Exit 0: deploy (warnings allowed); "
        "1: a check failed.")
    doctor.add_argument("--config", metavar="FILE", default=None, help="the daemon's TOML config "
                        "(default: $ENGRAM_STORE_CONFIG)")
    doctor.add_argument("--engine-user", metavar="USER", default=None,
                        help="the user engines run as: check it may connect to the socket and read the table files")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import exit_code, render, run

    checks = run(args.config, args.engine_user)
    if args.json:
        print(json.dumps({"deploy": exit_code(checks) == 0, "checks": [c.to_dict() for c in checks]}, indent=1))
    else:
        print(render(checks))
    return exit_code(checks)
