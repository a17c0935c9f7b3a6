"""Held Slurm jobs that no driver will release (real Slurm, the driver as a process with
``--held-grace 3 --adopt-window 1``): held jobs of attempts this cluster does not track are
cancelled after the grace (the oldest of an attempt only while a watch of the cluster, as
JobManager keeps, has been open the window; never while none is), a released one never; a launch whose release failed and was never retried leaves no
job queued, and a later retry of it submits anew and runs once; a job held while its own
launch is still releasing it is never cancelled."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests import security, slurm_cluster
from tests.harness import ServiceProcess
from tests.slurm_peer import CLUSTER, configure_request, launch, new_id, single

GRACE = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def driver(cluster: slurm_cluster.SlurmCluster) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--held-grace", str(GRACE),
                                           "--adopt-window", "1"],
                         name="slurm-driver-strays").start()
    yield svc
    svc.stop()


@pytest.fixture
async def stub(driver: ServiceProcess, cluster: slurm_cluster.SlurmCluster
               ) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(configure_request(cluster), timeout=30)
        yield s


def slurm_jobs(cluster: slurm_cluster.SlurmCluster, jid: str) -> dict[str, str]:
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i|%T").stdout
    return dict(line.split("|", 1) for line in out.split())


def sbatch(cluster: slurm_cluster.SlurmCluster, jid: str, code: str, *, hold: bool) -> str:
    """A job with dlsched's name and comment for attempt 1 of ``jid``, submitted behind the driver's back."""
    argv = ["sbatch", "--parsable", f"--job-name=dlsched-{jid}", f"--comment=dlsched-{jid}.1",
            f"--output={cluster.home}/{jid}.out"] + (["--hold"] if hold else [])
    r = cluster.run(*argv, "--wrap", code)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


async def until(what, ok, within: float = 90.0):
    deadline = time.monotonic() + within
    while not ok(value := await asyncio.to_thread(what)):
        assert time.monotonic() < deadline, value
        await asyncio.sleep(0.3)
    return value


async def test_held_jobs_of_attempts_no_driver_tracks_are_cancelled_and_released_ones_kept(stub, cluster):
    keep_busy = new_id("busy")  # the rounds that see strays run while the cluster has jobs to poll
    await launch(stub, keep_busy, single("import time; time.sleep(60)"))
    dup, lone, running = new_id("dup"), new_id("lone"), new_id("other")
    oldest = sbatch(cluster, dup, "true", hold=True)
    newer = sbatch(cluster, dup, "true", hold=True)
    alone = sbatch(cluster, lone, "true", hold=True)
    other = sbatch(cluster, running, "sleep 30", hold=False)  # another driver's adopted job
    # No watch of the cluster (JobManager away): JobManager may hold the oldest's ids, so
    # only the duplicate goes, whatever the grace.
    await until(lambda: slurm_jobs(cluster, dup), lambda j: j == {oldest: "PENDING", newer: "CANCELLED"})
    await asyncio.sleep(3 * GRACE)
    assert slurm_jobs(cluster, dup)[oldest] == "PENDING" and slurm_jobs(cluster, lone)[alone] == "PENDING"
    # JobManager's watch, which claims nothing of these: the oldest go once it has been open a while.
    watch = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=CLUSTER), timeout=120)
    try:
        async for ev in watch:
            if ev.snapshot_complete:
                break
        await until(lambda: {**slurm_jobs(cluster, dup), **slurm_jobs(cluster, lone)},
                    lambda j: j == {oldest: "CANCELLED", newer: "CANCELLED", alone: "CANCELLED"})
    finally:
        watch.cancel()
    assert slurm_jobs(cluster, running)[other] in ("PENDING", "RUNNING")  # released: never touched
    cluster.run("scancel", other)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=keep_busy)), timeout=30)


def _scontrol(bindir: pathlib.Path, release: str) -> str:
    """A remote ``scontrol`` whose ``release`` runs ``release`` (the real one is $REAL)."""
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(f"#!/bin/bash\nREAL={shutil.which('scontrol')}\n"
                                     f"if [ \"$1\" = release ]; then {release}; fi\nexec \"$REAL\" \"$@\"\n")
    (bindir / "scontrol").chmod(0o755)
    return f"{bindir}:/usr/bin:/bin"


async def test_a_launch_whose_release_keeps_failing_stays_held_until_it_works(stub, cluster, tmp_path):
    """The launch answers with the held job's id; its release, in the background, fails on
    every round: the job stays held (tracked, so no round cancels it) and never runs; once the
    release works (the cluster fixed) it runs, once, and a retried launch gets the same job."""
    name = "clusters/slurm-norelease"
    req = configure_request(cluster, name)
    req.options["PATH"] = _scontrol(tmp_path / "bin", "echo 'slurm_suspend error: Socket timed out' >&2; exit 1")
    await stub.ConfigureCluster(req, timeout=30)
    marker = pathlib.Path(cluster.home) / f"abandoned-{os.getpid()}-{time.monotonic_ns()}"
    jid = new_id("abandoned")
    spec = single(f"open({str(marker)!r}, 'a').write('ran\\n')")
    try:
        first = await stub.LaunchJob(dpb.LaunchJobRequest(cluster=name, job_id=jid, spec=spec, attempt=1),
                                     timeout=60)
        assert list(slurm_jobs(cluster, jid)) == [first.backend_job_id]
        ref = dpb.JobRef(job_id=jid, backend_job_id=first.backend_job_id)

        async def observed_until(ok) -> dpb.JobObservation:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 90
            while True:
                o = (await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                    cluster=name, jobs=[ref]), timeout=30)).observations[0]
                if ok(o):
                    return o
                assert time.monotonic() < deadline, o
                await asyncio.sleep(0.3)

        # the job says why it waits, not only Slurm's JobHeldUser
        obs = await observed_until(lambda o: "could not release" in o.message)
        assert obs.state == job_pb2.JOB_STATE_QUEUED and "Socket timed out" in obs.message, obs
        await asyncio.sleep(3 * GRACE)  # rounds past the grace: tracked, so never cancelled
        assert slurm_jobs(cluster, jid) == {first.backend_job_id: "PENDING"}
        assert not marker.exists()
        await stub.ConfigureCluster(configure_request(cluster, name), timeout=30)
        await until(lambda: slurm_jobs(cluster, jid), lambda j: j == {first.backend_job_id: "COMPLETED"})
        obs = await observed_until(lambda o: o.state == job_pb2.JOB_STATE_SUCCEEDED)
        assert "could not release" not in obs.message, obs
        again = await stub.LaunchJob(dpb.LaunchJobRequest(cluster=name, job_id=jid, spec=spec, attempt=1),
                                     timeout=60)
        assert again.backend_job_id == first.backend_job_id
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=name), timeout=30)
    assert marker.read_text().splitlines() == ["ran"]


async def test_a_job_held_while_its_own_launch_releases_it_is_never_cancelled(stub, cluster, tmp_path):
    """The release takes twice the grace: the rounds see the job held all that time, and leave
    it to the launch in flight, which then releases it; it runs once."""
    name = "clusters/slurm-slowrelease"
    req = configure_request(cluster, name)
    req.options["PATH"] = _scontrol(tmp_path / "bin", f"sleep {2 * GRACE}")
    await stub.ConfigureCluster(req, timeout=30)
    keep_busy = new_id("busy")
    await stub.LaunchJob(dpb.LaunchJobRequest(cluster=name, job_id=keep_busy,  # rounds run throughout
                                              spec=single("import time; time.sleep(30)"), attempt=1), timeout=60)
    marker = pathlib.Path(cluster.home) / f"slow-{os.getpid()}-{time.monotonic_ns()}"
    jid = new_id("slow")
    try:
        resp = await stub.LaunchJob(dpb.LaunchJobRequest(
            cluster=name, job_id=jid, spec=single(f"open({str(marker)!r}, 'a').write('ran\\n')"), attempt=1),
            timeout=60)
        await until(lambda: slurm_jobs(cluster, jid), lambda j: j.get(resp.backend_job_id) == "COMPLETED")
        assert slurm_jobs(cluster, jid) == {resp.backend_job_id: "COMPLETED"}
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=name), timeout=30)
    assert marker.read_text().splitlines() == ["ran"]


async def test_a_held_job_a_stop_is_the_first_to_name_is_cancelled_never_released(stub, cluster, tmp_path):
    """A job its driver submitted held and never released (it died), stopped by its ref before
    any observation named it: the driver adopts it to stop it, and never releases it first (it
    would start, however briefly, before the cancel)."""
    name = "clusters/slurm-stopheld"
    released = tmp_path / "released"
    req = configure_request(cluster, name)
    req.options["PATH"] = _scontrol(tmp_path / "bin", f"echo \"$2\" >> {released}")
    await stub.ConfigureCluster(req, timeout=30)
    jid = new_id("heldstop")
    marker = pathlib.Path(cluster.home) / f"{jid}.ran"
    held = sbatch(cluster, jid, f"touch {marker}", hold=True)
    try:
        resp = await stub.TerminateJob(dpb.TerminateJobRequest(
            cluster=name, job=dpb.JobRef(job_id=jid, backend_job_id=held)), timeout=60)
        assert resp.observation.found, resp.observation
        await until(lambda: slurm_jobs(cluster, jid), lambda j: j == {held: "CANCELLED"})
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=name), timeout=30)
    assert not marker.exists()
    assert held not in (released.read_text().split() if released.exists() else [])
