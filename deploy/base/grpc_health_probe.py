"""Liveness probe of a dlsched gRPC service, run by the kubelet as an exec probe.

Kubernetes' own gRPC probes speak plaintext only, and the services serve TLS
(drivers: mutual TLS). This asks grpc.health.v1 over the service's own TLS,
with the files the service itself uses (DLSCHED_TLS_CERT_FILE, _KEY_FILE,
_CA_FILE; DLSCHED_INSECURE=1: plaintext, as in overlays/istio), presenting
its certificate (drivers require one; health needs no more: it is public).
Exit 0 when the service answers SERVING, else 1 with the reason.

    python /etc/dlsched/probe/grpc_health_probe.py --port 50051 \
        --service dlsched.v1.JobManagerService --server-name job-manager

Mounted from ConfigMap dlsched-probe (deploy/base/kustomization.yaml); it uses
only the image's grpcio and grpcio-health-checking.
"""

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(env: str) -> bytes | None:
    path = os.environ.get(env)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def main() -> int:
    p = argparse.ArgumentParser(prog="grpc_health_probe.py")
    p.add_argument("--port", type=int, required=True, help="the service's port on this pod")
    p.add_argument("--service", default="", help="the service name to ask about ('' = the server)")
    p.add_argument("--server-name", default="",
                   help="a name in the service's certificate (its identity): the probe "
                        "dials 127.0.0.1, which the certificate need not name")
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args()
    target = f"127.0.0.1:{a.port}"
    if os.environ.get("DLSCHED_INSECURE", "").strip().lower() in ("1", "true", "yes", "on"):
        ch = grpc.insecure_channel(target)
    else:
        creds = grpc.ssl_channel_credentials(_read("DLSCHED_TLS_CA_FILE"), _read("DLSCHED_TLS_KEY_FILE"),
                                             _read("DLSCHED_TLS_CERT_FILE"))
        options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
        ch = grpc.secure_channel(target, creds, options=options)
    try:
        with ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
    except grpc.RpcError as e:
        print(f"{target} {a.service!r}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{target} {a.service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
