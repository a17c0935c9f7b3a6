"""``python -m job_manager``: build config, connect, reconcile, serve."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from dlsched.auth.audit import AuditLog
from dlsched.auth.authn import Authenticator, AuthOptions, add_auth_flags, auth_options_from_args
from dlsched.auth.interceptor import AuthInterceptor
from dlsched.auth.servicer import AccessServicer
from dlsched.auth.store import AccessStore
from dlsched.kit import etcd, logs, tracing
from dlsched.kit.channel import TokenSource
from dlsched.kit.etcd import EtcdOptions, add_etcd_flags, etcd_options_from_args
from dlsched.kit.parse import flag_number
from dlsched.kit.server import (
    Registration,
    ServerOptions,
    add_keepalive_flags,
    add_observability_flags,
    serve_until_signal,
    start_server,
)
from dlsched.kit.tls import TlsOptions, add_tls_flags, tls_options_from_args
from dlsched.v1 import access_service_pb2_grpc
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from job_manager.cache import JobCache
from job_manager.clients import ClusterManagerClient, DriverPool
from job_manager.history.options import (
    HistoryOptions,
    add_history_flags,
    history_options_from_args,
    start_history,
)
from job_manager.job_metrics import JobStateGauge
from job_manager.ownership import ClusterOwnership
from job_manager.scheduler import Scheduler, SchedulerConfig
from job_manager.servicer import JobManagerServicer
from job_manager.sole_writer import SoleWriter
from job_manager.store import FENCED_WAIT_SECONDS, JobStore
from job_manager.watch import WatchHub

log = logging.getLogger("job_manager")
#: The API promises clients a heartbeat at least this often on a quiet stream
#: (job_manager_service.proto); proxies' idle timeouts are sized by it.
MAX_STREAM_HEARTBEAT_SECONDS = 30.0


@dataclass(frozen=True)
class Config:
    listen: str
    port_file: str | None
    etcd: EtcdOptions
    cluster_manager: str
    prefix: str = "/dlsched/"
    watch_buffer: int = 0
    watch_buffer_bytes: int = 64 << 20
    watch_history: int = 5000
    consistent_reads: bool = True
    stop_grace_seconds: float = 10.0
    stream_heartbeat_seconds: float = 15.0
    log_level: str = "INFO"
    metrics_listen: str | None = None
    trace_export: str | None = None
    log_format: str = "text"
    tls: TlsOptions = TlsOptions(insecure=True)
    auth: AuthOptions = AuthOptions()
    audit_log: str | None = None
    keepalive_seconds: float = 30.0
    keepalive_timeout_seconds: float = 10.0
    replica_id: str = ""
    owner_ttl: int = 5
    history: HistoryOptions = HistoryOptions()


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m job_manager", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--port-file")
    add_etcd_flags(p)
    p.add_argument("--cluster-manager", required=True, help="ClusterManager host:port")
    p.add_argument("--prefix", default="/dlsched/")
    p.add_argument("--watch-buffer", type=int, default=0,
                   help="at most this many events kept for WatchJobs resume tokens "
                        "(0: bounded by --watch-buffer-bytes only)")
    p.add_argument("--watch-buffer-bytes", type=int, default=64 << 20,
                   help="bytes of events kept for WatchJobs resume tokens")
    p.add_argument("--consistent-reads", action=argparse.BooleanOptionalAction, default=True,
                   help="GetJob and ListJobs show every write made before them, on any replica "
                        "(one etcd read each); --no-consistent-reads: this replica's cache as it is")
    p.add_argument("--watch-history", type=flag_number(int, 0), default=5000,
                   help="revisions back the job watch starts at, so tokens survive a restart")
    p.add_argument("--stop-grace-seconds", type=flag_number(float, 0), default=10.0)
    p.add_argument("--stream-heartbeat-seconds", type=flag_number(float, 0), default=15.0,
                   help="WatchJobs and StreamJobLogs send a heartbeat after this long without "
                        "a message, so proxies keep quiet streams open: 0 < S <= 30, or 0 for none")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--replica-id", default="",
                   help="this replica's name among the JobManagers (default host/pid/random)")
    p.add_argument("--owner-ttl", type=flag_number(int, 2), default=5,
                   help="lease TTL of this replica's cluster ownership: a dead replica's "
                        "clusters move to another within it")
    add_history_flags(p)
    add_observability_flags(p)
    add_keepalive_flags(p)
    add_tls_flags(p)
    add_auth_flags(p)
    p.add_argument("--audit-log", default=os.environ.get("DLSCHED_AUDIT_LOG"),
                   help="append one JSON line per mutating call here (default: the service log)")
    a = p.parse_args(argv)
    if a.owner_ttl < 2:
        p.error("--owner-ttl must be at least 2")
    if a.watch_buffer < 0:
        p.error("--watch-buffer must be 0 (no count bound) or more")
    if a.watch_buffer_bytes < 1:
        p.error("--watch-buffer-bytes must be at least 1")
    if not 0 <= a.stream_heartbeat_seconds <= MAX_STREAM_HEARTBEAT_SECONDS:
        p.error(f"--stream-heartbeat-seconds must be 0 (none) to {MAX_STREAM_HEARTBEAT_SECONDS:g}")
    tls = tls_options_from_args(a, p)
    history = history_options_from_args(a, p)
    auth = auth_options_from_args(a, p)
    if not auth.disabled and not auth.control_plane_token_file:
        p.error("JobManager calls ClusterManager with --control-plane-token-file "
                "(env DLSCHED_CONTROL_PLANE_TOKEN_FILE); give it, or --no-auth")
    return Config(listen=a.listen, port_file=a.port_file, etcd=etcd_options_from_args(a, p),
                  cluster_manager=a.cluster_manager, prefix=a.prefix,
                  watch_buffer=a.watch_buffer, watch_buffer_bytes=a.watch_buffer_bytes,
                  watch_history=a.watch_history,
                  consistent_reads=a.consistent_reads,
                  stop_grace_seconds=a.stop_grace_seconds,
                  stream_heartbeat_seconds=a.stream_heartbeat_seconds, log_level=a.log_level,
                  metrics_listen=a.metrics_listen, trace_export=a.trace_export,
                  log_format=a.log_format, tls=tls, auth=auth, audit_log=a.audit_log,
                  keepalive_seconds=a.keepalive_seconds,
                  keepalive_timeout_seconds=a.keepalive_timeout_seconds,
                  replica_id=a.replica_id, owner_ttl=a.owner_ttl, history=history)


async def amain(cfg: Config) -> None:
    client = await etcd.until_reachable("JobManager", lambda: etcd.connect(cfg.etcd))
    # Job writes are fenced by the sole-writer key; alone, this replica claims it and
    # its consistent reads need no etcd round trip (job_manager/sole_writer.py).
    sole = SoleWriter(cfg.prefix, cfg.replica_id)
    # A write the claim of another replica refuses waits past that replica's lease TTL
    # (a frozen or dead holder's key goes with its lease).
    store = JobStore(client, cfg.prefix, sole=sole,
                     fenced_wait=max(FENCED_WAIT_SECONDS, cfg.owner_ttl * 1.5 + 2))
    # The watch cache: every job, loaded page by page at one revision, then kept
    # by the hub's one watch; reads are served from it.
    cache = JobCache()
    hub = WatchHub(client, cfg.prefix, buffer_size=cfg.watch_buffer,
                   buffer_bytes=cfg.watch_buffer_bytes, history=cfg.watch_history,
                   consistent_reads=cfg.consistent_reads,
                   cache=cache, store=store)
    hub.sole = sole
    await etcd.until_reachable("JobManager: the job cache", hub.start)
    log.info("job cache loaded: %d jobs at revision %d", len(cache), cache.revision)
    access = AccessStore(client, cfg.prefix)
    await etcd.until_reachable("JobManager: access", access.start)
    # JobManager only presents the control-plane token (to ClusterManager);
    # it never accepts it: nobody calls JobManager as the control plane.
    authenticator = Authenticator.from_options(
        dataclasses.replace(cfg.auth, control_plane_token_file=None), access)
    cp_token = (TokenSource(file=cfg.auth.control_plane_token_file)
                if cfg.auth.control_plane_token_file else None)
    cm = ClusterManagerClient(cfg.cluster_manager, tls=cfg.tls, token=cp_token)
    drivers = DriverPool(tls=cfg.tls)
    # Each cluster's tracking is done by one replica; it takes over (reconciles)
    # the clusters it wins as soon as it has joined.
    ownership = ClusterOwnership(client, store, hub, identity=cfg.replica_id,
                                 ttl=cfg.owner_ttl, prefix=cfg.prefix, cache=cache)
    # Job history: terminal jobs past the retention move out of etcd (the
    # archiver, leader-only), and reads look there after the cache and etcd.
    history, archiving = await start_history(cfg.history, client, store, cache, cfg.prefix,
                                             ownership.identity,
                                             functools.partial(hub.wait_current, prove=True))
    scheduler = Scheduler(store, cm, drivers,
                          SchedulerConfig(stop_grace_seconds=cfg.stop_grace_seconds),
                          ownership=ownership, cache=cache, history=history)
    ownership.start(scheduler)
    scheduler.start()
    gauge = JobStateGauge(cache, hub)
    if cfg.metrics_listen:
        gauge.start()
    audit = AuditLog(cfg.audit_log)
    running = await start_server(
        ServerOptions(listen=cfg.listen, port_file=cfg.port_file, grace_seconds=5.0,
                      keepalive_seconds=cfg.keepalive_seconds,
                      keepalive_timeout_seconds=cfg.keepalive_timeout_seconds,
                      metrics_listen=cfg.metrics_listen, tls=cfg.tls,
                      interceptors=[AuthInterceptor(authenticator.authenticate, audit=audit)]),
        [Registration(pb_grpc.add_JobManagerServiceServicer_to_server,
                      JobManagerServicer(scheduler, hub,
                                         heartbeat_seconds=cfg.stream_heartbeat_seconds,
                                         history=history),
                      "dlsched.v1.JobManagerService"),
         Registration(access_service_pb2_grpc.add_AccessServiceServicer_to_server,
                      AccessServicer(access), "dlsched.v1.AccessService")],
        announce_as="job-manager")

    async def before_stop() -> None:
        await gauge.close()
        await hub.stop()  # ends open WatchJobs streams now; clients resume elsewhere

    async def on_stop() -> None:
        await ownership.close()  # hands every cluster over now
        if archiving is not None:
            await archiving.close()
        if history is not None:
            await history.close()
        await scheduler.close()
        await cm.close()
        await drivers.close()
        await access.close()
        audit.close()
        await client.close()

    await serve_until_signal(running, before_stop=before_stop, on_stop=on_stop)


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    logs.setup(cfg.log_level, "job-manager", cfg.log_format)
    tracing.setup(cfg.trace_export, "job-manager")
    asyncio.run(amain(cfg))


if __name__ == "__main__":
    main()
