# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll a real Slurm, files and /proc
"""Slurm under a slow login node and a slow controller, through the services only (real Slurm
behind a real sshd, the Slurm driver as a process with a 3 s command timeout, ClusterManager and
JobManager over a real etcd):

- an ``sbatch`` wrapper on the remote PATH that, for 20 % of submissions, lands the job after the
  driver's command timeout, or errors after landing, or hangs after landing, or fails before
  landing: N jobs at concurrency 8 through JobManager make exactly N Slurm jobs that ever
  started (a marker file per dlsched job, written by the job with its Slurm id), every dlsched
  job SUCCEEDED tracked to the Slurm job that ran, no submit refused, and the cluster, watched
  through WatchClusters all along, never UNREACHABLE. N is 40 per variant here
  (``DLSCHED_SLURM_EXACTLY_ONCE_JOBS=300`` runs the issue's size: 4 x 300 jobs passed in 7 min,
  every job once, the cluster READY throughout);
- a login node whose commands hang (squeue and sbatch time out, the connection stays up): the
  cluster is DEGRADED, not UNREACHABLE; a job submitted meanwhile is accepted and stored, and
  runs once the node answers again; the cluster is READY again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security, slurm_cluster
from tests.harness import EtcdServer, ServiceProcess, Stack

asyncssh = pytest.importorskip("asyncssh")
if why := slurm_cluster.available():
    pytest.skip(why, allow_module_level=True)

S = job_pb2
C = cluster_pb2
CLUSTER = "clusters/slurm"
TIMEOUT = 3  # the driver's --command-timeout
JOBS = int(os.environ.get("DLSCHED_SLURM_EXACTLY_ONCE_JOBS", "40"))
TERMINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED)

#: sbatch behaviours, each for 20 % of submissions ($RANDOM % 5 == 0) while its name is in $CTL/sbatch.
#: The script is on stdin ($SCRIPT once saved); the real sbatch is $REAL. A landing that must outlive
#: the driver's kill of the timed-out command runs detached (setsid), as slurmctld would go on, with
#: the driver's own options (``--hold``): in ``bash -c`` "$@" starts at $1, the script, so "${@:2}".
VARIANTS = {
    "late": (f'setsid nohup bash -c \'sleep {TIMEOUT + 2}; "$0" "${{@:2}}" < "$1" >/dev/null 2>&1\' "$REAL" "$SCRIPT" "$@" '
             '</dev/null >/dev/null 2>&1 & sleep 120; exit 0'),
    "error-after": '"$REAL" "$@" < "$SCRIPT" >/dev/null; echo "sbatch: error: Socket timed out" >&2; exit 1',
    "hang-after": '"$REAL" "$@" < "$SCRIPT" >/dev/null; sleep 120; exit 0',
    "fail-before": 'echo "sbatch: error: Batch job submission failed: Socket timed out" >&2; exit 1',
}


def wrappers(bindir: pathlib.Path, ctl: pathlib.Path) -> str:
    """``sbatch`` and ``squeue`` wrappers steered by files in ``ctl``; the cluster's PATH option."""
    bindir.mkdir(parents=True, exist_ok=True)
    ctl.mkdir(parents=True, exist_ok=True)
    cases = "".join(f"  {name}) {body} ;;\n" for name, body in VARIANTS.items())
    (bindir / "sbatch").write_text(
        f"#!/bin/bash\nREAL={shutil.which('sbatch')}\nCTL={ctl}\n"
        "SCRIPT=$(mktemp)\ncat > \"$SCRIPT\"\n"  # (a warm sbatch started earlier gets here later)
        "[ -e \"$CTL/hang\" ] && { sleep 120; exit 0; }\n"
        "mode=$(cat \"$CTL/sbatch\" 2>/dev/null)\n"
        "if [ -n \"$mode\" ] && [ $((RANDOM % 5)) = 0 ]; then\n"
        f"  echo \"$mode\" >> \"$CTL/faults\"\n  case \"$mode\" in\n{cases}  esac\nfi\n"
        "exec \"$REAL\" \"$@\" < \"$SCRIPT\"\n")
    (bindir / "squeue").write_text(
        f"#!/bin/bash\n[ -e {ctl}/hang ] && sleep 120\nexec {shutil.which('squeue')} \"$@\"\n")
    for f in ("sbatch", "squeue"):
        (bindir / f).chmod(0o755)
    return f"{bindir}:/usr/bin:/bin"


@pytest.fixture(scope="module")
def slurm() -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster().start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ctl(slurm: slurm_cluster.SlurmCluster) -> pathlib.Path:
    return pathlib.Path(slurm.path("ctl"))


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer, slurm: slurm_cluster.SlurmCluster, ctl: pathlib.Path) -> Iterator[Stack]:
    driver = ServiceProcess("drivers.slurm", ["--poll-interval", "0.5", "--command-timeout", str(TIMEOUT)],
                            name="slurm-driver-ssh-services").start()
    st = Stack(etcd, f"/dlsched-slurm-ssh-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", "2"])
    try:
        st.start()
        with security.sync_channel(st.cm.address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            options = {**slurm.options(), "PATH": wrappers(pathlib.Path(slurm.path("wrappers")), ctl)}
            cm.CreateCluster(cm_pb.CreateClusterRequest(cluster_id="slurm", cluster=C.Cluster(
                type=S.CLUSTER_TYPE_SLURM, address=slurm.address, driver_address=driver.address, options=options,
                credentials=C.ClusterCredentials(ssh=C.SshCredentials(
                    username=slurm.user, private_key=slurm.user_key, known_host_keys=[slurm.host_key_pub])))),
                timeout=20)
            deadline = time.monotonic() + 60
            while cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER), timeout=10).cluster.state != \
                    C.CLUSTER_STATE_READY:
                assert time.monotonic() < deadline, "the Slurm cluster never READY"
                time.sleep(0.3)
    except BaseException:
        st.stop()
        driver.stop()
        raise
    yield st
    st.stop()
    driver.stop()


@pytest.fixture
async def jm(stack: Stack) -> AsyncIterator[jm_grpc.JobManagerServiceStub]:
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        yield jm_grpc.JobManagerServiceStub(ch)


@pytest.fixture
async def cm(stack: Stack) -> AsyncIterator[cm_grpc.ClusterManagerServiceStub]:
    async with security.channel(stack.cm.address) as ch:
        yield cm_grpc.ClusterManagerServiceStub(ch)


class States:
    """Every state WatchClusters shows for the Slurm cluster, from its snapshot on."""

    def __init__(self, cm: cm_grpc.ClusterManagerServiceStub) -> None:
        self.seen: list[int] = []
        self._call = cm.WatchClusters(cm_pb.WatchClustersRequest(filter="type=SLURM"))
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for ev in self._call:
                if ev.cluster.name == CLUSTER and (not self.seen or self.seen[-1] != ev.cluster.state):
                    self.seen.append(ev.cluster.state)

    async def until(self, state: int, within: float) -> None:
        deadline = time.monotonic() + within
        while not self.seen or self.seen[-1] != state:
            assert time.monotonic() < deadline, [C.ClusterState.Name(s) for s in self.seen]
            await asyncio.sleep(0.1)

    def names(self) -> list[str]:
        return [C.ClusterState.Name(s) for s in self.seen]

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def marking(markers: pathlib.Path) -> S.JobSpec:
    """A job that appends its Slurm job id to ``markers/<dlsched job id>``."""
    return S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, cluster_selector=S.ClusterSelector(cluster="slurm"),
                     replica_groups=[S.ReplicaGroup(role="main", replicas=1, command=[
                         "/bin/sh", "-c", f'echo "$SLURM_JOB_ID" >> {markers}/"$DLSCHED_JOB_ID"'],
                         resources=S.Resources(cpu=0.25))])


async def finished(jm: jm_grpc.JobManagerServiceStub, label: str, n: int, within: float) -> list[S.Job]:
    deadline = time.monotonic() + within
    while True:
        jobs = list((await jm.ListJobs(jpb.ListJobsRequest(filter=f'labels.run="{label}"', page_size=1000),
                                       timeout=30)).jobs)
        done = [j for j in jobs if j.state in TERMINAL]
        if len(done) == n:
            return jobs
        assert time.monotonic() < deadline, f"{len(done)} of {n} finished: {[j for j in jobs if j not in done][:3]}"
        await asyncio.sleep(1)


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_sbatch_faults_run_every_job_exactly_once_and_the_cluster_stays_reachable(
        jm, cm, slurm, ctl, variant):
    markers = pathlib.Path(slurm.home) / f"markers-{variant}-{uuid.uuid4().hex[:6]}"
    markers.mkdir()
    label = uuid.uuid4().hex[:12]
    states = States(cm)
    (ctl / "faults").unlink(missing_ok=True)
    (ctl / "sbatch").write_text(variant)
    refused: list[str] = []
    started = time.monotonic()
    try:
        await states.until(C.CLUSTER_STATE_READY, 30)
        sem = asyncio.Semaphore(8)

        async def submit(i: int) -> None:
            spec = marking(markers)
            spec.labels["run"] = label
            async with sem:
                try:
                    await jm.SubmitJob(jpb.SubmitJobRequest(job_id=f"x1-{label}-{i}", spec=spec,
                                                            request_id=f"r-{label}-{i}"), timeout=60)
                except Exception as e:  # noqa: BLE001 - counted and asserted below
                    refused.append(repr(e))

        await asyncio.gather(*(submit(i) for i in range(JOBS)))
        assert not refused, refused[:3]
        jobs = await finished(jm, label, JOBS, 120 + 2 * JOBS)
    finally:
        (ctl / "sbatch").unlink(missing_ok=True)
        await states.close()
    faults = (ctl / "faults").read_text().split() if (ctl / "faults").exists() else []
    assert faults, "the wrapper never faulted"  # 20 % of the submissions, at random
    assert [j.state for j in jobs] == [S.JOB_STATE_SUCCEEDED] * JOBS, [j for j in jobs if j.state !=
                                                                        S.JOB_STATE_SUCCEEDED][:3]
    ran = {p.name: p.read_text().split() for p in markers.iterdir()}
    assert len(ran) == JOBS and all(len(v) == 1 for v in ran.values()), \
        {k: v for k, v in ran.items() if len(v) != 1}  # each dlsched job ran exactly once
    assert {j.name.removeprefix("jobs/"): j.backend_job_id for j in jobs} == {k: v[0] for k, v in ran.items()}
    assert C.CLUSTER_STATE_UNREACHABLE not in states.seen, states.names()
    print(f"{variant}: {JOBS} jobs in {time.monotonic() - started:.0f} s, {len(faults)} sbatch faults, "
          f"cluster states {states.names()}")


async def test_a_congested_login_node_is_degraded_and_a_job_submitted_then_runs_when_it_recovers(
        jm, cm, slurm, ctl):
    markers = pathlib.Path(slurm.home) / f"markers-degraded-{uuid.uuid4().hex[:6]}"
    markers.mkdir()
    states = States(cm)
    busy = marking(markers)  # a tracked job keeps the poller's rounds going
    busy.replica_groups[0].command[:] = ["/bin/sh", "-c", "sleep 600"]
    busy_id = f"busy-{uuid.uuid4().hex[:8]}"
    try:
        await states.until(C.CLUSTER_STATE_READY, 30)
        await jm.SubmitJob(jpb.SubmitJobRequest(job_id=busy_id, spec=busy), timeout=60)
        deadline = time.monotonic() + 60
        while (await jm.GetJob(jpb.GetJobRequest(name=f"jobs/{busy_id}"), timeout=10)).job.state != \
                S.JOB_STATE_RUNNING:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)
        (ctl / "hang").touch()  # every squeue and sbatch now hangs; the connection stays up
        await states.until(C.CLUSTER_STATE_DEGRADED, 60)
        jid = f"degraded-{uuid.uuid4().hex[:8]}"
        job = (await jm.SubmitJob(jpb.SubmitJobRequest(job_id=jid, spec=marking(markers)), timeout=60)).job
        assert job.state == S.JOB_STATE_PENDING and job.cluster == CLUSTER, job  # accepted, stored
        await asyncio.sleep(2 * TIMEOUT)
        assert not (markers / jid).exists()
        (ctl / "hang").unlink()
        await states.until(C.CLUSTER_STATE_READY, 90)
        deadline = time.monotonic() + 120
        while (job := (await jm.GetJob(jpb.GetJobRequest(name=f"jobs/{jid}"), timeout=10)).job).state \
                not in TERMINAL:
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.5)
        assert job.state == S.JOB_STATE_SUCCEEDED, job
        assert (markers / jid).read_text().split() == [job.backend_job_id]  # launched once it recovered
        assert C.CLUSTER_STATE_UNREACHABLE not in states.seen, states.names()
    finally:
        (ctl / "hang").unlink(missing_ok=True)
        await jm.StopJob(jpb.StopJobRequest(name=f"jobs/{busy_id}"), timeout=30)
        await states.close()
