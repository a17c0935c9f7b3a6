"""The Kubernetes driver launching jobs: every run mode, failures, names, idempotency, stop, pacing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import aiohttp
import grpc
import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")


from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import driver_service_pb2_grpc, job_pb2  # noqa: E402
from drivers.kubernetes import naming  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    CONFIG_MAPS,
    MODES,
    NS,
    SECRETS,
    SERVICES,
    STOPPED_AFTER,
    TERMINAL,
    Emulator,
    all_replicas_running,
    configure,
    driver_fixture,
    emu_fixture,
    emulator,
    eventually,
    exited,
    group,
    has,
    has_service,
    kubelet,
    launch,
    new_id,
    observe,
    pods_of,
    spec,
    stub_fixture,
    unique,
    wait_for,
)


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_each_mode_runs_to_success(stub: Any, emu: tuple[Emulator, str], mode: str) -> None:
    e, url = emu
    job = new_id(mode.replace("_", "-"))
    res = await launch(stub, job, spec(mode))
    assert res.backend_job_id == f"{NS}/{job}-1"
    assert res.native_spec.media_type == "application/yaml"
    pods = pods_of(e, job)
    assert has_service(e, f"{job}-1")
    assert len(pods) == sum(g.replicas for g in MODES[mode][1])
    for p in pods.values():
        assert p["spec"]["subdomain"] == f"{job}-1" and p["spec"]["restartPolicy"] == "Never"
        assert p["metadata"]["ownerReferences"][0]["name"] == f"{job}-1"
    for name in pods:
        await kubelet(url, name, "Running")
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    obs = await all_replicas_running(stub, job, obs)
    assert all(r.state == job_pb2.REPLICA_STATE_RUNNING and r.host == "node-1" for r in obs.replicas)
    rest = STOPPED_AFTER.get(mode)
    role_of = {n: p["metadata"]["labels"][naming.LABEL_ROLE] for n, p in pods.items()}
    deciding = [n for n in pods if role_of[n] != rest]
    for name in deciding:
        await kubelet(url, name, "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    if rest:  # the parameter servers / MPI workers are stopped once the deciding roles are done
        await eventually(lambda: not any(role_of[n] == rest for n in pods_of(e, job)))
        obs = await observe(stub, job)
        assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
        stopped = [r for r in obs.replicas if r.role == rest]
        assert stopped and all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in stopped)

@pytest.mark.parametrize("mode", ["multi_process", "master_worker", "ps_worker"])
async def test_a_failed_worker_fails_the_job_with_its_replica_and_reason(stub: Any, emu: tuple[Emulator, str],
                                                                         mode: str) -> None:
    e, url = emu
    job = new_id(f"oom-{mode.replace('_', '-')}")
    groups = [group("worker", 2)] if mode == "multi_process" else MODES[mode][1]
    await launch(stub, job, job_pb2.JobSpec(run_mode=MODES[mode][0], replica_groups=groups))
    failing = f"{job}-1-worker-1"
    for name in pods_of(e, job):
        if name != failing:
            await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await kubelet(url, failing, "Failed", **exited(137, "OOMKilled"))
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "OOMKilled", 137)
    assert obs.message == "worker-1 exited with code 137; OOMKilled", obs.message  # as every backend names it
    (bad,) = [r for r in obs.replicas if r.state == job_pb2.REPLICA_STATE_FAILED]
    assert (bad.role, bad.index, bad.exit_code) == ("worker", 1, 137)
    await eventually(lambda: list(pods_of(e, job)) == [failing])  # the rest (master, ps, chief) is stopped
    obs = await observe(stub, job)
    assert obs.state == job_pb2.JOB_STATE_FAILED and obs.reason == "OOMKilled"  # latched
    assert all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in obs.replicas if (r.role, r.index) != ("worker", 1))

async def test_a_failed_process_of_a_pod_that_runs_on_fails_the_job_and_deletes_the_pod(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """MULTI_PROCESS, a replica of two processes (one pod, two containers): one is OOMKilled while
    the other blocks (in a collective, say), so the pod stays Running. The job FAILS with that
    process's reason and code, and the pod is deleted rather than left running."""
    e, url = emu
    job = new_id("mp-oom")
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                            replica_groups=[group("worker", 1, 2)]))
    (pod,) = pods_of(e, job)
    await kubelet(url, pod, "Running", containerStatuses=[
        {"name": "proc-0", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}},
        {"name": "proc-1", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                    "finishedAt": "2026-01-01T00:01:00Z"}}}])
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "OOMKilled", 137), obs
    assert obs.message == "worker-1 exited with code 137; OOMKilled", obs.message  # process 1 of replica 0
    await eventually(lambda: not pods_of(e, job))  # proc-0 does not run on


async def set_finalizers(url: str, pod: str, value: list[str] | None) -> None:
    async with aiohttp.ClientSession() as s, s.patch(
            f"{url}/api/v1/namespaces/{NS}/pods/{pod}", json={"metadata": {"finalizers": value}},
            headers={"Content-Type": "application/merge-patch+json"}) as r:
        assert r.status == 200, await r.text()


def procs(*states: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"proc-{k}", "state": st} for k, st in enumerate(states)]


def ended(code: int) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed",
                           "finishedAt": "2026-01-01T00:01:00Z"}}


async def test_a_failed_process_is_named_by_its_index_and_the_processes_stopped_read_stopped(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """MULTI_PROCESS, two replicas of two processes: process 1 of replica 1 (the role's process 3)
    exits 3. The job FAILS as on every backend (NonZeroExit, ``worker-3 exited with code 3``); its
    replicas are one per process, indexed replica * 2 + k. The pods dlsched then deletes end as a
    real kubelet reports them (phase Failed, exit 143, deletionTimestamp set, held here by a
    finalizer): those processes are STOPPED with their code, not FAILED 143."""
    e, url = emu
    job = new_id("mp-index")
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                            replica_groups=[group("worker", 2, 2)]))
    p0, p1 = f"{job}-1-worker-0", f"{job}-1-worker-1"
    for p in (p0, p1):
        await set_finalizers(url, p, ["example.com/hold"])
        await kubelet(url, p, "Running", containerStatuses=procs({"running": {}}, {"running": {}}))
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    assert [(r.index, r.state) for r in obs.replicas] == [(i, job_pb2.REPLICA_STATE_RUNNING) for i in range(4)]
    await kubelet(url, p1, "Running", containerStatuses=procs({"running": {}}, ended(3)))
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.message, obs.exit_code) == (
        job_pb2.JOB_STATE_FAILED, "NonZeroExit", "worker-3 exited with code 3", 3), obs
    try:
        await eventually(lambda: all(p["metadata"].get("deletionTimestamp") for p in pods_of(e, job).values()))
        await kubelet(url, p0, "Failed", containerStatuses=procs(ended(143), ended(143)))
        await kubelet(url, p1, "Failed", containerStatuses=procs(ended(143), ended(3)))
        want = [(0, job_pb2.REPLICA_STATE_STOPPED, 143), (1, job_pb2.REPLICA_STATE_STOPPED, 143),
                (2, job_pb2.REPLICA_STATE_STOPPED, 143), (3, job_pb2.REPLICA_STATE_FAILED, 3)]
        for _ in range(200):
            obs = await observe(stub, job)
            if [(r.index, r.state, r.exit_code) for r in obs.replicas] == want:
                break
            await asyncio.sleep(0.05)
        assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [("worker", *w) for w in want], obs
        assert obs.replicas[3].message == "exited with code 3", obs.replicas[3]
        assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "NonZeroExit", 3)  # latched
    finally:
        for p in (p0, p1):
            await set_finalizers(url, p, None)
    await eventually(lambda: not pods_of(e, job))


@pytest.mark.parametrize("phase,code", [("Succeeded", 0), ("Failed", 143)])
async def test_a_stopped_pods_processes_read_stopped_with_their_code_and_the_job_stopped_once_gone(
        stub: Any, emu: tuple[Emulator, str], phase: str, code: int) -> None:
    """A stop deletes the pods. A process that handles the SIGTERM and exits 0 (phase Succeeded)
    read SUCCEEDED inside the STOPPED job: STOPPED with its code, as on every backend; one of the
    same pod that had exited 0 before the stop stays SUCCEEDED. And the job is STOPPED once the
    pod is gone: a pod that reached its end (a kubelet reports Failed 143, KEP-3329) before it
    went was kept as ended, so the job stayed STOPPING for good."""
    e, url = emu
    job = new_id("stop0")
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                            replica_groups=[group("worker", 1, 2)]))
    pod = f"{job}-1-worker-0"
    await set_finalizers(url, pod, ["example.com/hold"])
    try:
        await kubelet(url, pod, "Running", containerStatuses=procs(ended(0), {"running": {}}))
        await eventually_observed(stub, job, lambda o: [r.state for r in o.replicas] == [
            job_pb2.REPLICA_STATE_SUCCEEDED, job_pb2.REPLICA_STATE_RUNNING])
        await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                timeout=30)
        await eventually(lambda: all(p["metadata"].get("deletionTimestamp") for p in pods_of(e, job).values()))
        await kubelet(url, pod, phase, containerStatuses=procs(ended(0), ended(code)))
        want = [(0, job_pb2.REPLICA_STATE_SUCCEEDED, 0), (1, job_pb2.REPLICA_STATE_STOPPED, code)]
        await eventually_observed(stub, job, lambda o: [(r.index, r.state, r.exit_code) for r in o.replicas] == want)
    finally:
        await set_finalizers(url, pod, None)
    await eventually(lambda: not pods_of(e, job))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_STOPPED, obs
    assert [(r.index, r.state, r.exit_code) for r in obs.replicas] == want, obs


async def eventually_observed(stub: Any, job: str, pred: Any, within: float = 60) -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while not pred(obs := await observe(stub, job)):
        assert time.monotonic() < deadline, obs
        await asyncio.sleep(0.05)
    return obs


async def two_workers_running(stub: Any, url: str, job: str) -> tuple[str, str]:
    """A MULTI_PROCESS job of two workers launched, each pod Running; their pod names."""
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                            replica_groups=[group("worker", 2)]))
    pods = f"{job}-1-worker-0", f"{job}-1-worker-1"
    for p in pods:
        await kubelet(url, p, "Running")
    return pods


async def test_pods_the_end_of_a_job_could_not_delete_are_deleted_once_the_api_answers(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A worker fails; the other worker's pod is to be deleted, but the API server answers 503
    to pod DELETEs for a while: the deletion is asked again until it goes through (it was
    logged and dropped, and the pod ran on while its replica read STOPPED)."""
    e, url = emu
    job = new_id("bgdel")
    p0, p1 = await two_workers_running(stub, url, job)
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    refused: list[str] = []

    def refuse(method: str, path: str) -> int | None:
        if method == "DELETE" and "/pods/" in path:
            refused.append(path)
            return 503
        return None

    e.refuse = refuse
    try:
        await kubelet(url, p0, "Failed", **exited(1, "Error"))
        assert (await wait_for(stub, job, TERMINAL)).state == job_pb2.JOB_STATE_FAILED
        await eventually(lambda: len(refused) >= 2)  # asked, refused, asked again
    finally:
        e.refuse = None
    await eventually(lambda: p1 not in pods_of(e, job), within=60)


async def test_a_pod_deleted_after_it_ended_keeps_its_end(stub: Any, emu: tuple[Emulator, str]) -> None:
    """A worker's pod that Succeeded is deleted (terminated-pod GC, a TTL controller) while the
    other runs on: the replica stays SUCCEEDED (it read FAILED PodDeleted, failing the job and
    killing the other worker), and the job succeeds when the other does."""
    e, url = emu
    job = new_id("gcd")
    p0, p1 = await two_workers_running(stub, url, job)
    await kubelet(url, p0, "Succeeded", **exited(0, "Completed"))
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    async with aiohttp.ClientSession() as session, \
            session.delete(f"{url}/api/v1/namespaces/{NS}/pods/{p0}") as r:
        assert r.status in (200, 202), await r.text()
    await eventually(lambda: p0 not in pods_of(e, job))
    obs = await observe(stub, job)
    assert obs.state == job_pb2.JOB_STATE_RUNNING, obs
    assert [(r.index, r.state) for r in obs.replicas] == [(0, job_pb2.REPLICA_STATE_SUCCEEDED),
                                                          (1, job_pb2.REPLICA_STATE_RUNNING)], obs
    await kubelet(url, p1, "Succeeded", **exited(0, "Completed"))
    assert (await wait_for(stub, job, TERMINAL)).state == job_pb2.JOB_STATE_SUCCEEDED


async def test_a_restarted_driver_cleans_up_a_stopped_job_it_never_saw(stub: Any, emu: tuple[Emulator, str]) -> None:
    """An MPI job stopped (every pod gone, no record written yet), then the driver restarts: it
    has no pod to adopt the job from, and CleanupJob deleted nothing, leaving the Service, the
    ConfigMap and the Secret holding the job's SSH private key for good."""
    e, url = emu
    job, uid = new_id("stopres"), str(uuid.uuid4())
    await launch(stub, job, spec("mpi"), uid=uid)
    for p in pods_of(e, job):
        await kubelet(url, p, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)), timeout=10)
    await wait_for(stub, job, [job_pb2.JOB_STATE_STOPPED], within=30)
    objects = [(SERVICES, f"{job}-1"), (SECRETS, naming.secret_name(job, 1)), (CONFIG_MAPS, naming.config_map_name(job, 1))]
    assert all(has(e, kind, name) for kind, name in objects)
    await configure(stub, "clusters/restarted", url)  # a driver that never saw the job, same API server
    try:
        ref = dpb.JobRef(job_id=job, backend_job_id=f"{NS}/{job}-1", job_uid=uid)
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/restarted", job=ref), timeout=10)
        assert not [name for kind, name in objects if has(e, kind, name)]
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/restarted"), timeout=10)


async def test_a_pod_deleted_while_no_driver_watched_fails_the_job(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Two workers run; the driver goes away, one pod is deleted (a node lost, a kubectl delete),
    the driver comes back: the launch had completed (its Service says so), so the missing pod
    was deleted, and the job FAILS PodDeleted. It read PENDING "created; not observed yet" for
    ever (a launch cut short looks the same, and that one is finished by the next launch)."""
    e, url = emu
    job = new_id("down")
    p0, p1 = await two_workers_running(stub, url, job)
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await eventually(lambda: (e.objects[SERVICES, NS, f"{job}-1"].raw["metadata"].get("annotations") or {})
                     .get("dlsched.io/launched") == "true")
    await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/k8s"), timeout=10)  # no driver watches
    try:
        async with aiohttp.ClientSession() as session, \
                session.delete(f"{url}/api/v1/namespaces/{NS}/pods/{p1}") as r:
            assert r.status in (200, 202), await r.text()
    finally:
        await configure(stub, "clusters/k8s", url)  # a driver that knows nothing of the job
    obs = await wait_for(stub, job, TERMINAL, within=30)
    assert (obs.state, obs.reason) == (job_pb2.JOB_STATE_FAILED, "PodDeleted"), obs
    await eventually(lambda: not pods_of(e, job))  # the other worker does not run on


async def test_a_stop_while_the_launch_creates_pods_stops_every_pod(stub: Any, emu: tuple[Emulator, str]) -> None:
    """TerminateJob while LaunchJob is still creating pods (a slow API server): the stop waits for
    the launch, so no pod made after it runs on, and the job ends STOPPED."""
    e, url = emu
    job = new_id("stoprace")
    posts: list[str] = []

    def hold(method: str, path: str) -> float | None:
        if method == "POST" and path.endswith("/pods"):
            posts.append(path)
            return 1.5 if len(posts) == 2 else None
        return None

    e.hold, e.held = hold, 0
    try:
        launching = asyncio.ensure_future(launch(stub, job, spec("master_worker")))
        await eventually(lambda: e.held > 0)
        stop = await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                       timeout=30)
        await launching
    finally:
        e.hold = None
    assert stop.observation.state in (job_pb2.JOB_STATE_STOPPING, job_pb2.JOB_STATE_STOPPED), stop
    await eventually(lambda: not pods_of(e, job))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_STOPPED, obs


async def test_a_launch_cut_short_by_an_api_error_is_completed_by_its_retry(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """The API server fails the second pod's creation (503): the launch of the same attempt
    again (the channel's retry, or JobManager's) creates the pods still missing, and the job
    runs with every replica, rather than waiting for ever on a pod never made."""
    e, url = emu
    job = new_id("flaky")
    posts: list[str] = []

    def refuse(method: str, path: str) -> int | None:
        if method == "POST" and path.endswith("/pods"):
            posts.append(path)
            return 503 if len(posts) == 2 else None
        return None

    e.refuse = refuse
    try:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await launch(stub, job, spec("master_worker"))
    finally:
        e.refuse = None
    await launch(stub, job, spec("master_worker"))  # JobManager's retry of the attempt
    await eventually(lambda: len(pods_of(e, job)) == 3)
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        obs = await observe(stub, job)
        if [r.state for r in obs.replicas] == [job_pb2.REPLICA_STATE_RUNNING] * 3:
            break
        assert asyncio.get_running_loop().time() < deadline, obs  # a replica never created stays Submitted
        await asyncio.sleep(0.1)
    assert obs.state == job_pb2.JOB_STATE_RUNNING, obs


async def test_a_driver_that_finds_a_job_whose_pods_are_being_deleted_reports_it_stopped(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A stop's pods in their grace period (a finalizer holds them here) when a driver first sees
    the job (after a restart; here a second configuration of the same API server): STOPPING, then
    STOPPED once they are gone, not RUNNING and then FAILED PodDeleted."""
    import aiohttp

    e, url = emu

    async def finalizers(pod: str, value: list[str] | None) -> None:
        async with aiohttp.ClientSession() as s, s.patch(
                f"{url}/api/v1/namespaces/{NS}/pods/{pod}", json={"metadata": {"finalizers": value}},
                headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 200, await r.text()

    job = new_id("graceful")
    await launch(stub, job, spec("master_worker"))
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
        await finalizers(name, ["example.com/hold"])
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)), timeout=10)
    await eventually(lambda: all(p["metadata"].get("deletionTimestamp") for p in pods_of(e, job).values()))
    await configure(stub, "clusters/adopter", url)
    try:
        obs = await wait_for(stub, job, [job_pb2.JOB_STATE_STOPPING], cluster="clusters/adopter")
        for name in pods_of(e, job):
            await finalizers(name, None)
        obs = await wait_for(stub, job, TERMINAL, cluster="clusters/adopter")
        assert obs.state == job_pb2.JOB_STATE_STOPPED, obs
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/adopter"), timeout=10)


async def test_a_namespace_quota_is_resource_exhausted_with_its_message_and_a_later_launch_completes(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A ResourceQuota refuses the second pod (HTTP 403 "exceeded quota"): the launch is
    RESOURCE_EXHAUSTED with the API server's message (JobManager retries it), not an RBAC error;
    once the quota frees, the launch of the same attempt creates the rest."""
    e, url = emu
    job = new_id("quota")
    quota = ('pods "x" is forbidden: exceeded quota: compute, requested: requests.cpu=1, '
             'used: requests.cpu=4, limited: requests.cpu=4')
    posts: list[str] = []

    def refuse(method: str, path: str) -> tuple[int, str, str] | None:
        if method == "POST" and path.endswith("/pods"):
            posts.append(path)
            return (403, "Forbidden", quota) if len(posts) >= 2 else None
        return None

    e.refuse = refuse
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await launch(stub, job, spec("master_worker"))
    finally:
        e.refuse = None
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert "exceeded quota" in (ei.value.details() or "") and "RBAC" not in (ei.value.details() or "")
    await launch(stub, job, spec("master_worker"))
    await eventually(lambda: len(pods_of(e, job)) == 3)


@pytest.mark.parametrize("job", ["odd--id", "trailing-"])
async def test_job_ids_that_are_not_labels_are_tracked_by_their_label(stub: Any, emu: tuple[Emulator, str],
                                                                      job: str) -> None:
    e, url = emu
    job = f"{job}{unique()}" if job.endswith("--id") else f"{job}{unique()}-"
    label = naming.job_label(job)
    assert label != job and naming.is_dns_label(label)  # validation accepts the id; the label differs
    res = await launch(stub, job, spec("master_worker"))
    pods = pods_of(e, job)
    assert len(pods) == 3 and res.backend_job_id == f"{NS}/{naming.service_name(job, 1)}"
    for name in pods:
        await kubelet(url, name, "Running")
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    obs = await all_replicas_running(stub, job, obs)
    assert obs.job_id == job and all(r.state == job_pb2.REPLICA_STATE_RUNNING for r in obs.replicas)
    before = len(e.paths)
    with pytest.raises(grpc.aio.AioRpcError):  # no metrics.k8s.io here; the query still names the label
        await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster="clusters/k8s",
                                                              job=dpb.JobRef(job_id=job)), timeout=10)
    assert any("metrics.k8s.io" in p and f"job-id%3D{label}" in p for p in e.paths[before:]), e.paths[before:]
    for name in pods:
        await kubelet(url, name, "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)), timeout=10)
    assert pods_of(e, job) == {} and not has_service(e, naming.service_name(job, 1))

async def test_a_messy_job_name_still_gives_valid_objects(stub: Any, emu: tuple[Emulator, str]) -> None:
    """The longest, oddest id and labels validation lets through (capitals, dots, a DNS prefix):
    every object the API gets is valid. Labels validation refuses (unicode, 200 characters, a
    space) are refused here too, naming the field, as JobManager refuses them (dlsched.spec_rules)."""
    from tests.test_kubernetes_render import MESSY, assert_valid_metadata

    e, url = emu
    job = f"m{unique()}-" + "a-" * 28 + "-"  # the longest, oddest id validation lets through
    assert len(job) <= 63
    refused = spec("mpi")
    refused.labels.update({"name": MESSY, "bad key!": "x"})
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, job, refused)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.labels" in (ei.value.details() or "")
    sp = spec("mpi")  # the mode with the most kinds of objects
    sp.labels.update({"Team.Name": "Vision.ML", "example.com/Odd_Key.x": "A-b_c.9", "empty": ""})
    await launch(stub, job, sp)
    mine = [obj.raw for (_res, _ns, _name), obj in list(e.objects.items()) if not obj.deleted and
            (obj.raw.get("metadata", {}).get("labels") or {}).get(naming.LABEL_JOB) == naming.job_label(job)]
    assert sorted(m["kind"] for m in mine) == ["ConfigMap", "Pod", "Pod", "Pod", "Secret", "Service"]
    for m in mine:
        assert_valid_metadata(m)
        assert m["metadata"]["labels"]["Team.Name"] == "Vision.ML"
    pods = pods_of(e, job)
    for name in pods:
        await kubelet(url, name, "Running")
    await kubelet(url, naming.pod_name(job, 1, "launcher", 0), "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED and obs.job_id == job

async def test_pending_reasons_and_idempotent_launch(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("pend")
    before = sum(1 for p in e.paths if p.startswith("POST"))
    first = await launch(stub, job, spec("single_process"))
    again = await launch(stub, job, spec("single_process"))
    assert again.backend_job_id == first.backend_job_id
    assert sum(1 for p in e.paths if p.startswith("POST")) - before == 2  # one Service, one Pod
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Pending", conditions=[{"type": "PodScheduled", "status": "False",
                                                    "reason": "Unschedulable", "message": "0/3 nodes"}])
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], reason="Unschedulable")
    assert "0/3 nodes" in obs.message
    await kubelet(url, pod, "Pending", conditions=[], containerStatuses=[
        {"name": "main", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}])
    await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], reason="ImagePullBackOff")
    # Not started yet: the log says so instead of failing.
    out = []
    async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                    timeout=10):
        out.extend(r.entries)
    assert len(out) == 1 and "has not started" in out[0].text

async def test_an_image_the_kubelet_can_never_run_fails_the_job_and_its_pods_go(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """InvalidImageName (the reference does not parse) is no wait that passes: the job fails, naming it,
    and the pods are deleted (they left the job PENDING until its time limit)."""
    e, url = emu
    job = new_id("badimg")
    await launch(stub, job, spec("master_worker"))
    pods = sorted(pods_of(e, job))
    assert len(pods) > 1
    await kubelet(url, pods[0], "Pending", containerStatuses=[
        {"name": "main", "state": {"waiting": {"reason": "InvalidImageName",
                                               "message": "could not parse image name x@@"}}}])
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_FAILED and obs.reason == "InvalidImageName", obs
    assert "parse image name" in obs.message
    deadline = time.monotonic() + 15
    while pods_of(e, job):
        assert time.monotonic() < deadline, f"pods left: {sorted(pods_of(e, job))}"
        await asyncio.sleep(0.1)

async def test_stop_and_delete_remove_the_right_objects(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job, other = new_id("stop"), new_id("keep")
    await launch(stub, job, spec("master_worker"))
    await launch(stub, other, spec("single_process"))
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    ref = dpb.JobRef(job_id=job)
    resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert resp.observation.state in (job_pb2.JOB_STATE_STOPPING, job_pb2.JOB_STATE_STOPPED)
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_STOPPED])
    assert all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in obs.replicas)
    assert pods_of(e, job) == {} and has_service(e, f"{job}-1")  # the record is kept
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not has_service(e, f"{job}-1")
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not (await observe(stub, job)).found
    assert len(pods_of(e, other)) == 1 and has_service(e, f"{other}-1")  # untouched

async def test_the_request_budget_paces_api_requests() -> None:
    """--qps 5 --burst 5: 20 concurrent launches (40 creates) reach the API server paced, not all at once."""
    qps, burst = 5, 5
    svc = ServiceProcess("drivers.kubernetes", ["--qps", str(qps), "--burst", str(burst), "--request-timeout", "5"],
                         name="kubernetes-paced").start()
    try:
        async with security.channel(svc.address) as ch, emulator() as (e, url):
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            await configure(stub, "clusters/paced", url)
            before = len(e.stamps)
            ids = [new_id("paced") for _ in range(20)]
            await asyncio.gather(*(stub.LaunchJob(dpb.LaunchJobRequest(
                cluster="clusters/paced", job_id=j, spec=spec("single_process"), attempt=1), timeout=60)
                for j in ids))
            posts = [t for t, p in e.stamps[before:] if p.startswith("POST ")]
            assert len(posts) == 40  # a Service and a Pod each
            # A bucket of 5 lets 5 through at once, then one every 0.2 s: 35 more take 7 s (allow 5).
            assert posts[-1] - posts[0] >= (len(posts) - burst) / qps * 0.7, posts[-1] - posts[0]
            # No second ever sees more than burst + qps of them (plus slack for arrival jitter).
            assert max(sum(1 for u in posts if t <= u < t + 1) for t in posts) <= burst + qps + 2
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/paced"), timeout=10)
    finally:
        svc.stop()


def test_a_kubeconfig_may_not_read_the_drivers_files_or_run_its_commands_unless_allowed(tmp_path: Any) -> None:
    """A kubeconfig is credentials an admin sends, not a say over the driver's host: an exec or
    auth-provider plugin (a command run there) is refused unless the driver allows them
    (--allow-kubeconfig-exec, for EKS or GKE), and fields naming the host's files always are."""
    from dlsched.errors import InvalidArgument
    from drivers.common.base import ClusterConfig, KubernetesCredentials
    from drivers.kubernetes.api import KubeApi

    def kubeconfig(user: str, cluster: str = 'server: "https://127.0.0.1:6443"') -> str:
        return ("apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: c\n  cluster: {{{cluster}}}\n"
                f"users:\n- name: u\n  user: {{{user}}}\n"
                "contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n")

    def api(text: str, allow_exec: bool = False) -> KubeApi:
        return KubeApi(ClusterConfig(name="clusters/kc", credentials=KubernetesCredentials(kubeconfig=text)),
                       qps=1, burst=1, request_timeout=1, allow_exec=allow_exec)

    ran = tmp_path / "ran"
    exec_user = f'exec: {{apiVersion: client.authentication.k8s.io/v1, command: /bin/touch, args: [{ran}]}}'
    for text in (kubeconfig(exec_user), kubeconfig('auth-provider: {name: oidc, config: {}}'),
                 kubeconfig('tokenFile: /etc/shadow'), kubeconfig('client-certificate: /etc/ssl/x.pem'),
                 kubeconfig('token: t', 'server: "https://127.0.0.1:6443", certificate-authority: /etc/hosts')):
        with pytest.raises(InvalidArgument) as e:
            api(text)
        assert [v.field for v in e.value.violations] == ["credentials.kubernetes.kubeconfig"], text
    assert not ran.exists()  # refused before anything ran
    api(kubeconfig("token: t")).client.close()  # a token, or the -data forms: as before
    api(kubeconfig(exec_user), allow_exec=True).client.close()  # allowed by the operator: it runs
    assert ran.exists()


async def test_an_object_of_the_launch_someone_else_made_is_a_name_collision(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A pod (or an MPI job's Secret or ConfigMap) of the launch's names that exists and is not
    owned by this launch's Service was taken for 'an earlier try' (409): the job then tracked a
    stranger's pod, and its clean-up deleted it by name; a pre-made SSH Secret would have been
    trusted by the job's workers. Now: NAME_COLLISION, the stranger's object untouched, nothing
    of the launch left behind."""
    import grpc

    from dlsched.kit.rpc_errors import error_info
    from tests.kube_emulator import PODS, SECRETS

    e, url = emu
    for kind, mode, name in ((PODS, "single_process", "{job}-1-main-0"), (SECRETS, "mpi", "{job}-1-ssh")):
        job = new_id("squat")
        obj = name.format(job=job)
        e.objects[kind, NS, obj] = {"apiVersion": "v1", "kind": "Pod" if kind == PODS else "Secret",
                                    "metadata": {"name": obj, "namespace": NS, "labels": {"owner": "mallory"}}}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await launch(stub, job, spec(mode))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(err.value).reason == "NAME_COLLISION", err.value.details()
        assert has(e, kind, obj)  # the stranger's object stays
        assert not has_service(e, f"{job}-1")
        assert not (await observe(stub, job)).found
