"""The Driver contract, once, on every driver: each case runs against the four
drivers as real processes over real gRPC on their real peers (``tests/driver_contract.py``).

Each backend starts once for the module (a module-scoped parametrised
fixture: pytest runs one driver's cases together, then stops its peers).
A case that only some backends can show is parametrised over those only.
At the end, the kit's ``LaunchRules`` in-process: its lock table stays empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from dlsched.errors import FailedPrecondition
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import job_pb2
from drivers.common.base import JobObservation, LaunchResult, NativeSpec
from drivers.common.launches import Known, LaunchRules
from tests import security
from tests.driver_contract import (
    CLUSTER_RPCS,
    DRIVERS,
    PEERS,
    TERMINAL,
    Peer,
    cluster_calls,
    new_id,
    started,
)

STOPPING_OR_STOPPED = (job_pb2.JOB_STATE_STOPPING, job_pb2.JOB_STATE_STOPPED)


@pytest.fixture(scope="module", params=DRIVERS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Peer]:
    async with started(request.param) as p:
        yield p


@pytest.fixture
async def peer(backend: Peer) -> AsyncIterator[Peer]:
    yield backend
    await backend.forget_launched()


async def refused(call: object, code: grpc.StatusCode, reason: str) -> dict[str, str]:
    """Await ``call``; it must fail with ``code`` and ``reason``. Returns the ErrorInfo metadata."""
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call  # type: ignore[misc]
    info = error_info(ei.value)
    assert (ei.value.code(), info.reason if info else None) == (code, reason), ei.value.details()
    return dict(info.metadata) if info else {}


# --------------------------------------------------------------------------- clusters


@pytest.mark.parametrize("rpc", CLUSTER_RPCS)
async def test_an_unknown_cluster_is_cluster_not_configured(peer: Peer, rpc: str) -> None:
    unknown = f"clusters/{new_id('nowhere')}"
    md = await refused(cluster_calls(peer)[rpc](unknown), grpc.StatusCode.FAILED_PRECONDITION,
                       "CLUSTER_NOT_CONFIGURED")
    assert md.get("cluster") == unknown


async def test_removing_an_unknown_cluster_succeeds(peer: Peer) -> None:
    await peer.stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=f"clusters/{new_id('nowhere')}"), timeout=10)


# --------------------------------------------------------------------------- launch rules


async def test_the_same_attempt_again_returns_the_first_launch_and_runs_once(
        peer: Peer, tmp_path: pathlib.Path) -> None:
    job, marker = new_id(), tmp_path / "runs"
    marker.touch()
    spec = peer.marking(str(marker))
    first, second = await asyncio.gather(peer.launch(job, spec), peer.launch(job, spec))
    third = await peer.launch(job, spec)
    assert first.backend_job_id
    assert first.backend_job_id == second.backend_job_id == third.backend_job_id
    assert first.native_spec == second.native_spec == third.native_spec
    assert await peer.runs(job, str(marker)) == 1
    again = await peer.launch(job, spec)  # after the job ended (where the backend ends it)
    assert again.backend_job_id == first.backend_job_id and again.observation.attempt == 1
    assert await peer.runs(job, str(marker)) == 1


async def test_a_launch_whose_caller_left_runs_once_and_the_retry_gets_it(
        peer: Peer, tmp_path: pathlib.Path) -> None:
    """A caller that goes away mid-launch (its deadline; JobManager killed) leaves the launch
    to the driver: the job runs exactly once and is not failed for it, and the caller's retry of
    the same attempt gets that launch. Deadlines from "before the driver saw it" to "mid-submit"."""
    deadlines = (0.001, 0.002, 0.003, 0.004, 0.006, 0.01, 0.05, 0.3)  # on local 1-5 ms killed the spawn

    async def one(n: int, deadline: float) -> None:
        job, marker = new_id(), tmp_path / f"runs-{n}"
        marker.touch()
        spec = peer.marking(str(marker))
        peer.launched.append(job)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await peer.stub.LaunchJob(dpb.LaunchJobRequest(cluster=peer.cluster, job_id=job, spec=spec, attempt=1),
                                      timeout=deadline)
        retried = await peer.launch(job, spec)
        assert retried.observation.attempt == 1 and retried.backend_job_id
        assert await peer.runs(job, str(marker)) == 1, f"deadline {deadline}"
        final = (await peer.observe(job))[0]
        assert final.state != job_pb2.JOB_STATE_FAILED, (deadline, final)
        assert final.backend_job_id == retried.backend_job_id

    await asyncio.gather(*(one(n, d) for n, d in enumerate(deadlines)))


async def test_a_lower_attempt_is_stale(peer: Peer) -> None:
    job = new_id()
    await peer.launch(job, peer.sleeping(), attempt=2)
    md = await refused(peer.launch(job, peer.sleeping(), attempt=1), grpc.StatusCode.FAILED_PRECONDITION,
                       "STALE_ATTEMPT")
    assert md["attempt"] == "2"


async def test_a_new_attempt_waits_until_the_previous_one_ended(peer: Peer) -> None:
    job = new_id()
    first = await peer.launch(job, peer.sleeping(), attempt=1)
    md = await refused(peer.launch(job, peer.sleeping(), attempt=2), grpc.StatusCode.FAILED_PRECONDITION,
                       "PREVIOUS_ATTEMPT_ACTIVE")
    assert md["attempt"] == "1"
    await peer.terminate(job)
    await peer.wait_state(job)
    second = await peer.launch(job, peer.sleeping(), attempt=2)
    assert second.backend_job_id != first.backend_job_id and second.observation.attempt == 2


@pytest.mark.parametrize("restarted", [False, True], ids=["same-driver", "driver-restarted"])
async def test_a_job_id_launched_again_after_its_cleanup_runs_again(
        peer: Peer, tmp_path: pathlib.Path, restarted: bool) -> None:
    """DeleteJob cleans a job up and the same id may be submitted again (a new job: a new uid,
    attempt 1 again) while the backend may still list the first run (squeue's MinJobAge): the
    second launch is a new run, never the first one adopted (which had ended, so the new job
    would end at once without running). Also across a driver restart in between, which
    forgets everything the driver kept in memory."""
    job, marker = new_id(), tmp_path / "runs"
    marker.touch()
    spec = peer.marking(str(marker))
    await peer.launch(job, spec)
    assert await peer.runs(job, str(marker)) == 1
    await peer.cleanup(job)
    if restarted:
        await peer.restart()
    second = await peer.launch(job, spec, uid=str(uuid.uuid4()))
    assert second.observation.attempt == 1
    assert await peer.runs(job, str(marker)) == 2
    assert (await peer.observe(job))[0].backend_job_id == second.backend_job_id


async def test_an_ended_job_of_the_same_id_left_without_its_cleanup_is_cleaned_up_not_adopted(
        peer: Peer) -> None:
    """A job deleted while its driver could not clean it up (JobManager deletes it anyway), then
    a new job of the same id (another uid): the launch cleans the ended old job up and submits
    the new one. Adopting the old one would give the new job its end: it would never run."""
    job = new_id()
    await peer.run_printing(job, 1)
    ended = (await peer.observe(job))[0]
    assert ended.state in TERMINAL
    assert ended.job_uid.replace("-", "") == peer.uids[job].replace("-", "")  # observations name the job
    uid = str(uuid.uuid4())
    second = await peer.launch(job, peer.sleeping(), uid=uid)
    assert second.observation.state not in TERMINAL, second.observation
    now = (await peer.observe(job))[0]
    assert now.state not in TERMINAL and now.backend_job_id == second.backend_job_id, now
    assert now.job_uid.replace("-", "") == uid.replace("-", "")


async def test_a_forgotten_ended_job_of_the_same_id_left_without_its_cleanup_is_cleaned_up_not_adopted(
        peer: Peer) -> None:
    """The same once JobManager recorded the old job's end (ForgetJobs: the driver keeps it on
    the backend only, Kubernetes in its Service's record, Ray in its submission): the new
    job's launch finds it on the backend, cleans it up and submits anew."""
    job = new_id()
    await peer.run_printing(job, 1)
    ended = (await peer.observe(job))[0]
    await peer.stub.ForgetJobs(dpb.ForgetJobsRequest(cluster=peer.cluster, jobs=[
        dpb.JobRef(job_id=job, backend_job_id=ended.backend_job_id)]), timeout=peer.call_timeout)
    uid = str(uuid.uuid4())
    second = await peer.launch(job, peer.sleeping(), uid=uid)
    assert second.observation.state not in TERMINAL, second.observation
    now = (await peer.observe(job))[0]
    assert now.state not in TERMINAL and now.job_uid.replace("-", "") == uid.replace("-", ""), now


@pytest.mark.parametrize("restarted", [False, True], ids=["same-driver", "driver-restarted"])
async def test_a_running_job_of_the_same_id_left_without_its_cleanup_is_a_name_collision(
        peer: Peer, restarted: bool) -> None:
    """The same while the old job still runs: NAME_COLLISION naming the old uid, nothing stopped
    (it could be another installation's job); the new job's DeleteJob (a cleanup without a
    backend id, with the new job's uid, as JobManager sends it) stops and cleans the old one
    up, and then the new job launches. Also when the driver restarted after the old launch."""
    job, old, new = new_id(), str(uuid.uuid4()), str(uuid.uuid4())
    first = await peer.launch(job, peer.sleeping(), uid=old)
    if restarted:
        await peer.restart()
    md = await refused(peer.launch(job, peer.sleeping(), uid=new), grpc.StatusCode.FAILED_PRECONDITION,
                       "NAME_COLLISION")
    assert md["job_uid"].replace("-", "") == old.replace("-", "")  # (Slurm's comment keeps it without dashes)
    if not restarted:  # (a restarted driver is asked for the old job by nobody: JobManager deleted it)
        still = (await peer.observe(job))[0]
        assert still.state not in TERMINAL and still.backend_job_id == first.backend_job_id
    await peer.cleanup(job, dpb.JobRef(job_id=job, job_uid=new))
    deadline = time.monotonic() + 90
    while True:  # UNAVAILABLE while the old one is still ending: JobManager retries the launch
        try:
            second = await peer.launch(job, peer.sleeping(), uid=new)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.5)
    assert second.observation.state not in TERMINAL, second.observation
    gone = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
        cluster=peer.cluster, jobs=[dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=old)]),
        timeout=peer.call_timeout)).observations[0]
    assert not gone.found or gone.state in TERMINAL, gone  # the old one stopped, never left running


async def test_a_restarted_drivers_first_call_for_a_running_job_may_be_its_stop(peer: Peer) -> None:
    """StopJob right after a driver restart, before any observation named the job: the job is
    stopped (found by its ref), not answered "unknown" and left running."""
    job, uid = new_id(), str(uuid.uuid4())
    first = await peer.launch(job, peer.sleeping(), uid=uid)
    ref = dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=uid)
    await peer.restart()
    stopped = await peer.terminate(job, ref)
    assert stopped.found, stopped
    deadline = time.monotonic() + 90
    while (now := (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=peer.cluster, jobs=[ref]), timeout=peer.call_timeout)).observations[0]).state not in TERMINAL:
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.3)
    assert now.state == job_pb2.JOB_STATE_STOPPED, now


async def test_the_cleanup_of_an_earlier_job_of_the_id_stops_only_that_one(
        peer: Peer, tmp_path: pathlib.Path) -> None:
    """An earlier job of the id (attempt 2, its uid) still running across a driver restart, and
    a new job of the id (attempt 1): the new launch is refused NAME_COLLISION where the backend
    knows the old one by the id, or runs beside it. Either way the old job's cleanup by its ref
    stops the old job only: the new one runs on, its output still there."""
    job, old, new = new_id(), str(uuid.uuid4()), str(uuid.uuid4())
    beat = tmp_path / "beat"
    first = await peer.launch(job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        peer.group(f"import time\nwhile True:\n    open({str(beat)!r}, 'a').write('.')\n    time.sleep(0.2)")]),
        attempt=2, uid=old)
    deadline = time.monotonic() + 90
    while peer.name != "kubernetes" and not beat.exists():  # it runs (released), where pods run
        assert time.monotonic() < deadline, (await peer.observe(job))[0]
        await asyncio.sleep(0.2)
    await peer.restart()
    printing = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        peer.group("import time\nprint('new job here', flush=True)\ntime.sleep(600)")])
    old_ref = dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=old)
    beside = True
    try:
        second = await peer.launch(job, printing, uid=new)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and error_info(e).reason == "NAME_COLLISION", e
        beside = False
    if beside:  # (Slurm: a restarted driver knows jobs by their Slurm id, not by the job id alone)

        async def output() -> list[str]:
            req = dpb.TailJobLogsRequest(cluster=peer.cluster, job=dpb.JobRef(
                job_id=job, backend_job_id=second.backend_job_id, job_uid=new))
            return [e.text async for r in peer.stub.TailJobLogs(req, timeout=60) for e in r.entries]
        deadline = time.monotonic() + 90
        while "new job here" not in await output():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
    await peer.cleanup(job, old_ref)
    if beside:
        deadline, last, still = time.monotonic() + 90, -1, time.monotonic()
        while time.monotonic() - still < 3:  # the old one's heart beat stops
            if (size := beat.stat().st_size) != last:
                last, still = size, time.monotonic()
            assert time.monotonic() < deadline, "the earlier job still runs after its cleanup"
            await asyncio.sleep(0.2)
        now = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=peer.cluster, jobs=[dpb.JobRef(job_id=job, backend_job_id=second.backend_job_id, job_uid=new)]),
            timeout=peer.call_timeout)).observations[0]
        assert now.found and now.state not in TERMINAL, now
        assert "new job here" in await output()
    else:
        gone = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=peer.cluster, jobs=[old_ref]), timeout=peer.call_timeout)).observations[0]
        assert not gone.found or gone.state in TERMINAL, gone
    await peer.cleanup(job, dpb.JobRef(job_id=job, job_uid=new))


async def test_a_late_cleanup_of_a_forgotten_earlier_job_leaves_the_new_job_of_its_id_alone(peer: Peer) -> None:
    """An ended job whose end JobManager recorded (forgotten), a new job of its id launched, and
    then the earlier job's cleanup by its ref (a retry arriving late): the new job runs on, and
    its output is still there (on Slurm a job id's attempts share one directory)."""
    job = new_id()
    if peer.name == "kubernetes":  # (the test plays the kubelet)
        await peer.run_printing(job, 1)
        ended = (await peer.observe(job))[0]
    else:  # attempt 2: its record stays beside the new job's attempt 1
        await peer.launch(job, peer.marking(os.devnull), attempt=2)
        ended = await peer.wait_state(job)
    await peer.stub.ForgetJobs(dpb.ForgetJobsRequest(cluster=peer.cluster, jobs=[
        dpb.JobRef(job_id=job, backend_job_id=ended.backend_job_id)]), timeout=peer.call_timeout)
    await asyncio.sleep(3)  # its record written (Slurm): from then on the driver knows it only from there
    uid = str(uuid.uuid4())
    second = await peer.launch(job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        peer.group("import time\nprint('new job here', flush=True)\ntime.sleep(600)")]), uid=uid)
    ref = dpb.JobRef(job_id=job, backend_job_id=second.backend_job_id, job_uid=uid)

    async def output() -> list[str]:
        req = dpb.TailJobLogsRequest(cluster=peer.cluster, job=ref)
        return [e.text async for r in peer.stub.TailJobLogs(req, timeout=60) for e in r.entries]
    deadline = time.monotonic() + 90
    while peer.name != "kubernetes" and "new job here" not in await output():  # (no pod runs there)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.5)
    await peer.cleanup(job, dpb.JobRef(job_id=job, backend_job_id=ended.backend_job_id,
                                       job_uid=peer.uids[job]))
    now = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
        cluster=peer.cluster, jobs=[ref]), timeout=peer.call_timeout)).observations[0]
    assert now.found and now.state not in TERMINAL, now
    if peer.name != "kubernetes":
        assert "new job here" in await output()
    await peer.cleanup(job, ref)


async def test_after_a_driver_restart_a_running_job_of_the_same_id_is_a_name_collision(peer: Peer) -> None:
    """The same after a driver restart (nothing of the old job in the driver's memory): the new
    job is never started beside the old one (on Slurm they would share the attempt directory)
    nor given its state. Once the old one is stopped and cleaned up, the new one launches."""
    job, old, new = new_id(), str(uuid.uuid4()), str(uuid.uuid4())
    first = await peer.launch(job, peer.sleeping(), uid=old)
    await peer.restart()
    md = await refused(peer.launch(job, peer.sleeping(), uid=new), grpc.StatusCode.FAILED_PRECONDITION,
                       "NAME_COLLISION")
    assert md["job_uid"].replace("-", "") == old.replace("-", "")
    ref = dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=old)
    deadline = time.monotonic() + 90
    while True:  # JobManager's watch asks for it by its ref, which makes a restarted driver track it
        seen = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=peer.cluster, jobs=[ref]), timeout=peer.call_timeout)).observations[0]
        if seen.found:
            break
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.3)
    await peer.terminate(job, ref)
    await peer.wait_state(job)
    await peer.cleanup(job, ref)
    second = await peer.launch(job, peer.sleeping(), uid=new)
    assert second.observation.state not in TERMINAL, second.observation


async def test_a_stop_or_cleanup_of_an_earlier_job_of_the_same_id_leaves_the_new_one_alone(peer: Peer) -> None:
    """JobManager still reaping an earlier job of the same id (deleted, its stop retried) names
    its backend id and uid; on Kubernetes and Ray the new job has the same backend id. The
    driver must not stop or delete the new job for it."""
    job, uid = new_id(), str(uuid.uuid4())
    first = await peer.launch(job, peer.sleeping(), uid=uid)
    earlier = dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=str(uuid.uuid4()))
    gone = await peer.terminate(job, earlier)
    assert not gone.found, gone
    await peer.cleanup(job, earlier)
    still = (await peer.observe(job))[0]
    assert still.found and still.state not in TERMINAL + STOPPING_OR_STOPPED, still
    mine = dpb.JobRef(job_id=job, backend_job_id=first.backend_job_id, job_uid=uid)
    stopped = await peer.terminate(job, mine)
    assert stopped.state in STOPPING_OR_STOPPED, stopped
    # the same once the new job ended and was forgotten (read back from the backend when asked)
    await peer.wait_state(job)
    await peer.stub.ForgetJobs(dpb.ForgetJobsRequest(cluster=peer.cluster, jobs=[mine]), timeout=peer.call_timeout)
    await peer.cleanup(job, earlier)

    async def asked(ref: dpb.JobRef) -> dpb.JobObservation:
        return (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=peer.cluster, jobs=[ref]), timeout=peer.call_timeout)).observations[0]
    kept = await asked(mine)
    assert kept.found and kept.state in TERMINAL, kept
    assert not (await asked(earlier)).found


async def test_a_job_uid_that_is_not_one_is_invalid_argument(peer: Peer) -> None:
    for bad in ("a b", "x\n#SBATCH --uid=0", "u" * 64, "a.b", "a/b", "-ab", "ab-", "---"):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await peer.launch(new_id(), peer.sleeping(), uid=bad)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(ei.value)] == ["job_uid"], ei.value.details()


@pytest.mark.parametrize("backend", [n for n in DRIVERS if PEERS[n].jobs_span_clusters], indirect=True)
async def test_a_job_running_on_another_cluster_is_refused(peer: Peer) -> None:
    """Only where one backend serves several cluster names (local: one host); elsewhere each
    cluster is its own backend and job namespace, and JobManager never moves a job."""
    other = f"clusters/{new_id('other')}"
    await peer.stub.ConfigureCluster(peer.configure_request(other), timeout=30)
    try:
        job = new_id()
        await peer.launch(job, peer.sleeping())
        md = await refused(peer.launch(job, peer.sleeping(), cluster=other), grpc.StatusCode.FAILED_PRECONDITION,
                           "JOB_ON_OTHER_CLUSTER")
        assert md["cluster"] == peer.cluster
    finally:
        await peer.stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=other), timeout=10)


@pytest.mark.parametrize("backend", [n for n in DRIVERS if PEERS[n].jobs_span_clusters], indirect=True)
async def test_an_ended_earlier_job_on_a_cluster_since_removed_is_cleaned_up_not_waited_for(peer: Peer) -> None:
    """An ended job of the same id and another uid, known on a cluster name this driver no
    longer serves: the new job's launch cleans it up and runs, rather than failing
    CLUSTER_NOT_CONFIGURED (retried by JobManager for ever) for a cluster it did not name."""
    other = f"clusters/{new_id('gone')}"
    await peer.stub.ConfigureCluster(peer.configure_request(other), timeout=30)
    job = new_id()
    try:
        await peer.launch(job, peer.sleeping(0), cluster=other)
        deadline = time.monotonic() + 90
        while True:
            obs = (await peer.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster=other, jobs=[dpb.JobRef(job_id=job)]), timeout=peer.call_timeout)).observations[0]
            if obs.state in TERMINAL:
                break
            assert time.monotonic() < deadline, obs
            await asyncio.sleep(0.1)
    finally:
        await peer.stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=other), timeout=10)
    uid = str(uuid.uuid4())
    second = await peer.launch(job, peer.sleeping(), uid=uid)
    assert second.observation.state not in TERMINAL, second.observation
    now = (await peer.observe(job))[0]
    assert now.state not in TERMINAL and now.job_uid == uid, now


# --------------------------------------------------------------------------- stop / cleanup


async def test_terminate_and_cleanup_of_an_unknown_job_succeed(peer: Peer) -> None:
    job = new_id("unknown")
    assert not (await peer.terminate(job)).found
    await peer.cleanup(job)
    await peer.cleanup(job)
    assert not (await peer.observe(job))[0].found


async def test_terminate_twice_and_after_the_end_is_fine(peer: Peer) -> None:
    job = new_id()
    await peer.launch(job, peer.sleeping())
    one = await peer.terminate(job)
    two = await peer.terminate(job)
    assert one.found and two.found
    assert one.state in STOPPING_OR_STOPPED and two.state in STOPPING_OR_STOPPED
    assert (await peer.wait_state(job)).state == job_pb2.JOB_STATE_STOPPED
    assert (await peer.terminate(job)).state == job_pb2.JOB_STATE_STOPPED
    await peer.cleanup(job)
    assert not (await peer.observe(job))[0].found


# --------------------------------------------------------------------------- observations


async def test_watch_sends_the_snapshot_then_the_marker_then_changes(peer: Peer) -> None:
    call = peer.stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=peer.cluster))
    it = call.__aiter__()
    try:
        while True:
            ev = await asyncio.wait_for(it.__anext__(), 30)
            if ev.snapshot_complete:
                assert not ev.HasField("observation")
                break
            assert ev.HasField("observation") and ev.observation.found, ev
        job = new_id()
        await peer.launch(job, peer.sleeping())
        while True:
            ev = await asyncio.wait_for(it.__anext__(), 30)
            assert not ev.snapshot_complete and ev.observation.found
            if ev.observation.job_id == job:
                break
    finally:
        call.cancel()


async def test_batch_get_answers_in_the_order_of_the_refs(peer: Peer) -> None:
    a, b, missing = new_id("a"), new_id("b"), new_id("missing")
    await peer.launch(a, peer.sleeping())
    await peer.launch(b, peer.sleeping())
    obs = await peer.observe(b, missing, a, b)
    assert [(o.job_id, o.found) for o in obs] == [(b, True), (missing, False), (a, True), (b, True)]


# --------------------------------------------------------------------------- logs


class _Mux:
    """A MultiplexJobLogs stream: what arrived for each tail, read by a task."""

    def __init__(self, peer: Peer) -> None:
        self.out: asyncio.Queue[dpb.MultiplexJobLogsRequest | None] = asyncio.Queue()
        self.batches: dict[int, list[dpb.TailJobLogsResponse]] = {}
        self.ends: dict[int, Any] = {}
        self.changed = asyncio.Event()
        self.auto: set[int] = set()  # tails given a credit back for each batch, as JobManager does
        self.call = peer.stub.MultiplexJobLogs(self._requests(), timeout=300)
        self.reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[dpb.MultiplexJobLogsRequest]:
        while (msg := await self.out.get()) is not None:
            yield msg

    async def _read(self) -> None:
        async for resp in self.call:
            if resp.HasField("batch"):
                assert resp.tail_id not in self.ends, "a batch after the end"
                self.batches.setdefault(resp.tail_id, []).append(resp.batch)
                if resp.tail_id in self.auto:
                    self.out.put_nowait(dpb.MultiplexJobLogsRequest(tail_id=resp.tail_id, credit=1))
            else:
                self.ends[resp.tail_id] = resp.end
            self.changed.set()

    def open(self, tail_id: int, request: dpb.TailJobLogsRequest, credit: int) -> None:
        self.out.put_nowait(dpb.MultiplexJobLogsRequest(
            tail_id=tail_id, open=dpb.OpenTail(request=request, credit=credit)))

    async def until(self, what: Callable[[], bool], within: float = 90.0) -> None:
        deadline = time.monotonic() + within
        while not what():
            assert not self.reader.done(), self.reader
            left = deadline - time.monotonic()
            assert left > 0, (self.batches, self.ends)
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))

    def lines(self, tail_id: int) -> list[tuple[str, int, int, str]]:
        return [(e.role, e.replica_index, e.stream, e.text)
                for b in self.batches.get(tail_id, []) for e in b.entries]


async def test_multiplexed_tails_answer_as_tail_calls_each_at_its_own_pace(peer: Peer) -> None:
    """One MultiplexJobLogs stream: each tail sends what a TailJobLogs call would (lines, then
    an OK end; a refusal as the end's status with its ErrorInfo), a tail with no credit left
    waits while another on the stream finishes, and credit lets it go on."""
    job = new_id()
    await peer.run_printing(job, 3000)
    req = dpb.TailJobLogsRequest(cluster=peer.cluster, job=dpb.JobRef(job_id=job))
    want: list[tuple[str, int, int, str]] = []
    async for resp in peer.stub.TailJobLogs(req, timeout=60):
        want += [(e.role, e.replica_index, e.stream, e.text) for e in resp.entries]
    assert [w[3] for w in want if w[2] == job_pb2.LOG_STREAM_STDOUT] == [peer.line(i) for i in range(3000)]

    mux = _Mux(peer)
    try:
        unknown = f"clusters/{new_id('nowhere')}"
        mux.open(1, dpb.TailJobLogsRequest(cluster=unknown, job=dpb.JobRef(job_id=job)), credit=4)
        mux.open(2, req, credit=1)  # slow: one batch, then waits for credit
        mux.auto.add(3)
        mux.open(3, req, credit=4)
        await mux.until(lambda: 1 in mux.ends and 3 in mux.ends)
        st = mux.ends[1]
        assert st.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], st
        info = error_details_pb2.ErrorInfo()
        assert st.details[0].Unpack(info) and info.reason == "CLUSTER_NOT_CONFIGURED", st
        assert info.metadata["cluster"] == unknown
        assert mux.ends[3].code == 0 and mux.lines(3) == want
        many = len(mux.batches[3]) >= 2
        if many:  # more than one batch: tail 2 has its first and waits
            assert len(mux.batches.get(2, [])) == 1 and 2 not in mux.ends
        assert peer.name != "local" or many, "the local backlog comes in several batches"
        mux.auto.add(2)
        mux.out.put_nowait(dpb.MultiplexJobLogsRequest(tail_id=2, credit=4))
        await mux.until(lambda: 2 in mux.ends)
        assert mux.ends[2].code == 0 and mux.lines(2) == want
        # A closed tail sends nothing more; ids only grow; the client's end ends the stream.
        mux.open(4, dpb.TailJobLogsRequest(cluster=peer.cluster, job=dpb.JobRef(job_id=job), follow=True),
                 credit=1)
        mux.out.put_nowait(dpb.MultiplexJobLogsRequest(tail_id=4, close=True))
        mux.out.put_nowait(None)
        await asyncio.wait_for(mux.reader, 60)
        assert 4 not in mux.ends and len(mux.batches.get(4, [])) <= 1
    finally:
        mux.call.cancel()


async def test_long_lines_come_in_pieces_and_no_message_nears_the_channel_limit(peer: Peer) -> None:
    """A 200,000-character line and 60 lines of 40,000 (2.4 MB written at once):
    the long line arrives in order as pieces of MAX_LINE_CHARS, every message
    carries at most about 1 MiB (one over the channels' 8 MiB limit would end
    every tail of a MultiplexJobLogs stream), and nothing is lost."""
    from drivers.common.convert import BATCH_BYTES, MAX_LINE_CHARS

    job = new_id()
    await peer.run_long_lines(job)
    req = dpb.TailJobLogsRequest(cluster=peer.cluster, job=dpb.JobRef(job_id=job),
                                 streams=[job_pb2.LOG_STREAM_STDOUT])
    texts: list[str] = []
    async for resp in peer.stub.TailJobLogs(req, timeout=120):
        assert resp.ByteSize() <= BATCH_BYTES + 4096, resp.ByteSize()
        texts += [e.text for e in resp.entries]
    want = [line[i:i + MAX_LINE_CHARS] for line in peer.long_lines()
            for i in range(0, len(line), MAX_LINE_CHARS)]
    assert texts == want, [len(t) for t in texts]


async def test_a_malformed_multiplex_message_ends_the_stream_invalid_argument(peer: Peer) -> None:
    req = dpb.TailJobLogsRequest(cluster=peer.cluster, job=dpb.JobRef(job_id=new_id()))
    cases = [
        ([dpb.MultiplexJobLogsRequest(tail_id=1, open=dpb.OpenTail(request=req, credit=1)),
          dpb.MultiplexJobLogsRequest(tail_id=1, open=dpb.OpenTail(request=req, credit=1))], "tail_id"),
        ([dpb.MultiplexJobLogsRequest(tail_id=0, open=dpb.OpenTail(request=req, credit=1))], "tail_id"),
        ([dpb.MultiplexJobLogsRequest(tail_id=1, open=dpb.OpenTail(request=req, credit=0))], "open.credit"),
        ([dpb.MultiplexJobLogsRequest(tail_id=1, open=dpb.OpenTail(request=req, credit=1025))], "open.credit"),
        ([dpb.MultiplexJobLogsRequest(tail_id=1)], "action"),
    ]
    for msgs, field in cases:
        call = peer.stub.MultiplexJobLogs(iter(msgs), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, ei.value.details())
        assert [v.field for v in field_violations(ei.value)] == [field], ei.value.details()
    # Bytes that are no MultiplexJobLogsRequest: a status of the kit's, not grpc's bare UNKNOWN.
    assert peer.driver is not None
    async with security.channel(peer.driver.address) as ch:
        call = ch.stream_stream("/dlsched.v1.DriverService/MultiplexJobLogs", request_serializer=None,
                                response_deserializer=None)(iter([b"\xff\xff\xff"]), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
    info = error_info(ei.value)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info is not None, ei.value.details()
    assert info.reason == "MALFORMED_REQUEST"


# --------------------------------------------------------------------------- optional capabilities


@pytest.mark.parametrize("backend", [n for n in DRIVERS if PEERS[n].unsupported], indirect=True)
async def test_an_unsupported_capability_is_unimplemented(peer: Peer) -> None:
    """Local and Slurm offer every optional RPC (logs, usage); the others refuse theirs."""
    job = new_id()
    await peer.launch(job, peer.sleeping())
    for rpc in type(peer).unsupported:
        await refused(cluster_calls(peer, job)[rpc](peer.cluster), grpc.StatusCode.UNIMPLEMENTED, "UNSUPPORTED")


# --------------------------------------------------------------------------- the kit in-process


def _result(attempt: int) -> LaunchResult:
    return LaunchResult(f"b-{attempt}", NativeSpec("text/plain", ""),
                        JobObservation(job_id="j", found=True, attempt=attempt))


async def test_launch_rules_serialise_a_job_and_keep_no_lock_after() -> None:
    rules, submitted = LaunchRules(), []
    jobs: dict[str, Known] = {}

    def known() -> Known | None:
        return jobs.get("j")

    def launcher(attempt: int, active: bool = True):  # type: ignore[no-untyped-def]
        async def submit() -> LaunchResult:
            await asyncio.sleep(0.01)  # a concurrent launch arrives meanwhile
            submitted.append(attempt)
            jobs["j"] = Known("clusters/a", attempt, active, lambda: _result(attempt))
            return _result(attempt)
        return submit

    got = await asyncio.gather(*(rules.launch("clusters/a", "j", 1, known=known, submit=launcher(1))
                                 for _ in range(5)))
    assert submitted == [1] and {r.backend_job_id for r in got} == {"b-1"}
    with pytest.raises(FailedPrecondition) as ei:
        await rules.launch("clusters/a", "j", 2, known=known, submit=launcher(2))
    assert ei.value.reason == "PREVIOUS_ATTEMPT_ACTIVE"
    jobs["j"] = Known("clusters/a", 1, False, lambda: _result(1))
    assert (await rules.launch("clusters/a", "j", 2, known=known, submit=launcher(2))).backend_job_id == "b-2"
    for attempt, cluster, reason in ((1, "clusters/a", "STALE_ATTEMPT"), (3, "clusters/b", "JOB_ON_OTHER_CLUSTER")):
        with pytest.raises(FailedPrecondition) as ei:
            await rules.launch(cluster, "j", attempt, known=known, submit=launcher(attempt))
        assert ei.value.reason == reason
    release, done = asyncio.Event(), []

    async def slow_submit() -> LaunchResult:
        await release.wait()
        done.append("k")
        return _result(1)

    slow = asyncio.ensure_future(rules.launch("clusters/a", "k", 1, known=lambda: None, submit=slow_submit))
    await asyncio.sleep(0.01)
    assert len(rules) == 1 and rules.inflight == 1
    slow.cancel()  # the caller leaves: the launch is the driver's and goes on
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert len(rules) == 1 and not done
    release.set()
    await rules.drain(10)
    assert done == ["k"]
    assert len(rules) == 0 and rules.inflight == 0  # pruned after success, refusal and a caller that left
