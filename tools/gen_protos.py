"""Generate the Python gRPC stubs from protos/ into vmesh/ (checked in).

    python tools/gen_protos.py [--out DIR]

The proto directories mirror their package (vmesh/v1), so the generated modules import
each other as `vmesh.v1.*` without rewriting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p.relative_to(PROTO_ROOT)) for p in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    for package in {p.relative_to(PROTO_ROOT).parent for p in protos}:
        for part in [package, *package.parents][:-2]:  # vmesh/__init__.py is written by hand
            (out / part / "__init__.py").touch()
    return sorted(p for p in out.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
