"""``python -m cluster_manager``: build the config, the dependencies, serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from dlsched.auth.audit import AuditLog
from dlsched.auth.authn import Authenticator, AuthOptions, add_auth_flags, auth_options_from_args
from dlsched.auth.interceptor import AuthInterceptor
from dlsched.auth.store import AccessStore
from dlsched.kit import etcd, logs, tracing
from dlsched.kit.election import Leadership
from dlsched.kit.envelope import Keyring
from dlsched.kit.etcd import EtcdOptions, add_etcd_flags, etcd_options_from_args
from dlsched.kit.parse import flag_number
from dlsched.kit.server import (
    Registration,
    ServerOptions,
    add_observability_flags,
    serve_until_signal,
    start_server,
)
from dlsched.kit.tls import TlsOptions, add_tls_flags, tls_options_from_args
from dlsched.v1 import cluster_manager_service_pb2_grpc as pb_grpc

from . import keys
from .drivers import DriverClients
from .hub import WatchHub
from .monitor import MonitorConfig, MonitorManager
from .servicer import ClusterManagerServicer
from .store import ClusterStore

log = logging.getLogger("cluster_manager")


@dataclass(frozen=True)
class Config:
    listen: str
    port_file: str | None
    etcd: EtcdOptions
    prefix: str
    monitor_interval: float
    heartbeat_interval: float
    watch_buffer: int
    driver_timeout: float
    grace_seconds: float
    log_level: str
    metrics_listen: str | None = None
    leader_ttl: int = 5
    trace_export: str | None = None
    log_format: str = "text"
    encryption_key_file: str | None = None
    tls: TlsOptions = TlsOptions(insecure=True)
    auth: AuthOptions = AuthOptions()
    audit_log: str | None = None
    stream_heartbeat_seconds: float = 15.0


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m cluster_manager",
                                description="dlsched ClusterManagerService")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port; port 0 picks one")
    p.add_argument("--port-file", default=None, help="write the bound host:port here")
    add_etcd_flags(p)
    p.add_argument("--prefix", default="/dlsched/", help="etcd key prefix")
    p.add_argument("--monitor-interval", type=flag_number(float, 0, inclusive=False), default=2.0,
                   help="seconds between GetClusterInfo calls per cluster")
    p.add_argument("--heartbeat-interval", type=flag_number(float, 0, inclusive=False), default=30.0,
                   help="most seconds between last_heartbeat_time writes of a steady cluster")
    p.add_argument("--watch-buffer", type=int, default=1024,
                   help="cluster events kept for WatchClusters resume")
    p.add_argument("--driver-timeout", type=flag_number(float, 0, inclusive=False), default=5.0,
                   help="deadline of each DriverService call, seconds")
    p.add_argument("--grace", type=flag_number(float, 0), default=5.0, help="shutdown grace, seconds")
    p.add_argument("--log-level", default="INFO")
    add_observability_flags(p)
    p.add_argument("--leader-ttl", type=flag_number(int, 2), default=5,
                   help="seconds a dead leader's lease outlives it before another replica takes over")
    keys.add_key_file_flag(p)
    add_tls_flags(p)
    add_auth_flags(p)
    p.add_argument("--audit-log", default=os.environ.get("DLSCHED_AUDIT_LOG"),
                   help="append one JSON line per mutating call here (default: the service log)")
    p.add_argument("--stream-heartbeat-seconds", type=flag_number(float, 0, inclusive=False), default=15.0,
                   help="a quiet WatchClusters stream re-checks its caller and gets a HEARTBEAT this often "
                        "(at most 30)")
    a = p.parse_args(argv)
    if a.stream_heartbeat_seconds > 30:
        p.error("--stream-heartbeat-seconds must be at most 30")
    tls = tls_options_from_args(a, p)
    auth = auth_options_from_args(a, p)
    if a.monitor_interval <= 0 or a.heartbeat_interval <= 0 or a.driver_timeout <= 0:
        p.error("intervals and timeouts must be positive")
    if a.watch_buffer < 1:
        p.error("--watch-buffer must be at least 1")
    if a.leader_ttl < 2:
        p.error("--leader-ttl must be at least 2")
    return Config(a.listen, a.port_file, etcd_options_from_args(a, p), a.prefix, a.monitor_interval,
                  a.heartbeat_interval, a.watch_buffer, a.driver_timeout, a.grace, a.log_level,
                  a.metrics_listen, a.leader_ttl, a.trace_export, a.log_format,
                  encryption_key_file=a.encryption_key_file, tls=tls, auth=auth,
                  audit_log=a.audit_log, stream_heartbeat_seconds=a.stream_heartbeat_seconds)


async def serve(cfg: Config, keyring: Keyring) -> None:
    client = await etcd.until_reachable("ClusterManager", lambda: etcd.connect(cfg.etcd))
    store = ClusterStore(client, keyring, cfg.prefix)
    hub = WatchHub(store, buffer_size=cfg.watch_buffer)
    await etcd.until_reachable("ClusterManager: the cluster watch", hub.start)
    drivers = DriverClients(timeout=cfg.driver_timeout, tls=cfg.tls)
    access = AccessStore(client, cfg.prefix)
    await etcd.until_reachable("ClusterManager: access", access.start)
    authenticator = Authenticator.from_options(cfg.auth, access)
    audit = AuditLog(cfg.audit_log)
    monitors = MonitorManager(hub, store, drivers, MonitorConfig(
        interval=cfg.monitor_interval, heartbeat_interval=cfg.heartbeat_interval))
    servicer = ClusterManagerServicer(store, hub, monitors, recheck_seconds=cfg.stream_heartbeat_seconds)
    running = await start_server(
        ServerOptions(listen=cfg.listen, port_file=cfg.port_file, grace_seconds=cfg.grace_seconds,
                      metrics_listen=cfg.metrics_listen, tls=cfg.tls,
                      interceptors=[AuthInterceptor(authenticator.authenticate, audit=audit)]),
        [Registration(pb_grpc.add_ClusterManagerServiceServicer_to_server, servicer,
                      "dlsched.v1.ClusterManagerService")],
        announce_as="cluster-manager",
    )
    # Every replica serves the API; only the leader monitors the clusters.
    election = Leadership(client, f"{cfg.prefix}leaders/cluster-manager".encode(),
                          f"{socket.gethostname()}/{os.getpid()}/{running.address}",
                          ttl=cfg.leader_ttl)

    async def lead() -> None:
        monitors.start()
        try:
            await asyncio.Event().wait()
        finally:
            await monitors.close()

    election.start(lead)

    async def on_stop() -> None:
        await election.close()
        await hub.close()
        await drivers.close()
        await access.close()
        audit.close()
        await store.close()

    await serve_until_signal(running, on_stop=on_stop)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["generate-key"], ["rotate-key"]):
        raise SystemExit(keys.main(args[0], args[1:]))
    cfg = parse_args(args)
    logs.setup(cfg.log_level, "cluster-manager", cfg.log_format)
    keyring = keys.load_or_exit(cfg.encryption_key_file)  # never run unencrypted
    tracing.setup(cfg.trace_export, "cluster-manager")
    asyncio.run(serve(cfg, keyring))


if __name__ == "__main__":
    main()
