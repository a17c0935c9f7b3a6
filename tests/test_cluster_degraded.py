"""CLUSTER_STATE_DEGRADED: a cluster reachable but slow stays eligible for jobs (they are
stored and launched as it recovers); an UNREACHABLE one is refused; one whose driver is down
(DRIVER_UNAVAILABLE) but answered lately is matched after every cluster that is up (the job
waits for it). The enum value is the same number in the API, the domain and the driver kit."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from cluster_manager import convert
from cluster_manager.domain.errors import NoMatchingCluster
from cluster_manager.domain.matching import DOWN_WAIT_SECONDS, rank
from cluster_manager.domain.models import ClusterState
from dlsched.v1 import cluster_pb2
from drivers.common import base
from tests.test_cluster_matching import cap, cluster, job


def test_a_degraded_cluster_is_matched_and_an_unreachable_one_refused() -> None:
    cands = rank(job(cpu=2), [cluster("slow", state=ClusterState.DEGRADED),
                              cluster("gone", state=ClusterState.UNREACHABLE)])
    assert [(c.cluster, c.eligible) for c in cands] == [("clusters/slow", True), ("clusters/gone", False)]
    assert any("DEGRADED" in r for r in cands[0].reasons)
    assert any("UNREACHABLE" in r for r in cands[1].reasons)


def test_a_driver_down_for_a_moment_is_matched_after_the_clusters_that_are_up() -> None:
    # "restarting" scores higher (more free capacity) but its driver is down: it comes last.
    now = datetime(2026, 6, 1, tzinfo=UTC)
    restarting = replace(cluster("restarting", state=ClusterState.DRIVER_UNAVAILABLE),
                         last_heartbeat_time=now - timedelta(seconds=40))
    cands = rank(job(cpu=2), [cluster("slow", cap(free_cpus=2), state=ClusterState.DEGRADED), restarting],
                 now)
    assert [(c.cluster, c.eligible) for c in cands] == [("clusters/slow", True), ("clusters/restarting", True)]
    assert cands[1].score > cands[0].score
    assert any("DRIVER_UNAVAILABLE" in r and "40 s ago" in r and "waits for it" in r for r in cands[1].reasons)


def test_a_driver_down_too_long_or_never_heard_from_is_refused() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    down = cluster("down", state=ClusterState.DRIVER_UNAVAILABLE)
    for c in (replace(down, last_heartbeat_time=now - timedelta(seconds=DOWN_WAIT_SECONDS + 1)),
              replace(down, last_heartbeat_time=None),
              replace(down, last_heartbeat_time=now, supported_run_modes=()),
              replace(down, last_heartbeat_time=now, capacity=None),
              replace(cluster("new", state=ClusterState.PENDING), last_heartbeat_time=now)):
        with pytest.raises(NoMatchingCluster, match=c.state.value):
            rank(job(cpu=2), [c], now)


def test_degraded_is_one_value_everywhere() -> None:
    assert cluster_pb2.CLUSTER_STATE_DEGRADED == base.ClusterState.DEGRADED == 5
    assert convert.cluster_state_from_proto(cluster_pb2.CLUSTER_STATE_DEGRADED) is ClusterState.DEGRADED
    assert convert.cluster_state_to_proto(ClusterState.DEGRADED) == cluster_pb2.CLUSTER_STATE_DEGRADED


def test_a_driver_that_runs_out_of_the_calls_time_is_unreachable_as_one_that_never_answers() -> None:
    """A driver whose GetClusterInfo outlived ClusterManager's deadline answers DEADLINE_EXCEEDED
    TIMED_OUT (its own interceptor): the driver did not answer in time, DRIVER_UNAVAILABLE (jobs
    matched to it wait), as JobManager's clients read it, not UNREACHABLE (jobs refused)."""
    from cluster_manager.drivers import is_unreachable
    from dlsched.errors import DeadlineExceeded, FailedPrecondition, Unavailable

    assert is_unreachable(DeadlineExceeded("slow", reason="TIMED_OUT"))
    assert is_unreachable(DeadlineExceeded("no answer", reason="DEADLINE_EXCEEDED"))
    assert is_unreachable(Unavailable("down", reason="UNAVAILABLE"))
    assert not is_unreachable(Unavailable("backend", reason="BACKEND_UNAVAILABLE"))
    assert not is_unreachable(FailedPrecondition("no", reason="CLUSTER_NOT_CONFIGURED"))
