"""ClusterManagerService over gRPC: transport only.

Each handler checks the request, converts proto -> domain, calls the store /
matcher / hub, converts back. Requests are never logged (they may carry
credentials); responses never carry credentials (``convert.cluster_to_proto``
has no path for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import grpc

from dlsched import spec_rules
from dlsched.auth.interceptor import caller
from dlsched.auth.model import Principal, check_project
from dlsched.errors import FieldViolation, InvalidArgument, PermissionDenied
from dlsched.kit import tokens
from dlsched.kit.timeutil import check_duration
from dlsched.v1 import cluster_manager_service_pb2 as pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2

from . import convert
from .domain import filter as flt
from .domain import matching, validation
from .domain.errors import ClusterEtagMismatch, ClusterNotFound
from .domain.models import Cluster, ClusterState, ClusterType, Credentials
from .hub import ResumeToken, Subscription, WatchHub
from .monitor import MonitorManager
from .store import ClusterStore, EventKind, StoreEvent

log = logging.getLogger("cluster_manager.servicer")

_EVENT_TYPE = {
    EventKind.CREATED: job_pb2.WATCH_EVENT_TYPE_CREATED,
    EventKind.UPDATED: job_pb2.WATCH_EVENT_TYPE_UPDATED,
    EventKind.DELETED: job_pb2.WATCH_EVENT_TYPE_DELETED,
}


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _request_credentials(p: Any) -> Credentials | None:
    return convert.credentials_from_proto(p.credentials) if p.HasField("credentials") else None


#: how often a quiet WatchClusters stream re-checks its caller and sends a HEARTBEAT
RECHECK_SECONDS = 15.0


def _watcher(p: Principal) -> Principal:
    """A cluster watcher as of now: UNAUTHENTICATED once its token was revoked or
    expired, PERMISSION_DENIED once it holds no role anywhere (an in-memory check)."""
    p = p.current()
    p.require_any_role("watching clusters")
    return p


class _Sent:
    """When the stream last sent something: its heartbeat is due ``every`` seconds after."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def mark(self) -> None:
        self.at = time.monotonic()


async def _events(sub: Subscription, p: Principal, every: float,
                  sent: _Sent) -> AsyncGenerator[StoreEvent | None, None]:
    """``sub``'s events, each after the caller was checked again (``_watcher``), which
    it also is once nothing was sent for ``every`` seconds (``sent``, which the stream
    marks; <= 0: only per event), each such check yielding None (the stream's heartbeat).
    An event the stream's filter drops sends nothing: it does not put the heartbeat off.

    One task awaits the pending event across those checks: a check never cancels
    the subscription's step."""
    step: asyncio.Future[StoreEvent] | None = None
    try:
        while True:
            if every <= 0:
                ev = await sub.next()
            else:
                if step is None:
                    step = asyncio.ensure_future(sub.next())
                wait = sent.at + every - time.monotonic()
                done = (await asyncio.wait((step,), timeout=wait))[0] if wait > 0 else set()
                if not done:
                    p = _watcher(p)
                    yield None
                    continue
                finished, step = step, None
                ev = finished.result()
            p = _watcher(p)
            yield ev
    finally:
        if step is not None:
            step.cancel()
            await asyncio.wait((step,))
            if not step.cancelled():
                step.exception()  # retrieved: the stream is ending for a reason of its own


class ClusterManagerServicer(pb_grpc.ClusterManagerServiceServicer):
    def __init__(self, store: ClusterStore, hub: WatchHub, monitors: MonitorManager,
                 clock: Callable[[], datetime] = _utcnow, *,
                 recheck_seconds: float = RECHECK_SECONDS) -> None:
        self._store = store
        self._hub = hub
        self._monitors = monitors
        self._clock = clock
        self._recheck = recheck_seconds

    async def CreateCluster(self, request: pb.CreateClusterRequest,
                            context: grpc.aio.ServicerContext) -> pb.CreateClusterResponse:
        caller().require_admin("registering clusters")
        cluster = convert.cluster_from_proto(request.cluster_id, request.cluster)
        creds = _request_credentials(request.cluster)
        validation.raise_if(
            validation.check_new_cluster(request.cluster_id, cluster, creds, request.request_id))
        now = self._clock()
        cluster = replace(cluster, uid=str(uuid.uuid4()), state=ClusterState.PENDING,
                          state_message="waiting for the driver's first report",
                          has_credentials=creds is not None, create_time=now, update_time=now)
        stored = await self._store.create(cluster, creds, request.request_id)
        log.info("created %s (type %s)", stored.name, stored.type.value)
        return pb.CreateClusterResponse(cluster=convert.cluster_to_proto(stored))

    async def GetCluster(self, request: pb.GetClusterRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetClusterResponse:
        caller().require_any_role("reading clusters")
        cid = validation.parse_cluster_name(request.name)
        cluster = convert.cluster_to_proto(await self._store.get(cid))
        cluster.tracking_replica = await self._store.tracking_replica(cid)
        return pb.GetClusterResponse(cluster=cluster)

    async def ListClusters(self, request: pb.ListClustersRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListClustersResponse:
        caller().require_any_role("reading clusters")
        size = flt.page_size(request.page_size)
        f = flt.parse_filter(request.filter)
        after = flt.decode_page_token(request.page_token, request.filter) if request.page_token else ""
        clusters, _ = await self._store.list_all()
        hits = [c for c in clusters if c.cluster_id > after and f.matches(c)]
        page = hits[:size]
        token = flt.encode_page_token(page[-1].cluster_id, request.filter) if len(hits) > size else ""
        owners = await self._store.tracking_replicas() if page else {}
        out = [convert.cluster_to_proto(c) for c in page]
        for c in out:
            c.tracking_replica = owners.get(c.name, "")
        return pb.ListClustersResponse(clusters=out, next_page_token=token)

    async def UpdateCluster(self, request: pb.UpdateClusterRequest,
                            context: grpc.aio.ServicerContext) -> pb.UpdateClusterResponse:
        caller().require_admin("changing clusters")
        cid = validation.parse_cluster_name(request.cluster.name, "cluster.name")
        paths = validation.check_update_mask(request.update_mask.paths)
        etag = _update_etag(request)
        given = convert.cluster_from_proto(cid, request.cluster)
        creds = _request_credentials(request.cluster)
        now = self._clock()

        def mutate(current: Cluster) -> Cluster:
            if given.type is not ClusterType.UNSPECIFIED and given.type is not current.type:
                raise InvalidArgument.for_field("cluster.type", "immutable")
            updated = current
            if "address" in paths:
                updated = replace(updated, address=given.address)
            if "driver_address" in paths:
                updated = replace(updated, driver_address=given.driver_address)
            if "labels" in paths:
                updated = replace(updated, labels=given.labels)
            if "options" in paths:
                updated = replace(updated, options=given.options)
            if "allowed_projects" in paths:
                updated = replace(updated, allowed_projects=given.allowed_projects)
            if "credentials" in paths:
                updated = replace(updated, has_credentials=creds is not None)
            elif (updated.address, updated.driver_address) != (current.address,
                                                               current.driver_address):
                # Credentials never follow a cluster to a new address or driver:
                # moving it without new ones deletes the stored ones (store.update).
                updated = replace(updated, has_credentials=False)
            validation.raise_if(validation.check_updated_cluster(updated, creds, paths))
            return replace(updated, update_time=now)

        kw: dict[str, Any] = {"credentials": creds} if "credentials" in paths else {}
        try:
            stored = await self._store.update(cid, mutate, etag=etag, **kw)
        except ClusterEtagMismatch as e:
            raise e.as_never_issued("etag" if request.etag else "cluster.etag") or e from None
        log.info("updated %s (%s)", stored.name, ", ".join(sorted(paths)))
        return pb.UpdateClusterResponse(cluster=convert.cluster_to_proto(stored))

    async def DeleteCluster(self, request: pb.DeleteClusterRequest,
                            context: grpc.aio.ServicerContext) -> pb.DeleteClusterResponse:
        caller().require_admin("removing clusters")
        cid = validation.parse_cluster_name(request.name)
        if request.etag:
            tokens.parse_etag(request.etag, "etag")
        with contextlib.suppress(ClusterNotFound):  # (answered below, as allow_missing says)
            current = await self._store.get(cid)
            if not request.etag or current.etag == request.etag:
                await self._monitors.release(current)  # its driver refuses while its jobs run
        try:
            last = await self._store.delete(cid, etag=request.etag)
        except ClusterEtagMismatch as e:
            raise e.as_never_issued("etag") or e from None
        if last is None:
            if request.allow_missing:
                return pb.DeleteClusterResponse()
            raise ClusterNotFound(f"clusters/{cid}")
        log.info("deleted %s", last.name)
        await self._monitors.forget(last)
        return pb.DeleteClusterResponse(cluster=convert.cluster_to_proto(last))

    async def WatchClusters(self, request: pb.WatchClustersRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> AsyncIterator[pb.WatchClustersResponse]:
        # The caller is checked again on every event and while the stream is
        # quiet (``_events``): a revoked or expired token, or a lost role, ends it.
        p = _watcher(caller())
        f = flt.parse_filter(request.filter)
        token = ResumeToken.decode(request.resume_token) if request.resume_token else None
        if token is not None and token.in_snapshot:
            token = None  # a snapshot cannot be continued half-way: send a fresh one
        sub = await self._hub.subscribe(token)
        try:
            at = request.resume_token  # a heartbeat's token: of the last event sent or skipped
            if token is None:
                clusters, rev = await self._store.list_all()
                sub.skip_through = rev
                snap = ResumeToken(rev, in_snapshot=True).encode()
                for c in clusters:
                    if f.matches(c):
                        yield pb.WatchClustersResponse(
                            type=job_pb2.WATCH_EVENT_TYPE_EXISTING,
                            cluster=convert.cluster_to_proto(c), resume_token=snap)
                at = ResumeToken(rev).encode()
                yield pb.WatchClustersResponse(type=job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE, resume_token=at)
            sent = _Sent()
            async with contextlib.aclosing(_events(sub, p, self._recheck, sent)) as events:
                async for ev in events:
                    if ev is None:  # quiet: a proxy that closes idle streams keeps this one
                        sent.mark()
                        yield pb.WatchClustersResponse(type=job_pb2.WATCH_EVENT_TYPE_HEARTBEAT, resume_token=at)
                        continue
                    at = ResumeToken(ev.revision).encode()
                    if f.matches(ev.cluster) or (ev.prev is not None and f.matches(ev.prev)):
                        sent.mark()
                        yield pb.WatchClustersResponse(
                            type=_EVENT_TYPE[ev.kind], cluster=convert.cluster_to_proto(ev.cluster),
                            resume_token=at)
        finally:
            sub.close()

    async def MatchClusters(self, request: pb.MatchClustersRequest,
                            context: grpc.aio.ServicerContext) -> pb.MatchClustersResponse:
        p = caller()
        p.require_any_role("matching clusters")
        if not request.HasField("spec"):
            raise InvalidArgument.for_field("spec", "required")
        validation.raise_if(_check_spec(request.spec), "invalid job spec")
        for field, project in (("project", request.project), ("spec.project", request.spec.project)):
            if project:
                check_project(project, field)
                if not p.may_read(project):  # which clusters a project may use is its members' to know
                    raise PermissionDenied(f"{p.name} may not match clusters for project {project}",
                                           metadata={"principal": p.name, "project": project,
                                                     "required_role": "viewer"})
        job = replace(convert.job_requirements_from_proto(request.spec),
                      project=request.project or request.spec.project)
        clusters, _ = await self._store.list_all()
        cands = matching.rank(job, clusters)
        return pb.MatchClustersResponse(candidates=convert.candidates_to_proto(cands))


def _update_etag(request: pb.UpdateClusterRequest) -> str:
    """The etag an update must match: the request's or the cluster's (AIP-154 puts it
    on the resource), each checked; both set must agree. Empty: no precondition."""
    for field, etag in (("etag", request.etag), ("cluster.etag", request.cluster.etag)):
        if etag:
            tokens.parse_etag(etag, field)
    if request.etag and request.cluster.etag and request.etag != request.cluster.etag:
        raise InvalidArgument.for_field("etag", "differs from cluster.etag; set one")
    return request.etag or request.cluster.etag


def _check_spec(spec: job_pb2.JobSpec) -> list[FieldViolation]:
    """What matching reads of a spec (JobManager sends no commands: ``match_spec``), bounded
    first; resources finite and in range (a NaN cpu was eligible, scored NaN)."""
    out = spec_rules.check_bounds(spec, spec.ByteSize())
    if out:
        return out
    if spec.run_mode not in spec_rules.MODE_NAMES:  # unset or unknown (a newer client's)
        out += spec_rules.check_run_mode(spec.run_mode, (), "spec")
    out += spec_rules.check_cluster_type(spec.cluster_selector.cluster_type,
                                         "spec.cluster_selector.cluster_type", allow_unspecified=True)
    out += spec_rules.check_selected_cluster(spec.cluster_selector.cluster, "spec.cluster_selector.cluster")
    out += spec_rules.check_labels(spec.cluster_selector.labels, "spec.cluster_selector.labels")  # as SubmitJob
    if spec.HasField("time_limit"):
        try:
            check_duration(spec.time_limit, "spec.time_limit")
        except InvalidArgument as e:
            out += e.violations
    if not spec.replica_groups:
        out.append(FieldViolation("spec.replica_groups", "at least one replica group"))
    for i, g in enumerate(spec.replica_groups):
        at = f"spec.replica_groups[{i}]"
        if g.replicas < 1:
            out.append(FieldViolation(f"{at}.replicas", "at least 1"))
        spec_rules.check_resources(out, at, g.resources)
    return out
