"""The Kubernetes driver's MPI jobs: the per-attempt SSH key, adoption, the launcher deciding."""

from __future__ import annotations

import shlex
import uuid
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")


from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import driver_service_pb2_grpc, job_pb2  # noqa: E402
from drivers.common import planner  # noqa: E402
from drivers.kubernetes import mpi  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    CONFIG_MAPS,
    NS,
    SECRETS,
    TERMINAL,
    Emulator,
    configure,
    driver_fixture,
    emu_fixture,
    emulator,
    eventually,
    exited,
    has,
    has_service,
    kubelet,
    launch,
    new_id,
    observe,
    pods_of,
    spec,
    stub_fixture,
    wait_for,
)


async def test_mpi_runs_with_a_per_attempt_ssh_key(stub: Any, emu: tuple[Emulator, str],
                                                   driver: ServiceProcess) -> None:
    e, url = emu
    job = new_id("mpi-key")
    sp = spec("mpi")
    sp.replica_groups[0].args[:] = [":", "touch", "/tmp/canary", "-np", "1", "--version"]
    sp.replica_groups[0].env["MY_VAR"] = "a b"
    res = await launch(stub, job, sp)
    secret, config_map = f"{job}-1-ssh", f"{job}-1-mpi"
    assert has(e, SECRETS, secret) and has(e, CONFIG_MAPS, config_map)
    keys = e.objects[SECRETS, NS, secret].raw["stringData"]
    private = keys["ssh-privatekey"]
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert keys["known_hosts"] == f"*.{job}-1.{NS}.svc {keys['ssh-publickey']}"
    assert "PRIVATE KEY-----\n" not in res.native_spec.content  # the reported spec is the rendered one
    assert private not in driver.log()
    hostfile = e.objects[CONFIG_MAPS, NS, config_map].raw["data"]["hostfile"]
    assert hostfile == f"worker-0.{job}-1.{NS}.svc slots=2\nworker-1.{job}-1.{NS}.svc slots=2\n"
    again = await launch(stub, new_id("mpi-key"), spec("mpi"))  # every attempt has its own key
    other = e.objects[SECRETS, NS, f"{again.backend_job_id.split('/')[1]}-ssh"].raw["stringData"]
    assert other["ssh-privatekey"] != private
    pods = pods_of(e, job)
    launcher = pods[f"{job}-1-launcher-0"]
    assert [c["name"] for c in launcher["spec"]["initContainers"]] == ["wait-for-workers"]
    # the launcher as the API server stored it: mpirun gets no user token, and -x hands every rank (started
    # through a worker's sshd, which gives it a clean environment) the contract and the group's env
    (main,) = launcher["spec"]["containers"]
    env = {x["name"]: x["value"] for x in main["env"]}
    argv = main["command"]
    assert argv[-3:] == list(planner.MPI_RANK_PROGRAM) and "args" not in main
    exported = {argv[i + 1] for i, t in enumerate(argv[:-3]) if t == "-x"}
    assert exported == set(env) - set(mpi.MPI_LAUNCHER_ENV)
    assert {"DLSCHED_JOB_ID", "DLSCHED_ROLE", "DLSCHED_MPI_ARGV", "DLSCHED_MPI_HOSTFILE", "MY_VAR"} <= exported
    assert shlex.split(env["DLSCHED_MPI_ARGV"]) == [*sp.replica_groups[0].command, *sp.replica_groups[0].args]
    for name in pods:
        await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await kubelet(url, f"{job}-1-launcher-0", "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED  # the launcher's state, the workers still up
    await eventually(lambda: list(pods_of(e, job)) == [f"{job}-1-launcher-0"])  # workers stopped
    ref = dpb.JobRef(job_id=job)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not has(e, SECRETS, secret) and not has(e, CONFIG_MAPS, config_map)
    assert not has_service(e, f"{job}-1") and pods_of(e, job) == {}

async def test_an_adopted_mpi_job_is_cleaned_up_whole(driver: ServiceProcess) -> None:
    """A driver that finds an MPI job on the watch (after a restart) still deletes its Secret and ConfigMap."""
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure(stub, "clusters/first", url)
        job = new_id("mpi-adopt")
        await launch(stub, job, spec("mpi"), cluster="clusters/first")
        await configure(stub, "clusters/second", url)  # knows the job from its pods alone
        obs = await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], cluster="clusters/second")
        assert obs.backend_job_id == f"{NS}/{job}-1" and len(obs.replicas) == 3
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/second", job=dpb.JobRef(job_id=job)),
                              timeout=10)
        assert not has(e, SECRETS, f"{job}-1-ssh") and not has(e, CONFIG_MAPS, f"{job}-1-mpi")
        assert not has_service(e, f"{job}-1") and pods_of(e, job) == {}
        for cluster in ("clusters/first", "clusters/second"):
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)

async def test_a_retried_mpi_job_is_cleaned_up_with_every_attempt(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Attempt 1 fails, attempt 2 runs, the job is deleted (JobManager cleans up the newest attempt):
    attempt 1's Service, pods, Secret (its SSH private key) and ConfigMap go too."""
    e, url = emu
    job, uid = new_id("mpi-retry"), str(uuid.uuid4())  # JobManager gives every launch the job's uid
    await launch(stub, job, spec("mpi"), attempt=1, uid=uid)
    await kubelet(url, f"{job}-1-launcher-0", "Failed", **exited(1, "Error"))
    await wait_for(stub, job, TERMINAL)
    await launch(stub, job, spec("mpi"), attempt=2, uid=uid)
    ref = dpb.JobRef(job_id=job, job_uid=uid)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=30)
    for attempt in (1, 2):
        assert not has(e, SECRETS, f"{job}-{attempt}-ssh") and not has(e, CONFIG_MAPS, f"{job}-{attempt}-mpi")
        assert not has_service(e, f"{job}-{attempt}")
    assert pods_of(e, job) == {}


async def test_a_failed_mpi_launcher_fails_the_job(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("mpi-fail")
    await launch(stub, job, spec("mpi"))
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
    await kubelet(url, f"{job}-1-launcher-0", "Failed", **exited(1, "Error"))
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "NonZeroExit", 1)
    assert obs.message == "launcher-0 exited with code 1", obs.message  # as every backend says it
    await eventually(lambda: list(pods_of(e, job)) == [f"{job}-1-launcher-0"])  # workers stopped
    assert (await observe(stub, job)).state == job_pb2.JOB_STATE_FAILED
