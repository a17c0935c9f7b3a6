"""The driver domain: plain typed Python, and the abstract ``Driver``.

Modelled on TorchX's scheduler API (``torchx/schedulers/api.py``): a driver
turns a backend-independent ``JobSpec`` into the backend's native form
(``render``), submits it (``launch``), observes it (``observe``, ``watch``),
stops it (``terminate``), removes it (``cleanup``), and optionally tails its
logs and measures its usage. Nothing here imports grpc or the generated stubs;
``drivers.common.convert`` maps these types to and from ``dlsched.v1`` in one
place, and ``drivers.common.servicer`` exposes any ``Driver`` over gRPC.

Conventions every driver follows:

- ``cluster`` arguments are full names, ``"clusters/{cluster}"`` (the
  servicer normalises ``"{cluster}"`` to that form). An operation on a
  cluster the driver has not been configured with raises
  ``ClusterNotConfigured`` (FAILED_PRECONDITION, reason
  ``CLUSTER_NOT_CONFIGURED``); the caller has ClusterManager configure it
  again and retries.
- Every operation is idempotent: ``launch`` on (cluster, job_id, attempt)
  returns the first submission; ``terminate`` and ``cleanup`` of an ended or
  unknown job succeed.
- Optional capabilities (``tail_logs``, ``usage`` by default) raise
  ``dlsched.errors.Unimplemented`` (UNIMPLEMENTED, reason ``UNSUPPORTED``).
- Enum values equal the ``dlsched.v1`` numbers, so conversion is ``Enum(n)``.
- Times are Unix seconds (``float``); log line times are Unix nanoseconds.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from dlsched.errors import FailedPrecondition, NotFound, Unimplemented
from dlsched.spec_rules import same_job as same_job  # (the drivers' name for it)

# --------------------------------------------------------------------------- enums


class RunMode(enum.IntEnum):
    """How a job's replicas relate (``dlsched.v1.RunMode``)."""

    UNSPECIFIED = 0
    SINGLE_PROCESS = 1
    MULTI_PROCESS = 2
    PS_WORKER = 3
    MASTER_WORKER = 4
    MPI = 5


class JobState(enum.IntEnum):
    """A job's lifecycle state (``dlsched.v1.JobState``)."""

    UNSPECIFIED = 0
    PENDING = 1
    QUEUED = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    STOPPING = 6
    STOPPED = 7

    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class ReplicaState(enum.IntEnum):
    """One replica's lifecycle state (``dlsched.v1.ReplicaState``)."""

    UNSPECIFIED = 0
    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    STOPPED = 5

    def is_terminal(self) -> bool:
        return self in (ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.STOPPED)


class LogStream(enum.IntEnum):
    """An output stream (``dlsched.v1.LogStream``)."""

    UNSPECIFIED = 0
    STDOUT = 1
    STDERR = 2

    @property
    def suffix(self) -> str:
        return self.name.lower()


class ClusterState(enum.IntEnum):
    """A cluster's health (``dlsched.v1.ClusterState``)."""

    UNSPECIFIED = 0
    PENDING = 1
    READY = 2
    UNREACHABLE = 3
    DRIVER_UNAVAILABLE = 4
    DEGRADED = 5


# --------------------------------------------------------------------------- errors


class ClusterNotConfigured(FailedPrecondition):
    """The driver does not know the cluster; ClusterManager must configure it."""

    reason = "CLUSTER_NOT_CONFIGURED"

    def __init__(self, cluster: str) -> None:
        super().__init__(
            f"cluster {cluster!r} is not configured on this driver",
            [(cluster, "not configured on this driver")],
            metadata={"cluster": cluster},
        )


class NameCollision(FailedPrecondition):
    """What a launch would submit exists on the backend and belongs to another job: another
    job id with the same backend name, or another incarnation of this id (another uid, e.g.
    another dlsched installation's job of the same id). Never adopted as this launch's."""

    reason = "NAME_COLLISION"


class JobNotFound(NotFound):
    """The driver knows no such job (for operations that need one, e.g. logs)."""

    reason = "JOB_NOT_FOUND"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} is not known to this driver",
                         metadata={"job_id": job_id})


# --------------------------------------------------------------------------- job spec


@dataclass(frozen=True)
class Resources:
    """Resources per replica; 0 means the backend's default."""

    cpu: float = 0.0
    memory_bytes: int = 0
    gpus: int = 0
    gpu_type: str = ""


@dataclass(frozen=True)
class ReplicaGroup:
    """Identical replicas playing one role."""

    role: str
    replicas: int
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    processes_per_replica: int = 0
    image: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = ""
    resources: Resources = field(default_factory=Resources)

    @property
    def processes(self) -> int:
        """Processes per replica (0 in the spec means 1)."""
        return max(1, self.processes_per_replica)

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.command, *self.args)


@dataclass(frozen=True)
class JobSpec:
    """The backend-independent job (the parts a driver needs)."""

    run_mode: RunMode
    replica_groups: tuple[ReplicaGroup, ...]
    queue: str = ""
    time_limit_seconds: float | None = None
    max_retries: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- clusters


@dataclass(frozen=True)
class SshCredentials:
    username: str
    private_key: str = field(default="", repr=False)
    known_host_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class KubernetesCredentials:
    kubeconfig: str = field(default="", repr=False)
    token: str = field(default="", repr=False)
    ca_cert: str = ""


@dataclass(frozen=True)
class TokenCredentials:
    token: str = field(default="", repr=False)


Credentials = SshCredentials | KubernetesCredentials | TokenCredentials


@dataclass(frozen=True)
class ClusterConfig:
    """What ClusterManager tells a driver about one cluster. Secrets never print."""

    name: str
    address: str = ""
    options: Mapping[str, str] = field(default_factory=dict)
    credentials: Credentials | None = None


@dataclass(frozen=True)
class GpuInventory:
    gpu_type: str
    total: int
    free: int


@dataclass(frozen=True)
class ClusterCapacity:
    nodes_total: int = 0
    nodes_free: int = 0
    cpus_total: float = 0.0
    cpus_free: float = 0.0
    memory_bytes_total: int = 0
    memory_bytes_free: int = 0
    gpus_total: int = 0
    gpus_free: int = 0
    gpus: tuple[GpuInventory, ...] = ()
    max_cpus_per_node: float = 0.0
    max_memory_bytes_per_node: int = 0
    max_gpus_per_node: int = 0


@dataclass(frozen=True)
class ClusterInfo:
    state: ClusterState
    message: str = ""
    capacity: ClusterCapacity = field(default_factory=ClusterCapacity)
    supported_run_modes: tuple[RunMode, ...] = ()
    driver_version: str = ""


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class NativeSpec:
    """The backend's native form of a job: an sbatch script, manifests, JSON."""

    media_type: str
    content: str


@dataclass(frozen=True)
class JobRef:
    job_id: str
    backend_job_id: str = ""
    uid: str = ""  # the job's uid, when known (with a backend id: another uid's job is not this one)

    def names(self, obs: JobObservation | None) -> bool:
        """Whether ``obs`` (what the driver tracks under this ref) may be the referenced job:
        not when the ref has a backend id and a uid, and ``obs`` is of another uid."""
        return obs is None or self.names_uid(obs.uid)

    def names_uid(self, uid: str) -> bool:
        """Whether a job of ``uid`` found under this ref may be the referenced job (``names``)."""
        return not (self.uid and self.backend_job_id) or same_job(uid, self.uid)


@dataclass(frozen=True)
class ReplicaStatus:
    role: str
    index: int
    state: ReplicaState
    exit_code: int | None = None
    host: str = ""
    message: str = ""


@dataclass(frozen=True)
class JobObservation:
    """What the driver observes of one job. ``found=False`` leaves the rest unset."""

    job_id: str
    backend_job_id: str = ""
    found: bool = False
    state: JobState = JobState.UNSPECIFIED
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    replicas: tuple[ReplicaStatus, ...] = ()
    start_time: float | None = None
    end_time: float | None = None
    attempt: int = 0
    backend_restarts: int = 0  # times the backend restarted this attempt on its own (a Slurm requeue)
    uid: str = ""  # the job uid its launch gave ("" for none; dashes may be left out)

    @classmethod
    def not_found(cls, ref: JobRef, uid: str = "") -> JobObservation:
        """``ref`` is gone; ``uid``: the job uid of what the driver tracked under it, when known."""
        return cls(job_id=ref.job_id, backend_job_id=ref.backend_job_id, found=False, uid=uid)


@dataclass(frozen=True)
class LaunchResult:
    backend_job_id: str
    native_spec: NativeSpec
    observation: JobObservation


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: an observation, or the end-of-snapshot marker."""

    observation: JobObservation | None = None
    snapshot_complete: bool = False


@dataclass(frozen=True)
class LogQuery:
    """Which log lines a tail wants. Empty ``streams`` means both."""

    follow: bool = False
    tail_lines: int = 0
    since_ns: int | None = None
    role: str = ""
    replica_index: int | None = None
    streams: frozenset[LogStream] = frozenset()

    def wants_stream(self, stream: LogStream) -> bool:
        return not self.streams or stream in self.streams

    def wants_replica(self, role: str, index: int) -> bool:
        return (not self.role or self.role == role) and (
            self.replica_index is None or self.replica_index == index
        )


@dataclass(frozen=True)
class LogEntry:
    role: str
    replica_index: int
    stream: LogStream
    text: str
    time_ns: int | None = None


@dataclass(frozen=True)
class ReplicaUsage:
    role: str
    replica_index: int
    cpu_seconds: float = 0.0
    memory_bytes: int = 0
    peak_memory_bytes: int = 0
    gpu_utilization_percent: float = 0.0
    gpu_memory_bytes: int = 0
    running: bool = False


@dataclass(frozen=True)
class JobUsage:
    replicas: tuple[ReplicaUsage, ...]
    sample_time: float


# --------------------------------------------------------------------------- the interface


class Driver(abc.ABC):
    """One backend type. One instance may serve many clusters of that type.

    ``start`` runs before the server accepts calls (reconcile what the
    backend already runs); ``close`` runs after it stopped.
    """

    #: Backend name, e.g. "local"; used in ``ClusterInfo.driver_version``.
    name: str = "driver"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Reconcile with the backend before serving. Default: nothing."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources after serving. Default: nothing."""

    @abc.abstractmethod
    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        """Configure (or reconfigure) a cluster; keep credentials in memory only."""

    @abc.abstractmethod
    async def remove_cluster(self, cluster: str, *, if_idle: bool = False) -> None:
        """Forget a cluster; jobs on it are not touched. Unknown clusters are fine. With
        ``if_idle``: FAILED_PRECONDITION ``CLUSTER_HAS_JOBS`` while a job of it is unfinished."""

    @abc.abstractmethod
    async def cluster_info(self, cluster: str) -> ClusterInfo:
        """Health, capacity and run modes, asked of the backend now."""

    @abc.abstractmethod
    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        """The native form ``launch`` would submit; a pure function of (job, cluster)."""

    @abc.abstractmethod
    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int, uid: str = "") -> LaunchResult:
        """Submit a job. Idempotent on (cluster, job_id, attempt). ``uid``: the job's uid
        (empty: unknown); a submission marked with another uid is another job's."""

    @abc.abstractmethod
    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        """One observation per ref, in order, from the shared poller or watch."""

    @abc.abstractmethod
    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        """Every job of the cluster, then ``WatchEvent(snapshot_complete=True)``,
        then each change, until the consumer stops iterating.

        Raise ``ClusterNotConfigured`` on the first iteration for an unknown
        cluster; ``dlsched.errors.Unavailable`` ends the stream when the
        consumer cannot keep up (it reconnects and gets a fresh snapshot).
        """

    @abc.abstractmethod
    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        """Start stopping a job (polite stop, kill after the grace period;
        ``None`` means the driver's default). Ended or unknown jobs succeed."""

    @abc.abstractmethod
    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        """Remove a job's backend objects and files. Unknown jobs succeed."""

    async def forget(self, cluster: str, refs: Sequence[JobRef]) -> int:
        """Drop ended jobs whose final state JobManager has recorded from memory
        (logs and usage stay readable from disk or the backend); how many were dropped."""
        return 0

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        """Batches of log lines. With ``query.follow`` the stream ends once the
        job has ended and its logs are drained; otherwise after what exists."""
        raise Unimplemented(f"{self.name} driver cannot tail logs")

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        """The job's resource usage now."""
        raise Unimplemented(f"{self.name} driver cannot measure usage")
