# ruff: noqa: ASYNC109, ASYNC110  -- polling etcd state in tests
"""The scheduler's launcher and tracker with fake ClusterManager and driver
clients over a real etcd: retry while the driver is down, refusal, a stop
that races the launch, a job the backend lost."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dlsched import errors
from dlsched.kit.etcd import connect
from job_manager.domain.errors import JobNotFound
from job_manager.domain.model import (
    Candidate,
    Job,
    JobSpec,
    JobState,
    NativeSpec,
    Observation,
    ReplicaGroup,
)
from job_manager.scheduler import Scheduler, SchedulerConfig
from job_manager.store import JobStore
from tests.harness import EtcdServer

CLUSTER = "clusters/fake"


class FakeCM:
    async def match(self, spec: JobSpec) -> list[Candidate]:
        return [Candidate(CLUSTER, eligible=True, driver_address="fake:1")]

    async def driver_address(self, cluster: str) -> str:
        return "fake:1"

    def forget(self, cluster: str) -> None:
        pass


class FakeDriver:
    def __init__(self) -> None:
        self.launch_errors: list[errors.DlschedError] = []
        self.launches: list[tuple[str, int]] = []
        self.terminated: list[str] = []
        self.terminated_ids: list[str] = []  # the backend id each terminate named
        self.cleaned: list[str] = []
        self.known: set[str] = set()
        self.forgotten: list[str] = []
        self.launch_gate: asyncio.Event | None = None
        self.uids: list[str] = []  # the job uid of each launch
        self.fail_at_once = 0  # launches whose answer says the attempt already FAILED
        self.events: asyncio.Queue[Observation | None] = asyncio.Queue()

    async def launch(self, cluster: str, job_id: str, spec: JobSpec,
                     attempt: int, uid: str = "") -> tuple[str, Observation | None]:
        self.uids.append(uid)
        if self.launch_gate is not None:
            await self.launch_gate.wait()
        if self.launch_errors:
            raise self.launch_errors.pop(0)
        self.launches.append((job_id, attempt))
        self.known.add(job_id)
        if self.fail_at_once:  # the attempt ended FAILED before its launch answered
            self.fail_at_once -= 1
            return f"b-{job_id}-{attempt}", Observation(job_id, f"b-{job_id}-{attempt}", state=JobState.FAILED,
                                                        reason="NonZeroExit", exit_code=7, attempt=attempt)
        return f"b-{job_id}-{attempt}", Observation(job_id, f"b-{job_id}-{attempt}",
                                                    state=JobState.QUEUED, attempt=attempt)

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        return NativeSpec("application/json", "{}")

    async def terminate(self, cluster: str, job_id: str, backend_job_id: str,
                        grace_seconds: float, uid: str = "") -> Observation | None:
        self.terminated.append(job_id)
        self.terminated_ids.append(backend_job_id)
        return None

    async def batch_get(self, cluster: str, refs: list[tuple[str, str]]) -> list[Observation]:
        return [Observation(j, b, found=j in self.known, state=JobState.RUNNING, attempt=1)
                if j in self.known else Observation(j, b, found=False) for j, b in refs]

    async def watch(self, cluster: str) -> AsyncIterator[Observation | None]:
        yield None  # empty snapshot
        while True:
            yield await self.events.get()

    async def cleanup(self, cluster: str, job_id: str, backend_job_id: str, uid: str = "") -> None:
        self.cleaned.append(job_id)

    async def forget(self, cluster: str, refs: list[tuple[str, str]]) -> int:
        self.forgotten.extend(j for j, _ in refs)
        return len(refs)


class FakePool:
    def __init__(self, drv: FakeDriver) -> None:
        self.drv = drv

    def get(self, address: str) -> Any:
        return self.drv


@pytest.fixture
async def env(etcd: EtcdServer, etcd_prefix: str) -> AsyncIterator[tuple[Scheduler, FakeDriver]]:
    client = await connect(etcd.endpoint)
    drv = FakeDriver()
    sched = Scheduler(JobStore(client, etcd_prefix), FakeCM(), FakePool(drv),  # type: ignore[arg-type]
                      SchedulerConfig(retry_initial_seconds=0.05, retry_max_seconds=0.1))
    yield sched, drv
    await sched.close()
    await client.close()


SPEC = JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="m", replicas=1, command=["x"])])


async def until(pred: Any, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.02)


async def stored(sched: Scheduler, job_id: str, pred: Any, timeout: float = 60) -> Job:
    """The stored job once ``pred`` holds of it (the launch runs after submit answered)."""
    async with asyncio.timeout(timeout):
        while not pred(job := await sched.store.get(job_id)):
            await asyncio.sleep(0.02)
    return job


async def test_submit_answers_before_the_launch(env: Any) -> None:
    sched, drv = env
    drv.launch_gate = asyncio.Event()  # the driver does not answer yet
    job, _ = await asyncio.wait_for(sched.submit("q", SPEC, "rq", dry_run=False, spec_bytes=10), 60)
    assert job.state == JobState.PENDING and job.reason == "LaunchQueued" and not job.launched
    assert (await sched.store.get("q")).reason == "LaunchQueued"
    drv.launch_gate.set()
    j = await stored(sched, "q", lambda j: j.launched)
    assert j.backend_job_id == "b-q-1" and j.reason == "" and drv.launches == [("q", 1)]
    assert drv.uids == [job.uid] and job.uid  # the driver marks the submission with the job's uid

    async def unlocked() -> bool:  # the job's lock goes with the launch, just after its write
        return len(sched._locks) == 0
    await until(unlocked)


async def test_unreachable_driver_leaves_job_pending_and_retries(env: Any) -> None:
    sched, drv = env
    drv.launch_errors = [errors.Unavailable("down"), errors.Unavailable("down")]
    drv.launch_gate = asyncio.Event()
    job, _ = await sched.submit("a", SPEC, "r", dry_run=False, spec_bytes=10)
    assert job.state == JobState.PENDING and not job.launched
    drv.launch_gate.set()
    await stored(sched, "a", lambda j: j.reason == "DriverUnavailable" or j.launched)

    async def launched() -> bool:
        return (await sched.store.get("a")).launched
    await until(launched)
    j = await sched.store.get("a")
    assert j.state == JobState.QUEUED and j.reason == "" and drv.launches == [("a", 1)]
    # A retried submit of a launched job launches nothing.
    again, _ = await sched.submit("", SPEC, "r", dry_run=False, spec_bytes=10)
    assert again.id == "a" and drv.launches == [("a", 1)]


async def test_refused_launch_fails_the_job(env: Any) -> None:
    sched, drv = env
    drv.launch_errors = [errors.InvalidArgument("no such mode")]
    await sched.submit("b", SPEC, "", dry_run=False, spec_bytes=10)
    job = await stored(sched, "b", lambda j: j.state.is_terminal())
    assert job.state == JobState.FAILED and job.reason == "LaunchRejected"
    assert drv.launches == []


async def test_stop_during_launch_terminates_backend_job(env: Any) -> None:
    sched, drv = env
    drv.launch_gate = asyncio.Event()
    await sched.submit("c", SPEC, "", dry_run=False, spec_bytes=10)
    await asyncio.sleep(0.2)  # the launch waits in the driver
    stopped = await sched.stop("c")
    assert stopped.state == JobState.STOPPED

    # The driver is told at once, by id (its launch's owner may be frozen: a launch it answers
    # later would run until the owner, or its successor, read the answer)...
    async def told() -> bool:
        return drv.terminated == ["c"] and drv.terminated_ids == [""]
    await until(told)
    drv.launch_gate.set()
    job = await stored(sched, "c", lambda j: "c" in drv.known)
    assert job.state == JobState.STOPPED

    async def terminated() -> bool:  # ... and by backend id once the launch answered
        return drv.terminated == ["c", "c"] and drv.terminated_ids == ["", "b-c-1"]
    await until(terminated)


async def test_an_attempt_lost_before_it_started_is_launched_again_whatever_max_retries(env: Any) -> None:
    """The driver says the backend lost the attempt before any process started (Slurm forgot a
    job slurmctld never saved): it never ran, so it is launched again as a new attempt though
    max_retries is 0, three times at most; then the job FAILS with that reason."""
    sched, drv = env
    job, _ = await sched.submit("lb", SPEC, "", dry_run=False, spec_bytes=10)
    for attempt in (1, 2, 3, 4):
        await stored(sched, "lb", lambda j, a=attempt: j.attempt == a and j.launched)
        drv.events.put_nowait(Observation("lb", f"b-lb-{attempt}", state=JobState.FAILED,
                                          reason="LostBeforeStart", attempt=attempt, job_uid=job.uid))
    final = await stored(sched, "lb", lambda j: j.state.is_terminal())
    assert (final.state, final.reason, final.attempt) == (JobState.FAILED, "LostBeforeStart", 4), final
    assert drv.launches == [("lb", 1), ("lb", 2), ("lb", 3), ("lb", 4)]


async def test_driver_losing_a_job_fails_it_after_snapshot(env: Any) -> None:
    sched, drv = env
    await sched.submit("d", SPEC, "", dry_run=False, spec_bytes=10)
    await stored(sched, "d", lambda j: j.launched)
    drv.known.discard("d")  # the backend forgot it
    sched._trackers.pop(CLUSTER).cancel()  # reconnect: a fresh snapshot without "d"
    sched.ensure_tracking(CLUSTER)

    async def lost() -> bool:
        return (await sched.store.get("d")).reason == "LostByBackend"
    await until(lost)
    assert (await sched.store.get("d")).state == JobState.FAILED


async def test_observations_of_an_earlier_job_of_the_same_id_change_nothing(env: Any) -> None:
    """A job of the same id deleted while its driver could not clean it up still reports, under
    the same backend name (Kubernetes, Ray) but another uid: its end or its loss must not become
    the new job's; the new job's own observations apply."""
    sched, drv = env
    job, _ = await sched.submit("u", SPEC, "", dry_run=False, spec_bytes=10)
    await stored(sched, "u", lambda j: j.launched)
    b, other = "b-u-1", "0" * 32
    drv.events.put_nowait(Observation("u", b, state=JobState.SUCCEEDED, exit_code=0, attempt=1, job_uid=other))
    drv.events.put_nowait(Observation("u", b, found=False, job_uid=other))
    drv.events.put_nowait(Observation("u", b, state=JobState.RUNNING, attempt=1, reason="Mine",
                                      job_uid=job.uid.replace("-", "")))
    j = await stored(sched, "u", lambda j: j.reason == "Mine" or j.state.is_terminal())
    assert j.state == JobState.RUNNING and j.exit_code is None, j


async def test_an_attempt_that_failed_before_its_launch_answered_is_retried(env: Any) -> None:
    """A process that exits at once: the launch's own answer already says FAILED. With retries
    left that is a retry (a failure seen later would be one too), not the job's end."""
    sched, drv = env
    drv.fail_at_once = 1
    spec = dataclasses.replace(SPEC, max_retries=1)
    await sched.submit("f", spec, "", dry_run=False, spec_bytes=10)
    j = await stored(sched, "f", lambda j: j.attempt == 2 and j.launched)
    assert j.state == JobState.QUEUED and drv.launches == [("f", 1), ("f", 2)], j
    drv.fail_at_once = 1
    await sched.submit("g", SPEC, "", dry_run=False, spec_bytes=10)  # no retries: it failed
    g = await stored(sched, "g", lambda j: j.state.is_terminal())
    assert (g.state, g.attempt, g.exit_code) == (JobState.FAILED, 1, 7), g


async def test_a_job_stopped_after_its_launch_answer_was_lost_is_terminated_on_the_backend(env: Any) -> None:
    """The launch reached the driver, which submitted, but the answer was lost (the driver
    frozen past the deadline): the job stays PENDING with no backend id, and a stop then ends it
    STOPPED at once. The driver goes on to report the backend job running: it is terminated
    (nothing else would ever stop it), and the job stays STOPPED."""
    sched, drv = env
    drv.launch_errors = [errors.Unavailable("deadline exceeded (the answer was lost)")] * 10_000
    drv.launch_gate = asyncio.Event()
    job, _ = await sched.submit("h", SPEC, "", dry_run=False, spec_bytes=10)
    drv.launch_gate.set()
    await stored(sched, "h", lambda j: j.reason == "DriverUnavailable")
    assert (await sched.stop("h")).state == JobState.STOPPED
    drv.events.put_nowait(Observation("h", "b-h-1", state=JobState.RUNNING, attempt=1, job_uid=job.uid))

    async def terminated() -> bool:
        return drv.terminated == ["h"]
    await until(terminated)
    j = await sched.store.get("h")
    assert j.state == JobState.STOPPED and not j.backend_job_id and drv.launches == []


async def test_late_observations_never_reopen_a_terminal_job(env: Any) -> None:
    sched, drv = env
    await sched.submit("e", SPEC, "", dry_run=False, spec_bytes=10)
    await stored(sched, "e", lambda j: j.launched)
    b = "b-e-1"
    drv.events.put_nowait(Observation("e", b, state=JobState.SUCCEEDED, exit_code=0, attempt=1))
    drv.events.put_nowait(Observation("e", b, state=JobState.RUNNING, attempt=1))

    async def drained() -> bool:
        return drv.events.empty() and (await sched.store.get("e")).state.is_terminal()
    await until(drained)
    await asyncio.sleep(0.1)
    j = await sched.store.get("e")
    assert j.state == JobState.SUCCEEDED and j.exit_code == 0

    async def forgotten() -> bool:  # the driver hears the end is recorded
        return drv.forgotten == ["e"]
    await until(forgotten)


async def test_a_late_observation_of_an_archived_job_never_removes_its_files(
        etcd: EtcdServer, etcd_prefix: str, tmp_path: Any) -> None:
    """A running (late) observation of a job etcd no longer has: a deleted job's backend job is
    stopped and its files removed, but an archived job's files stay (its logs are read through
    the history); the clean-up deleted them (StreamJobLogs of archived jobs: 'not known to
    this driver')."""
    from job_manager.convert import job_to_bytes
    from job_manager.history.store import HistoryStore, archived_entries

    client = await connect(etcd.endpoint)
    history = await HistoryStore.open(f"sqlite+aiosqlite:///{tmp_path}/history.db")
    drv = FakeDriver()
    sched = Scheduler(JobStore(client, etcd_prefix), FakeCM(), FakePool(drv),  # type: ignore[arg-type]
                      SchedulerConfig(retry_initial_seconds=0.05, retry_max_seconds=0.1), history=history)
    try:
        old = Job(id="arch", uid="u-arch", state=JobState.SUCCEEDED, cluster=CLUSTER, attempt=1,
                  spec=SPEC, backend_job_id="b-arch-1")
        await history.put(archived_entries([("arch", job_to_bytes(old), 10)]))
        await sched.apply(CLUSTER, Observation("arch", "b-arch-1", state=JobState.RUNNING, attempt=1,
                                               job_uid="u-arch"))
        await sched.apply(CLUSTER, Observation("gone", "b-gone-1", state=JobState.RUNNING, attempt=1,
                                               job_uid="u-gone"))

        async def both_stopped() -> bool:
            return sorted(drv.terminated) == ["arch", "gone"] and drv.cleaned == ["gone"]
        await until(both_stopped)
        await asyncio.sleep(0.2)
        assert drv.cleaned == ["gone"]  # the archived job's files stay
        # a job of that id deleted later (another uid): the archived one's id is no shield
        await sched.apply(CLUSTER, Observation("arch", "b-arch-2", state=JobState.RUNNING, attempt=1,
                                               job_uid="u-later"))

        async def later_cleaned() -> bool:
            return drv.cleaned == ["gone", "arch"]
        await until(later_cleaned)
    finally:
        await sched.close()
        await history.close()
        await client.close()


async def test_a_peer_that_does_not_answer_in_time_is_unavailable_not_deadline_exceeded() -> None:
    """JobManager's calls to a frozen ClusterManager or driver run out of their own time: the
    peer is unavailable, so the client gets UNAVAILABLE (retried by the channel's policy and
    the SDK), not gRPC's DEADLINE_EXCEEDED (which neither retries)."""
    import grpc

    from job_manager.clients import ClusterManagerClient, DriverClient
    from job_manager.domain.model import ReplicaGroup as Group
    from job_manager.domain.model import RunMode as Mode

    never = asyncio.Event()

    async def hang(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await never.wait()  # a frozen peer: the call is taken, never answered
        return b""

    handler = grpc.method_handlers_generic_handler("dlsched.v1.ClusterManagerService", {
        "MatchClusters": grpc.unary_unary_rpc_method_handler(hang),
        "GetCluster": grpc.unary_unary_rpc_method_handler(hang)})
    dhandler = grpc.method_handlers_generic_handler("dlsched.v1.DriverService", {
        "LaunchJob": grpc.unary_unary_rpc_method_handler(hang)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler, dhandler))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cm = ClusterManagerClient(f"127.0.0.1:{port}", timeout=0.5)
    drv = DriverClient(f"127.0.0.1:{port}", timeout=0.5)
    spec = JobSpec(run_mode=Mode.SINGLE_PROCESS, replica_groups=[Group(role="main", replicas=1, command=["x"])])
    try:
        for call, reason in ((cm.match(spec), "CLUSTER_MANAGER_UNAVAILABLE"),
                             (cm.driver_address("clusters/c"), "CLUSTER_MANAGER_UNAVAILABLE"),
                             (drv.launch("clusters/c", "j", spec, 1), "UNAVAILABLE")):
            with pytest.raises(errors.Unavailable) as ei:
                await call
            assert ei.value.reason == reason, ei.value
    finally:
        never.set()
        await cm.close()
        await drv.close()
        await server.stop(None)


def test_a_previous_attempt_still_running_is_waited_for_not_a_refusal() -> None:
    """A driver's PREVIOUS_ATTEMPT_ACTIVE (the last attempt has not ended there yet) is retried:
    it failed the job as LaunchRejected. A stale attempt or a spec the backend refuses is not."""
    from job_manager.scheduler import _retryable

    class Active(errors.FailedPrecondition):
        reason = "PREVIOUS_ATTEMPT_ACTIVE"

    class Stale(errors.FailedPrecondition):
        reason = "STALE_ATTEMPT"

    assert _retryable(Active("attempt 1 of job 'j' has not ended"))
    assert not _retryable(Stale("job 'j' is already at attempt 3"))
    assert not _retryable(errors.InvalidArgument("bad"))
    assert _retryable(errors.Unavailable("down"))


async def test_a_down_driver_is_probed_by_one_launch_at_a_time_not_by_every_queued_one(env: Any) -> None:
    """Its driver down, 40 queued launches each retried it every ``retry_max_seconds`` (read
    from etcd, called, logged): work in proportion to the backlog, which slowed every other
    call (SubmitJob 10x slower with 3,000 jobs waiting). Now one retry at a time probes the
    driver, with backoff; the others wait, each with the reason written once, and all launch
    once when it answers. A job stopped while it waits is never launched."""
    sched, drv = env
    drv.launch_errors = [errors.Unavailable("connections to all backends failing")] * 100_000
    ids = [f"w{i}" for i in range(40)]
    for i in ids:
        await sched.submit(i, SPEC, "", dry_run=False, spec_bytes=10)
    for i in ids:
        await stored(sched, i, lambda j: j.reason == "DriverUnavailable")
    assert (await sched.stop("w0")).state == JobState.STOPPED
    before = len(drv.uids)
    await asyncio.sleep(4)  # every queued job's own backoff (at most 0.1 s) would call ~40 times a 0.1 s
    probes = len(drv.uids) - before
    # one at a time, each at least retry_initial_seconds (0.05 s) after the last failure
    assert 0 < probes <= 4 / 0.05 + 2, probes
    drv.launch_errors = []

    async def all_launched() -> bool:
        return len(drv.launches) >= len(ids) - 1
    await until(all_launched)
    await asyncio.sleep(0.5)  # (nothing more may come)
    assert sorted(j for j, _ in drv.launches) == sorted(ids[1:]), drv.launches
    assert (await sched.store.get("w0")).state == JobState.STOPPED


async def test_the_gate_opens_for_the_jobs_own_failures_and_gives_one_probe_at_a_time() -> None:
    from job_manager.driver_gate import DriverGate, Turn

    gate = DriverGate(0.01, 0.05)
    assert await gate.turn() is Turn.GO
    gate.failed("BACKEND_UNAVAILABLE", "the job's own: the driver answered")
    assert not gate.closed and await gate.turn() is Turn.GO
    gate.failed("DRIVER_UNAVAILABLE", "down")
    assert gate.closed and (gate.reason, gate.message) == ("DRIVER_UNAVAILABLE", "down")
    assert gate.must_wait()  # (the first probe is due 0.01 s after the failure)
    waiters = [asyncio.ensure_future(gate.turn()) for _ in range(3)]
    first = await asyncio.wait_for(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), 10)
    assert [t.result() for t in first[0]] == [Turn.PROBE]  # one waiter woken to probe
    await asyncio.sleep(0.1)
    assert sum(t.done() for t in waiters) == 1 and gate.must_wait()  # the probe is out: the rest wait
    gate.failed("UNAVAILABLE", "still down")  # the probe failed
    gate.probed()
    second = await asyncio.wait_for(asyncio.wait([t for t in waiters if not t.done()],
                                                 return_when=asyncio.FIRST_COMPLETED), 10)
    assert [t.result() for t in second[0]] == [Turn.PROBE]
    gate.answered()  # the probe got an answer: every waiter goes
    rest = [t for t in waiters if t not in first[0] | second[0]]
    assert [await asyncio.wait_for(t, 10) for t in rest] == [Turn.GO]
    gate.probed()
    assert await gate.turn() is Turn.GO and not gate.closed
    # a probe that made no call (its job gone, etcd down): the next after the least delay, not at once
    gate.failed("DRIVER_UNAVAILABLE", "down")
    await asyncio.sleep(0.05)
    assert await gate.turn() is Turn.PROBE
    gate.probed()
    assert gate.must_wait()


async def test_a_never_launched_job_is_deleted_without_waiting_for_a_down_driver(etcd: EtcdServer, etcd_prefix: str) -> None:
    """Its driver frozen, DeleteJob of a job still waiting for its launch waited for the driver's
    clean-up (18 s each; a stranger's client with a 10 s deadline left jobs stopped, not deleted),
    though the clean-up of a job never launched is only the search for what a lost launch answer
    may have left. While the gate says the driver does not answer, the delete goes on at once and
    its recorded clean-up runs when the driver is back."""
    class Frozen(FakeDriver):
        def __init__(self) -> None:
            super().__init__()
            self.thawed = asyncio.Event()

        async def cleanup(self, cluster: str, job_id: str, backend_job_id: str, uid: str = "") -> None:
            await self.thawed.wait()
            await super().cleanup(cluster, job_id, backend_job_id, uid)

    client = await connect(etcd.endpoint)
    drv = Frozen()
    sched = Scheduler(JobStore(client, etcd_prefix), FakeCM(), FakePool(drv),  # type: ignore[arg-type]
                      SchedulerConfig(retry_initial_seconds=0.05, retry_max_seconds=0.1, inline_driver_seconds=3600))
    try:
        drv.launch_errors = [errors.Unavailable("connections to all backends failing")] * 100_000
        ids = [f"d{i}" for i in range(5)]
        for i in ids:
            await sched.submit(i, SPEC, "", dry_run=False, spec_bytes=10)
        for i in ids:
            await stored(sched, i, lambda j: j.reason == "DriverUnavailable")
        async with asyncio.timeout(120):  # (a wait for the frozen clean-up would be 3,600 s each)
            for i in ids:
                assert (await sched.delete(i, allow_missing=False)).state == JobState.STOPPED  # type: ignore[union-attr]
        for i in ids:
            with pytest.raises(JobNotFound):
                await sched.store.get(i)
        drv.launch_errors = []
        drv.thawed.set()

        async def cleaned() -> bool:
            return sorted(drv.cleaned) == ids
        await until(cleaned)
        assert drv.launches == []
    finally:
        drv.thawed.set()
        await sched.close()
        await client.close()


async def test_a_frozen_cluster_manager_lets_the_last_driver_address_serve() -> None:
    """Once the driver-address cache expired, every usage read asked a frozen ClusterManager for
    15 s: with the service config's retry the client's 30 s ran out, a bare DEADLINE_EXCEEDED.
    Known already, the address is asked for briefly, and the last one serves meanwhile; one
    never known is UNAVAILABLE."""
    import grpc

    from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
    from dlsched.v1 import cluster_pb2
    from job_manager import clients
    from job_manager.clients import ClusterManagerClient

    frozen = asyncio.Event()
    never = asyncio.Event()
    asked = []

    async def get(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        asked.append(1)
        if frozen.is_set():
            await never.wait()
        return cm_pb.GetClusterResponse(cluster=cluster_pb2.Cluster(
            name="clusters/c", driver_address="127.0.0.1:9", type=1)).SerializeToString()

    handler = grpc.method_handlers_generic_handler("dlsched.v1.ClusterManagerService", {
        "GetCluster": grpc.unary_unary_rpc_method_handler(get)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cm = ClusterManagerClient(f"127.0.0.1:{port}", timeout=600, cache_seconds=0.05)
    old = clients.STALE_LOOKUP_SECONDS
    clients.STALE_LOOKUP_SECONDS = 0.5
    try:
        assert await cm.driver_address("clusters/c") == "127.0.0.1:9"
        frozen.set()
        await asyncio.sleep(0.1)  # the cache has expired
        async with asyncio.timeout(60):  # (not the 600 s of a first look-up)
            assert await cm.driver_address("clusters/c") == "127.0.0.1:9"
            n = len(asked)
            assert await cm.driver_address("clusters/c") == "127.0.0.1:9"
        assert len(asked) == n  # asked again only after STALE_RETRY_SECONDS
        cm._timeout = 0.5
        with pytest.raises(errors.Unavailable):
            await cm.driver_address("clusters/other")
    finally:
        clients.STALE_LOOKUP_SECONDS = old
        never.set()
        await cm.close()
        await server.stop(None)
