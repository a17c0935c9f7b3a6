"""Adapters for the services JobManager calls: ClusterManager and drivers.

They speak ``dlsched.v1`` stubs and hand domain objects back; failed calls are
rebuilt as dlsched errors (``from_rpc_error``) so a ClusterManager reason such
as NO_MATCHING_CLUSTER reaches JobManager's client unchanged, with its
BadRequest or PreconditionFailure details.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from dlsched import errors
from dlsched.kit import tls as tls_kit
from dlsched.kit.channel import TokenSource, bearer_interceptors
from dlsched.kit.rpc_errors import from_rpc_error
from dlsched.kit.timeutil import to_duration
from dlsched.v1 import (
    cluster_manager_service_pb2 as cm_pb2,
)
from dlsched.v1 import (
    cluster_manager_service_pb2_grpc as cm_grpc,
)
from dlsched.v1 import (
    driver_service_pb2 as drv_pb2,
)
from dlsched.v1 import (
    driver_service_pb2_grpc as drv_grpc,
)
from dlsched.v1 import job_manager_service_pb2 as jm_pb2
from dlsched.v1 import job_pb2
from job_manager.convert import (
    candidate_from_proto,
    native_from_proto,
    observation_from_proto,
    spec_to_proto,
)
from job_manager.domain.model import Candidate, JobSpec, NativeSpec, Observation
from job_manager.driver_logs import IDLE, LogMux, MultiplexUnsupported
from job_manager.heartbeats import with_heartbeats

log = logging.getLogger("job_manager.clients")
T = TypeVar("T")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    # a replica that stopped answering (frozen, its host gone) leaves the rotation after a
    # keepalive ping and this much more, not gRPC's default 20 s
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # (gRPC core waits this one, 60 s by default)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # A target naming several replicas (ipv4:a,b or a headless Service's
    # dns:///name) spreads calls over them and skips one that died.
    ("grpc.lb_policy_name", "round_robin"),
]


#: a tail that failed UNAVAILABLE (or DRIVER_NOT_READY) before its first batch is opened again
#: this often (3 s in all; a client's channel retries the whole call on top, as the service config says)
_TAIL_RETRIES = 4


def for_client(e: errors.DlschedError, cluster: str) -> errors.DlschedError:
    """A driver's error as JobManager's client gets it (the calls a client's
    request makes: usage, logs, a dry run's render).

    - CLUSTER_NOT_CONFIGURED means the driver restarted and ClusterManager has
      not configured it again yet (its monitor does, within a probe interval):
      the client's request is fine, so UNAVAILABLE ``DRIVER_NOT_READY``, which
      clients retry, not the driver's FAILED_PRECONDITION, which they must not.
    - A driver that does not answer (gRPC's own UNAVAILABLE, no reason of the
      driver's) is UNAVAILABLE ``DRIVER_UNAVAILABLE`` naming the cluster, not
      gRPC's message about JobManager's connection to an internal address.
    """
    if e.reason == "CLUSTER_NOT_CONFIGURED":
        return errors.Unavailable(f"the driver of {cluster} restarted and is being configured again; retry",
                                  reason="DRIVER_NOT_READY", metadata={"cluster": cluster})
    if isinstance(e, errors.Unavailable) and e.reason == "UNAVAILABLE":
        return errors.Unavailable(f"the driver of {cluster} does not answer; retry",
                                  reason="DRIVER_UNAVAILABLE", metadata={"cluster": cluster})
    return e


def raise_for_client(e: errors.DlschedError, cluster: str) -> NoReturn:
    """Raise ``for_client(e, cluster)``, chained to ``e`` when it is another error."""
    err = for_client(e, cluster)
    if err is e:
        raise e
    raise err from e


def _channel(address: str, tls: tls_kit.TlsOptions | None,
             token: TokenSource | None = None) -> grpc.aio.Channel:
    """Verified TLS presenting JobManager's certificate (mutual TLS where the
    server asks for it), or plaintext when the operator chose --insecure."""
    interceptors = bearer_interceptors(token) if token else None
    if tls is None or tls.insecure:
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS,
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls_kit.client_credentials(tls, client_cert=True),
                                   options=[*_CHANNEL_OPTIONS, *tls_kit.name_options(address)],
                                   interceptors=interceptors)


def translate(exc: grpc.RpcError) -> errors.DlschedError:
    """A failed call as the dlsched error it carries, details included. A call of
    JobManager's that ran out of its own time (gRPC's DEADLINE_EXCEEDED, no error of the
    peer's) is the peer not answering: UNAVAILABLE, which clients retry, as for a peer
    that refuses connections (a frozen ClusterManager or driver gave JobManager's clients
    DEADLINE_EXCEEDED, which neither the channel's retry policy nor the SDK retries)."""
    err = from_rpc_error(exc)
    if isinstance(err, errors.DeadlineExceeded) and err.reason in ("DEADLINE_EXCEEDED", "TIMED_OUT"):
        return errors.Unavailable("no answer in time; retry", reason="UNAVAILABLE")
    return err


async def _unary(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.RpcError as e:
        raise translate(e) from e


async def _cm_unary(call: Awaitable[T]) -> T:
    """``_unary`` for ClusterManager: its outage named as such, not by gRPC's text about
    JobManager's connection to an internal address."""
    try:
        return await call
    except grpc.RpcError as e:
        err = translate(e)
        if isinstance(err, errors.Unavailable) and err.reason == "UNAVAILABLE":
            raise errors.Unavailable("ClusterManager does not answer; retry",
                                     reason="CLUSTER_MANAGER_UNAVAILABLE") from e
        raise err from e


def match_spec(spec: JobSpec) -> job_pb2.JobSpec:
    """What ClusterManager's matching reads of a spec (its run mode, each group's role,
    replicas, processes and resources, the selector, the project), nothing else:
    commands, environment and labels differ from job to job and never change a match
    (whether a group names an image does: only container backends run one). Built from
    the job's spec directly (not through the whole spec's proto: a submit's cost).
    ``tests/test_submit_path.py`` checks ClusterManager derives the same requirements."""
    sel = spec.cluster_selector
    return job_pb2.JobSpec(
        run_mode=spec.run_mode, project=spec.project,  # type: ignore[arg-type]
        cluster_selector=job_pb2.ClusterSelector(
            cluster=sel.cluster, cluster_type=sel.cluster_type, labels=sel.labels),  # type: ignore[arg-type]
        replica_groups=[job_pb2.ReplicaGroup(
            role=g.role, replicas=g.replicas, processes_per_replica=g.processes_per_replica, image=g.image,
            resources=job_pb2.Resources(cpu=g.resources.cpu, memory_bytes=g.resources.memory_bytes,
                                        gpus=g.resources.gpus, gpu_type=g.resources.gpu_type))
            for g in spec.replica_groups])


#: one MatchClusters attempt's deadline: one that gets no answer in time is sent again (the
#: channel's round robin takes the next replica: a frozen one cost every other submit the whole
#: timeout, then UNAVAILABLE); the last attempt has what is left of the client's timeout
MATCH_ATTEMPT_SECONDS = 2.0
MATCH_ATTEMPTS = 3

#: a cluster's driver address known, ClusterManager is asked again for at most this long once the
#: cache has expired; then the last address serves, and is asked for again after STALE_RETRY_SECONDS
STALE_LOOKUP_SECONDS = 3.0
STALE_RETRY_SECONDS = 5.0


class ClusterManagerClient:
    """MatchClusters, and the driver address of a cluster (cached briefly).

    MatchClusters gets what matching reads of a spec (``match_spec``), and
    identical requests in flight at once share one call (a burst of jobs alike
    in their needs, e.g. a sweep or an array of jobs, costs ClusterManager one
    match): a request that joins gets the answer of the call already in flight,
    sent at most one round trip before it (a cluster registered within that
    round trip may be missed by it, as by a call of its own sent a moment sooner).
    """

    def __init__(self, address: str, *, timeout: float = 15.0, cache_seconds: float = 10.0,
                 tls: tls_kit.TlsOptions | None = None, token: TokenSource | None = None) -> None:
        self._channel = _channel(address, tls, token)
        self._stub = cm_grpc.ClusterManagerServiceStub(self._channel)
        self._timeout = timeout
        self._cache_seconds = cache_seconds
        self._drivers: dict[str, tuple[str, float, int]] = {}  # cluster: (driver address, when, type)
        self._matching: dict[bytes, asyncio.Future[cm_pb2.MatchClustersResponse]] = {}  # in flight

    async def match(self, spec: JobSpec) -> list[Candidate]:
        req = cm_pb2.MatchClustersRequest(spec=match_spec(spec), project=spec.project)
        key = req.SerializeToString(deterministic=True)
        call = self._matching.get(key)
        if call is None:  # the call is a task of its own: a caller that leaves never ends it
            call = self._matching[key] = asyncio.ensure_future(self._match_call(req))
            call.add_done_callback(lambda done: self._match_done(key, done))
        resp = await asyncio.shield(call)
        out = [candidate_from_proto(c) for c in resp.candidates]
        for c in out:
            if c.driver_address:
                self._drivers[c.cluster] = (c.driver_address, time.monotonic(), c.cluster_type)
        return out

    async def _match_call(self, req: cm_pb2.MatchClustersRequest) -> cm_pb2.MatchClustersResponse:
        """MatchClusters (a read: safe to send again), each attempt MATCH_ATTEMPT_SECONDS at
        most, another while an attempt found no answer and the timeout leaves time."""
        deadline = time.monotonic() + self._timeout
        for attempt in range(MATCH_ATTEMPTS):
            left = deadline - time.monotonic()
            try:
                last = attempt == MATCH_ATTEMPTS - 1  # (the rest of the time: a slow one still answers)
                return await _cm_unary(self._stub.MatchClusters(
                    req, timeout=left if last else min(left, MATCH_ATTEMPT_SECONDS)))
            except errors.Unavailable:
                if attempt == MATCH_ATTEMPTS - 1 or deadline - time.monotonic() < 1.0:
                    raise
                log.info("MatchClusters got no answer; asked again")
            await asyncio.sleep(0.1 * (attempt + 1))  # (every replica down answers at once: no spin)
        raise AssertionError("unreachable")

    def _match_done(self, key: bytes, call: asyncio.Future[cm_pb2.MatchClustersResponse]) -> None:
        if self._matching.get(key) is call:
            del self._matching[key]
        if not call.cancelled():
            call.exception()  # retrieved: every caller still waiting gets it

    async def driver_address(self, cluster: str) -> str:
        return (await self._driver(cluster))[0]

    async def cluster_type(self, cluster: str) -> int:
        """The cluster's ``ClusterType`` (cached with its driver's address)."""
        return (await self._driver(cluster))[2]

    async def _driver(self, cluster: str) -> tuple[str, float, int]:
        hit = self._drivers.get(cluster)
        if hit and time.monotonic() - hit[1] < self._cache_seconds:
            return hit
        try:
            # Known already: asked briefly (a frozen ClusterManager must not hold a client's read
            # past its deadline, a bare DEADLINE_EXCEEDED), and when it does not answer, the
            # address it gave last serves, asked again STALE_RETRY_SECONDS later.
            resp = await _cm_unary(self._stub.GetCluster(
                cm_pb2.GetClusterRequest(name=cluster),
                timeout=min(self._timeout, STALE_LOOKUP_SECONDS) if hit else self._timeout))
        except errors.Unavailable as e:
            if hit is None:
                raise
            log.info("ClusterManager did not give %s's driver (%s): its last address serves", cluster, e.reason)
            self._drivers[cluster] = (hit[0], time.monotonic() - self._cache_seconds + STALE_RETRY_SECONDS, hit[2])
            return hit
        addr = str(resp.cluster.driver_address)
        if not addr:
            raise errors.Unavailable(f"{cluster} has no driver address",
                                     reason="DRIVER_UNAVAILABLE")
        hit = self._drivers[cluster] = (addr, time.monotonic(), int(resp.cluster.type))
        return hit

    def forget(self, cluster: str) -> None:
        self._drivers.pop(cluster, None)

    async def close(self) -> None:
        await self._channel.close()


#: A client's read through a driver (usage, a dry run's render) waits this long for the
#: driver: well inside the 30 s the shipped service config gives reads, so a frozen driver
#: is the client's UNAVAILABLE ``DRIVER_UNAVAILABLE`` naming the cluster, not its own bare
#: DEADLINE_EXCEEDED (the config's deadline is the client's alone: no server sees it).
CLIENT_READ_TIMEOUT = 20.0
#: Once a client read of a cluster found its driver silent (no answer at all; a driver that
#: answers, even TIMED_OUT for a slow backend, is not silent), client reads of that cluster fail
#: at once for this long (unless the driver answers for it meanwhile): the service config
#: retries UNAVAILABLE, and each retry waiting CLIENT_READ_TIMEOUT again would outlast the
#: client's deadline. Follow tails are never refused (a follower waits for lines anyway).
SILENT_HOLD = 15.0


class DriverClient:
    """One driver service (one channel, shared by every cluster it serves)."""

    def __init__(self, address: str, *, timeout: float = 30.0,
                 tls: tls_kit.TlsOptions | None = None,
                 read_timeout: float = CLIENT_READ_TIMEOUT) -> None:
        self.address = address
        self._channel = _channel(address, tls)
        self._stub = drv_grpc.DriverServiceStub(self._channel)
        self._timeout = timeout
        self._read_timeout = read_timeout
        self._silent: dict[str, float] = {}  # cluster -> when a client read found its driver silent
        self._logs = LogMux(self._stub)

    def _silence(self, cluster: str) -> errors.Unavailable:
        return errors.Unavailable(
            f"the driver of {cluster} did not answer within {self._read_timeout:g} s; retry",
            reason="DRIVER_UNAVAILABLE", metadata={"cluster": cluster})

    def _refuse_if_silent(self, cluster: str) -> None:
        silent = self._silent.get(cluster)
        if silent is not None:
            if time.monotonic() - silent < SILENT_HOLD:
                raise self._silence(cluster)
            del self._silent[cluster]

    async def _client_read(self, cluster: str, call: Callable[[], Awaitable[T]]) -> T:
        """A call a client's request waits on (made with ``self._read_timeout``)."""
        self._refuse_if_silent(cluster)
        try:
            resp = await call()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and from_rpc_error(e).reason == "DEADLINE_EXCEEDED":
                self._silent[cluster] = time.monotonic()  # our own deadline: no answer at all
            raise_for_client(translate(e), cluster)
        self._answered(cluster)
        return resp

    def _answered(self, cluster: str) -> None:
        self._silent.pop(cluster, None)

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        resp = await self._client_read(cluster, lambda: self._stub.RenderJob(drv_pb2.RenderJobRequest(
            cluster=cluster, job_id=job_id, spec=spec_to_proto(spec)), timeout=self._read_timeout))
        return native_from_proto(resp.native_spec)

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int,
                     uid: str = "") -> tuple[str, Observation | None]:
        resp = await _unary(self._stub.LaunchJob(drv_pb2.LaunchJobRequest(
            cluster=cluster, job_id=job_id, spec=spec_to_proto(spec), attempt=attempt, job_uid=uid),
            timeout=self._timeout))
        obs = observation_from_proto(resp.observation) if resp.HasField("observation") else None
        return resp.backend_job_id, obs

    async def batch_get(self, cluster: str, refs: list[tuple[str, str]]) -> list[Observation]:
        out: list[Observation] = []
        for i in range(0, len(refs), 1000):
            chunk = refs[i:i + 1000]
            resp = await _unary(self._stub.BatchGetJobObservations(
                drv_pb2.BatchGetJobObservationsRequest(
                    cluster=cluster,
                    jobs=[drv_pb2.JobRef(job_id=j, backend_job_id=b) for j, b in chunk]),
                timeout=self._timeout))
            out.extend(observation_from_proto(o) for o in resp.observations)
            self._answered(cluster)
        return out

    async def watch(self, cluster: str) -> AsyncIterator[Observation | None]:
        """Observations of a cluster's jobs; None marks the end of the snapshot."""
        call = self._stub.WatchJobObservations(drv_pb2.WatchJobObservationsRequest(cluster=cluster))
        try:
            async for resp in call:
                self._answered(cluster)
                if resp.snapshot_complete:
                    yield None
                if resp.HasField("observation"):
                    yield observation_from_proto(resp.observation)
        except grpc.RpcError as e:
            raise translate(e) from e
        finally:
            call.cancel()

    async def terminate(self, cluster: str, job_id: str, backend_job_id: str,
                        grace_seconds: float, uid: str = "") -> Observation | None:
        resp = await _unary(self._stub.TerminateJob(drv_pb2.TerminateJobRequest(
            cluster=cluster, job=drv_pb2.JobRef(job_id=job_id, backend_job_id=backend_job_id, job_uid=uid),
            grace_period=to_duration(grace_seconds)), timeout=self._timeout + grace_seconds))
        return observation_from_proto(resp.observation) if resp.HasField("observation") else None

    async def cleanup(self, cluster: str, job_id: str, backend_job_id: str, uid: str = "") -> None:
        await _unary(self._stub.CleanupJob(drv_pb2.CleanupJobRequest(
            cluster=cluster, job=drv_pb2.JobRef(job_id=job_id, backend_job_id=backend_job_id, job_uid=uid)),
            timeout=self._timeout))

    async def forget(self, cluster: str, refs: list[tuple[str, str]]) -> int:
        """ForgetJobs: these ended jobs' final states are recorded (1000 per call)."""
        n = 0
        for i in range(0, len(refs), 1000):
            resp = await _unary(self._stub.ForgetJobs(drv_pb2.ForgetJobsRequest(
                cluster=cluster,
                jobs=[drv_pb2.JobRef(job_id=j, backend_job_id=b) for j, b in refs[i:i + 1000]]),
                timeout=self._timeout))
            n += resp.forgotten
        return n

    async def tail_logs(self, cluster: str, job_id: str, backend_job_id: str,
                        req: jm_pb2.StreamJobLogsRequest, *, idle: float = 0.0,
                        ) -> AsyncGenerator[list[job_pb2.LogEntry], None]:
        """Log batches, passed through as protos (JobManager only relays them):
        a tail on the driver's shared MultiplexJobLogs stream (``driver_logs``).
        With ``idle`` > 0, an empty batch each time that many seconds pass
        without lines."""
        treq = drv_pb2.TailJobLogsRequest(
            cluster=cluster, job=drv_pb2.JobRef(job_id=job_id, backend_job_id=backend_job_id),
            follow=req.follow, tail_lines=req.tail_lines, role=req.role, streams=req.streams)
        if req.HasField("since_time"):
            treq.since_time.CopyFrom(req.since_time)
        if req.HasField("replica_index"):
            treq.replica_index = req.replica_index
        # Without follow the driver reads what is there and ends: silence past
        # ``self._read_timeout`` is a driver that does not answer (a client read).
        limit = 0.0 if req.follow else self._read_timeout
        wait = min(idle, limit) if idle > 0 and limit else (idle or limit)
        retries = 0
        while not self._logs.unsupported:
            if limit:
                self._refuse_if_silent(cluster)
            tail = self._logs.open(treq)
            got = False
            quiet = 0.0
            try:
                while True:  # no batch held while the follower waits
                    batch = await tail.next(wait)
                    if batch is None:
                        return
                    if batch is IDLE:
                        quiet += wait
                        if limit and quiet >= limit:
                            self._silent[cluster] = time.monotonic()
                            raise self._silence(cluster)
                    else:
                        got, quiet = True, 0.0
                        self._answered(cluster)
                    entries = list(batch.entries)
                    del batch
                    yield entries
                    del entries
            except MultiplexUnsupported:
                self._logs.mark_unsupported()  # an older driver: one TailJobLogs call per tail, below
                break
            except errors.DlschedError as e:
                # As the service config retries a stream before its first message.
                # Not the backend's own UNAVAILABLE: the driver answered it after its own timeout
                # (a frozen Ray agent: 4 more opens of 10 s each held a read ~1 minute).
                if (not isinstance(for_client(e, cluster), errors.Unavailable) or got or retries >= _TAIL_RETRIES
                        or e.reason == "BACKEND_UNAVAILABLE"):
                    raise_for_client(e, cluster)
                await asyncio.sleep(min(0.2 * 2 ** retries, 5.0))
                retries += 1
            finally:
                tail.close()
        try:
            async with contextlib.aclosing(with_heartbeats(self._tail_call(treq), idle, list)) as batches:
                async for entries in batches:
                    yield entries
        except errors.DlschedError as e:
            raise_for_client(e, cluster)

    async def _tail_call(self, treq: drv_pb2.TailJobLogsRequest) -> AsyncGenerator[list[job_pb2.LogEntry], None]:
        call = self._stub.TailJobLogs(treq)
        try:
            async for resp in call:
                yield list(resp.entries)
        except grpc.RpcError as e:
            raise translate(e) from e
        finally:
            call.cancel()

    async def usage(self, cluster: str, job_id: str, backend_job_id: str) -> job_pb2.JobUsage:
        resp = await self._client_read(cluster, lambda: self._stub.MeasureJobUsage(
            drv_pb2.MeasureJobUsageRequest(
                cluster=cluster, job=drv_pb2.JobRef(job_id=job_id, backend_job_id=backend_job_id)),
            timeout=self._read_timeout))
        usage: job_pb2.JobUsage = resp.usage
        return usage

    def retire(self) -> None:
        """Replaced (a renewed certificate): its log streams end once their tails have."""
        self._logs.retire()

    async def close(self) -> None:
        await self._logs.close()
        await self._channel.close()


class DriverPool:
    """Driver clients by address; channels are cached and reused."""

    def __init__(self, **kw: Any) -> None:
        self._clients: dict[str, DriverClient] = {}
        self._kw = kw
        tls = kw.get("tls")
        self._watch = tls_kit.FilesWatch(tls) if tls is not None else None
        self._retired: list[DriverClient] = []

    def get(self, address: str) -> DriverClient:
        if self._watch is not None and self._watch.changed():
            # A renewed certificate: new calls get new channels; calls in
            # flight finish on the old ones (closed with the pool).
            for retired in self._clients.values():
                retired.retire()
            self._retired.extend(self._clients.values())
            self._clients.clear()
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = DriverClient(address, **self._kw)
        return c

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in [*self._clients.values(), *self._retired]),
                             return_exceptions=True)
        self._clients.clear()
        self._retired.clear()
