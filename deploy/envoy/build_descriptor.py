"""Build the descriptor set Envoy's gRPC-JSON transcoder reads (``proto_descriptor``).

Usage: python deploy/envoy/build_descriptor.py [--out dlsched.pb]

Runs grpcio-tools' protoc with ``--include_imports`` over the two public
services (protos/dlsched/v1/*_service.proto, which carry the google.api.http
rules) plus google/rpc/status.proto and error_details.proto, so that
``convert_grpc_status`` can print ErrorInfo and BadRequest details. The
google/rpc protos come from the googleapis-common-protos package; google/api
from protos/google/api (vendored); google/protobuf from grpcio-tools.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import grpc_tools
from google.rpc import status_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
SERVICES = ["dlsched/v1/job_manager_service.proto", "dlsched/v1/cluster_manager_service.proto",
            "dlsched/v1/access_service.proto"]
ERROR_TYPES = ["google/rpc/status.proto", "google/rpc/error_details.proto"]


def build(out: pathlib.Path) -> None:
    wkt = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    common = pathlib.Path(status_pb2.__file__).resolve().parents[2]  # holds google/rpc/*.proto
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"-I{wkt}", f"-I{common}",
           "--include_imports", f"--descriptor_set_out={out}", *SERVICES, *ERROR_TYPES]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or r.stderr.strip():
        raise SystemExit(f"protoc failed:\n{r.stderr}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("dlsched.pb"))
    ns = p.parse_args()
    build(ns.out)
    print(f"wrote {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
