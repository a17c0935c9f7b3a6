"""CLUSTER_STATE_DEGRADED: a cluster reachable but slow stays eligible for jobs (they are
stored and launched as it recovers); an UNREACHABLE one is matched only after every cluster
that is up (the job waits for it), and refused when it was never observed. The enum value is
the same number in the API, the domain and the driver kit."""

from __future__ import annotations

import pytest

from cluster_manager import convert
from cluster_manager.domain.errors import NoMatchingCluster
from cluster_manager.domain.matching import rank
from cluster_manager.domain.models import ClusterState
from dlsched.v1 import cluster_pb2
from drivers.common import base
from tests.test_cluster_matching import cap, cluster, job


def test_a_degraded_cluster_is_matched_before_an_unreachable_one() -> None:
    # "gone" scores higher (more capacity) but is down: it comes after the one that is up.
    cands = rank(job(cpu=2), [cluster("slow", cap(free_cpus=2), state=ClusterState.DEGRADED),
                              cluster("gone", state=ClusterState.UNREACHABLE)])
    assert [(c.cluster, c.eligible) for c in cands] == [("clusters/slow", True), ("clusters/gone", True)]
    assert cands[1].score > cands[0].score
    assert any("DEGRADED" in r for r in cands[0].reasons)
    assert any("UNREACHABLE" in r and "waits for it" in r for r in cands[1].reasons)


def test_a_cluster_never_observed_is_refused_whatever_its_state() -> None:
    for state in (ClusterState.UNREACHABLE, ClusterState.DRIVER_UNAVAILABLE, ClusterState.PENDING):
        with pytest.raises(NoMatchingCluster, match=state.value):
            rank(job(cpu=2), [cluster("new", state=state, modes=())])


def test_degraded_is_one_value_everywhere() -> None:
    assert cluster_pb2.CLUSTER_STATE_DEGRADED == base.ClusterState.DEGRADED == 5
    assert convert.cluster_state_from_proto(cluster_pb2.CLUSTER_STATE_DEGRADED) is ClusterState.DEGRADED
    assert convert.cluster_state_to_proto(ClusterState.DEGRADED) == cluster_pb2.CLUSTER_STATE_DEGRADED
