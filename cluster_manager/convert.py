"""proto <-> domain, in one place for the whole service.

Credentials only ever go proto -> domain (requests) and domain -> proto for
the credentials key and ConfigureCluster; ``cluster_to_proto`` never sets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar

from dlsched.errors import InvalidArgument
from dlsched.kit.timeutil import from_timestamp, to_timestamp
from dlsched.v1 import cluster_pb2, driver_service_pb2, job_pb2

from .domain import models as m

E = TypeVar("E", m.ClusterType, m.ClusterState, m.RunMode)


def _from_enum(enum_desc: Any, prefix: str, value: int, cls: type[E], field: str | None = None) -> E:
    """The domain value of ``value``. An unknown number is UNSPECIFIED in what was
    stored or a driver reported; in a request (``field`` given) it is
    INVALID_ARGUMENT naming the field, never read as unset."""
    try:
        name = enum_desc.Name(value)
    except ValueError:
        if field is not None:
            known = ", ".join(n for n in enum_desc.keys() if not n.endswith("_UNSPECIFIED"))
            raise InvalidArgument.for_field(field, f"unknown value {value}: one of {known}") from None
        return cls("UNSPECIFIED")
    return cls(name[len(prefix):])


def _to_enum(enum_desc: Any, prefix: str, value: m.ClusterType | m.ClusterState | m.RunMode) -> int:
    return int(enum_desc.Value(prefix + value.value))


def cluster_type_from_proto(v: int, field: str | None = None) -> m.ClusterType:
    return _from_enum(job_pb2.ClusterType, "CLUSTER_TYPE_", v, m.ClusterType, field)


def cluster_type_to_proto(v: m.ClusterType) -> int:
    return _to_enum(job_pb2.ClusterType, "CLUSTER_TYPE_", v)


def cluster_state_from_proto(v: int) -> m.ClusterState:
    return _from_enum(cluster_pb2.ClusterState, "CLUSTER_STATE_", v, m.ClusterState)


def cluster_state_to_proto(v: m.ClusterState) -> int:
    return _to_enum(cluster_pb2.ClusterState, "CLUSTER_STATE_", v)


def run_mode_from_proto(v: int, field: str | None = None) -> m.RunMode:
    return _from_enum(job_pb2.RunMode, "RUN_MODE_", v, m.RunMode, field)


def run_mode_to_proto(v: m.RunMode) -> int:
    return _to_enum(job_pb2.RunMode, "RUN_MODE_", v)


def _time(dt: datetime | None) -> Any:
    return to_timestamp(dt)


# --- credentials ------------------------------------------------------------


def credentials_from_proto(p: cluster_pb2.ClusterCredentials | None) -> m.Credentials | None:
    """None when unset (no kind chosen)."""
    if p is None:
        return None
    kind = p.WhichOneof("kind")
    if kind == "ssh":
        return m.Credentials(m.CredentialsKind.SSH, username=p.ssh.username,
                             private_key=p.ssh.private_key,
                             known_host_keys=tuple(p.ssh.known_host_keys))
    if kind == "kubernetes":
        return m.Credentials(m.CredentialsKind.KUBERNETES, kubeconfig=p.kubernetes.kubeconfig,
                             token=p.kubernetes.token, ca_cert=p.kubernetes.ca_cert)
    if kind == "token":
        return m.Credentials(m.CredentialsKind.TOKEN, token=p.token.token)
    return None


def credentials_to_proto(c: m.Credentials | None) -> cluster_pb2.ClusterCredentials:
    p = cluster_pb2.ClusterCredentials()
    if c is None:
        return p
    if c.kind is m.CredentialsKind.SSH:
        p.ssh.username = c.username
        p.ssh.private_key = c.private_key
        p.ssh.known_host_keys.extend(c.known_host_keys)
    elif c.kind is m.CredentialsKind.KUBERNETES:
        p.kubernetes.kubeconfig = c.kubeconfig
        p.kubernetes.token = c.token
        p.kubernetes.ca_cert = c.ca_cert
    else:
        p.token.token = c.token
    return p


def credentials_to_bytes(c: m.Credentials) -> bytes:
    return credentials_to_proto(c).SerializeToString()


def credentials_from_bytes(b: bytes) -> m.Credentials | None:
    return credentials_from_proto(cluster_pb2.ClusterCredentials.FromString(b))


# --- capacity ---------------------------------------------------------------


def capacity_from_proto(p: cluster_pb2.ClusterCapacity) -> m.Capacity:
    return m.Capacity(
        nodes_total=p.nodes_total, nodes_free=p.nodes_free,
        cpus_total=p.cpus_total, cpus_free=p.cpus_free,
        memory_bytes_total=p.memory_bytes_total, memory_bytes_free=p.memory_bytes_free,
        gpus_total=p.gpus_total, gpus_free=p.gpus_free,
        gpus=tuple(m.GpuInventory(g.gpu_type, g.total, g.free) for g in p.gpus),
        max_cpus_per_node=p.max_cpus_per_node,
        max_memory_bytes_per_node=p.max_memory_bytes_per_node,
        max_gpus_per_node=p.max_gpus_per_node,
    )


def capacity_to_proto(c: m.Capacity) -> cluster_pb2.ClusterCapacity:
    return cluster_pb2.ClusterCapacity(
        nodes_total=c.nodes_total, nodes_free=c.nodes_free,
        cpus_total=c.cpus_total, cpus_free=c.cpus_free,
        memory_bytes_total=c.memory_bytes_total, memory_bytes_free=c.memory_bytes_free,
        gpus_total=c.gpus_total, gpus_free=c.gpus_free,
        gpus=[cluster_pb2.GpuInventory(gpu_type=g.gpu_type, total=g.total, free=g.free)
              for g in c.gpus],
        max_cpus_per_node=c.max_cpus_per_node,
        max_memory_bytes_per_node=c.max_memory_bytes_per_node,
        max_gpus_per_node=c.max_gpus_per_node,
    )


def observation_from_info(info: driver_service_pb2.ClusterInfo) -> m.Observation:
    state = cluster_state_from_proto(info.state)
    if state is m.ClusterState.UNSPECIFIED:
        state = m.ClusterState.UNREACHABLE
    return m.Observation(
        state=state,
        message=info.message,
        capacity=capacity_from_proto(info.capacity) if info.HasField("capacity") else None,
        supported_run_modes=tuple(
            r for r in (run_mode_from_proto(x) for x in info.supported_run_modes)
            if r is not m.RunMode.UNSPECIFIED
        ),
    )


# --- cluster ----------------------------------------------------------------


def cluster_from_proto(cluster_id: str, p: cluster_pb2.Cluster) -> m.Cluster:
    """The input fields of a request's cluster (output-only fields ignored); an
    unknown type is INVALID_ARGUMENT on ``cluster.type``."""
    return m.Cluster(
        cluster_id=cluster_id,
        type=cluster_type_from_proto(p.type, "cluster.type"),
        driver_address=p.driver_address,
        address=p.address,
        labels=dict(p.labels),
        options=dict(p.options),
        allowed_projects=tuple(p.allowed_projects),
    )


def cluster_to_proto(c: m.Cluster) -> cluster_pb2.Cluster:
    """The cluster as clients see it; never carries credentials."""
    p = cluster_pb2.Cluster(
        name=c.name, uid=c.uid, type=cluster_type_to_proto(c.type), address=c.address,  # type: ignore[arg-type]
        labels=c.labels, driver_address=c.driver_address, options=c.options,
        state=cluster_state_to_proto(c.state), state_message=c.state_message,  # type: ignore[arg-type]
        supported_run_modes=[run_mode_to_proto(r) for r in c.supported_run_modes],  # type: ignore[misc]
        has_credentials=c.has_credentials, etag=c.etag,
        allowed_projects=list(c.allowed_projects),
    )
    if c.capacity is not None:
        p.capacity.CopyFrom(capacity_to_proto(c.capacity))
    for field, dt in (("create_time", c.create_time), ("update_time", c.update_time),
                      ("last_heartbeat_time", c.last_heartbeat_time)):
        ts = _time(dt)
        if ts is not None:
            getattr(p, field).CopyFrom(ts)
    return p


def cluster_to_bytes(c: m.Cluster) -> bytes:
    """The etcd value of ``clusters/{id}``: the proto without etag (etag is the
    key's mod revision) and, by construction, without credentials."""
    p = cluster_to_proto(c)
    p.ClearField("etag")
    return p.SerializeToString()


def cluster_from_bytes(b: bytes, etag: str) -> m.Cluster:
    p = cluster_pb2.Cluster.FromString(b)
    return m.Cluster(
        cluster_id=p.name[len("clusters/"):],
        type=cluster_type_from_proto(p.type),
        driver_address=p.driver_address,
        address=p.address,
        labels=dict(p.labels),
        options=dict(p.options),
        uid=p.uid,
        state=cluster_state_from_proto(p.state),
        state_message=p.state_message,
        capacity=capacity_from_proto(p.capacity) if p.HasField("capacity") else None,
        supported_run_modes=tuple(run_mode_from_proto(r) for r in p.supported_run_modes),
        has_credentials=p.has_credentials,
        create_time=from_timestamp(p.create_time) if p.HasField("create_time") else None,
        update_time=from_timestamp(p.update_time) if p.HasField("update_time") else None,
        last_heartbeat_time=(from_timestamp(p.last_heartbeat_time)
                             if p.HasField("last_heartbeat_time") else None),
        etag=etag,
        allowed_projects=tuple(p.allowed_projects),
    )


# --- matching ---------------------------------------------------------------


def job_requirements_from_proto(spec: job_pb2.JobSpec) -> m.JobRequirements:
    """What matching reads of a request's spec; an unknown run mode or cluster
    type is INVALID_ARGUMENT naming the field."""
    groups = tuple(
        m.ReplicaGroup(
            role=g.role,
            replicas=g.replicas,
            processes_per_replica=g.processes_per_replica or 1,
            resources=m.Resources(cpu=g.resources.cpu, memory_bytes=g.resources.memory_bytes,
                                  gpus=g.resources.gpus, gpu_type=g.resources.gpu_type),
        )
        for g in spec.replica_groups
    )
    sel = spec.cluster_selector
    return m.JobRequirements(
        run_mode=run_mode_from_proto(spec.run_mode, "spec.run_mode"),
        replica_groups=groups,
        image=any(g.image for g in spec.replica_groups),
        selector=m.Selector(cluster=sel.cluster,
                            cluster_type=cluster_type_from_proto(
                                sel.cluster_type, "spec.cluster_selector.cluster_type"),
                            labels=dict(sel.labels)),
    )


def candidates_to_proto(cands: Iterable[m.Candidate]) -> list[cluster_pb2.ClusterCandidate]:
    return [
        cluster_pb2.ClusterCandidate(
            cluster=c.cluster, cluster_type=cluster_type_to_proto(c.cluster_type),  # type: ignore[arg-type]
            eligible=c.eligible, score=c.score, reasons=list(c.reasons),
            driver_address=c.driver_address,
        )
        for c in cands
    ]
