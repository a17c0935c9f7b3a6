"""Generate the Python stubs of protos/dlsched/v1 into dlsched/v1.

Usage: python scripts/genproto.py [--out DIR]

With --out the stubs go to DIR (the stale-stub test uses that to compare with
what is committed). Uses grpcio-tools' bundled protoc, so no system protoc is
needed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_ROOT.glob("dlsched/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # The gRPC service config ships with the protos; clients load it from the package.
    config = PROTO_ROOT / "dlsched" / "v1" / "service_config.json"
    (out / "dlsched" / "v1" / config.name).write_text(config.read_text())
    return sorted((out / "dlsched" / "v1").glob("*_pb2*.py*")) + [out / "dlsched" / "v1" / config.name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    ns = parser.parse_args()
    files = generate(ns.out)
    print(f"generated {len(files)} files", file=sys.stderr)


if __name__ == "__main__":
    main()
