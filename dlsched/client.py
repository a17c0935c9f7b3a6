"""The Python SDK: thin, typed async clients for the dlsched services.

``JobManagerClient`` and ``ClusterManagerClient`` mirror the RPCs of
``dlsched.v1.JobManagerService`` and ``dlsched.v1.ClusterManagerService`` one
method each, take bare ids (``"myjob"``) or resource names (``"jobs/myjob"``),
and return the proto messages themselves. Every failed call raises
``DlschedRpcError``, which carries the gRPC code, the ``ErrorInfo`` reason
clients branch on, its metadata and the field violations::

    async with JobManagerClient("127.0.0.1:50051") as jm:
        job_id, spec = load_job_file("examples/hello.yaml")
        job = (await jm.submit_job(spec, job_id=job_id)).job
        async for entry in jm.stream_job_logs(job.name, follow=True):
            print(entry.text)

``load_job_file`` reads the YAML job format: the ``JobSpec`` JSON form
(camelCase or snake_case keys) plus a few shorthands, see its docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import shlex
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

import grpc
import yaml
from google.protobuf import descriptor, field_mask_pb2, json_format, timestamp_pb2

from dlsched import errors
from dlsched import profile as profile_defaults
from dlsched.kit import rpc_errors, timeutil
from dlsched.kit import tls as tls_kit
from dlsched.profile import Profile
from dlsched.profile import resolve as resolve_profile
from dlsched.v1 import (
    access_pb2,
    cluster_pb2,
    job_pb2,
)
from dlsched.v1 import access_service_pb2 as acs
from dlsched.v1 import access_service_pb2_grpc as acs_grpc
from dlsched.v1 import (
    cluster_manager_service_pb2 as cms,
)
from dlsched.v1 import (
    cluster_manager_service_pb2_grpc as cms_grpc,
)
from dlsched.v1 import (
    job_manager_service_pb2 as jms,
)
from dlsched.v1 import (
    job_manager_service_pb2_grpc as jms_grpc,
)

__all__ = [
    "AccessClient",
    "ClusterManagerClient",
    "DlschedRpcError",
    "JobFileError",
    "JobManagerClient",
    "TERMINAL_JOB_STATES",
    "cluster_name",
    "is_terminal",
    "job_name",
    "load_job_file",
    "parse_job_dict",
]

DEFAULT_SERVER = profile_defaults.DEFAULT_SERVER
DEFAULT_CLUSTER_MANAGER = profile_defaults.DEFAULT_CLUSTER_MANAGER

TERMINAL_JOB_STATES = frozenset(
    {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED}
)

_T = TypeVar("_T")
log = logging.getLogger("dlsched.client")
# Backoff between calls that resume a log stream (seconds).
_RECONNECT_FIRST = 0.2
_RECONNECT_MAX = 5.0


def is_terminal(state: int) -> bool:
    """Whether a ``JobState`` is terminal (SUCCEEDED, FAILED or STOPPED)."""
    return state in TERMINAL_JOB_STATES


# --------------------------------------------------------------------------- errors


class DlschedRpcError(errors.DlschedError):
    """A failed call to a dlsched service.

    ``code`` is the gRPC status code name (``"NOT_FOUND"``), ``status_code``
    the ``grpc.StatusCode``; ``reason`` and ``metadata`` come from the
    ``google.rpc.ErrorInfo`` (``reason`` falls back to the code name when the
    server sent none); ``field_violations`` from a ``BadRequest`` and
    ``precondition_violations`` from a ``PreconditionFailure``, as
    ``(field_or_subject, description)`` pairs. Branch on ``reason``.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: grpc.StatusCode,
        reason: str,
        metadata: Mapping[str, str] | None = None,
        field_violations: Sequence[errors.FieldViolation] = (),
        precondition_violations: Sequence[tuple[str, str]] = (),
        domain: str = "",
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.status_code = status_code
        self.code = status_code.name
        self.domain = domain
        self.field_violations = list(field_violations)
        self.precondition_violations = list(precondition_violations)

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> DlschedRpcError:
        code: grpc.StatusCode = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        try:
            info = rpc_errors.error_info(exc)
            fvs = [errors.FieldViolation(v.field, v.description)
                   for v in rpc_errors.field_violations(exc)]
            pvs = rpc_errors.precondition_violations(exc)
        except Exception:  # noqa: BLE001 - a malformed status must not hide the error
            info, fvs, pvs = None, [], []
        return cls(
            details or code.name,
            status_code=code,
            reason=info.reason if info is not None and info.reason else code.name,
            metadata=dict(info.metadata) if info is not None else {},
            field_violations=fvs,
            precondition_violations=pvs,
            domain=info.domain if info is not None else "",
        )

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"


class JobFileError(errors.InvalidArgument):
    """A job file that cannot be read or does not describe a ``JobSpec``.

    ``field`` is the offending key's path in the file (``replicaGroups[0].memory``).
    """

    reason = "INVALID_JOB_FILE"

    def __init__(self, message: str, field: str = "") -> None:
        vs = [errors.FieldViolation(field, message)] if field else []
        super().__init__(f"{field}: {message}" if field else message, vs)
        self.field = field


# --------------------------------------------------------------------------- names


def _resource_name(collection: str, id_or_name: str) -> str:
    value = id_or_name.strip()
    if not value:
        raise errors.InvalidArgument.for_field("name", f"a {collection[:-1]} id or name is required")
    if value.startswith(collection + "/"):
        return value
    if "/" in value:
        raise errors.InvalidArgument.for_field(
            "name", f"{value!r} is neither an id nor a name {collection}/ID")
    return f"{collection}/{value}"


def job_name(id_or_name: str) -> str:
    """``"myjob"`` or ``"jobs/myjob"`` -> ``"jobs/myjob"``."""
    return _resource_name("jobs", id_or_name)


def cluster_name(id_or_name: str) -> str:
    """``"local"`` or ``"clusters/local"`` -> ``"clusters/local"``."""
    return _resource_name("clusters", id_or_name)


def _request_id() -> str:
    """A fresh request id: a retried call (the channel retries UNAVAILABLE) returns the first result."""
    return f"sdk-{uuid.uuid4().hex}"


def short_id(name: str) -> str:
    """``"jobs/myjob"`` -> ``"myjob"``."""
    return name.rpartition("/")[2]


# --------------------------------------------------------------------------- base


class _Client:
    """Owns (or borrows) one grpc.aio channel and maps errors."""

    _profile_address = "server"

    def __init__(self, address: str | None = None, *, channel: grpc.aio.Channel | None = None,
                 timeout: float | None = 30.0, profile: Profile | None = None) -> None:
        self._own_channel = channel is None
        if channel is None or address is None:
            # TLS and the bearer token from the profile (flags, env, config file);
            # the shipped service config: reads retry on UNAVAILABLE, deadlines, keepalive.
            prof = profile if profile is not None else resolve_profile()
            address = address or getattr(prof, self._profile_address)
            if channel is None:
                channel = tls_kit.channel(address, prof.tls, client_cert=True,
                                          token=prof.token_source())
        self.address = address
        self.channel = channel
        self.timeout = timeout

    async def __aenter__(self: _T) -> _T:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None = None,  # noqa: ASYNC109
                     ) -> Any:
        try:
            return await method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise DlschedRpcError.from_rpc_error(e) from None

    @staticmethod
    async def _stream(call: Any) -> AsyncGenerator[Any, None]:
        try:
            async for item in call:
                yield item
        except grpc.RpcError as e:
            raise DlschedRpcError.from_rpc_error(e) from None
        finally:
            call.cancel()


async def _watch_events(stream: AsyncGenerator[Any, None], heartbeats: bool) -> AsyncIterator[Any]:
    """A watch's events, HEARTBEAT ones only if ``heartbeats``; closing this ends the call
    (``_stream`` cancels it)."""
    async with contextlib.aclosing(stream) as events:
        async for ev in events:
            if heartbeats or ev.type != job_pb2.WATCH_EVENT_TYPE_HEARTBEAT:
                yield ev


def _timestamp(value: datetime | float | timestamp_pb2.Timestamp | None) -> timestamp_pb2.Timestamp | None:
    if value is None or isinstance(value, timestamp_pb2.Timestamp):
        return value
    return timeutil.to_timestamp(value)


def _log_stream(value: int | str) -> int:
    if isinstance(value, int):
        return value
    v = value.strip().upper()
    if not v.startswith("LOG_STREAM_"):
        v = "LOG_STREAM_" + v
    return job_pb2.LogStream.Value(v)


# --------------------------------------------------------------------------- jobs


class JobManagerClient(_Client):
    """Async client of ``dlsched.v1.JobManagerService``."""

    def __init__(self, address: str | None = None, **kw: Any) -> None:
        super().__init__(address, **kw)
        self.stub: Any = jms_grpc.JobManagerServiceStub(self.channel)  # type: ignore[no-untyped-call,unused-ignore]

    async def submit_job(self, spec: job_pb2.JobSpec, *, job_id: str = "", request_id: str = "",
                         dry_run: bool = False) -> jms.SubmitJobResponse:
        """Submits (or, with ``dry_run``, plans) a job; the response has ``job`` and ``dry_run``.

        Without ``request_id`` one is made up, so the channel's retry of an
        UNAVAILABLE submit can never make a second job."""
        req = jms.SubmitJobRequest(job_id=short_id(job_id) if job_id else "", spec=spec,
                                   request_id=request_id or _request_id(), dry_run=dry_run)
        resp: jms.SubmitJobResponse = await self._unary(self.stub.SubmitJob, req)
        return resp

    async def get_job(self, name_or_id: str, *, min_etag: str = "") -> job_pb2.Job:
        """The job; ``min_etag`` (an etag an answer carried): at least as new as that write,
        from the replica's cache (cheaper than the default consistent read)."""
        resp = await self._unary(self.stub.GetJob, jms.GetJobRequest(name=job_name(name_or_id),
                                                                    min_etag=min_etag))
        return resp.job  # type: ignore[no-any-return]

    async def list_jobs(self, filter: str = "", page_size: int = 0, page_token: str = "", *,
                        min_etag: str = "") -> AsyncIterator[jms.ListJobsResponse]:
        """Yields every page of ``ListJobs`` until the last (``min_etag``: as ``get_job``)."""
        token = page_token
        while True:
            resp: jms.ListJobsResponse = await self._unary(
                self.stub.ListJobs,
                jms.ListJobsRequest(filter=filter, page_size=page_size, page_token=token, min_etag=min_etag))
            yield resp
            token = resp.next_page_token
            if not token:
                return

    async def list_all_jobs(self, filter: str = "", page_size: int = 0) -> list[job_pb2.Job]:
        """Every matching job, all pages together."""
        out: list[job_pb2.Job] = []
        async for page in self.list_jobs(filter, page_size):
            out.extend(page.jobs)
        return out

    async def stop_job(self, name_or_id: str, *, request_id: str = "") -> job_pb2.Job:
        resp = await self._unary(self.stub.StopJob, jms.StopJobRequest(
            name=job_name(name_or_id), request_id=request_id))
        return resp.job  # type: ignore[no-any-return]

    async def delete_job(self, name_or_id: str, *, allow_missing: bool = False,
                         etag: str = "") -> job_pb2.Job | None:
        """Deletes (stopping it first if it runs); ``etag``: only if the job is unchanged."""
        resp = await self._unary(self.stub.DeleteJob, jms.DeleteJobRequest(
            name=job_name(name_or_id), allow_missing=allow_missing, etag=etag))
        return resp.job if resp.HasField("job") else None

    def watch_jobs(self, filter: str = "", resume_token: str = "", *, heartbeats: bool = False,
                   ) -> AsyncIterator[jms.WatchJobsResponse]:
        """Streams ``WatchJobs`` events; close the iterator (or break) to stop watching.

        The HEARTBEAT events a quiet watch gets (no job; they keep proxies
        from closing the stream) are left out unless ``heartbeats``: a caller
        that keeps resume tokens may take theirs, which can be newer."""
        call = self.stub.WatchJobs(jms.WatchJobsRequest(filter=filter, resume_token=resume_token))
        return _watch_events(self._stream(call), heartbeats)

    async def stream_job_logs(
        self,
        name_or_id: str,
        *,
        follow: bool = False,
        tail_lines: int = 0,
        since: datetime | float | timestamp_pb2.Timestamp | None = None,
        role: str = "",
        replica_index: int | None = None,
        streams: Iterable[int | str] = (),
        resume_cursor: str = "",
        reconnect: bool = True,
        reconnect_timeout: float = 120.0,
        on_reconnect: Callable[[DlschedRpcError], None] | None = None,
    ) -> AsyncIterator[job_pb2.LogEntry]:
        """Yields a job's log lines one ``LogEntry`` at a time (a quiet
        stream's heartbeats, responses with no entries, yield nothing).

        ``since`` is a datetime, a Unix time or a Timestamp; ``streams`` holds
        ``LogStream`` values or ``"stdout"`` / ``"stderr"``; ``resume_cursor``
        (a response's ``resume_cursor``) starts after the line it marks.

        With ``reconnect`` (the default), a stream that ends UNAVAILABLE once
        it was established (the server shut down or the connection was lost)
        is called again with the last resume cursor, with backoff (0.2 s
        doubling to 5 s), on whichever replica the channel's target reaches,
        until a call succeeds or ``reconnect_timeout`` seconds pass without
        one; the lines go on with none lost and none repeated.
        ``on_reconnect`` is told each error that makes it call again.
        """
        stream_values: list[Any] = [_log_stream(s) for s in streams]
        req = jms.StreamJobLogsRequest(
            name=job_name(name_or_id), follow=follow, tail_lines=tail_lines, role=role,
            streams=stream_values)
        ts = _timestamp(since)
        if ts is not None:
            req.since_time.CopyFrom(ts)
        if replica_index is not None:
            req.replica_index = replica_index
        cursor = resume_cursor
        connected = bool(resume_cursor)
        delay = _RECONNECT_FIRST
        failing_since: float | None = None
        while True:
            req.resume_cursor = cursor
            try:
                async for batch in self._stream(self.stub.StreamJobLogs(req)):
                    connected, failing_since, delay = True, None, _RECONNECT_FIRST
                    cursor = batch.resume_cursor or cursor
                    for entry in batch.entries:
                        yield entry
                return
            except DlschedRpcError as e:
                # A server that never answered is not there: say so at once
                # (gRPC already retried the call before its first message).
                # One that answered it is going away, or that the job's driver
                # is being set up again, is.
                if not reconnect or e.code != "UNAVAILABLE" or not (
                        connected or e.reason in ("SHUTTING_DOWN", "DRIVER_NOT_READY")):
                    raise
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > reconnect_timeout:
                    raise
                log.info("log stream of %s ended (%s %s); reconnecting", req.name, e.code, e.reason)
                if on_reconnect is not None:
                    on_reconnect(e)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))  # noqa: S311 - jitter
            delay = min(delay * 2, _RECONNECT_MAX)

    async def get_job_usage(self, name_or_id: str) -> job_pb2.JobUsage:
        resp = await self._unary(self.stub.GetJobUsage, jms.GetJobUsageRequest(
            name=job_name(name_or_id)))
        return resp.usage  # type: ignore[no-any-return]

    async def wait_for_job(self, name_or_id: str, *,
                           timeout: float | None = None,  # noqa: ASYNC109 - a deadline
                           unavailable_timeout: float | None = 120.0,
                           ) -> job_pb2.Job:
        """Waits (via WatchJobs) until the job is terminal and returns it.

        Raises ``TimeoutError`` after ``timeout`` seconds, and the last UNAVAILABLE error once
        the server was unreachable for ``unavailable_timeout`` seconds in a row (None: never).
        """
        name = job_name(name_or_id)

        async def wait() -> job_pb2.Job:
            token = ""
            failing_since: float | None = None
            while True:
                try:
                    job = await self.get_job(name) if not token else None
                    if job is not None and is_terminal(job.state):
                        return job
                    failing_since = None if job is not None else failing_since
                    async for ev in self.watch_jobs(resume_token=token):
                        failing_since = None
                        token = ev.resume_token or token
                        if ev.job.name != name:
                            continue
                        if ev.type == job_pb2.WATCH_EVENT_TYPE_DELETED:
                            return ev.job
                        if is_terminal(ev.job.state):
                            return ev.job
                except DlschedRpcError as e:
                    if e.reason == "WATCH_TOKEN_EXPIRED":
                        token = ""
                        continue
                    if e.code != "UNAVAILABLE":
                        raise
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if unavailable_timeout is not None and now - failing_since > unavailable_timeout:
                        raise
                    await asyncio.sleep(0.5)
                    continue
                # The stream ended without an error: the server is going away.
                await asyncio.sleep(0.2)

        return await asyncio.wait_for(wait(), timeout)


# --------------------------------------------------------------------------- access


class AccessClient(_Client):
    """Async client of ``dlsched.v1.AccessService`` (served by JobManager)."""

    def __init__(self, address: str | None = None, **kw: Any) -> None:
        super().__init__(address, **kw)
        self.stub: Any = acs_grpc.AccessServiceStub(self.channel)  # type: ignore[no-untyped-call,unused-ignore]

    async def get_caller(self) -> acs.GetCallerResponse:
        return cast(acs.GetCallerResponse, await self._unary(self.stub.GetCaller, acs.GetCallerRequest()))

    async def create_role_binding(self, principal: str, project: str,
                                  role: int | str) -> access_pb2.RoleBinding:
        if isinstance(role, str):
            r = role.strip().upper()
            role = access_pb2.Role.Value(r if r.startswith("ROLE_") else f"ROLE_{r}")
        resp = await self._unary(self.stub.CreateRoleBinding, acs.CreateRoleBindingRequest(
            role_binding=access_pb2.RoleBinding(principal=principal, project=project,
                                                role=cast(access_pb2.Role, role))))
        return cast(access_pb2.RoleBinding, resp.role_binding)

    async def list_role_bindings(self, *, principal: str = "",
                                 project: str = "") -> list[access_pb2.RoleBinding]:
        out: list[access_pb2.RoleBinding] = []
        token = ""
        while True:
            resp = await self._unary(self.stub.ListRoleBindings, acs.ListRoleBindingsRequest(
                principal=principal, project=project, page_token=token))
            out.extend(resp.role_bindings)
            token = resp.next_page_token
            if not token:
                return out

    async def delete_role_binding(self, name: str) -> None:
        if "/" not in name:
            name = f"roleBindings/{name}"
        await self._unary(self.stub.DeleteRoleBinding, acs.DeleteRoleBindingRequest(name=name))

    async def create_api_token(self, service_account: str, *, description: str = "",
                               expire_time: datetime | None = None
                               ) -> tuple[access_pb2.ApiToken, str]:
        """A new token and its secret (shown only now)."""
        tok = access_pb2.ApiToken(service_account=service_account, description=description)
        if expire_time is not None:
            tok.expire_time.CopyFrom(timeutil.to_timestamp(expire_time))
        resp = await self._unary(self.stub.CreateApiToken, acs.CreateApiTokenRequest(api_token=tok))
        return resp.api_token, resp.secret

    async def list_api_tokens(self, *, service_account: str = "") -> list[access_pb2.ApiToken]:
        out: list[access_pb2.ApiToken] = []
        token = ""
        while True:
            resp = await self._unary(self.stub.ListApiTokens, acs.ListApiTokensRequest(
                service_account=service_account, page_token=token))
            out.extend(resp.api_tokens)
            token = resp.next_page_token
            if not token:
                return out

    async def delete_api_token(self, name: str) -> None:
        if "/" not in name:
            name = f"apiTokens/{name}"
        await self._unary(self.stub.DeleteApiToken, acs.DeleteApiTokenRequest(name=name))


# --------------------------------------------------------------------------- clusters


class ClusterManagerClient(_Client):
    """Async client of ``dlsched.v1.ClusterManagerService``."""

    _profile_address = "cluster_manager"

    def __init__(self, address: str | None = None, **kw: Any) -> None:
        super().__init__(address, **kw)
        self.stub: Any = cms_grpc.ClusterManagerServiceStub(self.channel)  # type: ignore[no-untyped-call,unused-ignore]

    async def create_cluster(self, cluster_id: str, cluster: cluster_pb2.Cluster, *,
                             request_id: str = "") -> cluster_pb2.Cluster:
        resp = await self._unary(self.stub.CreateCluster, cms.CreateClusterRequest(
            cluster_id=short_id(cluster_id), cluster=cluster, request_id=request_id or _request_id()))
        return resp.cluster  # type: ignore[no-any-return]

    async def get_cluster(self, name_or_id: str) -> cluster_pb2.Cluster:
        resp = await self._unary(self.stub.GetCluster, cms.GetClusterRequest(
            name=cluster_name(name_or_id)))
        return resp.cluster  # type: ignore[no-any-return]

    async def list_clusters(self, filter: str = "", page_size: int = 0, page_token: str = "",
                            ) -> AsyncIterator[cms.ListClustersResponse]:
        """Yields every page of ``ListClusters`` until the last."""
        token = page_token
        while True:
            resp: cms.ListClustersResponse = await self._unary(
                self.stub.ListClusters,
                cms.ListClustersRequest(filter=filter, page_size=page_size, page_token=token))
            yield resp
            token = resp.next_page_token
            if not token:
                return

    async def list_all_clusters(self, filter: str = "", page_size: int = 0,
                                ) -> list[cluster_pb2.Cluster]:
        out: list[cluster_pb2.Cluster] = []
        async for page in self.list_clusters(filter, page_size):
            out.extend(page.clusters)
        return out

    async def update_cluster(self, cluster: cluster_pb2.Cluster, update_mask: Iterable[str], *,
                             etag: str = "") -> cluster_pb2.Cluster:
        """Updates the masked fields; ``cluster.name`` may be a bare id."""
        c = cluster_pb2.Cluster()
        c.CopyFrom(cluster)
        c.name = cluster_name(cluster.name)
        resp = await self._unary(self.stub.UpdateCluster, cms.UpdateClusterRequest(
            cluster=c, update_mask=field_mask_pb2.FieldMask(paths=list(update_mask)), etag=etag))
        return resp.cluster  # type: ignore[no-any-return]

    async def delete_cluster(self, name_or_id: str, *, allow_missing: bool = False,
                             etag: str = "") -> cluster_pb2.Cluster | None:
        resp = await self._unary(self.stub.DeleteCluster, cms.DeleteClusterRequest(
            name=cluster_name(name_or_id), allow_missing=allow_missing, etag=etag))
        return resp.cluster if resp.HasField("cluster") else None

    def watch_clusters(self, filter: str = "", resume_token: str = "", *, heartbeats: bool = False,
                       ) -> AsyncIterator[cms.WatchClustersResponse]:
        """Streams ``WatchClusters`` events; HEARTBEAT events are left out unless ``heartbeats``
        (as in ``JobManagerClient.watch_jobs``)."""
        call = self.stub.WatchClusters(cms.WatchClustersRequest(
            filter=filter, resume_token=resume_token))
        return _watch_events(self._stream(call), heartbeats)

    async def match_clusters(self, spec: job_pb2.JobSpec) -> list[cluster_pb2.ClusterCandidate]:
        resp = await self._unary(self.stub.MatchClusters, cms.MatchClustersRequest(spec=spec))
        return list(resp.candidates)

    async def wait_cluster_state(self, name_or_id: str,
                                 state: int = cluster_pb2.CLUSTER_STATE_READY, *,
                                 timeout: float = 30.0, interval: float = 0.1,  # noqa: ASYNC109
                                 ) -> cluster_pb2.Cluster:
        """Polls GetCluster until the cluster is in ``state``; ``TimeoutError`` otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            c = await self.get_cluster(name_or_id)
            if c.state == state:
                return c
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"{c.name} is {cluster_pb2.ClusterState.Name(c.state)}, not "
                    f"{cluster_pb2.ClusterState.Name(state)}: {c.state_message}")
            await asyncio.sleep(interval)


# --------------------------------------------------------------------------- job files

_ID_KEYS = ("jobId", "job_id", "name", "id")
#: a Job's fields the server sets (all but ``name`` and ``spec``), by both their names
_JOB_OUTPUT_KEYS = frozenset(n for f in job_pb2.Job.DESCRIPTOR.fields if f.name not in ("name", "spec")
                             for n in (f.name, f.json_name))
# Shorthand keys per message: YAML key -> proto field name.
_ALIASES: dict[str, dict[str, str]] = {
    "dlsched.v1.Resources": {"memory": "memory_bytes"},
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]i?|[kmgtpe]i?)?[bB]?\s*\Z", re.ASCII)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "e": 10**18,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50, "ei": 2**60}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s|d)", re.ASCII)
_DURATION_UNIT = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6,
                  "ns": 1e-9}


def parse_quantity(value: object) -> int:
    """``4Gi`` -> 4294967296, ``512M`` -> 512000000, ``1024`` -> 1024 (bytes)."""
    if isinstance(value, bool):
        raise ValueError(f"not a memory size: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"not a memory size: {value!r} (want e.g. 512Mi, 4Gi, 2G or bytes)")
    return int(float(m.group(1)) * _UNIT[(m.group(2) or "").lower()])


def parse_duration(value: object) -> float:
    """``3600``, ``"3600s"``, ``"1h30m"``, ``"90m"``, ``"500ms"`` -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", text, re.ASCII):
        return float(text)
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNIT[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration: {value!r} (want e.g. 3600s, 90m, 1h30m)")
    return total


def _is_repeated(f: descriptor.FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)
    if rep is not None:
        return bool(rep)
    return bool(f.label == f.LABEL_REPEATED)  # type: ignore[attr-defined,unused-ignore]


def _is_map(f: descriptor.FieldDescriptor) -> bool:
    return (f.type == f.TYPE_MESSAGE and f.message_type is not None
            and f.message_type.GetOptions().map_entry)


def _enum_value(enum: descriptor.EnumDescriptor, value: object, path: str) -> str | int:
    if isinstance(value, bool):
        raise JobFileError(f"want one of {_enum_choices(enum)}", path)
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().replace("-", "_")
    names = [v.name for v in enum.values]
    prefix = names[0][: -len("UNSPECIFIED")] if names[0].endswith("UNSPECIFIED") else ""
    for cand in (text, prefix + text):
        if cand in names:
            return cand
    raise JobFileError(f"{value!r} is not one of {_enum_choices(enum)}", path)


def _enum_choices(enum: descriptor.EnumDescriptor) -> str:
    names = [v.name for v in enum.values][1:]
    prefix = enum.values[0].name[: -len("UNSPECIFIED")]
    return ", ".join(n[len(prefix):] if n.startswith(prefix) else n for n in names)


def _scalar(f: descriptor.FieldDescriptor, value: object, path: str) -> object:
    if f.type == f.TYPE_ENUM:
        assert f.enum_type is not None
        return _enum_value(f.enum_type, value, path)
    if f.type == f.TYPE_MESSAGE:
        assert f.message_type is not None
        full = f.message_type.full_name
        if full == "google.protobuf.Duration":
            try:
                return f"{parse_duration(value):.9f}".rstrip("0").rstrip(".") + "s"
            except ValueError as e:
                raise JobFileError(str(e), path) from None
        if full == "google.protobuf.Timestamp":
            return value.isoformat() if isinstance(value, datetime) else value
        return _normalize(f.message_type, value, path)
    if f.type == f.TYPE_STRING:
        if isinstance(value, dict | list):
            raise JobFileError("want a string", path)
        if isinstance(value, bool):
            return "true" if value else "false"
        return "" if value is None else str(value)
    if f.name == "memory_bytes" or f.name.endswith("_bytes"):
        try:
            return parse_quantity(value)
        except ValueError as e:
            raise JobFileError(str(e), path) from None
    return value


#: what an unknown key must look like to be named in the error (else the file's text is not echoed)
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _normalize(desc: descriptor.Descriptor, data: object, path: str) -> dict[str, object]:
    """The YAML mapping ``data`` turned into the JSON form of ``desc`` (json_names)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobFileError(f"want a mapping for {desc.name}", path)
    by_key: dict[str, descriptor.FieldDescriptor] = {}
    for f in desc.fields:
        by_key[f.name] = f
        by_key[f.json_name] = f
    aliases = _ALIASES.get(desc.full_name, {})
    out: dict[str, object] = {}
    for key, value in data.items():
        key_s = str(key)
        sub = f"{path}.{key_s}" if path else key_s
        found = by_key.get(aliases.get(key_s, key_s))
        if found is None:
            if not _KEY_RE.fullmatch(key_s):  # not a name: the file is no job file (a secret, say): not echoed
                sub = f"{path}.<key>" if path else "<key>"
            raise JobFileError(
                f"unknown field for {desc.name} (known: "
                f"{', '.join(sorted(fd.json_name for fd in desc.fields))})", sub)
        f = found
        if f.json_name in out:
            raise JobFileError("given twice", sub)
        if _is_map(f):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise JobFileError("want a mapping", sub)
            assert f.message_type is not None
            vf = f.message_type.fields_by_name["value"]
            out[f.json_name] = {str(k): _scalar(vf, v, f"{sub}.{k}") for k, v in value.items()}
        elif _is_repeated(f):
            if value is None:
                value = []
            if isinstance(value, str) and f.type == f.TYPE_STRING:
                try:
                    value = shlex.split(value)
                except ValueError as e:  # an unbalanced quote
                    raise JobFileError(f"not a command line: {e}", sub) from e
            elif not isinstance(value, list):
                value = [value]
            out[f.json_name] = [_scalar(f, v, f"{sub}[{i}]") for i, v in enumerate(value)]
        else:
            out[f.json_name] = _scalar(f, value, sub)
    return out


def parse_job_dict(data: object, *, base_dir: str | None = None) -> tuple[str, job_pb2.JobSpec]:
    """A parsed YAML/JSON job document -> (job_id or "", JobSpec). See ``load_job_file``."""
    if not isinstance(data, dict):
        raise JobFileError("a job file holds a mapping (runMode, replicaGroups, ...)")
    doc = dict(data)
    job_id = ""
    for key in _ID_KEYS:
        if key in doc:
            value = doc.pop(key)
            if job_id:
                raise JobFileError("the job id is given twice", key)
            job_id = short_id(str(value)) if value is not None else ""
    if "spec" in doc:
        # A job as ``dlsched get -o yaml`` prints it submits again (as kubectl's get | apply):
        # what the server set (uid, state, times, ...) is left out; anything else is refused.
        rest = {k: v for k, v in doc.items() if k != "spec" and k not in _JOB_OUTPUT_KEYS}
        if rest:
            raise JobFileError("with a spec key, only jobId/name (and what a job printed by "
                               "`dlsched get` holds) may stand beside it", next(iter(rest)))
        doc = doc["spec"] or {}
    body = _normalize(cast(descriptor.Descriptor, job_pb2.JobSpec.DESCRIPTOR), doc, "")
    spec = job_pb2.JobSpec()
    try:
        json_format.ParseDict(body, spec)
    except json_format.ParseError as e:
        raise JobFileError(str(e)) from None
    if base_dir is not None:
        for g in spec.replica_groups:
            if g.working_dir and not os.path.isabs(os.path.expanduser(g.working_dir)):
                g.working_dir = os.path.normpath(os.path.join(base_dir, g.working_dir))
            elif g.working_dir:
                g.working_dir = os.path.expanduser(g.working_dir)
    return job_id, spec


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last:
    ``runMode: SINGLE_PROCESS`` then ``runMode: MPI`` was silently an MPI job)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # ``<<: *defaults``: merged keys a mapping's own ones override, as YAML says
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"the key {str(key)[:80]!r} is given twice",
                                                    key_node.start_mark)
        if isinstance(key, str | int | float | bool):
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_job_file(path: str | os.PathLike[str]) -> tuple[str, job_pb2.JobSpec]:
    """Reads a YAML (or JSON) job file -> (job_id or "", JobSpec).

    The file is the JSON form of ``dlsched.v1.JobSpec`` (camelCase or
    snake_case keys), either at the top level or under ``spec:``, plus:

    - ``jobId`` (or ``name: jobs/ID``) at the top level sets the job id;
    - enum values may drop their prefix and case: ``runMode: multi_process``,
      ``clusterType: local``;
    - ``memory: 4Gi`` (or ``memoryBytes: 512Mi``) for ``Resources.memory_bytes``;
    - ``timeLimit`` as ``3600s``, ``90m``, ``1h30m`` or a number of seconds;
    - ``command`` (and ``args``) as an argv list, or a string split like a shell would;
    - a relative ``workingDir`` is taken relative to the file's folder.

    Unknown keys and bad values raise ``JobFileError`` naming the key.
    """
    p = os.fspath(path)
    try:
        if p == "-":
            import sys

            text = sys.stdin.read()
            base = os.getcwd()
        else:
            with open(p, encoding="utf-8") as fh:
                text = fh.read()
            base = os.path.dirname(os.path.abspath(p))
    except OSError as e:
        raise JobFileError(f"cannot read job file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JobFileError(f"job file {p} is not UTF-8 text (byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise JobFileError(f"{p} is not valid YAML: {e}") from None
    try:
        return parse_job_dict(data, base_dir=base)
    except JobFileError as e:
        e.message = f"{p}: {e.message}"
        e.args = (e.message,)
        raise
