# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll real processes and files
"""Identity and access end to end (issue #13): real etcd, real service
processes (``tests.harness.Stack``), real gRPC over TLS and a real HTTP OIDC
issuer (``tests.oidc_issuer``). Nothing is mocked.

- every method of every dlsched service refuses every bad credential with
  UNAUTHENTICATED before anything happens (no job, cluster, binding or token,
  no etcd write, no canary file), and drivers take only the control plane;
- projects: two users never see or touch each other's jobs, viewers read,
  members do not administer, clusters can be restricted to projects;
- OIDC: the JWKS is cached, key rotation refetches once, clock-skew leeway;
- TLS: a foreign CA is refused, a renewed certificate is served without a restart;
- the audit log: one JSON line per mutating call, never a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from cryptography import x509
from google.protobuf import duration_pb2, field_mask_pb2, message_factory, timestamp_pb2
from google.protobuf.descriptor import MethodDescriptor

from dlsched.client import AccessClient, ClusterManagerClient, DlschedRpcError, JobManagerClient
from dlsched.kit import etcd as etcd_kit
from dlsched.kit import pki
from dlsched.kit import tls as tls_kit
from dlsched.kit.channel import TokenSource
from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import (
    access_pb2,
    access_service_pb2,
    cluster_manager_service_pb2,
    cluster_pb2,
    driver_service_pb2,
    job_manager_service_pb2,
    job_manager_service_pb2_grpc,
    job_pb2,
)
from dlsched.v1 import access_service_pb2 as acs
from dlsched.v1 import cluster_manager_service_pb2 as cms
from dlsched.v1 import driver_service_pb2 as drv
from dlsched.v1 import driver_service_pb2_grpc as drv_grpc
from dlsched.v1 import job_manager_service_pb2 as jms
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack
from tests.oidc_issuer import OidcIssuer, new_key

PY = sys.executable
AUD = "dlsched-test"
WAIT = 60.0  # generous deadline for anything that happens "soon"

# Every dlsched service, from the generated descriptors: a new RPC shows up here by itself.
SERVICES = {
    "dlsched.v1.JobManagerService": job_manager_service_pb2.DESCRIPTOR.services_by_name["JobManagerService"],
    "dlsched.v1.AccessService": access_service_pb2.DESCRIPTOR.services_by_name["AccessService"],
    "dlsched.v1.ClusterManagerService":
        cluster_manager_service_pb2.DESCRIPTOR.services_by_name["ClusterManagerService"],
    "dlsched.v1.DriverService": driver_service_pb2.DESCRIPTOR.services_by_name["DriverService"],
}


# ---------------------------------------------------------------- helpers

def sleeper(seconds: int = 300, project: str = "") -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, project=project,
                           replica_groups=[job_pb2.ReplicaGroup(
                               role="main", replicas=1,
                               command=[PY, "-c", f"import time; print('up', flush=True); time.sleep({seconds})"])])


def canary(path: str, project: str = "") -> job_pb2.JobSpec:
    """A job whose only effect is to create ``path``."""
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, project=project,
                           replica_groups=[job_pb2.ReplicaGroup(
                               role="main", replicas=1,
                               command=[PY, "-c", f"open({path!r}, 'w').write('x')"])])


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = WAIT,
                     interval: float = 0.2) -> None:
    deadline = time.monotonic() + within
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:.0f}s: {what}")
        await asyncio.sleep(interval)


async def refused(aw: Awaitable[Any], code: str, reason: str | None = None) -> DlschedRpcError:
    with pytest.raises(DlschedRpcError) as ei:
        await aw
    assert ei.value.code == code, str(ei.value)
    if reason is not None:
        assert ei.value.reason == reason, str(ei.value)
    return ei.value


async def drain(it: AsyncIterator[Any]) -> list[Any]:
    return [x async for x in it]


@dataclass
class Caller:
    """One caller's SDK clients over user channels (CA-verified TLS, no client
    certificate) carrying its bearer token."""

    jobs: JobManagerClient
    access: AccessClient
    clusters: ClusterManagerClient


@contextlib.asynccontextmanager
async def as_caller(st: Stack, token: str | None) -> AsyncIterator[Caller]:
    assert st.jm is not None
    jm_ch = security.user_channel(st.jm.address, token)
    cm_ch = security.user_channel(st.cm.address, token)
    try:
        yield Caller(JobManagerClient(st.jm.address, channel=jm_ch),
                     AccessClient(st.jm.address, channel=jm_ch),
                     ClusterManagerClient(st.cm.address, channel=cm_ch))
    finally:
        await jm_ch.close()
        await cm_ch.close()


def admin_token() -> str:
    return security.current().admin_token


# What ClusterManager's monitor writes into a cluster's record on its own (the
# driver's observations, a heartbeat every --heartbeat-interval).
_OBSERVED = ("state", "state_message", "capacity", "supported_run_modes", "update_time",
             "last_heartbeat_time", "etag")


async def prefix_snapshot(endpoint: str, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` with its mod revision and value; a cluster
    record as its proto without what the monitor observes, since the monitor
    rewrites it in the background."""
    c = await etcd_kit.connect(endpoint)
    try:
        res = await c.get_prefix(prefix.encode())
        out: dict[str, Any] = {}
        for kv in res:
            key, value = bytes(kv.key).decode(), bytes(kv.value)
            if key.startswith(f"{prefix}clusters/"):
                cl = cluster_pb2.Cluster.FromString(value)
                for f in _OBSERVED:
                    cl.ClearField(f)
                out[key] = cl
            else:
                out[key] = (int(kv.mod_revision), value)
        return out
    finally:
        await c.close()


async def _held_open(request: Any) -> Any:
    """A bidi call's requests: none until the server has answered (then ``request``).
    The server refuses on its headers alone; a request written while its refusal
    arrives can make the client report INTERNAL 'Internal error from Core'
    instead of the server's status (seen once in a loaded CI run)."""
    await asyncio.sleep(3600)
    yield request  # pragma: no cover - the call ends first


async def raw_call(ch: grpc.aio.Channel, m: MethodDescriptor, request: Any,
                   metadata: list[tuple[str, str]], timeout: float = 30) -> None:
    """Calls ``m`` (unary, server- or bidi-streaming: ``request`` its one
    message) by its descriptor; returns when it answered (a stream: its first
    message; a bidi stream is sent nothing, so one that was not refused runs
    into ``timeout``), raises ``AioRpcError`` when refused."""
    path = f"/{m.containing_service.full_name}/{m.name}"
    resp = message_factory.GetMessageClass(m.output_type)
    ser = type(request).SerializeToString
    if m.server_streaming:
        if m.client_streaming:
            call = ch.stream_stream(path, request_serializer=ser, response_deserializer=resp.FromString)(
                _held_open(request), metadata=metadata, timeout=timeout)
        else:
            call = ch.unary_stream(path, request_serializer=ser, response_deserializer=resp.FromString)(
                request, metadata=metadata, timeout=timeout)
        try:
            async for _ in call:
                return
        finally:
            call.cancel()
        return
    await ch.unary_unary(path, request_serializer=ser, response_deserializer=resp.FromString)(
        request, metadata=metadata, timeout=timeout)


# ---------------------------------------------------------------- the module's stack

@dataclass
class Env:
    stack: Stack
    issuer: OidcIssuer
    audit_log: str
    tmp: str
    cluster: str
    secrets: list[str] = field(default_factory=list)  # every credential used: never in the audit log

    @property
    def jm(self) -> str:
        assert self.stack.jm is not None
        return self.stack.jm.address

    def jwt(self, sub: str, **kw: Any) -> str:
        t = self.issuer.token(sub, **kw)
        self.secrets.append(t)
        return t


@pytest.fixture(scope="module")
def issuer() -> Iterator[OidcIssuer]:
    with OidcIssuer().running() as iss:
        yield iss


@pytest.fixture(scope="module")
async def env(etcd: EtcdServer, issuer: OidcIssuer) -> AsyncIterator[Env]:
    tmp = tempfile.mkdtemp(prefix="dlsched-auth-")
    audit = os.path.join(tmp, "audit.jsonl")
    # Streams beat every second: a quiet stream's re-check of its caller is seen soon.
    st = Stack(etcd, f"/dlsched-auth-{uuid.uuid4().hex[:8]}/",
               jm_args=[*issuer.service_args(AUD), "--audit-log", audit, "--stop-grace-seconds", "1",
                        "--stream-heartbeat-seconds", "1"],
               cm_args=issuer.service_args(AUD))
    try:
        st.start()
        cluster = await st.register_local()
        e = Env(st, issuer, audit, tmp, cluster, [admin_token()])
        yield e
        # Stop what the tests left running (as the admin), then the stack.
        async with as_caller(st, admin_token()) as a:
            for j in await a.jobs.list_all_jobs():
                if j.state not in (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED,
                                   job_pb2.JOB_STATE_STOPPED):
                    with contextlib.suppress(DlschedRpcError):
                        await a.jobs.stop_job(j.name)
    finally:
        st.stop()


async def wait_running(c: Caller, name: str) -> job_pb2.Job:
    out: list[job_pb2.Job] = []

    async def running() -> bool:
        j = await c.jobs.get_job(name)
        assert j.state not in (job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED), j
        out[:] = [j]
        return j.state == job_pb2.JOB_STATE_RUNNING and bool(j.backend_job_id)

    await eventually(running, f"{name} RUNNING")
    return out[0]


# ---------------------------------------------------------------- (a) every method refuses bad credentials

async def _revoked_api_token(e: Env) -> str:
    """An admin's API token (sa:revoked, bound admin on '*'), proven to work on
    JobManager and ClusterManager, then revoked and proven refused by both."""
    async with as_caller(e.stack, admin_token()) as a:
        await a.access.create_role_binding("sa:revoked", "*", "admin")
        tok, secret = await a.access.create_api_token("revoked", description="revoked in a test")
    e.secrets.append(secret)
    async with as_caller(e.stack, secret) as r:
        async def works() -> bool:
            try:
                await r.clusters.list_all_clusters()
                return (await r.access.get_caller()).admin
            except DlschedRpcError:
                return False
        await eventually(works, "the new API token works on JobManager and ClusterManager")
        async with as_caller(e.stack, admin_token()) as a:
            await a.access.delete_api_token(tok.name)

        async def gone() -> bool:
            results = []
            for aw in (r.access.get_caller(), r.clusters.list_all_clusters()):
                try:
                    await aw
                    results.append(False)
                except DlschedRpcError as err:
                    results.append(err.code == "UNAUTHENTICATED")
            return all(results)
        await eventually(gone, "the revoked API token is refused by JobManager and ClusterManager")
    return secret


async def test_every_method_refuses_bad_credentials_without_side_effects(env: Env) -> None:
    e, st = env, env.stack
    assert st.jm is not None
    canary_job = os.path.join(e.tmp, "canary-jm")
    canary_drv = os.path.join(e.tmp, "canary-driver")

    # Objects the refused calls aim at: a running job, a cluster, a binding, a token.
    async with as_caller(st, admin_token()) as a:
        job = (await a.jobs.submit_job(sleeper(), job_id=f"target-{uuid.uuid4().hex[:6]}")).job
        job = await wait_running(a, job.name)
        root = await a.access.create_role_binding("user:root", "*", "admin")
        keeper, keeper_secret = await a.access.create_api_token("keeper")
        e.secrets.append(keeper_secret)

    # A valid JWT for user:root is an admin on both services (so the bad ones
    # below would be, were they accepted).
    async with as_caller(st, e.jwt("root")) as r:
        async def root_is_admin() -> bool:
            try:
                await r.clusters.list_all_clusters()
                return (await r.access.get_caller()).admin
            except DlschedRpcError:
                return False
        await eventually(root_is_admin, "user:root is an admin")

    revoked = await _revoked_api_token(e)
    other_key = new_key("rsa", kid=e.issuer.kid)  # same key id, not the issuer's key
    bad: dict[str, tuple[str | None, set[str]]] = {
        "no token": (None, {"UNAUTHENTICATED"}),
        "malformed": ("Bearer not a token", {"UNAUTHENTICATED"}),
        "not bearer": (f"Basic {admin_token()}", {"UNAUTHENTICATED"}),
        "garbage": ("Bearer not-a-token-at-all", {"UNAUTHENTICATED"}),
        "garbage JWT": ("Bearer aaaa.bbbb.cccc", {"UNAUTHENTICATED"}),
        "expired JWT": (f"Bearer {e.jwt('root', exp_in=-600)}", {"TOKEN_EXPIRED"}),
        "wrong audience": (f"Bearer {e.jwt('root', aud='another-service')}", {"UNAUTHENTICATED"}),
        "wrong issuer": (f"Bearer {e.jwt('root', iss='https://elsewhere.example')}", {"UNAUTHENTICATED"}),
        "bad signature": (f"Bearer {e.jwt('root', sign_with=other_key)}", {"UNAUTHENTICATED"}),
        "revoked API token": (f"Bearer {revoked}", {"UNAUTHENTICATED"}),
    }
    e.secrets.extend(v for v, _ in bad.values() if v)

    ref = drv.JobRef(job_id=job.name.rpartition("/")[2], backend_job_id=job.backend_job_id)
    local = e.cluster
    requests: dict[str, Any] = {
        "dlsched.v1.JobManagerService.SubmitJob": jms.SubmitJobRequest(
            job_id="canary", spec=canary(canary_job), request_id=f"canary-{uuid.uuid4().hex}"),
        "dlsched.v1.JobManagerService.GetJob": jms.GetJobRequest(name=job.name),
        "dlsched.v1.JobManagerService.ListJobs": jms.ListJobsRequest(),
        "dlsched.v1.JobManagerService.StopJob": jms.StopJobRequest(name=job.name),
        "dlsched.v1.JobManagerService.DeleteJob": jms.DeleteJobRequest(name=job.name),
        "dlsched.v1.JobManagerService.WatchJobs": jms.WatchJobsRequest(),
        "dlsched.v1.JobManagerService.StreamJobLogs": jms.StreamJobLogsRequest(name=job.name),
        "dlsched.v1.JobManagerService.GetJobUsage": jms.GetJobUsageRequest(name=job.name),
        "dlsched.v1.AccessService.GetCaller": acs.GetCallerRequest(),
        "dlsched.v1.AccessService.CreateRoleBinding": acs.CreateRoleBindingRequest(
            role_binding=access_pb2.RoleBinding(principal="user:mallory", project="*",
                                                role=access_pb2.ROLE_ADMIN)),
        "dlsched.v1.AccessService.ListRoleBindings": acs.ListRoleBindingsRequest(),
        "dlsched.v1.AccessService.DeleteRoleBinding": acs.DeleteRoleBindingRequest(name=root.name),
        "dlsched.v1.AccessService.CreateApiToken": acs.CreateApiTokenRequest(
            api_token=access_pb2.ApiToken(service_account="mallory")),
        "dlsched.v1.AccessService.ListApiTokens": acs.ListApiTokensRequest(),
        "dlsched.v1.AccessService.DeleteApiToken": acs.DeleteApiTokenRequest(name=keeper.name),
        "dlsched.v1.ClusterManagerService.CreateCluster": cms.CreateClusterRequest(
            cluster_id="canary", request_id=f"canary-{uuid.uuid4().hex}", cluster=cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=st.driver.address)),
        "dlsched.v1.ClusterManagerService.GetCluster": cms.GetClusterRequest(name=local),
        "dlsched.v1.ClusterManagerService.ListClusters": cms.ListClustersRequest(),
        "dlsched.v1.ClusterManagerService.UpdateCluster": cms.UpdateClusterRequest(
            cluster=cluster_pb2.Cluster(name=local, labels={"pwned": "yes"}, allowed_projects=["evil"]),
            update_mask=field_mask_pb2.FieldMask(paths=["labels", "allowed_projects"])),
        "dlsched.v1.ClusterManagerService.DeleteCluster": cms.DeleteClusterRequest(name=local),
        "dlsched.v1.ClusterManagerService.WatchClusters": cms.WatchClustersRequest(),
        "dlsched.v1.ClusterManagerService.MatchClusters": cms.MatchClustersRequest(spec=canary(canary_job)),
        "dlsched.v1.DriverService.ConfigureCluster": drv.ConfigureClusterRequest(cluster="clusters/canary"),
        "dlsched.v1.DriverService.RemoveCluster": drv.RemoveClusterRequest(cluster=local),
        "dlsched.v1.DriverService.GetClusterInfo": drv.GetClusterInfoRequest(cluster=local),
        "dlsched.v1.DriverService.RenderJob": drv.RenderJobRequest(
            cluster=local, job_id="canary-driver", spec=canary(canary_drv)),
        "dlsched.v1.DriverService.LaunchJob": drv.LaunchJobRequest(
            cluster=local, job_id="canary-driver", spec=canary(canary_drv), attempt=1),
        "dlsched.v1.DriverService.BatchGetJobObservations": drv.BatchGetJobObservationsRequest(
            cluster=local, jobs=[ref]),
        "dlsched.v1.DriverService.WatchJobObservations": drv.WatchJobObservationsRequest(cluster=local),
        "dlsched.v1.DriverService.TerminateJob": drv.TerminateJobRequest(
            cluster=local, job=ref, grace_period=duration_pb2.Duration(seconds=0)),
        "dlsched.v1.DriverService.CleanupJob": drv.CleanupJobRequest(cluster=local, job=ref),
        "dlsched.v1.DriverService.ForgetJobs": drv.ForgetJobsRequest(cluster=local, jobs=[ref]),
        "dlsched.v1.DriverService.TailJobLogs": drv.TailJobLogsRequest(cluster=local, job=ref),
        "dlsched.v1.DriverService.MultiplexJobLogs": drv.MultiplexJobLogsRequest(
            tail_id=1, open=drv.OpenTail(request=drv.TailJobLogsRequest(cluster=local, job=ref), credit=1)),
        "dlsched.v1.DriverService.MeasureJobUsage": drv.MeasureJobUsageRequest(cluster=local, job=ref),
    }
    every = {m.full_name: m for svc in SERVICES.values() for m in svc.methods}
    assert set(requests) == set(every), (
        "every RPC needs a request here (one that would have a side effect if accepted): "
        f"missing {sorted(set(every) - set(requests))}, stale {sorted(set(requests) - set(every))}")
    for name, req in requests.items():
        assert type(req).DESCRIPTOR is every[name].input_type, name

    before = await prefix_snapshot(st.etcd.endpoint, st.prefix)
    address = {"dlsched.v1.JobManagerService": st.jm.address, "dlsched.v1.AccessService": st.jm.address,
               "dlsched.v1.ClusterManagerService": st.cm.address}
    failures: list[str] = []

    # JobManager, AccessService, ClusterManager: every bad credential, every method.
    for svc_name, addr in address.items():
        async with security.user_channel(addr) as ch:
            for m in SERVICES[svc_name].methods:
                for what, (authz, reasons) in bad.items():
                    md = [("authorization", authz)] if authz else []
                    try:
                        await raw_call(ch, m, requests[m.full_name], md)
                        failures.append(f"{m.full_name} with {what}: ACCEPTED")
                        continue
                    except grpc.aio.AioRpcError as err:
                        info = error_info(err)
                        got = (err.code().name, info.reason if info else None)
                    if got[0] != "UNAUTHENTICATED" or got[1] not in reasons:
                        failures.append(f"{m.full_name} with {what}: {got}")

    # Drivers: no client certificate → no TLS session at all; a user's
    # certificate (CN alice) → PERMISSION_DENIED, with or without a token.
    s = security.current()
    alice_cert = tls_kit.TlsOptions(s.user.cert_file, s.user.key_file, s.ca.cert_file)
    driver_cases = [
        ("no client certificate", security.user_channel(st.driver.address, admin_token()), "UNAVAILABLE"),
        ("user certificate", tls_kit.channel(st.driver.address, alice_cert, client_cert=True),
         "PERMISSION_DENIED"),
        ("user certificate + admin token", tls_kit.channel(
            st.driver.address, alice_cert, client_cert=True, token=TokenSource(token=admin_token())),
         "PERMISSION_DENIED"),
    ]
    for what, ch, want in driver_cases:
        async with ch:
            for m in SERVICES["dlsched.v1.DriverService"].methods:
                try:
                    await raw_call(ch, m, requests[m.full_name], [], timeout=20)
                    failures.append(f"{m.full_name} with {what}: ACCEPTED")
                except grpc.aio.AioRpcError as err:
                    if err.code().name != want:
                        failures.append(f"{m.full_name} with {what}: {err.code().name} {err.details()}")
    assert not failures, "\n".join(failures)

    # The control plane's certificate is what drivers take.
    async with security.control_plane_channel(st.driver.address) as ch:
        d = drv_grpc.DriverServiceStub(ch)
        info = await d.GetClusterInfo(drv.GetClusterInfoRequest(cluster=local), timeout=30)
        assert info.info.state == cluster_pb2.CLUSTER_STATE_READY
        obs = await d.BatchGetJobObservations(drv.BatchGetJobObservationsRequest(
            cluster=local, jobs=[ref, drv.JobRef(job_id="canary-driver")]), timeout=30)
        by_id = {o.job_id: o for o in obs.observations}
        assert by_id[ref.job_id].state == job_pb2.JOB_STATE_RUNNING, by_id
        assert not by_id.get("canary-driver", drv.JobObservation()).found, by_id

    # No side effect: nothing under the stack's prefix was written...
    after = await prefix_snapshot(st.etcd.endpoint, st.prefix)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"etcd keys written by refused calls: {changed}"
    # ...every object is as it was, and nothing new exists.
    async with as_caller(st, admin_token()) as a:
        jobs = {j.name: j for j in await a.jobs.list_all_jobs()}
        assert job.name in jobs and jobs[job.name].state == job_pb2.JOB_STATE_RUNNING
        assert "jobs/canary" not in jobs
        clusters = {c.name: c for c in await a.clusters.list_all_clusters()}
        assert set(clusters) >= {local} and "clusters/canary" not in clusters
        assert "pwned" not in clusters[local].labels and not clusters[local].allowed_projects
        bindings = await a.access.list_role_bindings()
        assert root.name in {b.name for b in bindings}
        assert not [b for b in bindings if b.principal == "user:mallory"]
        tokens = await a.access.list_api_tokens()
        assert keeper.name in {t.name for t in tokens}
        assert not [t for t in tokens if t.service_account == "mallory"]
    assert not os.path.exists(canary_job) and not os.path.exists(canary_drv)

    # The canary request was a real one: as the admin it does create the file.
    async with as_caller(st, admin_token()) as a:
        await a.jobs.stub.SubmitJob(requests["dlsched.v1.JobManagerService.SubmitJob"], timeout=30)

        async def created() -> bool:
            return os.path.exists(canary_job)
        await eventually(created, "the canary job, submitted by the admin, creates its file")
        await a.jobs.stop_job(job.name)
    assert not os.path.exists(canary_drv)


# ---------------------------------------------------------------- (b) projects

async def test_projects_isolate_jobs_and_roles_limit_what_callers_do(env: Env) -> None:
    e, st = env, env.stack
    alice_t = e.jwt("alice", projects=["pa"])
    bob_t = e.jwt("bob", projects=["pb:member"])
    carol_t = e.jwt("carol", projects=["pa:viewer"])
    dave_t = e.jwt("dave", projects=["pa", "pb"])
    async with (as_caller(st, alice_t) as alice, as_caller(st, bob_t) as bob,
                as_caller(st, carol_t) as carol, as_caller(st, dave_t) as dave,
                as_caller(st, admin_token()) as admin):
        me = await alice.access.get_caller()
        assert me.principal == "user:alice" and not me.admin
        assert [(r.project, r.role) for r in me.roles] == [("pa", access_pb2.ROLE_MEMBER)]

        a1 = (await alice.jobs.submit_job(sleeper())).job
        b1 = (await bob.jobs.submit_job(sleeper())).job
        assert (a1.owner, a1.project) == ("user:alice", "pa")
        assert (b1.owner, b1.project) == ("user:bob", "pb")
        a1 = await wait_running(alice, a1.name)
        b1 = await wait_running(bob, b1.name)

        # Neither sees nor touches the other's job: NOT_FOUND, as for a missing one.
        for me_, other in ((bob, a1), (alice, b1)):
            await refused(me_.jobs.get_job(other.name), "NOT_FOUND", "JOB_NOT_FOUND")
            await refused(drain(me_.jobs.stream_job_logs(other.name)), "NOT_FOUND", "JOB_NOT_FOUND")
            await refused(me_.jobs.get_job_usage(other.name), "NOT_FOUND", "JOB_NOT_FOUND")
            await refused(me_.jobs.stop_job(other.name), "NOT_FOUND", "JOB_NOT_FOUND")
            await refused(me_.jobs.delete_job(other.name), "NOT_FOUND", "JOB_NOT_FOUND")
        assert (await admin.jobs.get_job(a1.name)).state == job_pb2.JOB_STATE_RUNNING
        assert (await admin.jobs.get_job(b1.name)).state == job_pb2.JOB_STATE_RUNNING
        # Each still reaches its own job.
        assert (await alice.jobs.get_job(a1.name)).name == a1.name
        await alice.jobs.get_job_usage(a1.name)
        # Which clusters another project may use is not a non-member's to learn (MatchClusters
        # ranked clusters for any project named)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await alice.clusters.stub.MatchClusters(cms.MatchClustersRequest(spec=sleeper(), project="pb"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, denied.value
        assert (await alice.clusters.stub.MatchClusters(cms.MatchClustersRequest(
            spec=sleeper(), project="pa"))).candidates

        # List shows only the caller's project.
        seen = {j.name: j.project for j in await alice.jobs.list_all_jobs()}
        assert a1.name in seen and b1.name not in seen and set(seen.values()) == {"pa"}
        seen = {j.name: j.project for j in await bob.jobs.list_all_jobs()}
        assert b1.name in seen and a1.name not in seen and set(seen.values()) == {"pb"}

        # Watch: the snapshot and the live events are the caller's project's only.
        watch = bob.jobs.watch_jobs()
        try:
            snapshot: list[job_pb2.Job] = []
            async for ev in watch:
                if ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                    break
                snapshot.append(ev.job)
            assert b1.name in {j.name for j in snapshot}
            assert {j.project for j in snapshot} == {"pb"}, snapshot
            a2 = (await alice.jobs.submit_job(sleeper(5))).job
            b2 = (await bob.jobs.submit_job(sleeper(5))).job
            live: list[job_pb2.Job] = []

            async def until_b2() -> None:
                async for ev in watch:
                    live.append(ev.job)
                    if ev.job.name == b2.name:
                        return
            await asyncio.wait_for(until_b2(), WAIT)
            assert {j.project for j in live} == {"pb"}, live
            assert a2.name not in {j.name for j in live}
        finally:
            await watch.aclose()  # type: ignore[attr-defined]

        # A viewer reads the project's jobs but cannot submit, stop or delete.
        await refused(carol.jobs.submit_job(sleeper()), "PERMISSION_DENIED", "PERMISSION_DENIED")
        await refused(carol.jobs.submit_job(sleeper(project="pa")), "PERMISSION_DENIED")
        assert (await carol.jobs.get_job(a1.name)).project == "pa"
        assert a1.name in {j.name for j in await carol.jobs.list_all_jobs()}
        await carol.jobs.get_job_usage(a1.name)
        await refused(carol.jobs.stop_job(a1.name), "PERMISSION_DENIED", "PERMISSION_DENIED")
        await refused(carol.jobs.delete_job(a1.name), "PERMISSION_DENIED", "PERMISSION_DENIED")
        await refused(carol.jobs.get_job(b1.name), "NOT_FOUND", "JOB_NOT_FOUND")
        # A member may not submit to a project it is not in.
        await refused(alice.jobs.submit_job(sleeper(project="pb")), "PERMISSION_DENIED")

        # A member administers nothing: clusters, tokens, role bindings.
        local = await alice.clusters.get_cluster(e.cluster)  # reads are fine
        assert local.name == e.cluster
        assert e.cluster in {c.name for c in await alice.clusters.list_all_clusters()}
        denied = [
            alice.clusters.create_cluster("mine", cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=st.driver.address)),
            alice.clusters.update_cluster(cluster_pb2.Cluster(name=e.cluster, labels={"a": "b"}),
                                          ["labels"]),
            alice.clusters.delete_cluster(e.cluster),
            alice.access.create_api_token("alice-bot"),
            alice.access.list_api_tokens(),
            alice.access.delete_api_token("apiTokens/abcdefabcdef"),
            alice.access.create_role_binding("user:alice", "pb", "member"),
            alice.access.create_role_binding("user:alice", "*", "admin"),
            alice.access.list_role_bindings(),
            alice.access.delete_role_binding("roleBindings/abcdefabcdef"),
        ]
        for aw in denied:
            await refused(aw, "PERMISSION_DENIED", "PERMISSION_DENIED")
        assert (await admin.clusters.get_cluster(e.cluster)).labels.get("a") is None
        assert not [b for b in await admin.access.list_role_bindings(principal="user:alice")]

        # In several projects, a job must say which.
        err = await refused(dave.jobs.submit_job(sleeper()), "INVALID_ARGUMENT")
        assert "spec.project" in [v.field for v in err.field_violations], err
        d1 = (await dave.jobs.submit_job(sleeper(5, project="pb"))).job
        assert (d1.owner, d1.project) == ("user:dave", "pb")
        assert d1.name in {j.name for j in await bob.jobs.list_all_jobs()}
        assert d1.name not in {j.name for j in await alice.jobs.list_all_jobs()}

        # A cluster restricted to project pa: refused to pb's jobs, used for pa's.
        await admin.clusters.update_cluster(cluster_pb2.Cluster(name=e.cluster, allowed_projects=["pa"]),
                                            ["allowed_projects"])
        try:
            async def restricted() -> bool:
                try:
                    resp = await admin.clusters.stub.MatchClusters(cms.MatchClustersRequest(
                        spec=sleeper(), project="pb"), timeout=30)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
                    return True
                return not any(c.eligible for c in resp.candidates)
            await eventually(restricted, "the restriction reaches matching")
            before = {j.name for j in await bob.jobs.list_all_jobs()}
            err = await refused(bob.jobs.submit_job(sleeper()), "FAILED_PRECONDITION", "NO_MATCHING_CLUSTER")
            # Refused, so nothing stored (earlier jobs may still be PENDING: launches run after SubmitJob)
            assert {j.name for j in await bob.jobs.list_all_jobs()} == before
            a3 = (await alice.jobs.submit_job(sleeper(5))).job
            assert a3.cluster == e.cluster and a3.project == "pa"
            await wait_running(alice, a3.name)
        finally:
            await admin.clusters.update_cluster(cluster_pb2.Cluster(name=e.cluster, allowed_projects=[]),
                                                ["allowed_projects"])
        for j in (a1, b1):
            await admin.jobs.stop_job(j.name)


# ---------------------------------------------------------------- (c) OIDC

async def test_oidc_keys_are_cached_rotation_refetches_once_and_leeway_holds(etcd: EtcdServer) -> None:
    with OidcIssuer().running() as iss:
        st = Stack(etcd, f"/dlsched-oidc-{uuid.uuid4().hex[:8]}/", jm_args=iss.service_args(AUD),
                   cm_args=iss.service_args(AUD))
        with st.running():
            async def caller_name(token: str) -> str:
                async with as_caller(st, token) as c:
                    return (await c.access.get_caller()).principal

            assert iss.fetches("jwks") == 0
            # Many calls with many distinct valid tokens (two key types are not
            # needed: one RSA key), against JobManager only: one JWKS fetch.
            for i in range(25):
                assert await caller_name(iss.token(f"user{i}", projects=["pa"])) == f"user:user{i}"
            assert iss.fetches("jwks") == 1, iss.fetches("jwks")
            assert iss.fetches("discovery") == 1

            # Clock skew: the default leeway (60 s) accepts a token expired 30 s
            # ago, and refuses one expired 120 s ago.
            assert await caller_name(iss.token("skewed", exp_in=-30)) == "user:skewed"
            async with as_caller(st, iss.token("late", exp_in=-120)) as c:
                await refused(c.access.get_caller(), "UNAUTHENTICATED", "TOKEN_EXPIRED")
            # Not yet valid (nbf) beyond the leeway: refused too.
            async with as_caller(st, iss.token("early", extra={"nbf": int(time.time()) + 600})) as c:
                await refused(c.access.get_caller(), "UNAUTHENTICATED")
            assert iss.fetches("jwks") == 1

            # Key rotation: the issuer publishes an EC key under a new key id and
            # signs with it; the service fetches the JWKS again (once) and accepts it.
            old = iss.token("before-rotation")
            iss.rotate("ec")
            rotated = iss.token("after-rotation")

            async def accepted() -> bool:
                try:
                    return await caller_name(rotated) == "user:after-rotation"
                except DlschedRpcError as err:
                    assert err.code == "UNAUTHENTICATED", err
                    return False
            await eventually(accepted, "a token signed with the rotated key is accepted", within=120,
                             interval=1.0)
            assert iss.fetches("jwks") == 2, iss.fetches("jwks")
            for i in range(10):
                assert await caller_name(iss.token(f"new{i}")) == f"user:new{i}"
            assert await caller_name(old) == "user:before-rotation"  # the old key is still published
            assert iss.fetches("jwks") == 2, iss.fetches("jwks")

            # ClusterManager verifies the same tokens with its own cache.
            async with as_caller(st, iss.token("cm-user", projects=["pa"])) as c:
                await c.clusters.list_all_clusters()
            assert iss.fetches("jwks") == 3


async def test_oidc_email_as_the_user_needs_email_verified() -> None:
    """With --oidc-user-claim email a token names its user by its email only when the
    issuer says it verified it: many issuers let a user set any address, which would
    make them whoever owns it ("nOAuth")."""
    from dlsched.auth.oidc import OidcOptions, OidcVerifier
    from dlsched.errors import Unauthenticated
    with OidcIssuer().running() as iss:
        v = OidcVerifier(OidcOptions(issuer=iss.url, audience=AUD, user_claim="email"))
        ok = iss.token("someone", AUD, extra={"email": "lead@corp.example", "email_verified": True})
        assert (await v.verify(ok)).name == "user:lead@corp.example"
        for extra in ({"email_verified": False}, {}, {"email_verified": "true"}):
            forged = iss.token("attacker", AUD, extra={"email": "lead@corp.example", **extra})
            with pytest.raises(Unauthenticated, match="not verified"):
                await v.verify(forged)
        # The default claim, sub, is the issuer's own and needs no such flag.
        plain = OidcVerifier(OidcOptions(issuer=iss.url, audience=AUD))
        assert (await plain.verify(iss.token("someone", AUD))).name == "user:someone"


async def test_an_oidc_subject_over_255_characters_is_refused() -> None:
    """OpenID Connect caps ``sub`` at 255 characters; a longer one is no user (it would become a
    job owner longer than the history's column: every archive batch it was in failed)."""
    from dlsched.auth.oidc import OidcOptions, OidcVerifier
    from dlsched.errors import Unauthenticated
    with OidcIssuer().running() as iss:
        v = OidcVerifier(OidcOptions(issuer=iss.url, audience=AUD))
        assert (await v.verify(iss.token("s" * 255, AUD))).name == "user:" + "s" * 255
        with pytest.raises(Unauthenticated, match="over 255"):
            await v.verify(iss.token("s" * 256, AUD))


async def test_an_oidc_expiry_no_float_holds_is_unauthenticated() -> None:
    """A token its issuer signed with ``exp`` 10**400 (PyJWT takes it: an int in the future) is
    UNAUTHENTICATED, not an OverflowError answered INTERNAL."""
    from dlsched.auth.oidc import OidcOptions, OidcVerifier
    from dlsched.errors import Unauthenticated
    with OidcIssuer().running() as iss:
        v = OidcVerifier(OidcOptions(issuer=iss.url, audience=AUD))
        with pytest.raises(Unauthenticated, match="'exp'"):
            await v.verify(iss.token("someone", AUD, extra={"exp": 10**400}))
        assert (await v.verify(iss.token("someone", AUD, extra={"exp": 2**62}))).name == "user:someone"


# ---------------------------------------------------------------- (d) TLS

def _served_certificate(port: int, opts: tls_kit.TlsOptions) -> x509.Certificate:
    """The certificate a server presents to a new, CA-verified TLS connection."""
    assert opts.ca_file and opts.cert_file and opts.key_file
    ctx = ssl.create_default_context(cafile=opts.ca_file)
    ctx.load_cert_chain(opts.cert_file, opts.key_file)
    ctx.set_alpn_protocols(["h2"])
    with (socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
          ctx.wrap_socket(sock, server_hostname="localhost") as tls):
        der = tls.getpeercert(binary_form=True)
    assert der
    return x509.load_der_x509_certificate(der)


async def test_tls_foreign_ca_refused_and_renewed_certificate_served_without_restart(env: Env) -> None:
    s = security.current()
    tmp = tempfile.mkdtemp(prefix="dlsched-tls-renew-")
    served = pki.issue(s.ca, tmp, "job-manager", dns=("cluster-manager", "localhost"), basename="served")
    state = os.path.join(tmp, "state")
    os.makedirs(state)
    driver = ServiceProcess("drivers.local", ["--state-dir", state,
                                              "--tls-cert-file", served.cert_file,
                                              "--tls-key-file", served.key_file], name="tls-driver")
    driver.start()
    try:
        port = int(driver.address.rsplit(":", 1)[1])
        client = s.service_tls()

        # A client that trusts another CA does not get a session (driver and JobManager).
        other_ca = pki.make_ca(os.path.join(tmp, "other-ca"))
        foreign = tls_kit.TlsOptions(s.service.cert_file, s.service.key_file, other_ca.cert_file)
        async with tls_kit.channel(driver.address, foreign, client_cert=True) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await drv_grpc.DriverServiceStub(ch).GetClusterInfo(
                    drv.GetClusterInfoRequest(cluster="clusters/x"), timeout=20)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        async with tls_kit.channel(env.jm, tls_kit.TlsOptions(ca_file=other_ca.cert_file),
                                   token=TokenSource(token=admin_token())) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await AccessClient(env.jm, channel=ch).stub.GetCaller(acs.GetCallerRequest(), timeout=20)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        # A server certificate from a foreign CA is refused by our clients too.
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(_served_certificate, port, tls_kit.TlsOptions(
                s.service.cert_file, s.service.key_file, other_ca.cert_file))

        first = await asyncio.to_thread(_served_certificate, port, client)
        with open(served.cert_file, "rb") as f:
            assert first.serial_number == x509.load_pem_x509_certificate(f.read()).serial_number
        old_ch = security.control_plane_channel(driver.address)
        try:
            old = drv_grpc.DriverServiceStub(old_ch)
            await old.ConfigureCluster(drv.ConfigureClusterRequest(cluster="clusters/x"), timeout=30)
            await old.GetClusterInfo(drv.GetClusterInfoRequest(cluster="clusters/x"), timeout=30)

            # Renew: a new certificate (same CA, new key and serial) moved into place atomically.
            renewed = pki.issue(s.ca, tmp, "job-manager", dns=("cluster-manager", "localhost"),
                                basename="renewed")
            os.replace(renewed.key_file, served.key_file)
            os.replace(renewed.cert_file, served.cert_file)
            with open(served.cert_file, "rb") as f:
                new_serial = x509.load_pem_x509_certificate(f.read()).serial_number
            assert new_serial != first.serial_number

            async def renewed_served() -> bool:
                c = await asyncio.to_thread(_served_certificate, port, client)
                return c.serial_number == new_serial
            await eventually(renewed_served, "the renewed certificate is served on new connections")

            # A new channel verifies the renewed certificate; the old channel keeps working.
            async with security.control_plane_channel(driver.address) as ch:
                await drv_grpc.DriverServiceStub(ch).GetClusterInfo(
                    drv.GetClusterInfoRequest(cluster="clusters/x"), timeout=30)
            await old.GetClusterInfo(drv.GetClusterInfoRequest(cluster="clusters/x"), timeout=30)
            assert driver.proc is not None and driver.proc.poll() is None  # never restarted
        finally:
            await old_ch.close()
    finally:
        driver.stop()


# ---------------------------------------------------------------- (e) the audit log

def _audit_lines(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


async def test_a_token_of_the_largest_size_is_read_every_time(env: Env) -> None:
    """A bearer token of 8,192 characters (the most a token may have: a large OIDC token) is
    read and judged on every call; gRPC's 8 KiB metadata soft limit refused such calls at random
    (RESOURCE_EXHAUSTED, HTTP 429 at the gateway)."""
    async with security.user_channel(env.jm) as ch:
        stub = job_manager_service_pb2_grpc.JobManagerServiceStub(ch)
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.ListJobs(jms.ListJobsRequest(), timeout=30,
                                    metadata=[("authorization", "Bearer " + "x" * 8192)])
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value


async def test_a_call_with_two_authorization_values_is_unauthenticated(env: Env) -> None:
    """Two bearer tokens on one call (an admin's and another): which counts is ambiguous (gRPC
    read the first, a proxy may keep the last), so neither does."""
    viewer = env.jwt("nobody-in-particular")
    async with security.user_channel(env.jm) as ch:
        stub = job_manager_service_pb2_grpc.JobManagerServiceStub(ch)
        for pair in ((admin_token(), viewer), (viewer, admin_token())):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.ListJobs(jms.ListJobsRequest(), timeout=30,
                                    metadata=[("authorization", f"Bearer {t}") for t in pair])
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value


async def test_a_call_that_outlasts_its_deadline_is_audited_deadline_exceeded_not_internal(env: Env) -> None:
    """StopJob while the job's driver is frozen, with a 3 s deadline: answered at its deadline,
    and the audit log says DEADLINE_EXCEEDED (it said INTERNAL: a server fault that never was)."""
    st = env.stack
    async with as_caller(st, admin_token()) as admin:
        job = (await admin.jobs.submit_job(sleeper(120), job_id=f"frozen-{uuid.uuid4().hex[:6]}")).job
        await eventually(lambda: _is_running(admin, job.name), "the job runs")
        assert st.driver.proc is not None
        os.kill(st.driver.proc.pid, signal.SIGSTOP)
        try:
            async with security.user_channel(env.jm, admin_token()) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await job_manager_service_pb2_grpc.JobManagerServiceStub(ch).StopJob(
                        jms.StopJobRequest(name=job.name), timeout=3)
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        finally:
            os.kill(st.driver.proc.pid, signal.SIGCONT)
        await admin.jobs.delete_job(job.name)

    async def audited() -> bool:
        return any(x["method"].endswith("/StopJob") and x["object"] == job.name for x in _audit_lines(env.audit_log))
    await eventually(audited, "the StopJob audit line")
    (line,) = [x for x in _audit_lines(env.audit_log) if x["method"].endswith("/StopJob") and x["object"] == job.name]
    assert line["result"] == "DEADLINE_EXCEEDED", line


async def _is_running(c: Any, name: str) -> bool:
    return bool((await c.jobs.get_job(name)).state == job_pb2.JOB_STATE_RUNNING)


async def test_audit_log_records_mutations_and_never_a_token(env: Env) -> None:
    e, st = env, env.stack
    alice_t = e.jwt("alice", projects=["pa"])
    bob_t = e.jwt("bob", projects=["pb"])
    async with as_caller(st, alice_t) as alice, as_caller(st, bob_t) as bob:
        job = (await alice.jobs.submit_job(sleeper(5), job_id=f"audited-{uuid.uuid4().hex[:6]}")).job
        await refused(bob.jobs.stop_job(job.name), "NOT_FOUND", "JOB_NOT_FOUND")
    async with as_caller(st, None) as anon:
        await refused(anon.jobs.delete_job(job.name), "UNAUTHENTICATED", "UNAUTHENTICATED")

    def lines(method: str) -> list[dict[str, Any]]:
        return [x for x in _audit_lines(e.audit_log)
                if x["method"] == f"/dlsched.v1.JobManagerService/{method}" and x["object"] == job.name]

    async def all_written() -> bool:
        return all(lines(m) for m in ("SubmitJob", "StopJob", "DeleteJob"))
    try:
        await eventually(all_written, "the three audit lines")
    except AssertionError:
        raise AssertionError(f"audit log:\n{open(e.audit_log).read()}") from None
    expected = {"SubmitJob": ("user:alice", "OK"), "StopJob": ("user:bob", "NOT_FOUND"),
                "DeleteJob": ("unauthenticated", "UNAUTHENTICATED")}
    for method, (principal, result) in expected.items():
        got = lines(method)
        assert len(got) == 1, got
        assert (got[0]["principal"], got[0]["result"]) == (principal, result), got
        assert set(got[0]) >= {"time", "principal", "method", "object", "result"}
    # Reads are not audited.
    assert not [x for x in _audit_lines(e.audit_log) if x["method"].endswith("/GetJob")]

    text = open(e.audit_log).read()
    assert e.secrets and admin_token() in e.secrets
    for secret in e.secrets:
        token = secret.removeprefix("Bearer ").removeprefix("Basic ")
        assert token not in text
        for part in token.split("."):  # not even a JWT's signature or payload
            if len(part) >= 16:
                assert part not in text
    assert oct(os.stat(e.audit_log).st_mode & 0o777) == oct(0o600)


async def test_an_api_token_expire_time_outside_a_timestamp_is_invalid_argument(env: Env) -> None:
    """CreateApiToken with an expire_time no Timestamp holds (seconds past year 9999
    or before year 1, nanos outside 0..999,999,999): INVALID_ARGUMENT naming
    ``api_token.expire_time``, never INTERNAL, and no token made."""
    sa = f"expiry-{uuid.uuid4().hex[:6]}"
    async with as_caller(env.stack, admin_token()) as a:
        for ts in ({"seconds": 2**62}, {"seconds": -2**62}, {"seconds": 253402300800},
                   {"seconds": 4102444800, "nanos": -5}, {"seconds": 4102444800, "nanos": 10**9}):
            req = acs.CreateApiTokenRequest(api_token=access_pb2.ApiToken(
                service_account=sa, expire_time=timestamp_pb2.Timestamp(**ts)))
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await a.access.stub.CreateApiToken(req)
            err = DlschedRpcError.from_rpc_error(ei.value)
            assert (err.code, err.reason) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT"), (ts, str(err))
            assert [v.field for v in err.field_violations] == ["api_token.expire_time"], (ts, str(err))
        assert await a.access.list_api_tokens(service_account=sa) == []
        # The last second a Timestamp holds is a valid expiry.
        tok, secret = await a.access.create_api_token(sa, expire_time=datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC))
        env.secrets.append(secret)
        assert tok.expire_time.seconds == 253402300799
        await a.access.delete_api_token(tok.name)


async def test_role_bindings_and_api_tokens_are_listed_in_pages(env: Env) -> None:
    """ListRoleBindings and ListApiTokens page (AIP-158): page_size caps a page, the
    next_page_token walks every item once in order, a token is refused with other filters
    or when forged, a negative page_size names its field."""
    tag = uuid.uuid4().hex[:6]
    sa = f"pages-{tag}"
    project = f"pages-{tag}"
    async with as_caller(env.stack, admin_token()) as a:
        made_tokens = []
        for _ in range(5):
            tok, secret = await a.access.create_api_token(sa)
            env.secrets.append(secret)
            made_tokens.append(tok.name)
        made_bindings = [(await a.access.create_role_binding(f"user:p{i}-{tag}", project, "viewer")).name
                         for i in range(5)]
        try:
            names, token, pages = [], "", 0
            while True:
                resp = await a.access.stub.ListApiTokens(acs.ListApiTokensRequest(
                    service_account=sa, page_size=2, page_token=token))
                assert len(resp.api_tokens) <= 2
                names += [t.name for t in resp.api_tokens]
                pages += 1
                token = resp.next_page_token
                if not token:
                    break
            assert pages == 3 and sorted(names) == sorted(made_tokens) and len(set(names)) == 5
            names, token = [], ""
            while True:
                resp2 = await a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(
                    project=project, page_size=3, page_token=token))
                names += [b.name for b in resp2.role_bindings]
                token = resp2.next_page_token
                if not token:
                    break
            assert sorted(names) == sorted(made_bindings) and len(names) == 5
            # the client's list walks every page
            assert sorted(t.name for t in await a.access.list_api_tokens(service_account=sa)) == sorted(made_tokens)
            first = await a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(project=project, page_size=1))
            assert first.next_page_token
            bad_calls = [
                (a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(
                    project="default", page_token=first.next_page_token)), "page_token"),
                (a.access.stub.ListApiTokens(acs.ListApiTokensRequest(page_token="bmFu")), "page_token"),
                (a.access.stub.ListApiTokens(acs.ListApiTokensRequest(page_token="x" * 100_000)), "page_token"),
                (a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(page_size=-1)), "page_size"),
                # filters no binding or token can match (they were answered empty)
                (a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(principal="garbage\n")), "principal"),
                (a.access.stub.ListRoleBindings(acs.ListRoleBindingsRequest(project=";x")), "project"),
                (a.access.stub.ListApiTokens(acs.ListApiTokensRequest(service_account="Bad\n")), "service_account"),
            ]
            for call, field in bad_calls:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await call
                err = DlschedRpcError.from_rpc_error(ei.value)
                assert err.code == "INVALID_ARGUMENT" and [v.field for v in err.field_violations] == [field]
        finally:
            for name in made_tokens:
                await a.access.delete_api_token(name)
            for name in made_bindings:
                await a.access.delete_role_binding(name)


async def test_a_bad_service_account_or_match_project_names_its_field(env: Env) -> None:
    """CreateApiToken's service_account is a bare DNS label (its message said 'user:...' or
    'sa:...'); MatchClusters' project and spec.project are project names (any text was taken)."""
    from dlsched.v1 import cluster_manager_service_pb2 as cms
    from dlsched.v1 import cluster_manager_service_pb2_grpc as cms_grpc
    from dlsched.v1 import job_pb2

    async with as_caller(env.stack, admin_token()) as a:
        for bad in ("sa:ci", "CI", "-ci", "a" * 64, ""):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await a.access.stub.CreateApiToken(acs.CreateApiTokenRequest(
                    api_token=access_pb2.ApiToken(service_account=bad)))
            err = DlschedRpcError.from_rpc_error(ei.value)
            assert err.code == "INVALID_ARGUMENT" and "DNS label" in str(err), (bad, str(err))
            assert [v.field for v in err.field_violations] == ["api_token.service_account"]
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])
    async with security.channel(env.stack.cm.address) as ch:
        cm = cms_grpc.ClusterManagerServiceStub(ch)
        assert (await cm.MatchClusters(cms.MatchClustersRequest(spec=spec, project="team-a"))).candidates is not None
        for req, field in ((cms.MatchClustersRequest(spec=spec, project="BAD PROJ"), "project"),
                           (cms.MatchClustersRequest(spec=job_pb2.JobSpec(
                               run_mode=spec.run_mode, replica_groups=spec.replica_groups, project="x/../y")),
                            "spec.project")):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await cm.MatchClusters(req)
            err = DlschedRpcError.from_rpc_error(ei.value)
            assert err.code == "INVALID_ARGUMENT" and [v.field for v in err.field_violations] == [field]


async def test_revoking_a_token_ends_its_open_watch(env: Env) -> None:
    """Authorization is not checked only when a stream opens: once its API token
    is revoked, an open WatchJobs stream ends UNAUTHENTICATED at its next event."""
    from dlsched.v1 import job_manager_service_pb2 as jpb
    from dlsched.v1 import job_manager_service_pb2_grpc as jgrpc

    async with as_caller(env.stack, admin_token()) as a:
        await a.access.create_role_binding("sa:watcher", "pw", "viewer")
        tok, secret = await a.access.create_api_token("watcher")
    env.secrets.append(secret)
    ch = security.user_channel(env.jm, secret)
    try:
        stream = jgrpc.JobManagerServiceStub(ch).WatchJobs(jpb.WatchJobsRequest())
        while (await stream.read()).type != job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            pass
        async with as_caller(env.stack, admin_token()) as a:
            await a.access.delete_api_token(tok.name)
            # The next event the stream would pass on: a job of its project.
            await a.jobs.submit_job(sleeper(1, project="pw"))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while True:
                ev = await asyncio.wait_for(stream.read(), WAIT)
                assert ev is not grpc.aio.EOF, "the stream ended without an error"
                assert ev.type in (job_pb2.WATCH_EVENT_TYPE_HEARTBEAT,), ev
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await ch.close()


# ---------------------------------------------------------------- open streams re-check their caller

def chatty(project: str) -> job_pb2.JobSpec:
    """A job that prints a line every 0.2 s (for 5 minutes)."""
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, project=project,
                           replica_groups=[job_pb2.ReplicaGroup(
                               role="main", replicas=1,
                               command=[PY, "-c", "import time\nfor i in range(1500):\n"
                                                  "    print('line', i, flush=True); time.sleep(0.2)"])])


async def ends_with_error(stream: Any, what: str,
                          allowed: Callable[[Any], bool] = lambda _: True) -> grpc.aio.AioRpcError:
    """Reads ``stream`` (each message must pass ``allowed``) until it fails; its error.
    A stream still open after WAIT seconds, or ended without an error, fails the test."""
    async def read() -> grpc.aio.AioRpcError:
        while True:
            try:
                msg = await stream.read()
            except grpc.aio.AioRpcError as err:
                return err
            assert msg is not grpc.aio.EOF, f"{what}: the stream ended without an error"
            assert allowed(msg), f"{what}: sent {msg}"
    try:
        return await asyncio.wait_for(read(), WAIT)
    except TimeoutError:
        raise AssertionError(f"{what}: still open after {WAIT:.0f}s") from None


def code_and_reason(err: grpc.aio.AioRpcError) -> tuple[str, str | None]:
    info = error_info(err)
    return err.code().name, info.reason if info else None


async def test_losing_read_access_ends_open_log_streams_as_not_found(env: Env) -> None:
    """A viewer following a job's logs loses its role binding (its token stays
    valid): GetJob answers NOT_FOUND, and so do its open StreamJobLogs streams,
    at their next batch of lines (a chatty job) or next heartbeat (a quiet one)."""
    from dlsched.v1 import job_manager_service_pb2_grpc as jgrpc

    viewer = f"log-viewer-{uuid.uuid4().hex[:6]}"
    async with as_caller(env.stack, admin_token()) as a:
        binding = await a.access.create_role_binding(f"user:{viewer}", "pv", "viewer")
        loud = (await a.jobs.submit_job(chatty("pv"))).job
        quiet = (await a.jobs.submit_job(sleeper(300, project="pv"))).job
        await wait_running(a, loud.name)
        await wait_running(a, quiet.name)
    token = env.jwt(viewer)
    ch = security.user_channel(env.jm, token)
    try:
        stub = jgrpc.JobManagerServiceStub(ch)
        streams = {j.name: stub.StreamJobLogs(jms.StreamJobLogsRequest(name=j.name, follow=True))
                   for j in (loud, quiet)}
        # Both streams are open and the loud one delivers lines.
        first = await asyncio.wait_for(streams[quiet.name].read(), WAIT)
        assert first is not grpc.aio.EOF

        async def a_line() -> None:
            while not (await streams[loud.name].read()).entries:
                pass
        await asyncio.wait_for(a_line(), WAIT)

        async with as_caller(env.stack, admin_token()) as a:
            await a.access.delete_role_binding(binding.name)
        async with as_caller(env.stack, token) as v:
            await refused(v.jobs.get_job(loud.name), "NOT_FOUND", "JOB_NOT_FOUND")
        for name, stream in streams.items():
            err = await ends_with_error(stream, f"the log stream of {name}")
            assert code_and_reason(err) == ("NOT_FOUND", "JOB_NOT_FOUND"), err
            assert name in (err.details() or ""), err
    finally:
        await ch.close()
        async with as_caller(env.stack, admin_token()) as a:
            for j in (loud, quiet):
                with contextlib.suppress(DlschedRpcError):
                    await a.jobs.stop_job(j.name)


async def test_a_retried_request_id_does_not_outlive_the_role_it_was_made_with(env: Env) -> None:
    """SubmitJob retried with a request id answers the first job only to a caller who may
    still read it: after losing the role in its project, a member of another project gets
    REQUEST_ID_IN_USE (another caller's answer), not the job's state, spec and env."""
    user = f"replayer-{uuid.uuid4().hex[:6]}"
    rid = f"req-{uuid.uuid4().hex}"
    async with as_caller(env.stack, admin_token()) as a:
        lost = await a.access.create_role_binding(f"user:{user}", "pr1", "member")
        await a.access.create_role_binding(f"user:{user}", "pr2", "member")
    async with as_caller(env.stack, env.jwt(user)) as u:
        first = (await u.jobs.submit_job(sleeper(300, project="pr1"), request_id=rid)).job
        again = (await u.jobs.submit_job(sleeper(300, project="pr1"), request_id=rid)).job
        assert again.name == first.name  # a retry, while it may read the job
        async with as_caller(env.stack, admin_token()) as a:
            await a.access.delete_role_binding(lost.name)
        await refused(u.jobs.get_job(first.name), "NOT_FOUND", "JOB_NOT_FOUND")
        err = await refused(u.jobs.submit_job(sleeper(300, project="pr2"), request_id=rid),
                            "ALREADY_EXISTS", "REQUEST_ID_IN_USE")
        assert first.name not in str(err)
    async with as_caller(env.stack, admin_token()) as a:
        await a.jobs.stop_job(first.name)


async def test_a_revoked_token_ends_quiet_streams_at_their_heartbeat(env: Env) -> None:
    """No event, no line: a WatchJobs and a StreamJobLogs stream that only
    beat end UNAUTHENTICATED at a heartbeat once their API token is revoked."""
    from dlsched.v1 import job_manager_service_pb2_grpc as jgrpc

    sa = f"quiet-{uuid.uuid4().hex[:6]}"
    async with as_caller(env.stack, admin_token()) as a:
        await a.access.create_role_binding(f"sa:{sa}", "ph", "viewer")
        tok, secret = await a.access.create_api_token(sa)
        job = (await a.jobs.submit_job(sleeper(300, project="ph"))).job
        await wait_running(a, job.name)
        # Quiet: no other job changes while the streams wait (any job event
        # would end the watch at the event, not at a heartbeat).
        for j in await a.jobs.list_all_jobs():
            if j.name != job.name and j.state not in (
                    job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED):
                with contextlib.suppress(DlschedRpcError):
                    await a.jobs.stop_job(j.name)

        async def others_ended() -> bool:
            return all(j.name == job.name or j.state in (
                job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)
                for j in await a.jobs.list_all_jobs())
        await eventually(others_ended, "every other job ended")
    env.secrets.append(secret)
    ch = security.user_channel(env.jm, secret)
    try:
        stub = jgrpc.JobManagerServiceStub(ch)
        watch = stub.WatchJobs(jms.WatchJobsRequest())
        while (await asyncio.wait_for(watch.read(), WAIT)).type != job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            pass
        logs = stub.StreamJobLogs(jms.StreamJobLogsRequest(name=job.name, follow=True))
        assert await asyncio.wait_for(logs.read(), WAIT) is not grpc.aio.EOF
        async with as_caller(env.stack, admin_token()) as a:
            await a.access.delete_api_token(tok.name)
        err = await ends_with_error(watch, "the quiet watch",
                                    lambda ev: ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        err = await ends_with_error(logs, "the quiet log stream")
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    finally:
        await ch.close()
        async with as_caller(env.stack, admin_token()) as a:
            with contextlib.suppress(DlschedRpcError):
                await a.jobs.stop_job(job.name)


async def test_a_revoked_token_or_a_lost_role_ends_an_open_cluster_watch(env: Env) -> None:
    """WatchClusters re-checks its caller on every event: once its API token is
    revoked the stream ends UNAUTHENTICATED, once its only role binding is
    deleted PERMISSION_DENIED (as a new call would), before the next event."""
    from dlsched.v1 import cluster_manager_service_pb2_grpc as cgrpc

    tag = uuid.uuid4().hex[:6]
    async with as_caller(env.stack, admin_token()) as a:
        await a.access.create_role_binding(f"sa:cw-revoked-{tag}", "pc", "viewer")
        revoked, revoked_secret = await a.access.create_api_token(f"cw-revoked-{tag}")
        unbound = await a.access.create_role_binding(f"sa:cw-unbound-{tag}", "pc", "viewer")
        _, unbound_secret = await a.access.create_api_token(f"cw-unbound-{tag}")
    env.secrets += [revoked_secret, unbound_secret]

    def answers(secret: str, code: str | None) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            async with as_caller(env.stack, secret) as c:
                try:
                    await c.clusters.list_all_clusters()
                    return code is None
                except DlschedRpcError as err:
                    return err.code == code
        return check

    for secret in (revoked_secret, unbound_secret):  # ClusterManager learns of bindings by its watch
        await eventually(answers(secret, None), "ClusterManager takes the new API token")
    channels = [security.user_channel(env.stack.cm.address, s) for s in (revoked_secret, unbound_secret)]
    try:
        watches = [cgrpc.ClusterManagerServiceStub(ch).WatchClusters(cms.WatchClustersRequest())
                   for ch in channels]
        for w in watches:
            while (await asyncio.wait_for(w.read(), WAIT)).type != job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                pass
        async with as_caller(env.stack, admin_token()) as a:
            await a.access.delete_api_token(revoked.name)
            await a.access.delete_role_binding(unbound.name)
            # Once ClusterManager's own view has both changes, an event every watch gets.
            await eventually(answers(revoked_secret, "UNAUTHENTICATED"),
                             "ClusterManager refuses the revoked token")
            await eventually(answers(unbound_secret, "PERMISSION_DENIED"),
                             "ClusterManager refuses the caller without a role")
            before = await a.clusters.get_cluster(env.cluster)
            await a.clusters.update_cluster(cluster_pb2.Cluster(
                name=env.cluster, labels={**before.labels, "watch-probe": tag}), ["labels"])
            try:
                for w, want in zip(watches, ("UNAUTHENTICATED", "PERMISSION_DENIED"), strict=True):
                    err = await ends_with_error(
                        w, f"the cluster watch that should end {want}",
                        lambda ev: ev.cluster.labels.get("watch-probe") != tag)
                    assert err.code().name == want, err
            finally:
                await a.clusters.update_cluster(cluster_pb2.Cluster(
                    name=env.cluster, labels=dict(before.labels)), ["labels"])
    finally:
        for ch in channels:
            await ch.close()


async def test_a_quiet_cluster_watch_rechecks_its_caller_while_no_event_comes() -> None:
    """WatchClusters' events (``cluster_manager.servicer._events``) re-check the
    caller every ``recheck_seconds`` while none arrives: a quiet watch ends
    PERMISSION_DENIED once its caller has no role, UNAUTHENTICATED once its token
    is revoked, without an event. (In process: ClusterManager has no flag for
    the interval, 15 s; a real, empty subscription of a real hub.)"""
    from cluster_manager.hub import Subscription, WatchHub
    from cluster_manager.servicer import _events, _Sent
    from dlsched.auth.model import Principal, Role
    from dlsched.errors import DlschedError, PermissionDenied, Unauthenticated

    @dataclass
    class Now:  # the caller's roles and token as the access store would say now
        roles: dict[str, Role] = field(default_factory=lambda: {"pc": Role.VIEWER})
        revoked: bool = False

        def revalidate(self, p: Principal) -> Principal:
            if self.revoked:
                raise Unauthenticated("invalid or revoked token")
            return Principal(p.name, dict(self.roles), revalidate=p.revalidate)

        def lose_role(self) -> None:
            self.roles = {}

        def revoke(self) -> None:
            self.revoked = True

    hub = WatchHub(store=None)  # type: ignore[arg-type]  # never started: no etcd needed
    for how, error in (("lose_role", PermissionDenied), ("revoke", Unauthenticated)):
        now = Now()
        p = Principal("sa:quiet", dict(now.roles), revalidate=now.revalidate)
        sub = Subscription(hub, 10)
        sent = _Sent()
        events = _events(sub, p, 0.05, sent)
        try:
            for _ in range(3):  # re-checks pass, each a heartbeat (None): the caller is fine
                assert await asyncio.wait_for(events.__anext__(), WAIT) is None
                sent.mark()
            getattr(now, how)()
            with pytest.raises(DlschedError) as ei:
                while True:  # a heartbeat may be on its way; the next re-check ends the stream
                    assert await asyncio.wait_for(events.__anext__(), WAIT) is None
                    sent.mark()
            assert type(ei.value) is error, ei.value
        finally:
            await events.aclose()
            sub.close()


def test_audit_caps_unauthenticated_refusals_and_says_how_many_it_left_out(tmp_path) -> None:
    """An anonymous flood cannot grow the audit log without bound; authenticated
    lines are never dropped, and the next line counts what was left out."""
    import json as _json

    from dlsched.auth.audit import AuditLog

    now = [0.0]
    path = tmp_path / "audit.log"
    audit = AuditLog(str(path), unauthenticated_per_second=5, clock=lambda: now[0])
    for _ in range(100):
        audit.write(principal="unauthenticated", method="/m/DeleteJob", obj="x" * 300,
                    result="UNAUTHENTICATED")
    audit.write(principal="user:alice", method="/m/SubmitJob", obj="jobs/a", result="OK")
    now[0] += 10
    audit.write(principal="unauthenticated", method="/m/DeleteJob", obj="y", result="UNAUTHENTICATED")
    audit.close()
    lines = [_json.loads(x) for x in path.read_text().splitlines()]
    anon = [x for x in lines if x["principal"] == "unauthenticated"]
    assert len(anon) == 6  # the bucket's 5, then one after it refilled
    alice = next(x for x in lines if x["principal"] == "user:alice")
    assert alice["suppressed"] == 95 and alice["result"] == "OK"


def test_a_refused_create_is_audited_under_the_id_it_asked_for_not_a_name_it_chose() -> None:
    """A viewer's CreateCluster(cluster_id="evil", cluster.name="clusters/local") was audited as
    acting on clusters/local; a create's own name field is ignored by the service."""
    from dlsched.auth.audit import object_of
    from dlsched.v1 import access_pb2, cluster_pb2
    from dlsched.v1 import access_service_pb2 as apb
    from dlsched.v1 import cluster_manager_service_pb2 as cpb

    forged = cpb.CreateClusterRequest(cluster_id="evil", cluster=cluster_pb2.Cluster(name="clusters/local"))
    assert object_of(forged) == "clusters/evil"
    assert object_of(forged, cpb.CreateClusterResponse(cluster=cluster_pb2.Cluster(name="clusters/evil"))) \
        == "clusters/evil"
    assert object_of(apb.CreateRoleBindingRequest(role_binding=access_pb2.RoleBinding(name="roleBindings/admin"))) == ""
    assert object_of(cpb.UpdateClusterRequest(cluster=cluster_pb2.Cluster(name="clusters/a"))) == "clusters/a"
    assert object_of(cpb.DeleteClusterRequest(name="clusters/b")) == "clusters/b"
