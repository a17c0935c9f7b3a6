"""gRPC client conventions shared by every dlsched client (the SDK, the CLI,
JobManager, ClusterManager and the gateway).

- The service config shipped with the protos (``protos/dlsched/v1/
  service_config.json``, copied next to the stubs as
  ``dlsched/v1/service_config.json``): reads retry on UNAVAILABLE with
  backoff; mutations retry only where a retry cannot act twice (SubmitJob and
  CreateCluster deduplicate on their ``request_id``, which the SDK always
  sets; StopJob and the driver calls are idempotent); deletes and updates
  never retry; unary calls have deadlines; streams retry only until their
  first message arrives (gRPC's rule) and have no deadline.
- Keepalive pings every 30 s, so an idle watch or log stream is not cut by a
  load balancer's idle timeout (servers permit pings every 10 s).
- Messages up to ``MAX_MESSAGE_BYTES`` (8 MiB) each way, the servers' limit.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def service_config() -> str:
    """The shipped service config, as the JSON text gRPC takes."""
    text = resources.files("dlsched.v1").joinpath("service_config.json").read_text()
    json.loads(text)  # fail loudly on a broken file rather than run without retries
    return text


def options(*, round_robin: bool = False) -> list[tuple[str, Any]]:
    """Channel options for a dlsched client; ``round_robin`` spreads calls
    over every address a target resolves to (several replicas)."""
    cfg = json.loads(service_config())
    if round_robin:
        cfg["loadBalancingConfig"] = [{"round_robin": {}}]
    return [
        ("grpc.service_config", json.dumps(cfg)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def insecure_channel(target: str, *, round_robin: bool = False) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=options(round_robin=round_robin))
