"""CLUSTER_STATE_DEGRADED: a cluster reachable but slow stays eligible for jobs (they are
stored and launched as it recovers); an UNREACHABLE one is refused. The enum value is the
same number in the API, the domain and the driver kit."""

from __future__ import annotations

from cluster_manager import convert
from cluster_manager.domain.matching import rank
from cluster_manager.domain.models import ClusterState
from dlsched.v1 import cluster_pb2
from drivers.common import base
from tests.test_cluster_matching import cluster, job


def test_a_degraded_cluster_is_matched_and_an_unreachable_one_refused() -> None:
    cands = rank(job(cpu=2), [cluster("slow", state=ClusterState.DEGRADED),
                              cluster("gone", state=ClusterState.UNREACHABLE)])
    assert [(c.cluster, c.eligible) for c in cands] == [("clusters/slow", True), ("clusters/gone", False)]
    assert any("DEGRADED" in r for r in cands[0].reasons)
    assert any("UNREACHABLE" in r for r in cands[1].reasons)


def test_degraded_is_one_value_everywhere() -> None:
    assert cluster_pb2.CLUSTER_STATE_DEGRADED == base.ClusterState.DEGRADED == 5
    assert convert.cluster_state_from_proto(cluster_pb2.CLUSTER_STATE_DEGRADED) is ClusterState.DEGRADED
    assert convert.cluster_state_to_proto(ClusterState.DEGRADED) == cluster_pb2.CLUSTER_STATE_DEGRADED
