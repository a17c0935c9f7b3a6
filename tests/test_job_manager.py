# ruff: noqa: ASYNC109, ASYNC110, ASYNC230  -- tests poll real processes and files
"""JobManager end to end: real etcd, the local driver, ClusterManager and JobManager
as separate processes (``tests.harness.Stack``), over real gRPC."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dlsched.kit import tokens
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack, pid_alive

S = job_pb2
PY = sys.executable
GRACE = 1.0
TERMINAL = {S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED}


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    st = Stack(etcd, f"/dlsched-jm-{uuid.uuid4().hex[:8]}/",
               jm_args=["--stop-grace-seconds", str(GRACE), "--log-level", "DEBUG"])
    try:
        st.start()
    except Exception:
        st.stop()
        raise
    yield st
    st.stop()
    assert st.jm is not None
    log = st.jm.log()
    if os.environ.get("JM_TEST_LOG"):
        open(os.environ["JM_TEST_LOG"], "w").write(log)
    # Nothing unhandled while serving (grpc prints a harmless CancelledError
    # traceback when the etcd watch stream closes at shutdown).
    serving = log.split("shutting down")[0]
    assert "Traceback" not in serving and " ERROR " not in serving, serving[-5000:]


@pytest.fixture(scope="module")
async def cluster(stack: Stack) -> str:
    return await stack.register_local()


@pytest.fixture
async def jm(stack: Stack, cluster: str) -> AsyncIterator[pb_grpc.JobManagerServiceStub]:
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        yield pb_grpc.JobManagerServiceStub(ch)


# ---------------------------------------------------------------- helpers

def program(code: str) -> list[str]:
    return [PY, "-u", "-c", textwrap.dedent(code)]


def single(code: str, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=program(code))], **kw)


def multi(code: str, replicas: int = 2, processes: int = 1, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=S.RUN_MODE_MULTI_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="worker", replicas=replicas, processes_per_replica=processes,
                             command=program(code))], **kw)


async def wait_state(jm: pb_grpc.JobManagerServiceStub, name: str, states: set[int],
                     timeout: float = 20) -> job_pb2.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = (await jm.GetJob(pb.GetJobRequest(name=name))).job
        if job.state in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stuck in {S.JobState.Name(job.state)}: {job}")
        await asyncio.sleep(0.1)


def uniq() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- tests

async def test_health_and_reflection(stack: Stack) -> None:
    """Every server of the stack is SERVING, overall and for its service, and
    reflection lists the three dlsched services between them."""
    assert stack.jm is not None
    listed: set[str] = set()
    for proc, service in ((stack.jm, "dlsched.v1.JobManagerService"),
                          (stack.cm, "dlsched.v1.ClusterManagerService"),
                          (stack.driver, "dlsched.v1.DriverService")):
        async with security.channel(proc.address) as ch:
            for name in ("", service):
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name))
                assert h.status == health_pb2.HealthCheckResponse.SERVING, (proc.address, name)
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name async for r in call for s in r.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names, names
            listed |= names
    assert {"dlsched.v1.JobManagerService", "dlsched.v1.ClusterManagerService",
            "dlsched.v1.DriverService"} <= listed


async def test_health_watch_and_client_side_health_checking_through_every_server(
        stack: Stack) -> None:
    """grpc_health's Watch writes with context.write() (a coroutine handler, not
    a generator): through every interceptor of every server it answers SERVING,
    and a round_robin channel with healthCheckConfig (client-side health
    checking, as the README recommends for replicas) can call each service."""
    import json

    from dlsched.kit import channel as channel_kit
    from dlsched.kit import tls as tls_kit
    from dlsched.kit.channel import TokenSource

    assert stack.jm is not None
    for proc, service in ((stack.jm, "dlsched.v1.JobManagerService"),
                          (stack.cm, "dlsched.v1.ClusterManagerService"),
                          (stack.driver, "dlsched.v1.DriverService")):
        async with security.channel(proc.address) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=30)
            first = await call.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING, (proc.address, first)
            call.cancel()
        cfg = {"loadBalancingConfig": [{"round_robin": {}}],
               "healthCheckConfig": {"serviceName": service}}
        sec = security.current()
        async with tls_kit.channel(
                f"ipv4:{proc.address}", sec.service_tls(), client_cert=True,
                token=TokenSource(token=sec.admin_token),
                extra_options=[("grpc.service_config", json.dumps(cfg))]) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
    assert channel_kit.MAX_MESSAGE_BYTES  # the kit's options came along


async def test_undecodable_requests_are_invalid_argument_on_every_server(stack: Stack) -> None:
    """Bytes that are not the method's request message (malformed protobuf, a
    string field that is not UTF-8) get INVALID_ARGUMENT / MALFORMED_REQUEST
    with a google.rpc.Status, unary and streaming, on every server."""
    assert stack.jm is not None
    garbage = b"\xff\xff\xff\xff"
    bad_utf8 = b"\x0a\x02\xc3\x28"  # field 1 (a string) = invalid UTF-8
    for proc, unary, stream in (
            (stack.jm, "/dlsched.v1.JobManagerService/GetJob",
             "/dlsched.v1.JobManagerService/StreamJobLogs"),
            (stack.cm, "/dlsched.v1.ClusterManagerService/GetCluster",
             "/dlsched.v1.ClusterManagerService/WatchClusters"),
            (stack.driver, "/dlsched.v1.DriverService/GetClusterInfo",
             "/dlsched.v1.DriverService/WatchJobObservations")):
        async with security.channel(proc.address) as ch:
            for payload in (garbage, bad_utf8):
                for kind, method in (("unary", unary), ("stream", stream)):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        if kind == "unary":
                            await ch.unary_unary(method)(payload, timeout=30)
                        else:
                            async for _ in ch.unary_stream(method)(payload, timeout=30):
                                pass
                    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload)
                    info = error_info(ei.value)
                    assert info is not None and info.reason == "MALFORMED_REQUEST", method


async def test_single_process_job_runs_to_success(jm: pb_grpc.JobManagerServiceStub) -> None:
    job = (await jm.SubmitJob(pb.SubmitJobRequest(
        job_id=uniq(), spec=single("print('hello')", labels={"suite": "jm"})))).job
    assert job.state in (S.JOB_STATE_PENDING, S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING,
                         S.JOB_STATE_SUCCEEDED)
    assert job.cluster == "clusters/local" and job.attempt == 1 and job.uid
    assert job.labels["suite"] == "jm" and job.HasField("create_time")
    done = await wait_state(jm, job.name, TERMINAL)
    assert done.state == S.JOB_STATE_SUCCEEDED and done.exit_code == 0
    assert done.backend_job_id and done.HasField("end_time")


async def test_failing_job_reports_exit_code(jm: pb_grpc.JobManagerServiceStub) -> None:
    job = (await jm.SubmitJob(pb.SubmitJobRequest(spec=single("raise SystemExit(3)")))).job
    assert job.name.startswith("jobs/job-")  # server-generated id
    done = await wait_state(jm, job.name, TERMINAL)
    assert done.state == S.JOB_STATE_FAILED and done.exit_code == 3


async def test_multi_process_job_runs_to_success(jm: pb_grpc.JobManagerServiceStub) -> None:
    code = "import time; time.sleep(0.5); print('ok')"
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=multi(code, 2, 2)))).job
    running = await wait_state(jm, job.name, {S.JOB_STATE_RUNNING} | TERMINAL)
    assert running.state == S.JOB_STATE_RUNNING
    done = await wait_state(jm, job.name, TERMINAL)
    assert done.state == S.JOB_STATE_SUCCEEDED and done.exit_code == 0
    assert len(done.replicas) in (2, 4)  # per replica or per process, as the driver reports
    assert all(r.state == S.REPLICA_STATE_SUCCEEDED for r in done.replicas)


async def test_logs_follow_line_by_line_and_tail(jm: pb_grpc.JobManagerServiceStub) -> None:
    code = """
        import time
        for i in range(5):
            print(f"line-{i}", flush=True)
            time.sleep(0.4)
    """
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=single(code)))).job
    got: list[tuple[float, str]] = []
    t0 = time.monotonic()
    async for resp in jm.StreamJobLogs(pb.StreamJobLogsRequest(name=job.name, follow=True),
                                       timeout=30):
        for e in resp.entries:
            if e.stream == S.LOG_STREAM_STDOUT:
                got.append((time.monotonic() - t0, e.text))
    # The stream ended by itself (no timeout) once the job ended.
    assert [t for _, t in got] == [f"line-{i}" for i in range(5)]
    assert got[-1][0] - got[0][0] > 1.0, f"lines arrived in one batch: {got}"
    done = await wait_state(jm, job.name, TERMINAL, timeout=5)
    assert done.state == S.JOB_STATE_SUCCEEDED
    tail = [e.text async for r in jm.StreamJobLogs(
        pb.StreamJobLogsRequest(name=job.name, tail_lines=2, streams=[S.LOG_STREAM_STDOUT]))
        for e in r.entries]
    assert tail == ["line-3", "line-4"]


async def test_logs_of_a_role_or_replica_the_job_lacks_are_invalid_argument(jm: pb_grpc.JobManagerServiceStub) -> None:
    """As ``kubectl logs -c`` of a container the pod lacks: the field named, not a stream with no lines."""
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=multi("print('x')", 2, 2)))).job
    role = job.spec.replica_groups[0].role
    await wait_state(jm, job.name, TERMINAL)
    for req, field, words in (
            (pb.StreamJobLogsRequest(name=job.name, role="nosuchrole"), "role", f"its roles: {role}"),
            (pb.StreamJobLogsRequest(name=job.name, role=role, replica_index=4), "replica_index", "0 to 3"),
            (pb.StreamJobLogsRequest(name=job.name, replica_index=99), "replica_index", "0 to 3")):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [r async for r in jm.StreamJobLogs(req, timeout=30)]
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert field in ei.value.details() and words in ei.value.details(), ei.value.details()
    lines = [e.text async for r in jm.StreamJobLogs(pb.StreamJobLogsRequest(
        name=job.name, role=role, replica_index=3, streams=[S.LOG_STREAM_STDOUT])) for e in r.entries]
    assert lines == ["x"]


async def test_stop_running_multi_process_job(jm: pb_grpc.JobManagerServiceStub) -> None:
    pid_dir = tempfile.mkdtemp(prefix="jm-stop-")
    code = f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join({pid_dir!r}, str(os.getpid())), "w").close()
        while True:
            time.sleep(0.1)
    """
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=multi(code, 2, 2)))).job
    await wait_state(jm, job.name, {S.JOB_STATE_RUNNING})
    deadline = time.monotonic() + 60
    while len(os.listdir(pid_dir)) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert len(pids) == 4
    usage = (await jm.GetJobUsage(pb.GetJobUsageRequest(name=job.name))).usage
    assert usage.replicas and any(r.running for r in usage.replicas)
    t0 = time.monotonic()
    stopped = (await jm.StopJob(pb.StopJobRequest(name=job.name))).job
    assert stopped.state in (S.JOB_STATE_STOPPING, S.JOB_STATE_STOPPED)

    while any(pid_alive(p) for p in pids) and time.monotonic() - t0 < GRACE + 1.0:
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - t0
    assert not [p for p in pids if pid_alive(p)], f"processes outlived grace + 1 s ({elapsed:.2f}s)"
    print(f"all processes gone {elapsed:.2f}s after StopJob")
    done = await wait_state(jm, job.name, TERMINAL, timeout=10)
    assert done.state == S.JOB_STATE_STOPPED
    again = (await jm.StopJob(pb.StopJobRequest(name=job.name))).job
    assert again.state == S.JOB_STATE_STOPPED and again.etag == done.etag


async def test_failed_attempt_is_retried(jm: pb_grpc.JobManagerServiceStub) -> None:
    marker = os.path.join(tempfile.mkdtemp(prefix="jm-retry-"), "attempts")
    code = f"""
        import os
        n = len(open({marker!r}).read()) if os.path.exists({marker!r}) else 0
        open({marker!r}, "a").write("x")
        raise SystemExit(0 if n >= 1 else 7)
    """
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(),
                                                  spec=single(code, max_retries=2)))).job
    done = await wait_state(jm, job.name, TERMINAL)
    assert done.state == S.JOB_STATE_SUCCEEDED and done.attempt == 2 and done.exit_code == 0
    assert open(marker).read() == "xx"
    no_retry = (await jm.SubmitJob(pb.SubmitJobRequest(spec=single("raise SystemExit(5)")))).job
    failed = await wait_state(jm, no_retry.name, TERMINAL)
    assert failed.state == S.JOB_STATE_FAILED and failed.attempt == 1


async def test_same_request_id_runs_once(jm: pb_grpc.JobManagerServiceStub) -> None:
    marker = os.path.join(tempfile.mkdtemp(prefix="jm-dedup-"), "runs")
    spec = single(f"open({marker!r}, 'a').write('ran\\n')")
    rid = f"req-{uuid.uuid4().hex}"
    first = (await jm.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=rid))).job
    again = (await jm.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=rid))).job
    assert again.name == first.name and again.uid == first.uid

    rid2 = f"req-{uuid.uuid4().hex}"
    marker2 = os.path.join(os.path.dirname(marker), "runs2")
    spec2 = single(f"open({marker2!r}, 'a').write('ran\\n')")
    conc = f"conc-{uuid.uuid4().hex[:6]}"
    results = await asyncio.gather(*(jm.SubmitJob(pb.SubmitJobRequest(
        job_id=conc, spec=spec2, request_id=rid2)) for _ in range(8)))
    names = {r.job.name for r in results}
    assert names == {f"jobs/{conc}"}
    # The request id of another job_id's request is refused (as CreateCluster refuses
    # it), not answered with a job the caller did not name; nothing is stored for it.
    other = f"other-{uuid.uuid4().hex[:6]}"
    for rid_used, made in ((rid2, conc), (rid, first.name.removeprefix("jobs/"))):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.SubmitJob(pb.SubmitJobRequest(job_id=other, spec=spec2, request_id=rid_used))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(ei.value)] == ["request_id"]
        assert f"jobs/{made}" in (ei.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(pb.GetJobRequest(name=f"jobs/{other}"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    for name in (first.name, names.pop()):
        assert (await wait_state(jm, name, TERMINAL)).state == S.JOB_STATE_SUCCEEDED
    await asyncio.sleep(0.5)
    assert open(marker).read() == "ran\n"
    assert open(marker2).read() == "ran\n"


async def _events(call: grpc.aio.UnaryStreamCall, out: list[pb.WatchJobsResponse],
                  until: callable) -> None:  # type: ignore[valid-type]
    async for ev in call:
        out.append(ev)
        if until(out):
            return


async def test_watch_resume_has_no_gap_and_no_duplicate(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    tag = uniq()
    flt = f"labels.watch={tag}"
    ids = [f"{tag}-{i}" for i in range(3)]

    def finished(evs: list[pb.WatchJobsResponse]) -> bool:
        done = {e.job.name for e in evs if e.job.state == S.JOB_STATE_SUCCEEDED}
        return done >= {f"jobs/{i}" for i in ids}

    cont: list[pb.WatchJobsResponse] = []
    cont_call = jm.WatchJobs(pb.WatchJobsRequest(filter=flt))
    cont_task = asyncio.create_task(_events(cont_call, cont, finished))
    part1: list[pb.WatchJobsResponse] = []
    call1 = jm.WatchJobs(pb.WatchJobsRequest(filter=flt))
    while not any(e.type == S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE for e in cont):
        await asyncio.sleep(0.05)

    async def first_created() -> None:
        await _events(call1, part1, lambda evs: any(e.type == S.WATCH_EVENT_TYPE_CREATED
                                                    for e in evs))
    reader = asyncio.create_task(first_created())
    for i in ids:
        await jm.SubmitJob(pb.SubmitJobRequest(job_id=i, spec=single(
            "import time; time.sleep(0.3)", labels={"watch": tag})))
    await asyncio.wait_for(reader, 60)
    call1.cancel()  # disconnect while events keep happening
    await asyncio.sleep(1.0)
    token = part1[-1].resume_token
    part2: list[pb.WatchJobsResponse] = []
    call2 = jm.WatchJobs(pb.WatchJobsRequest(filter=flt, resume_token=token))
    await asyncio.wait_for(_events(call2, part2, lambda evs: finished(part1 + evs)), 30)
    call2.cancel()
    await asyncio.wait_for(cont_task, 30)
    cont_call.cancel()

    def changes(evs: list[pb.WatchJobsResponse]) -> list[tuple[str, int, str]]:
        return [(e.job.name, e.job.state, e.job.etag) for e in evs
                if e.type in (S.WATCH_EVENT_TYPE_CREATED, S.WATCH_EVENT_TYPE_UPDATED)]

    resumed = changes(part1) + changes(part2)
    assert all(e.type != S.WATCH_EVENT_TYPE_EXISTING for e in part2)  # no second snapshot
    assert len(resumed) == len(set(resumed)), "duplicate events after resume"
    assert resumed == changes(cont)[:len(resumed)]
    assert {(n, s) for n, s, _ in resumed} == {(n, s) for n, s, _ in changes(cont)}
    assert {n for n, _, _ in resumed} == {f"jobs/{i}" for i in ids}


async def test_a_job_that_stops_matching_a_watch_filter_is_sent_once_with_its_new_state(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    """A watch filtered on state=RUNNING gets the job's end (UPDATED, SUCCEEDED): a view kept
    from the stream showed the job RUNNING for ever, while ListJobs with the filter did not list
    it. A stream resumed from before the end gets the same event."""
    tag = uniq()
    flt = f"state=RUNNING AND labels.leave={tag}"
    events: list[pb.WatchJobsResponse] = []
    call = jm.WatchJobs(pb.WatchJobsRequest(filter=flt), timeout=120)
    await asyncio.wait_for(_events(call, events, lambda evs: any(
        e.type == S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE for e in evs)), 60)
    name = (await jm.SubmitJob(pb.SubmitJobRequest(spec=single(
        "import time; time.sleep(1.5)", labels={"leave": tag})))).job.name
    await asyncio.wait_for(_events(call, events, lambda evs: any(
        e.job.name == name and e.job.state == S.JOB_STATE_SUCCEEDED for e in evs)), 90)
    call.cancel()
    mine = [(e.type, e.job.state) for e in events if e.job.name == name]
    assert mine[-1] == (S.WATCH_EVENT_TYPE_UPDATED, S.JOB_STATE_SUCCEEDED), mine
    assert [st for _, st in mine[:-1]] and all(st == S.JOB_STATE_RUNNING for _, st in mine[:-1]), mine
    before_end = next(e for e in reversed(events) if e.job.name == name and e.job.state == S.JOB_STATE_RUNNING)
    again = jm.WatchJobs(pb.WatchJobsRequest(filter=flt, resume_token=before_end.resume_token), timeout=60)
    resumed: list[pb.WatchJobsResponse] = []
    await asyncio.wait_for(_events(again, resumed, lambda evs: any(e.job.name == name for e in evs)), 60)
    again.cancel()
    got = [e for e in resumed if e.job.name == name]
    assert (got[0].type, got[0].job.state) == (S.WATCH_EVENT_TYPE_UPDATED, S.JOB_STATE_SUCCEEDED), got[0]


async def test_a_watch_cut_mid_snapshot_resumes_with_the_whole_snapshot(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    """Resumed with the token of an EXISTING event (cut after the first of three), the stream
    sends the snapshot again: every job, then SNAPSHOT_COMPLETE. Each EXISTING event carried
    the snapshot's revision, so the resume went on after it and the other two never came."""
    tag = uniq()
    flt = f"labels.cut={tag}"
    names = {(await jm.SubmitJob(pb.SubmitJobRequest(spec=single("pass", labels={"cut": tag})))).job.name
             for _ in range(3)}
    call = jm.WatchJobs(pb.WatchJobsRequest(filter=flt), timeout=60)
    first = await call.read()
    assert first.type == S.WATCH_EVENT_TYPE_EXISTING
    call.cancel()
    resumed: list[pb.WatchJobsResponse] = []
    again = jm.WatchJobs(pb.WatchJobsRequest(filter=flt, resume_token=first.resume_token), timeout=60)
    await asyncio.wait_for(_events(again, resumed, lambda evs: any(
        e.type == S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE for e in evs)), 30)
    again.cancel()
    assert {e.job.name for e in resumed if e.type == S.WATCH_EVENT_TYPE_EXISTING} == names
    # The snapshot's end token resumes after it, with no second snapshot.
    token = resumed[-1].resume_token
    after = jm.WatchJobs(pb.WatchJobsRequest(filter=flt, resume_token=token), timeout=60)
    ev = await asyncio.wait_for(after.read(), 60)  # a change of a job, or a heartbeat (15 s)
    after.cancel()
    assert ev.type in (S.WATCH_EVENT_TYPE_UPDATED, S.WATCH_EVENT_TYPE_HEARTBEAT)


async def test_bad_input_is_invalid_argument_and_stores_nothing(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    tag = uniq()
    labels = {"bad": tag}
    ok = job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])
    cases: list[tuple[job_pb2.JobSpec, str]] = [
        (job_pb2.JobSpec(replica_groups=[ok], labels=labels), "spec.run_mode"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MULTI_PROCESS, labels=labels, replica_groups=[
            job_pb2.ReplicaGroup(role="worker", replicas=0, command=["true"])]),
         "spec.replica_groups[0].replicas"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MULTI_PROCESS, labels=labels, replica_groups=[
            job_pb2.ReplicaGroup(role="worker", replicas=-2, command=["true"])]),
         "spec.replica_groups[0].replicas"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MULTI_PROCESS, labels=labels, replica_groups=[
            job_pb2.ReplicaGroup(role="ps", replicas=1, command=["true"])]),
         "spec.replica_groups[0].role"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, labels=labels, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"],
                                 args=["x" * 1000] * 300)]), "spec"),
    ]
    def group(role: str, replicas: int = 1) -> job_pb2.ReplicaGroup:
        return job_pb2.ReplicaGroup(role=role, replicas=replicas, command=["true"])

    cases += [  # the roles each distributed mode allows and needs
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, labels=labels,
                         replica_groups=[group("master", 2), group("worker")]), "spec.replica_groups[0].replicas"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, labels=labels,
                         replica_groups=[group("worker", 2)]), "spec.replica_groups"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, labels=labels,
                         replica_groups=[group("worker", 2)]), "spec.replica_groups"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, labels=labels,
                         replica_groups=[group("ps"), group("worker"), group("master")]),
         "spec.replica_groups[2].role"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MPI, labels=labels,
                         replica_groups=[group("launcher", 2), group("worker")]), "spec.replica_groups[0].replicas"),
        (job_pb2.JobSpec(run_mode=S.RUN_MODE_MPI, labels=labels,
                         replica_groups=[group("worker", 2)]), "spec.replica_groups"),
    ]
    for spec, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=uniq()))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in [v.field for v in field_violations(ei.value)], field

    for bad_id in ("Upper", "has_underscore", "-leading", "x" * 64, "jobs/x", "a b"):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.SubmitJob(pb.SubmitJobRequest(job_id=bad_id, spec=single("pass", labels=labels)))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad_id
        assert [v.field for v in field_violations(ei.value)] == ["job_id"], bad_id

    unknown = single("pass", labels=labels)
    unknown.cluster_selector.cluster = "clusters/nope"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.SubmitJob(pb.SubmitJobRequest(spec=unknown))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert any("cluster" in v.field for v in field_violations(ei.value))

    for call, req in ((jm.GetJob, pb.GetJobRequest(name="job/x")),
                      (jm.StopJob, pb.StopJobRequest(name="jobs/Not_Valid")),
                      (jm.DeleteJob, pb.DeleteJobRequest(name="x"))):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(req)  # type: ignore[operator]
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(ei.value)] == ["name"]

    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.ListJobs(pb.ListJobsRequest(filter="colour=red"))
    assert [v.field for v in field_violations(ei.value)] == ["filter"]
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(pb.GetJobRequest(name="jobs/does-not-exist"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(ei.value).reason == "JOB_NOT_FOUND"  # type: ignore[union-attr]

    listed = await jm.ListJobs(pb.ListJobsRequest(filter=f"labels.bad={tag}"))
    assert list(listed.jobs) == []


async def test_too_many_gpus_is_no_matching_cluster(jm: pb_grpc.JobManagerServiceStub) -> None:
    spec = single("pass")
    spec.replica_groups[0].resources.gpus = 512
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.SubmitJob(pb.SubmitJobRequest(spec=spec))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "NO_MATCHING_CLUSTER"  # type: ignore[union-attr]


async def test_dry_run_renders_and_stores_nothing(jm: pb_grpc.JobManagerServiceStub) -> None:
    job_id = uniq()
    resp = await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=single("pass"),
                                                  dry_run=True, request_id=uniq()))
    assert resp.dry_run.cluster == "clusters/local"
    assert resp.dry_run.native_spec.content and resp.dry_run.native_spec.media_type
    assert resp.dry_run.candidates and resp.dry_run.candidates[0].cluster == "clusters/local"
    assert resp.job.name == f"jobs/{job_id}"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(pb.GetJobRequest(name=f"jobs/{job_id}"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_dry_run_answers_the_errors_the_call_would(jm: pb_grpc.JobManagerServiceStub) -> None:
    """AIP-163: validate-only answers what the real request would: a job id taken is
    ALREADY_EXISTS, a request id used for another job id INVALID_ARGUMENT (a dry run said OK)."""
    job_id, request_id = uniq(), uniq()
    first = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=single("pass"),
                                                    request_id=request_id))).job
    for req, code, field in ((pb.SubmitJobRequest(job_id=job_id, spec=single("pass"), dry_run=True),
                              grpc.StatusCode.ALREADY_EXISTS, None),
                             (pb.SubmitJobRequest(job_id=uniq(), spec=single("pass"), dry_run=True,
                                                  request_id=request_id),
                              grpc.StatusCode.INVALID_ARGUMENT, "request_id")):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.SubmitJob(req)
        assert ei.value.code() == code, ei.value
        if field:
            assert [v.field for v in field_violations(ei.value)] == [field]
    # a retry of the request that made it is no error, dry or not
    again = await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=single("pass"), dry_run=True,
                                                   request_id=request_id))
    assert again.job.name == f"jobs/{job_id}" and again.job.uid == first.uid  # the job the retry gets
    # without a job id too: the retry's answer is the first job, not a new name
    unnamed = await jm.SubmitJob(pb.SubmitJobRequest(spec=single("pass"), dry_run=True, request_id=request_id))
    assert unnamed.job.name == f"jobs/{job_id}" and unnamed.job.uid == first.uid
    assert unnamed.dry_run.cluster  # and the placement the spec would get now, rendered for that job
    assert job_id in unnamed.dry_run.native_spec.content, unnamed.dry_run.native_spec.content[:300]


async def test_list_paging_and_delete(jm: pb_grpc.JobManagerServiceStub) -> None:
    tag = uniq()
    names = []
    for i in range(3):
        j = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"{tag}-{i}", spec=single(
            "pass", labels={"page": tag})))).job
        names.append(j.name)
    seen: list[str] = []
    token = ""
    while True:
        r = await jm.ListJobs(pb.ListJobsRequest(page_size=2, page_token=token,
                                                 filter=f"labels.page={tag}"))
        seen += [j.name for j in r.jobs]
        if r.next_page_token and not token:  # AIP-158: a token goes with its own filter only
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await jm.ListJobs(pb.ListJobsRequest(page_size=2, page_token=r.next_page_token))
            assert other.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "another filter" in (other.value.details() or "")
            # the same position as an older server's p1 token (which named no filter): refused
            # with any filter, the one it was taken from included
            _, _, position = (tokens.decode(r.next_page_token) or "").split(":", 2)
            for text in ("", f"labels.page={tag}"):
                with pytest.raises(grpc.aio.AioRpcError) as legacy:
                    await jm.ListJobs(pb.ListJobsRequest(page_size=2, filter=text,
                                                         page_token=tokens.encode(f"p1:{position}")))
                assert legacy.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
        token = r.next_page_token
        if not token:
            break
    assert seen == names[::-1]  # newest first
    for n in names:
        await wait_state(jm, n, TERMINAL)
        last = await jm.DeleteJob(pb.DeleteJobRequest(name=n))
        assert last.job.name == n
    assert not (await jm.ListJobs(pb.ListJobsRequest(filter=f"labels.page={tag}"))).jobs
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.DeleteJob(pb.DeleteJobRequest(name=names[0]))
    assert error_info(ei.value).reason == "JOB_NOT_FOUND"  # type: ignore[union-attr]
    assert not (await jm.DeleteJob(pb.DeleteJobRequest(name=names[0], allow_missing=True))).HasField("job")


async def test_a_page_of_large_jobs_stays_under_the_response_limit(jm: pb_grpc.JobManagerServiceStub) -> None:
    """Jobs of ~190 KB (specs may be 256 KiB): the default page of 100 would be over the 8 MiB a
    response may carry (RESOURCE_EXHAUSTED for every page); pages stop at 4 MiB instead, each
    with a token, and every job comes once."""
    tag = uniq()
    big = ["x" * (63 * 1024)] * 3
    names = set()
    for i in range(45):
        spec = job_pb2.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, labels={"big": tag}, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=[*program("pass"), *big])])
        names.add((await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"{tag}-{i}", spec=spec))).job.name)
    seen: list[str] = []
    token, pages = "", 0
    while True:
        r = await jm.ListJobs(pb.ListJobsRequest(page_token=token, filter=f"labels.big={tag}"))
        assert r.ByteSize() <= (4 << 20) + 300 * 1024, r.ByteSize()  # the budget, past it by one job at most
        seen += [j.name for j in r.jobs]
        pages += 1
        token = r.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(names) and pages >= 3
    for n in names:
        await wait_state(jm, n, TERMINAL)
        await jm.DeleteJob(pb.DeleteJobRequest(name=n))


async def test_a_request_id_makes_a_new_job_once_its_job_is_deleted(jm: pb_grpc.JobManagerServiceStub) -> None:
    """The request key goes with its job: a SubmitJob with the request id of a deleted job makes
    the new job at once (it was ABORTED "names deleted job; retry" until the archiver's sweep)."""
    rid = f"req-{uniq()}"
    first = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), request_id=rid, spec=single("pass")))).job
    await wait_state(jm, first.name, TERMINAL)
    await jm.DeleteJob(pb.DeleteJobRequest(name=first.name))
    second_id = uniq()
    second = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=second_id, request_id=rid, spec=single("pass")))).job
    assert second.name == f"jobs/{second_id}" and second.uid != first.uid
    again = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=second_id, request_id=rid, spec=single("pass")))).job
    assert again.uid == second.uid  # a retry of it: that job, not a third


async def test_delete_with_an_etag_changes_nothing_unless_it_matches(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    """DeleteJob's etag (AIP-154): a stale one is ABORTED and the job neither stopped nor
    deleted; a garbage one is INVALID_ARGUMENT naming it; the current one deletes."""
    running = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=single(
        "import time; time.sleep(600)")))).job
    running = await wait_state(jm, running.name, {S.JOB_STATE_RUNNING})
    stale = str(int(running.etag) - 1)
    for bad in ("abc", "0", "-1", "1" * 30, " 12"):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.DeleteJob(pb.DeleteJobRequest(name=running.name, etag=bad))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert [v.field for v in field_violations(ei.value)] == ["etag"], bad
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.DeleteJob(pb.DeleteJobRequest(name=running.name, etag=stale))
    assert ei.value.code() == grpc.StatusCode.ABORTED
    assert error_info(ei.value).reason == "ETAG_MISMATCH"  # type: ignore[union-attr]
    # One this service never returned (past every write): INVALID_ARGUMENT, no retry gets past it.
    for never in ("999999999999", str(int(running.etag) + 10_000_000)):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await jm.DeleteJob(pb.DeleteJobRequest(name=running.name, etag=never))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, never
        assert [v.field for v in field_violations(ei.value)] == ["etag"], never
    still = (await jm.GetJob(pb.GetJobRequest(name=running.name))).job
    assert still.state == S.JOB_STATE_RUNNING and still.etag == running.etag  # not even stopped
    last = (await jm.DeleteJob(pb.DeleteJobRequest(name=running.name, etag=running.etag))).job
    assert last.name == running.name and last.state in TERMINAL | {S.JOB_STATE_STOPPING}
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(pb.GetJobRequest(name=running.name))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND

    ended = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=single("print('hi')")))).job
    ended = await wait_state(jm, ended.name, TERMINAL)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.DeleteJob(pb.DeleteJobRequest(name=ended.name, etag=str(int(ended.etag) - 1)))
    assert ei.value.code() == grpc.StatusCode.ABORTED
    # A never-returned one on an ended job: refused before anything is cleaned up (its logs stay).
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.DeleteJob(pb.DeleteJobRequest(name=ended.name, etag="999999999999"))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    logs = [e.text async for r in jm.StreamJobLogs(pb.StreamJobLogsRequest(name=ended.name)) for e in r.entries]
    assert logs == ["hi"], logs
    assert (await jm.GetJob(pb.GetJobRequest(name=ended.name))).job.etag == ended.etag
    last = (await jm.DeleteJob(pb.DeleteJobRequest(name=ended.name, etag=ended.etag))).job
    assert last.etag == ended.etag
    # Gone: with allow_missing, any etag answers an empty response.
    assert not (await jm.DeleteJob(pb.DeleteJobRequest(
        name=ended.name, etag=ended.etag, allow_missing=True))).HasField("job")


async def _snapshot_token(jm: pb_grpc.JobManagerServiceStub) -> str:
    """The resume token of a fresh WatchJobs snapshot (the stream then closed)."""
    call = jm.WatchJobs(pb.WatchJobsRequest(), timeout=60)
    try:
        async for ev in call:
            if ev.type == S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                return str(ev.resume_token)
        raise AssertionError("the watch ended before its snapshot")
    finally:
        call.cancel()


async def test_expired_token_is_out_of_range(stack: Stack, cluster: str, etcd: EtcdServer) -> None:
    # A second JobManager with a 5-event buffer, on a prefix of its own.
    small = ServiceProcess("job_manager", ["--etcd", etcd.endpoint, "--prefix",
                                           f"/dlsched-jm-small-{uuid.uuid4().hex[:6]}/",
                                           "--cluster-manager", stack.cm.address,
                                           "--watch-buffer", "5"], name="jm-small").start()
    try:
        async with security.channel(small.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            token = await _snapshot_token(jm)
            for i in range(4):
                j = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"x{i}", spec=single("pass")))).job
                await jm.StopJob(pb.StopJobRequest(name=j.name))
                await jm.DeleteJob(pb.DeleteJobRequest(name=j.name, allow_missing=True))
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in jm.WatchJobs(pb.WatchJobsRequest(resume_token=token)):
                    pass
            assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert error_info(ei.value).reason == "WATCH_TOKEN_EXPIRED"  # type: ignore[union-attr]
    finally:
        small.stop()


async def test_a_token_from_the_future_is_out_of_range(stack: Stack, cluster: str) -> None:
    """A resume token past etcd's revision (of an etcd restored or replaced) is refused, as
    WatchClusters refuses one: subscribed, it skipped every event up to it, silently."""
    from job_manager.watch import decode_token, encode_token

    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        jm = pb_grpc.JobManagerServiceStub(ch)
        token = await _snapshot_token(jm)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in jm.WatchJobs(pb.WatchJobsRequest(resume_token=encode_token(decode_token(token) + 1000)),
                                        timeout=30):
                pass
        assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert error_info(ei.value).reason == "WATCH_TOKEN_EXPIRED"  # type: ignore[union-attr]
        # The snapshot's own token resumes, and the next job comes through it.
        resumed = jm.WatchJobs(pb.WatchJobsRequest(resume_token=token), timeout=60)
        name = (await jm.SubmitJob(pb.SubmitJobRequest(spec=single("pass")))).job.name
        async for ev in resumed:
            if ev.job.name == name:
                break
        resumed.cancel()


async def test_jobs_survive_job_manager_sigkill(stack: Stack, cluster: str) -> None:
    assert stack.jm is not None
    mdir = tempfile.mkdtemp(prefix="jm-restart-")
    code = f"""
        import os, sys, time
        open(os.path.join({mdir!r}, sys.argv[1]), "a").write("start\\n")
        time.sleep(2.5)
        print("done")
    """
    names = []
    async with security.channel(stack.jm.address) as ch:
        jm = pb_grpc.JobManagerServiceStub(ch)
        for i in range(3):
            spec = single(code)
            spec.replica_groups[0].args.append(f"m{i}")
            names.append((await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"{uniq()}-{i}",
                                                                 spec=spec))).job.name)
        for n in names:
            await wait_state(jm, n, {S.JOB_STATE_RUNNING})
    stack.restart_jm(kill=True)
    async with security.channel(stack.jm.address) as ch:
        jm = pb_grpc.JobManagerServiceStub(ch)
        for n in names:
            done = await wait_state(jm, n, TERMINAL, timeout=30)
            assert done.state == S.JOB_STATE_SUCCEEDED and done.exit_code == 0, done
            assert done.attempt == 1
    await asyncio.sleep(0.5)
    for i in range(3):
        assert open(os.path.join(mdir, f"m{i}")).read() == "start\n"


async def test_a_cluster_with_a_running_job_is_not_deleted_until_the_job_has_ended(
        stack: Stack, jm: pb_grpc.JobManagerServiceStub) -> None:
    """A stranger's find: DeleteCluster under a running job, then StopJob and DeleteJob answered
    OK while its process ran on, out of every API's reach. The driver refuses to forget a cluster
    whose jobs it still runs: FAILED_PRECONDITION CLUSTER_HAS_JOBS; once the job ended, the delete
    goes through."""
    from dlsched.client import ClusterManagerClient
    from dlsched.v1 import cluster_manager_service_pb2 as cm_pb

    spare = await stack.register_local("spare")
    spec = single("import time; time.sleep(600)")
    spec.cluster_selector.cluster = spare
    job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=uniq(), spec=spec))).job
    await wait_state(jm, job.name, {S.JOB_STATE_RUNNING})
    async with ClusterManagerClient(stack.cm.address) as cm:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await cm.stub.DeleteCluster(cm_pb.DeleteClusterRequest(name=spare), timeout=30)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value
        assert "CLUSTER_HAS_JOBS" in str(ei.value.trailing_metadata()) or "unfinished" in ei.value.details()
        assert (await cm.get_cluster("spare")).name == spare
        await jm.StopJob(pb.StopJobRequest(name=job.name))
        await wait_state(jm, job.name, TERMINAL)
        deadline = time.monotonic() + 60
        while True:  # (the driver forgets the job once JobManager has recorded its end)
            try:
                await cm.stub.DeleteCluster(cm_pb.DeleteClusterRequest(name=spare), timeout=30)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, e
                await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await cm.stub.GetCluster(cm_pb.GetClusterRequest(name=spare), timeout=30)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_working_dir_the_chosen_clusters_driver_refuses_is_refused_at_submit(
        jm: pb_grpc.JobManagerServiceStub) -> None:
    """A hostile corpus's find: a relative working_dir leading out of the attempt directory passed
    SubmitJob, then the local driver refused the launch (FAILED LaunchRejected). The chosen
    cluster's type rules run at SubmitJob: INVALID_ARGUMENT naming the field, nothing stored."""
    from dlsched import spec_rules
    from job_manager.domain.model import JobSpec, ReplicaGroup

    job_id = uniq()
    spec = single("print(1)")
    spec.replica_groups[0].working_dir = "../../../../tmp"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=spec))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.replica_groups[0].working_dir" in ei.value.details(), ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(pb.GetJobRequest(name=f"jobs/{job_id}"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    spec.replica_groups[0].working_dir = "inside/../here"  # stays inside: taken (a dry run)
    assert (await jm.SubmitJob(pb.SubmitJobRequest(spec=spec, dry_run=True))).dry_run.cluster
    # Kubernetes: a container's workingDir must be absolute (MPI workers run sshd, not the command)
    k8s = JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1, command=["x"],
                                                           working_dir="rel")])
    assert [v.field for v in spec_rules.check_for_cluster_type(k8s, 3)] == ["spec.replica_groups[0].working_dir"]
    assert spec_rules.check_for_cluster_type(k8s, 4) == []  # (Ray: a path on its nodes)
    mpi = JobSpec(run_mode=spec_rules.MPI, replica_groups=[
        ReplicaGroup(role="launcher", replicas=1, command=["x"], working_dir="/abs"),
        ReplicaGroup(role="worker", replicas=2, command=["x"], working_dir="rel")])
    assert spec_rules.check_for_cluster_type(mpi, 3) == []
