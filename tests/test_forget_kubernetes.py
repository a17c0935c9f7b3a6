"""ForgetJobs on the Kubernetes driver (issue 18 item 4): an ended job JobManager has recorded leaves
the driver's memory; its record goes on its Service (annotation ``dlsched.io/final``) and its pods
get the label ``dlsched.io/recorded`` that the pod watch selects out, so neither this driver (a
re-list, a re-watch) nor a restarted one tracks it again. Observations, logs, usage, stop and
cleanup still answer for it, from the API server; a relaunch (higher attempt) still works. kmock's
API emulator over real HTTP (it applies no label selector: the driver's own check is what holds),
the driver as a real process over real gRPC; the memory measure runs the driver in this process."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
import types
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import driver_service_pb2_grpc, job_pb2  # noqa: E402
from drivers.common.base import (  # noqa: E402
    ClusterConfig,
    JobObservation,
    JobRef,
    JobSpec,
    JobState,
    KubernetesCredentials,
    ReplicaGroup,
    ReplicaState,
    ReplicaStatus,
    RunMode,
)
from drivers.kubernetes import naming  # noqa: E402
from drivers.kubernetes.driver import KubernetesConfig, KubernetesDriver  # noqa: E402
from tests import harness, security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    NS,
    PODS,
    SERVICES,
    TOKEN,
    Emulator,
    configure,
    driver_fixture,
    emu_fixture,
    eventually,
    exited,
    has,
    kubelet,
    launch,
    measure,
    new_id,
    spec,
    stub_fixture,
    wait_for,
)

CLUSTER = "clusters/k8s"
SUCCEEDED = [job_pb2.JOB_STATE_SUCCEEDED]


async def forget(stub: Any, *refs: dpb.JobRef) -> int:
    resp = await stub.ForgetJobs(dpb.ForgetJobsRequest(cluster=CLUSTER, jobs=list(refs)), timeout=30)
    return int(resp.forgotten)


async def snapshot_ids(stub: Any) -> set[str]:
    return await harness.snapshot_ids(stub, CLUSTER)


async def observe_ref(stub: Any, ref: dpb.JobRef) -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(cluster=CLUSTER, jobs=[ref]),
                                              timeout=30)
    obs: dpb.JobObservation = resp.observations[0]
    return obs


async def tail_ref(stub: Any, ref: dpb.JobRef) -> list[str]:
    return [e.text async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster=CLUSTER, job=ref), timeout=30)
            for e in r.entries]


def labels(e: Emulator, resource: Any, name: str) -> dict[str, str]:
    return dict(e.objects[resource, NS, name].raw["metadata"].get("labels") or {})


def record_of(e: Emulator, service: str) -> dict[str, Any] | None:
    ann = e.objects[SERVICES, NS, service].raw["metadata"].get("annotations") or {}
    raw = ann.get(naming.ANN_FINAL)
    return json.loads(raw) if raw else None


async def relisted(e: Emulator) -> None:
    """Make the driver's informer re-list (410 Gone on its watch) and wait until it has listed again."""
    n = len(e.paths)
    e.gone = True
    e.drop_streams()
    await eventually(lambda: not e.gone, within=60)
    await eventually(lambda: any(p.startswith(f"GET /api/v1/namespaces/{NS}/pods?") and "watch" not in p
                                 for p in e.paths[max(n, e.gone_at):]), within=60)
    await eventually(lambda: any("watch=" in p and "/pods?" in p for p in e.paths[e.gone_at:]), within=60)


async def test_a_forgotten_job_leaves_memory_and_is_answered_from_the_api_server(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    jid, running_id = new_id("forget"), new_id("forget-running")
    first = await launch(stub, jid, spec("single_process"))
    running = await launch(stub, running_id, spec("single_process"))
    ref = dpb.JobRef(job_id=jid, backend_job_id=first.backend_job_id)
    running_ref = dpb.JobRef(job_id=running_id, backend_job_id=running.backend_job_id)
    pod, service = naming.pod_name(jid, 1, "main", 0), naming.service_name(jid, 1)
    await kubelet(url, pod, "Running")
    await kubelet(url, naming.pod_name(running_id, 1, "main", 0), "Running")
    await wait_for(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    e.write_log(pod, "kept by the API server")
    e.pod_metrics = {pod: {"timestamp": "2026-01-01T00:00:40Z", "window": "15s",
                           "containers": [{"name": "main", "usage": {"cpu": "500m", "memory": "64Mi"}}]}}
    try:
        sampled = await measure(stub, jid)
    finally:
        e.pod_metrics = None
    assert sampled["main", 0].cpu_seconds == pytest.approx(20.0)  # 0.5 cores over 40 s since startTime
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    ended = await wait_for(stub, jid, SUCCEEDED)
    try:
        # Only an ended job is forgotten; the running one stays tracked.
        assert await forget(stub, ref, running_ref) == 1
        assert await forget(stub, ref) == 0  # already forgotten
        ids = await snapshot_ids(stub)
        assert jid not in ids and running_id in ids
        # Its record goes on the Service, the recorded label on its pod (the watch selects it out).
        await eventually(lambda: record_of(e, service) is not None and
                         naming.LABEL_RECORDED in labels(e, PODS, pod), within=30)
        doc = record_of(e, service)
        assert doc is not None and doc["state"] == "SUCCEEDED" and doc["job_id"] == jid
        assert naming.LABEL_RECORDED not in labels(e, PODS, naming.pod_name(running_id, 1, "main", 0))

        # Answered from the API server: observation (as it was reported), logs, usage, stop.
        for r in (ref, dpb.JobRef(job_id=jid)):
            obs = await observe_ref(stub, r)
            assert obs.found and obs.state == job_pb2.JOB_STATE_SUCCEEDED and obs.attempt == 1
            assert obs.replicas == ended.replicas and obs.end_time == ended.end_time
            assert obs.backend_job_id == first.backend_job_id
            assert await tail_ref(stub, r) == ["kept by the API server"]
        e.pod_metrics = {}  # metrics.k8s.io served, the ended pod in it no more
        try:
            usage = await measure(stub, jid)
        finally:
            e.pod_metrics = None
        assert set(usage) == {("main", 0)} and not usage["main", 0].running
        assert usage["main", 0].cpu_seconds == pytest.approx(20.0)  # the samples kept in the record
        stopped = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=30)
        assert stopped.observation.state == job_pb2.JOB_STATE_SUCCEEDED  # ended: nothing to stop
        assert has(e, PODS, pod)  # ...and nothing deleted

        # Never tracked again: a pod event (the watch replays every pod), a re-list.
        await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
        await relisted(e)
        assert jid not in await snapshot_ids(stub)
        assert (await observe_ref(stub, ref)).state == job_pb2.JOB_STATE_SUCCEEDED

        # A restarted driver does not load it back, and still answers for it.
        other = ServiceProcess("drivers.kubernetes", ["--request-timeout", "3", "--qps", "500", "--burst", "1000"],
                               name="kubernetes-driver-forget-2").start()
        try:
            async with security.channel(other.address) as ch:
                s2 = driver_service_pb2_grpc.DriverServiceStub(ch)
                await configure(s2, CLUSTER, url)
                ids2 = await snapshot_ids(s2)
                assert jid not in ids2 and running_id in ids2
                again = await observe_ref(s2, dpb.JobRef(job_id=jid))
                assert again.found and again.state == job_pb2.JOB_STATE_SUCCEEDED
                assert again.replicas == ended.replicas
                assert await tail_ref(s2, ref) == ["kept by the API server"]
        finally:
            other.stop()

        # A relaunch (a higher attempt) is tracked as any launch; the forgotten attempt still answers.
        second = await launch(stub, jid, spec("single_process"), attempt=2)
        pod2 = naming.pod_name(jid, 2, "main", 0)
        await kubelet(url, pod2, "Running")
        now = await wait_for(stub, jid, [job_pb2.JOB_STATE_RUNNING])
        assert now.attempt == 2 and jid in await snapshot_ids(stub)
        old = await observe_ref(stub, ref)
        assert old.state == job_pb2.JOB_STATE_SUCCEEDED and old.attempt == 1
        ref2 = dpb.JobRef(job_id=jid, backend_job_id=second.backend_job_id)
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref2), timeout=30)

        # Cleanup of the forgotten attempt deletes its objects; then it is not found.
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=30)
        await eventually(lambda: not has(e, PODS, pod) and not has(e, SERVICES, service), within=30)
        assert not (await observe_ref(stub, ref)).found
    finally:
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=running_ref), timeout=30)


# --------------------------------------------------------------------------- memory per job


def held_bytes(*roots: object) -> int:
    """The bytes of every object reachable from ``roots`` (each once), short of what every job shares:
    modules, classes, functions, event loops, threads."""
    shared = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.CodeType, asyncio.AbstractEventLoop, threading.Thread)
    seen: set[int] = set()
    todo = list(roots)
    total = 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, shared):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return total


async def test_memory_per_job_before_and_after_forget(emu: tuple[Emulator, str]) -> None:
    """N ended jobs tracked, then forgotten: what the driver holds per job (the driver in this process,
    its per-cluster record and per-job maps measured by what they reach)."""
    e, url = emu
    n = 50
    drv = KubernetesDriver(KubernetesConfig(qps=1000, burst=2000, request_timeout=30))
    name = "clusters/k8s-mem"
    await drv.configure_cluster(ClusterConfig(name=name, address=url, options={
        "namespace": NS, "default_image": "python:3.11-slim"}, credentials=KubernetesCredentials(token=TOKEN)))
    c = drv.clusters.require(name)

    def held() -> int:
        gc.collect()
        # the maps' and sets' entries (an emptied dict or set keeps its table, sized for its peak)
        return held_bytes(list(c.jobs.items()), list(c.forgetting.items()), list(drv._tasks),  # noqa: SLF001
                          drv.hub)

    one = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("true",)),))
    ids = [new_id("mem") for _ in range(n)]
    try:
        base = held()
        refs = [JobRef(j, (await drv.launch(name, j, one, 1)).backend_job_id) for j in ids]
        for j in ids:
            await kubelet(url, naming.pod_name(j, 1, "main", 0), "Running")
            await kubelet(url, naming.pod_name(j, 1, "main", 0), "Succeeded", **exited(0, "Completed"))
        deadline = time.monotonic() + 120
        while not all(o.state.is_terminal() for o in await drv.observe(name, refs)):
            assert time.monotonic() < deadline, "the jobs never ended"
            await asyncio.sleep(0.2)
        tracked = held()
        assert await drv.forget(name, refs) == n
        await eventually(lambda: not c.forgetting, within=120)  # every record written
        await eventually(lambda: not drv._tasks, within=30)  # noqa: SLF001
        forgotten = held()
        assert not c.jobs and len(drv.launches) == 0 and drv.launches.inflight == 0  # the per-job maps, pruned
        assert all(o.found and o.state.is_terminal() for o in await drv.observe(name, refs))
        assert all(naming.LABEL_RECORDED in labels(e, PODS, naming.pod_name(j, 1, "main", 0)) for j in ids)
        per_tracked, per_forgotten = (tracked - base) / n, (forgotten - base) / n
        print(f"\nkubernetes driver bytes per ended job: tracked {per_tracked:.0f}, forgotten {per_forgotten:.0f}")
        # a tracked job is compact (issue 18: <= 2 KiB; its pods' JSON took ~9 KiB), a forgotten one is gone
        assert 512 < per_tracked <= 2048, per_tracked
        assert per_forgotten < 16, (per_tracked, per_forgotten)
    finally:
        for j in ids:
            await drv.cleanup(name, JobRef(j))
        await drv.close()


def test_a_record_of_a_large_job_fits_the_annotations_and_reads_back() -> None:
    """5,000 replicas with long termination messages made a record of ~1 MB: the API server
    refused it (annotations are 256 KiB in all) and the driver retried it for ever, the job never
    leaving memory. It is compressed (then cut) to fit, and reads back the same job."""
    import base64
    import zlib

    from drivers.common.planner import SuccessRule
    from drivers.kubernetes import records
    from drivers.kubernetes.tracking import Replica, TrackedJob

    n = 5000
    job = TrackedJob("clusters/k", "big", 1, "ns/big-1", "big-1",
                     [Replica("worker", i, naming.pod_name("big", 1, "worker", i), ("main",)) for i in range(n)],
                     SuccessRule(frozenset({"worker"})))
    final = JobObservation(job_id="big", backend_job_id="ns/big-1", found=True, state=JobState.FAILED,
                           reason="Error", message="worker-7 exited with code 1",
                           replicas=tuple(ReplicaStatus(role="worker", index=i, state=ReplicaState.FAILED,
                                                        exit_code=1, host=f"node-{i % 50}",
                                                        message=f"Error: exited with code 1: {'trace ' * 80}{i}")
                                          for i in range(n)), attempt=1)
    assert len(json.dumps(records.record(job, final))) > 1 << 20
    text = records.annotation(job, final)
    assert len(text.encode()) <= records.MAX_RECORD_BYTES
    back = records.from_service("clusters/k", {"metadata": {"annotations": {naming.ANN_FINAL: text}}})
    assert back is not None and back.final is not None
    assert back.final.state is JobState.FAILED and [r.pod for r in back.replicas] == [r.pod for r in job.replicas]
    assert [s.exit_code for s in back.final.replicas] == [1] * n
    # A compressed record is read only up to a bound (anyone who may edit the Service may write one).
    bomb = records.COMPRESSED + base64.b64encode(zlib.compress(b" " * (64 << 20))).decode()
    assert records.from_service("clusters/k", {"metadata": {"annotations": {naming.ANN_FINAL: bomb}}}) is None
