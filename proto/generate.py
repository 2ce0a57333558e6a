"""Generate the checked-in Python code for proto/engram_store.proto.

    python proto/generate.py                 # writes engram_store/wire/_proto/
    python proto/generate.py --out DIR       # writes elsewhere (the drift test uses this)

Uses grpc_tools.protoc (the ``test`` extra). The generated grpc module imports
its messages as a top-level module; the import is rewritten to be relative so
the code works inside the ``engram_store.wire._proto`` package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "engram_store.proto"
DEFAULT_OUT = ROOT / "engram_store" / "wire" / "_proto"
GENERATED = ("engram_store_pb2.py", "engram_store_pb2.pyi", "engram_store_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # test extra; imported here so --help works without it

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO.parent}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", str(PROTO)]
        rc = protoc.main(args)
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            text = (Path(tmp) / name).read_text()
            if name.endswith("_grpc.py"):
                text = text.replace("import engram_store_pb2 as engram__store__pb2",
                                    "from . import engram_store_pb2 as engram__store__pb2")
            (out / name).write_text(text)
            written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
