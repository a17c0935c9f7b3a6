"""Conversion between ``dlsched.v1`` messages and the driver domain, in one place.

Inbound conversion also validates, defensively: JobManager validates jobs
before they reach a driver, but a driver assumes a hostile client. Ids end up
in paths and names, so they must match ``ID_RE``; anything wrong raises
``InvalidArgument`` naming every bad field (``spec.replica_groups[0].role``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from google.protobuf import duration_pb2, timestamp_pb2

from dlsched import spec_rules
from dlsched.errors import FieldViolation, InvalidArgument
from dlsched.kit.timeutil import check_duration, check_timestamp, from_duration, to_timestamp
from dlsched.v1 import cluster_pb2, driver_service_pb2, job_pb2
from drivers.common import base

#: Job ids and cluster ids: they become paths and backend object names.
ID_RE = spec_rules.ID_RE
ROLE_RE = spec_rules.ROLE_RE
MAX_REFS = 1000


def _raise(violations: list[FieldViolation]) -> None:
    if violations:
        desc = "; ".join(f"{v.field}: {v.description}" for v in violations)
        raise InvalidArgument(desc, violations)


def _has_nul(s: str) -> bool:
    return "\x00" in s


# --------------------------------------------------------------------------- inbound


def cluster_name(value: str, field: str = "cluster") -> str:
    """``"clusters/{id}"`` or ``"{id}"`` -> ``"clusters/{id}"``."""
    cid = value[len("clusters/"):] if value.startswith("clusters/") else value
    if not cid:
        raise InvalidArgument.for_field(field, "required")
    if not ID_RE.match(cid):
        raise InvalidArgument.for_field(field, "must be clusters/{id} with id matching [a-z][a-z0-9-]{0,62}")
    return f"clusters/{cid}"


def job_id(value: str, field: str = "job_id") -> str:
    if not value:
        raise InvalidArgument.for_field(field, "required")
    if not ID_RE.match(value):
        raise InvalidArgument.for_field(field, "must match [a-z][a-z0-9-]{0,62}")
    return value


def backend_job_id(value: str, field: str) -> str:
    if len(value) > 256 or _has_nul(value):
        raise InvalidArgument.for_field(field, "too long or contains NUL")
    return value


def job_ref(pb: driver_service_pb2.JobRef, field: str = "job") -> base.JobRef:
    return base.JobRef(job_id=job_id(pb.job_id, f"{field}.job_id"),
                       backend_job_id=backend_job_id(pb.backend_job_id, f"{field}.backend_job_id"),
                       uid=job_uid(pb.job_uid, f"{field}.job_uid"))


def job_refs(pbs: list[driver_service_pb2.JobRef], field: str = "jobs") -> list[base.JobRef]:
    if len(pbs) > MAX_REFS:
        raise InvalidArgument.for_field(field, f"at most {MAX_REFS} jobs per call")
    return [job_ref(pb, f"{field}[{i}]") for i, pb in enumerate(pbs)]


def attempt(value: int, field: str = "attempt") -> int:
    if value < 1:
        raise InvalidArgument.for_field(field, "must be at least 1")
    return value


JOB_UID_RE = spec_rules.JOB_UID_RE


def job_uid(value: str, field: str = "job_uid") -> str:
    """``value`` when empty or a uid (full match of ``JOB_UID_RE``); else INVALID_ARGUMENT."""
    if value and not JOB_UID_RE.fullmatch(value):
        raise InvalidArgument.for_field(field, "must be up to 63 letters, digits and dashes, "
                                               "starting and ending with a letter or digit")
    return value


def grace_seconds(pb: duration_pb2.Duration, present: bool, field: str = "grace_period") -> float | None:
    if not present:
        return None
    check_duration(pb, field)
    secs = float(pb.ToNanoseconds()) / 1e9
    if secs < 0:
        raise InvalidArgument.for_field(field, "must not be negative")
    return secs


def job_spec(pb: job_pb2.JobSpec, present: bool, field: str = "spec") -> base.JobSpec:
    """Validate (``dlsched.spec_rules``, as JobManager does) and convert a JobSpec."""
    if not present:
        raise InvalidArgument.for_field(field, "required")
    if pb.HasField("time_limit"):  # as JobManager checks it: never normalised
        spec_rules.check_time_limit(pb.time_limit, f"{field}.time_limit")
    time_limit = from_duration(pb.time_limit) if pb.HasField("time_limit") else None  # 0 = unset, as in JobManager
    # The same rules as JobManager's (dlsched.spec_rules), on the message before any conversion.
    _raise(spec_rules.check_spec(pb, time_limit_seconds=time_limit, spec_bytes=pb.ByteSize(), field=field))
    run_mode = base.RunMode(pb.run_mode)
    groups = tuple(base.ReplicaGroup(
        role=g.role,
        replicas=g.replicas,
        command=tuple(g.command),
        args=tuple(g.args),
        processes_per_replica=g.processes_per_replica,
        image=g.image,
        env=dict(g.env),
        working_dir=g.working_dir,
        resources=base.Resources(cpu=g.resources.cpu, memory_bytes=g.resources.memory_bytes,
                                 gpus=g.resources.gpus, gpu_type=g.resources.gpu_type),
    ) for g in pb.replica_groups)
    return base.JobSpec(run_mode=run_mode, replica_groups=groups, queue=pb.queue,
                        time_limit_seconds=time_limit, max_retries=pb.max_retries,
                        labels=dict(pb.labels))


def cluster_config(req: driver_service_pb2.ConfigureClusterRequest) -> base.ClusterConfig:
    name = cluster_name(req.cluster)
    creds: base.Credentials | None = None
    kind = req.credentials.WhichOneof("kind") if req.HasField("credentials") else None
    if kind == "ssh":
        s = req.credentials.ssh
        creds = base.SshCredentials(username=s.username, private_key=s.private_key,
                                    known_host_keys=tuple(s.known_host_keys))
    elif kind == "kubernetes":
        k = req.credentials.kubernetes
        creds = base.KubernetesCredentials(kubeconfig=k.kubeconfig, token=k.token, ca_cert=k.ca_cert)
    elif kind == "token":
        creds = base.TokenCredentials(token=req.credentials.token.token)
    return base.ClusterConfig(name=name, address=req.address, options=dict(req.options),
                              credentials=creds)


def log_query(req: driver_service_pb2.TailJobLogsRequest) -> base.LogQuery:
    vs: list[FieldViolation] = []
    if req.tail_lines < 0:
        vs.append(FieldViolation("tail_lines", "must not be negative"))
    if req.role and not ROLE_RE.match(req.role):
        vs.append(FieldViolation("role", "must match [a-z][a-z0-9-]{0,62}"))
    if req.HasField("replica_index") and req.replica_index < 0:
        vs.append(FieldViolation("replica_index", "must not be negative"))
    streams: set[base.LogStream] = set()
    for i, s in enumerate(req.streams):
        if s not in (job_pb2.LOG_STREAM_STDOUT, job_pb2.LOG_STREAM_STDERR):
            vs.append(FieldViolation(f"streams[{i}]", "must be LOG_STREAM_STDOUT or LOG_STREAM_STDERR"))
        else:
            streams.add(base.LogStream(s))
    _raise(vs)
    if req.HasField("since_time"):  # JobManager checks it too; a driver assumes a hostile client
        check_timestamp(req.since_time, "since_time")
    since = req.since_time.ToNanoseconds() if req.HasField("since_time") else None
    return base.LogQuery(
        follow=req.follow,
        tail_lines=req.tail_lines,
        since_ns=since or None,
        role=req.role,
        replica_index=req.replica_index if req.HasField("replica_index") else None,
        streams=frozenset(streams),
    )


# --------------------------------------------------------------------------- outbound


def cluster_info_pb(info: base.ClusterInfo) -> driver_service_pb2.ClusterInfo:
    c = info.capacity
    return driver_service_pb2.ClusterInfo(
        state=int(info.state),  # type: ignore[arg-type]
        message=info.message,
        capacity=cluster_pb2.ClusterCapacity(
            nodes_total=c.nodes_total, nodes_free=c.nodes_free,
            cpus_total=c.cpus_total, cpus_free=c.cpus_free,
            memory_bytes_total=c.memory_bytes_total, memory_bytes_free=c.memory_bytes_free,
            gpus_total=c.gpus_total, gpus_free=c.gpus_free,
            gpus=[cluster_pb2.GpuInventory(gpu_type=g.gpu_type, total=g.total, free=g.free)
                  for g in c.gpus],
            max_cpus_per_node=c.max_cpus_per_node,
            max_memory_bytes_per_node=c.max_memory_bytes_per_node,
            max_gpus_per_node=c.max_gpus_per_node,
        ),
        supported_run_modes=[int(m) for m in info.supported_run_modes],  # type: ignore[misc]
        driver_version=info.driver_version,
    )


def native_spec_pb(spec: base.NativeSpec) -> job_pb2.NativeSpec:
    return job_pb2.NativeSpec(media_type=spec.media_type, content=spec.content)


#: Bounds of what an observation carries: a backend reports what jobs chose (a Slurm job's name
#: and comment, a local job's status file), so every field is clamped here, once for every
#: backend, and the conversion never raises (one observation that did would end a cluster's
#: WatchJobObservations stream at every snapshot).
MAX_REASON_CHARS = 128
MAX_MESSAGE_CHARS = 4096
MAX_HOST_CHARS = 1024
_INT32 = (-(1 << 31), (1 << 31) - 1)
_LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z, the last a Timestamp holds


def _i32(v: object) -> int:
    if not isinstance(v, int):
        return 0
    return min(max(v, _INT32[0]), _INT32[1])


def _text(v: object, most: int) -> str:
    """``v`` as valid UTF-8 text of at most ``most`` characters (lone surrogates replaced)."""
    t = v if isinstance(v, str) else ""
    t = t[:most]
    return t if t.isascii() else t.encode("utf-8", "replace").decode("utf-8")


def _time(v: object) -> timestamp_pb2.Timestamp | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= _LAST_SECOND:
        return None  # unset, not a number, NaN, or out of a Timestamp's range
    return to_timestamp(float(v))


def observation_pb(obs: base.JobObservation) -> driver_service_pb2.JobObservation:
    pb = driver_service_pb2.JobObservation(
        job_id=_text(obs.job_id, spec_rules.MAX_STRING_BYTES),
        backend_job_id=_text(obs.backend_job_id, spec_rules.MAX_STRING_BYTES),
        found=bool(obs.found), job_uid=_text(obs.uid, spec_rules.MAX_STRING_BYTES))
    if not obs.found:
        return pb
    pb.state = int(obs.state)  # type: ignore[assignment]
    pb.reason = _text(obs.reason, MAX_REASON_CHARS)
    pb.message = _text(obs.message, MAX_MESSAGE_CHARS)
    pb.attempt = _i32(obs.attempt)
    pb.backend_restarts = _i32(obs.backend_restarts)
    if obs.exit_code is not None:
        pb.exit_code = _i32(obs.exit_code)
    for r in obs.replicas[:spec_rules.MAX_PROCESSES]:
        rs = pb.replicas.add(role=_text(r.role, spec_rules.MAX_STRING_BYTES), index=_i32(r.index),
                             state=int(r.state), host=_text(r.host, MAX_HOST_CHARS),
                             message=_text(r.message, MAX_MESSAGE_CHARS))
        if r.exit_code is not None:
            rs.exit_code = _i32(r.exit_code)
    if (st := _time(obs.start_time)) is not None:
        pb.start_time.CopyFrom(st)
    if (et := _time(obs.end_time)) is not None:
        pb.end_time.CopyFrom(et)
    return pb


def launch_response_pb(res: base.LaunchResult) -> driver_service_pb2.LaunchJobResponse:
    return driver_service_pb2.LaunchJobResponse(
        backend_job_id=res.backend_job_id,
        native_spec=native_spec_pb(res.native_spec),
        observation=observation_pb(res.observation),
    )


def watch_event_pb(ev: base.WatchEvent) -> driver_service_pb2.WatchJobObservationsResponse:
    if ev.observation is None:
        return driver_service_pb2.WatchJobObservationsResponse(snapshot_complete=ev.snapshot_complete)
    return driver_service_pb2.WatchJobObservationsResponse(
        observation=observation_pb(ev.observation), snapshot_complete=ev.snapshot_complete)


#: a longer line goes out in pieces of this many characters (as the local and
#: Ray drivers write them): every backend's lines fit a message
MAX_LINE_CHARS = 64 * 1024


def piece_end(line: bytes, most: int = MAX_LINE_CHARS) -> int:
    """Where the first piece of a ``line`` longer than ``most`` bytes ends: at ``most``, moved
    back to the start of a UTF-8 character. Cuts made from a line's start are the same
    however its bytes arrived (whole, or over several reads)."""
    end = most
    while end > most - 4 and (line[end] & 0xC0) == 0x80:
        end -= 1
    return end if (line[end] & 0xC0) != 0x80 else most


def pieces(line: bytes, first: int = MAX_LINE_CHARS) -> tuple[list[bytes], bytes]:
    """A ``line`` (or the unfinished end of a stream) longer than a piece: its whole pieces
    (``piece_end``; the first at most ``first`` bytes, the others ``MAX_LINE_CHARS``) and
    what is left, at most one piece."""
    out: list[bytes] = []
    most = first
    while len(line) > most:
        cut = piece_end(line, most)
        out.append(line[:cut])
        line, most = line[cut:], MAX_LINE_CHARS
    return out, line
#: a batch of more goes out as several messages (the channels' limit is 8 MiB;
#: one message of a MultiplexJobLogs stream over it would end every tail on it)
BATCH_BYTES = 1 << 20
#: what an entry costs beyond its text (role, index, stream, time, framing)
_ENTRY_OVERHEAD = 48


def log_entries_pb(entries: list[base.LogEntry]) -> driver_service_pb2.TailJobLogsResponse:
    out = driver_service_pb2.TailJobLogsResponse()
    for e in entries:
        pe = out.entries.add(role=e.role, replica_index=e.replica_index,
                             stream=int(e.stream), text=e.text)
        if e.time_ns is not None:
            pe.time.FromNanoseconds(e.time_ns)
    return out


def log_batches_pb(entries: list[base.LogEntry]) -> Iterator[driver_service_pb2.TailJobLogsResponse]:
    """``entries`` as messages of at most about ``BATCH_BYTES``, a line longer than
    ``MAX_LINE_CHARS`` split in order into pieces (the same pieces each time the
    lines are read, so a resumed follower's count of lines stays true); none
    for no entries."""
    if not entries:
        return
    if all(len(e.text) <= MAX_LINE_CHARS for e in entries) and (
            sum(len(e.text) for e in entries) * 4 + _ENTRY_OVERHEAD * len(entries) <= BATCH_BYTES):
        yield log_entries_pb(entries)  # the usual case: one message, nothing to measure
        return
    cur: list[base.LogEntry] = []
    size = 0
    for e in entries:
        pieces = ([e] if len(e.text) <= MAX_LINE_CHARS else
                  [dataclasses.replace(e, text=e.text[i:i + MAX_LINE_CHARS])
                   for i in range(0, len(e.text), MAX_LINE_CHARS)])
        for piece in pieces:
            n = (len(piece.text) if piece.text.isascii() else len(piece.text.encode(errors="replace"))
                 ) + _ENTRY_OVERHEAD
            if cur and size + n > BATCH_BYTES:
                yield log_entries_pb(cur)
                cur, size = [], 0
            cur.append(piece)
            size += n
    if cur:
        yield log_entries_pb(cur)


def usage_pb(u: base.JobUsage) -> job_pb2.JobUsage:
    pb = job_pb2.JobUsage(replicas=[
        job_pb2.ReplicaUsage(role=r.role, replica_index=r.replica_index, cpu_seconds=r.cpu_seconds,
                             memory_bytes=r.memory_bytes, peak_memory_bytes=r.peak_memory_bytes,
                             gpu_utilization_percent=r.gpu_utilization_percent,
                             gpu_memory_bytes=r.gpu_memory_bytes, running=r.running)
        for r in u.replicas
    ])
    if (ts := to_timestamp(u.sample_time)) is not None:
        pb.sample_time.CopyFrom(ts)
    return pb
