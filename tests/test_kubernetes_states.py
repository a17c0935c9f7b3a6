"""Pod status as the API reports it -> replica state and reason; replicas -> job state."""

from __future__ import annotations

import pytest

from drivers.common.base import JobState, ReplicaState
from drivers.common.planner import SuccessRule
from drivers.kubernetes import states


def pod(phase: str, *, reason: str = "", conditions: list | None = None,
        containers: list | None = None, node: str = "n1") -> dict:
    st: dict = {"phase": phase, "conditions": conditions or [], "containerStatuses": containers or []}
    if reason:
        st["reason"] = reason
        st["message"] = f"because {reason}"
    return {"spec": {"nodeName": node}, "status": st}


def waiting(reason: str) -> dict:
    return {"name": "main", "state": {"waiting": {"reason": reason, "message": "m"}}}


def terminated(code: int, reason: str) -> dict:
    return {"name": "main", "state": {"terminated": {"exitCode": code, "reason": reason,
                                                     "finishedAt": "2026-01-01T00:00:05Z"}}}


CASES = [
    (pod("Pending", node="", conditions=[{"type": "PodScheduled", "status": "False",
                                          "reason": "Unschedulable", "message": "0/3 nodes"}]),
     ReplicaState.PENDING, "Unschedulable", None),
    (pod("Pending", containers=[waiting("ImagePullBackOff")]), ReplicaState.PENDING, "ImagePullBackOff", None),
    (pod("Pending", containers=[waiting("ErrImagePull")]), ReplicaState.PENDING, "ErrImagePull", None),
    (pod("Pending", containers=[waiting("ContainerCreating")]), ReplicaState.PENDING, "Scheduled", None),
    (pod("Pending", containers=[waiting("CreateContainerConfigError")]), ReplicaState.PENDING,
     "CreateContainerConfigError", None),  # a Secret or ConfigMap may still come
    # A wait the kubelet never gets past: the replica fails (its pod is deleted: ``alive``)
    (pod("Pending", containers=[waiting("InvalidImageName")]), ReplicaState.FAILED, "InvalidImageName", None),
    (pod("Pending", containers=[waiting("ErrImageNeverPull")]), ReplicaState.PENDING, "ErrImageNeverPull",
     None),  # the image may yet be loaded onto the node
    (pod("Running", containers=[{"name": "proc-0", "state": {"running": {}}}, {**waiting("InvalidImageName"),
                                                                             "name": "proc-1"}]),
     ReplicaState.FAILED, "InvalidImageName", None),
    (pod("Pending", node=""), ReplicaState.PENDING, "Pending", None),
    (pod("Running"), ReplicaState.RUNNING, "Running", None),
    (pod("Running", containers=[waiting("CrashLoopBackOff")]), ReplicaState.RUNNING, "CrashLoopBackOff", None),
    (pod("Succeeded", containers=[terminated(0, "Completed")]), ReplicaState.SUCCEEDED, "Completed", 0),
    (pod("Failed", containers=[terminated(137, "OOMKilled")]), ReplicaState.FAILED, "OOMKilled", 137),
    # a non-zero exit the kubelet says no more of ("Error"), as every backend names it
    (pod("Failed", containers=[terminated(3, "Error")]), ReplicaState.FAILED, "NonZeroExit", 3),
    (pod("Failed", reason="Evicted"), ReplicaState.FAILED, "Evicted", None),
    (pod("Failed", reason="DeadlineExceeded"), ReplicaState.FAILED, "TimeLimitExceeded", None),  # as elsewhere
    (pod("Failed"), ReplicaState.FAILED, "Failed", None),
    # A replica of several processes (one container each): its first failing process fails it,
    # though the pod runs on (restartPolicy Never keeps it Running while one container runs).
    (pod("Running", containers=[{"name": "proc-0", "state": {"running": {}}},
                                {**terminated(137, "OOMKilled"), "name": "proc-1"}]),
     ReplicaState.FAILED, "OOMKilled", 137),
    (pod("Running", containers=[{"name": "proc-0", "state": {"running": {}}}, terminated(0, "Completed")]),
     ReplicaState.RUNNING, "Running", None),
    # MPI's launcher: its wait-for-workers init container failed, the main one never started.
    ({"spec": {}, "status": {"phase": "Failed", "initContainerStatuses": [
        {"name": "wait-for-workers", "state": {"terminated": {"exitCode": 255, "reason": "Error"}}}],
        "containerStatuses": [{"name": "main", "state": {"waiting": {"reason": "PodInitializing"}}}]}},
     ReplicaState.FAILED, "NonZeroExit", 255),
    (pod("Unknown"), ReplicaState.UNSPECIFIED, "Unknown", None),
    (pod("Bogus"), ReplicaState.UNSPECIFIED, "Unknown", None),
    ({}, ReplicaState.PENDING, "Pending", None),
]


@pytest.mark.parametrize(("p", "state", "reason", "code"), CASES)
def test_replica_of(p: dict, state: ReplicaState, reason: str, code: int | None) -> None:
    v = states.replica_of(p)
    assert (v.state, v.reason, v.exit_code) == (state, reason, code)


def test_times_and_node() -> None:
    p = pod("Succeeded", containers=[terminated(0, "Completed")])
    p["status"]["startTime"] = "2026-01-01T00:00:00Z"
    v = states.replica_of(p)
    assert v.end_time is not None and v.start_time is not None and v.end_time - v.start_time == 5
    assert v.node == "n1"


def test_a_failed_process_of_a_running_pod_leaves_the_pod_to_delete() -> None:
    """The failed replica's pod still runs its other processes: the job's end deletes it."""
    from drivers.common.planner import SuccessRule as Rule
    from drivers.kubernetes.tracking import Replica, TrackedJob, live_pods

    job = TrackedJob("c", "j", 1, "ns/j-1", "j-1", [Replica("worker", 0, "j-1-worker-0", ("proc-0", "proc-1"))],
                     Rule(frozenset({"worker"})))
    job.pods["j-1-worker-0"] = states.replica_of(pod("Running", containers=[
        {"name": "proc-0", "state": {"running": {}}}, {**terminated(1, "Error"), "name": "proc-1"}]))
    assert job.pods["j-1-worker-0"].alive and live_pods(job) == ["j-1-worker-0"]
    job.pods["j-1-worker-0"] = states.replica_of(pod("Failed", containers=[terminated(1, "Error")]))
    assert live_pods(job) == []


def test_a_pod_being_deleted_is_terminating_unless_a_disruption_deletes_it() -> None:
    """A stop's pod in its grace period is ``terminating``; one an eviction, a preemption or a
    taint deletes (DisruptionTarget) is not: that is the replica's failure, retried as one."""
    stopped = pod("Running")
    stopped["metadata"] = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
    assert states.replica_of(stopped).terminating
    evicted = pod("Running", conditions=[{"type": "DisruptionTarget", "status": "True",
                                          "reason": "EvictionByEvictionAPI"}])
    evicted["metadata"] = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
    assert not states.replica_of(evicted).terminating
    assert not states.replica_of(pod("Running")).terminating


def test_missing_pods() -> None:
    assert states.missing(deleted_by_us=True, seen=True).state is ReplicaState.STOPPED
    assert states.missing(deleted_by_us=False, seen=True).reason == "PodDeleted"
    assert states.missing(deleted_by_us=False, seen=False).state is ReplicaState.PENDING


def v(state: ReplicaState, reason: str = "", code: int | None = None) -> states.PodView:
    return states.PodView(state, reason, exit_code=code)


ALL = SuccessRule(frozenset({"worker"}))
PS = SuccessRule(frozenset({"worker"}), frozenset({"ps"}))
R, S, F, P, X = (ReplicaState.RUNNING, ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.PENDING,
                 ReplicaState.STOPPED)


def test_job_state_follows_the_success_rule() -> None:
    j = states.job_state([("worker", 0, v(S)), ("worker", 1, v(R))], ALL)
    assert j.state is JobState.RUNNING
    j = states.job_state([("worker", 0, v(S)), ("worker", 1, v(S))], ALL)
    assert (j.state, j.exit_code) == (JobState.SUCCEEDED, 0)
    j = states.job_state([("ps", 0, v(R)), ("worker", 0, v(S)), ("worker", 1, v(S))], PS)
    assert j.state is JobState.SUCCEEDED
    j = states.job_state([("ps", 0, v(X, "Stopped")), ("worker", 0, v(S))], PS)
    assert j.state is JobState.SUCCEEDED
    j = states.job_state([("worker", 0, v(R)), ("worker", 1, v(F, "OOMKilled", 137))], ALL)
    assert (j.state, j.reason, j.exit_code) == (JobState.FAILED, "OOMKilled", 137)
    assert "worker-1" in j.message
    j = states.job_state([("worker", 0, v(P, "Unschedulable")), ("worker", 1, v(P, "Pending"))], ALL)
    assert (j.state, j.reason) == (JobState.PENDING, "Unschedulable")
    j = states.job_state([("worker", 0, v(R)), ("worker", 1, v(P, "Submitted"))], ALL, stop_requested=True)
    assert j.state is JobState.STOPPING
    j = states.job_state([("worker", 0, v(X)), ("worker", 1, v(P, "Submitted"))], ALL, stop_requested=True)
    assert j.state is JobState.STOPPED


def test_a_failure_the_success_rule_did_not_end_wins_over_the_success() -> None:
    """A failed ps and every worker succeeded, seen together (a re-list after a driver restart or
    an API outage): the ps failed before the workers were done, so the job FAILS, as on the local
    backend; a ps that ended after them (the stop that follows the success) or that is being
    deleted (no disruption) does not undo the success."""
    def at(state: ReplicaState, reason: str, code: int, end: float | None,
           terminating: bool = False) -> states.PodView:
        return states.PodView(state, reason, exit_code=code, end_time=end, terminating=terminating)

    j = states.job_state([("ps", 0, v(F, "NonZeroExit", 1)), ("worker", 0, v(S, "Completed", 0))], PS)
    assert (j.state, j.reason, j.message, j.exit_code) == (JobState.FAILED, "NonZeroExit", "ps-0 exited with code 1", 1)
    j = states.job_state([("ps", 0, at(F, "NonZeroExit", 1, 10.0)), ("worker", 0, at(S, "Completed", 0, 20.0))], PS)
    assert j.state is JobState.FAILED
    j = states.job_state([("ps", 0, at(F, "NonZeroExit", 143, 30.0)), ("worker", 0, at(S, "Completed", 0, 20.0))], PS)
    assert j.state is JobState.SUCCEEDED
    j = states.job_state([("ps", 0, at(F, "NonZeroExit", 143, None, terminating=True)),
                          ("worker", 0, at(S, "Completed", 0, 20.0))], PS)
    assert j.state is JobState.SUCCEEDED
    # the failure that decided the job, not the 143 of a pod its end deleted (a re-list shows both)
    j = states.job_state([("ps", 0, at(F, "NonZeroExit", 143, 30.0, terminating=True)),
                          ("worker", 0, at(F, "NonZeroExit", 3, 20.0))], PS)
    assert (j.message, j.failed) == ("worker-0 exited with code 3", ("worker", 0))


def running(name: str) -> dict:
    return {"name": name, "state": {"running": {}}}


def test_each_process_of_a_pod_is_a_replica_status_indexed_as_on_every_backend() -> None:
    """Two replicas of two processes (a pod each, a container per process): one status per
    process, index = replica * 2 + k; process 1 of replica 1 exiting 3 is ``worker-3``, the rest
    run on until the job's end deletes their pods."""
    from drivers.kubernetes.tracking import Replica, TrackedJob, observation

    conts = ("proc-0", "proc-1")
    job = TrackedJob("c", "j", 1, "ns/j-1", "j-1", [Replica("worker", 0, "j-1-worker-0", conts),
                                                     Replica("worker", 1, "j-1-worker-1", conts)], ALL)
    job.pods["j-1-worker-0"] = states.replica_of(pod("Running", containers=[running("proc-0"), running("proc-1")]))
    job.pods["j-1-worker-1"] = states.replica_of(pod("Running", containers=[
        running("proc-0"), {**terminated(3, "Error"), "name": "proc-1"}]))
    obs = observation(job, None)
    assert (obs.state, obs.reason, obs.message, obs.exit_code) == (
        JobState.FAILED, "NonZeroExit", "worker-3 exited with code 3", 3)
    assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [
        ("worker", 0, R, None), ("worker", 1, R, None), ("worker", 2, R, None), ("worker", 3, F, 3)]
    assert obs.replicas[3].message == "exited with code 3"


def test_pods_dlsched_deleted_read_stopped_with_their_exit_code() -> None:
    """As a real kubelet reports a pod dlsched deleted (KEP-3329: phase Failed, the container
    terminated 143 by SIGTERM, deletionTimestamp set): the ps stopped after the workers
    succeeded, and every pod of a stopped job, are STOPPED 143, not FAILED."""
    from drivers.kubernetes.tracking import Replica, TrackedJob, observation

    def deleted_pod(code: int) -> dict:
        p = pod("Failed", containers=[terminated(code, "Error")])
        p["metadata"] = {"deletionTimestamp": "2026-01-01T00:01:01Z"}
        return p

    job = TrackedJob("c", "j", 1, "ns/j-1", "j-1", [Replica("ps", 0, "j-1-ps-0", ("main",)),
                                                     Replica("worker", 0, "j-1-worker-0", ("main",))], PS)
    job.pods["j-1-worker-0"] = states.replica_of(pod("Succeeded", containers=[terminated(0, "Completed")]))
    job.pods["j-1-ps-0"] = states.replica_of(pod("Running"))
    job.final = observation(job, None)
    assert job.final.state is JobState.SUCCEEDED
    job.deleted.add("j-1-ps-0")  # the success rule stops the ps
    job.pods["j-1-ps-0"] = states.replica_of(deleted_pod(143))
    assert [(r.role, r.state, r.exit_code) for r in observation(job, None).replicas] == [
        ("ps", X, 143), ("worker", S, 0)]

    stopped = TrackedJob("c", "k", 1, "ns/k-1", "k-1", [Replica("worker", 0, "k-1-worker-0", ("main",))], ALL)
    stopped.stop_requested = True  # TerminateJob; a driver restarted since: it did not note the deletion
    stopped.pods["k-1-worker-0"] = states.replica_of(deleted_pod(137))
    (r,) = observation(stopped, None).replicas
    assert (r.state, r.exit_code) == (X, 137)
