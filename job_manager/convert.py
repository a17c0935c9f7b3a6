"""proto ⇄ domain conversion, in one place for the whole service."""

from __future__ import annotations

from datetime import datetime

from google.protobuf import timestamp_pb2

from dlsched.kit.timeutil import from_duration, from_timestamp, to_duration, to_timestamp
from dlsched.v1 import cluster_pb2, driver_service_pb2, job_pb2
from job_manager.domain.model import (
    Candidate,
    ClusterSelector,
    Job,
    JobSpec,
    JobState,
    NativeSpec,
    Observation,
    ReplicaGroup,
    ReplicaStatus,
    Resources,
)


def _ts(dt: datetime | None) -> timestamp_pb2.Timestamp | None:
    return to_timestamp(dt) if dt is not None else None


def _from_ts(msg: object, field: str) -> datetime | None:
    if not msg.HasField(field):  # type: ignore[attr-defined]
        return None
    return from_timestamp(getattr(msg, field))


def spec_from_proto(p: job_pb2.JobSpec) -> JobSpec:
    return JobSpec(
        run_mode=int(p.run_mode),
        replica_groups=[
            ReplicaGroup(
                role=g.role, replicas=g.replicas, processes_per_replica=g.processes_per_replica,
                command=list(g.command), args=list(g.args), image=g.image, env=dict(g.env),
                working_dir=g.working_dir,
                resources=Resources(cpu=g.resources.cpu, memory_bytes=g.resources.memory_bytes,
                                    gpus=g.resources.gpus, gpu_type=g.resources.gpu_type),
            )
            for g in p.replica_groups
        ],
        cluster_selector=ClusterSelector(
            cluster=p.cluster_selector.cluster,
            cluster_type=int(p.cluster_selector.cluster_type),
            labels=dict(p.cluster_selector.labels),
        ),
        queue=p.queue,
        time_limit=from_duration(p.time_limit) if p.HasField("time_limit") else None,
        max_retries=p.max_retries,
        labels=dict(p.labels),
        project=p.project,
    )


def spec_to_proto(s: JobSpec) -> job_pb2.JobSpec:
    p = job_pb2.JobSpec(
        run_mode=s.run_mode,  # type: ignore[arg-type]
        queue=s.queue,
        max_retries=s.max_retries,
        labels=s.labels,
        project=s.project,
        cluster_selector=job_pb2.ClusterSelector(
            cluster=s.cluster_selector.cluster,
            cluster_type=s.cluster_selector.cluster_type,  # type: ignore[arg-type]
            labels=s.cluster_selector.labels,
        ),
    )
    if s.time_limit is not None:
        p.time_limit.CopyFrom(to_duration(s.time_limit))
    for g in s.replica_groups:
        p.replica_groups.append(job_pb2.ReplicaGroup(
            role=g.role, replicas=g.replicas, processes_per_replica=g.processes_per_replica,
            command=g.command, args=g.args, image=g.image, env=g.env, working_dir=g.working_dir,
            resources=job_pb2.Resources(cpu=g.resources.cpu, memory_bytes=g.resources.memory_bytes,
                                        gpus=g.resources.gpus, gpu_type=g.resources.gpu_type),
        ))
    return p


def _replica_from_proto(r: job_pb2.ReplicaStatus) -> ReplicaStatus:
    return ReplicaStatus(role=r.role, index=r.index, state=int(r.state),
                         exit_code=r.exit_code if r.HasField("exit_code") else None,
                         host=r.host, message=r.message)


def _replica_to_proto(r: ReplicaStatus) -> job_pb2.ReplicaStatus:
    p = job_pb2.ReplicaStatus(role=r.role, index=r.index, state=r.state,  # type: ignore[arg-type]
                              host=r.host, message=r.message)
    if r.exit_code is not None:
        p.exit_code = r.exit_code
    return p


def job_from_proto(p: job_pb2.Job) -> Job:
    return Job(
        id=p.name.partition("/")[2],
        uid=p.uid,
        spec=spec_from_proto(p.spec),
        state=JobState.of(p.state),
        reason=p.reason,
        message=p.message,
        exit_code=p.exit_code if p.HasField("exit_code") else None,
        replicas=[_replica_from_proto(r) for r in p.replicas],
        cluster=p.cluster,
        backend_job_id=p.backend_job_id,
        create_time=_from_ts(p, "create_time"),
        update_time=_from_ts(p, "update_time"),
        start_time=_from_ts(p, "start_time"),
        end_time=_from_ts(p, "end_time"),
        labels=dict(p.labels),
        attempt=p.attempt,
        etag=p.etag,
        backend_restarts=p.backend_restarts,
        owner=p.owner,
        project=p.project,
    )


def job_to_proto(j: Job) -> job_pb2.Job:
    p = job_pb2.Job(
        name=j.name, uid=j.uid, spec=spec_to_proto(j.spec), state=int(j.state),  # type: ignore[arg-type]
        reason=j.reason, message=j.message, cluster=j.cluster,
        backend_job_id=j.backend_job_id, labels=j.labels, attempt=j.attempt, etag=j.etag,
        backend_restarts=j.backend_restarts, owner=j.owner, project=j.project,
        replicas=[_replica_to_proto(r) for r in j.replicas],
    )
    if j.exit_code is not None:
        p.exit_code = j.exit_code
    for f in ("create_time", "update_time", "start_time", "end_time"):
        ts = _ts(getattr(j, f))
        if ts is not None:
            getattr(p, f).CopyFrom(ts)
    return p


def observation_from_proto(p: driver_service_pb2.JobObservation) -> Observation:
    return Observation(
        job_id=p.job_id, backend_job_id=p.backend_job_id, found=p.found,
        state=JobState.of(p.state), reason=p.reason, message=p.message,
        exit_code=p.exit_code if p.HasField("exit_code") else None,
        replicas=[_replica_from_proto(r) for r in p.replicas],
        start_time=_from_ts(p, "start_time"), end_time=_from_ts(p, "end_time"),
        attempt=p.attempt, backend_restarts=p.backend_restarts, job_uid=p.job_uid,
    )


def candidate_from_proto(p: cluster_pb2.ClusterCandidate) -> Candidate:
    return Candidate(cluster=p.cluster, cluster_type=int(p.cluster_type), eligible=p.eligible,
                     score=p.score, reasons=tuple(p.reasons), driver_address=p.driver_address)


def candidate_to_proto(c: Candidate) -> cluster_pb2.ClusterCandidate:
    return cluster_pb2.ClusterCandidate(
        cluster=c.cluster, cluster_type=c.cluster_type, eligible=c.eligible,  # type: ignore[arg-type]
        score=c.score, reasons=list(c.reasons), driver_address=c.driver_address)


def native_from_proto(p: job_pb2.NativeSpec) -> NativeSpec:
    return NativeSpec(media_type=p.media_type, content=p.content)


def native_to_proto(n: NativeSpec) -> job_pb2.NativeSpec:
    return job_pb2.NativeSpec(media_type=n.media_type, content=n.content)


def _us(ts: timestamp_pb2.Timestamp) -> int:
    return ts.seconds * 1_000_000 + ts.nanos // 1000


def end_us_of_proto(p: job_pb2.Job) -> int:
    """When a terminal job ended, in microseconds: its ``end_time``, else its
    ``update_time``, else its ``create_time`` (what ``end_time`` filter terms
    compare and the history's retention counts from)."""
    for f in ("end_time", "update_time", "create_time"):
        if p.HasField(f):
            return _us(getattr(p, f))
    return 0


def job_to_bytes(j: Job) -> bytes:
    """The stored form: the Job proto without its etag (the etag is the mod revision)."""
    p = job_to_proto(j)
    p.etag = ""
    data: bytes = p.SerializeToString(deterministic=True)
    return data


def job_from_bytes(data: bytes, mod_revision: int = 0) -> Job:
    p = job_pb2.Job()
    p.ParseFromString(data)
    j = job_from_proto(p)
    j.etag = str(mod_revision) if mod_revision else ""
    return j
