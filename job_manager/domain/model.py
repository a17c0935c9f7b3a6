"""The job model: plain dataclasses mirroring ``dlsched.v1`` Job and JobSpec.

Enum members carry the proto numbers, so conversion is a cast. Times are
timezone-aware UTC datetimes; durations are float seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime


class JobState(enum.IntEnum):
    UNSPECIFIED = 0
    PENDING = 1
    QUEUED = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    STOPPING = 6
    STOPPED = 7

    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @classmethod
    def of(cls, value: int) -> JobState:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})


class RunMode(enum.IntEnum):
    UNSPECIFIED = 0
    SINGLE_PROCESS = 1
    MULTI_PROCESS = 2
    PS_WORKER = 3
    MASTER_WORKER = 4
    MPI = 5


class ReplicaState(enum.IntEnum):
    UNSPECIFIED = 0
    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    STOPPED = 5


@dataclass
class Resources:
    cpu: float = 0.0
    memory_bytes: int = 0
    gpus: int = 0
    gpu_type: str = ""


@dataclass
class ReplicaGroup:
    role: str = ""
    replicas: int = 0
    processes_per_replica: int = 0
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    image: str = ""
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str = ""
    resources: Resources = field(default_factory=Resources)


@dataclass
class ClusterSelector:
    cluster: str = ""
    cluster_type: int = 0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class JobSpec:
    # run_mode stays an int: an unknown number must survive to validation.
    run_mode: int = 0
    replica_groups: list[ReplicaGroup] = field(default_factory=list)
    cluster_selector: ClusterSelector = field(default_factory=ClusterSelector)
    queue: str = ""
    time_limit: float | None = None
    max_retries: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    project: str = ""


@dataclass
class ReplicaStatus:
    role: str = ""
    index: int = 0
    state: int = 0
    exit_code: int | None = None
    host: str = ""
    message: str = ""


@dataclass
class Job:
    """A job record as stored in etcd (``etag`` is the key's mod revision)."""

    id: str
    spec: JobSpec = field(default_factory=JobSpec)
    uid: str = ""
    state: JobState = JobState.PENDING
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    replicas: list[ReplicaStatus] = field(default_factory=list)
    cluster: str = ""
    backend_job_id: str = ""
    create_time: datetime | None = None
    update_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    labels: dict[str, str] = field(default_factory=dict)
    attempt: int = 0
    etag: str = ""
    backend_restarts: int = 0  # the backend restarted this attempt on its own (a Slurm requeue)
    owner: str = ""  # the principal that submitted it
    project: str = ""  # the project it belongs to (spec.project as resolved)

    @property
    def name(self) -> str:
        return f"jobs/{self.id}"

    @property
    def launched(self) -> bool:
        return bool(self.backend_job_id)


@dataclass
class Observation:
    """What a driver observed of one job (``dlsched.v1.JobObservation``)."""

    job_id: str
    backend_job_id: str = ""
    found: bool = True
    state: JobState = JobState.UNSPECIFIED
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    replicas: list[ReplicaStatus] = field(default_factory=list)
    start_time: datetime | None = None
    end_time: datetime | None = None
    attempt: int = 0
    backend_restarts: int = 0
    job_uid: str = ""  # the uid of the job whose launch made the submission ("" unknown; dashes may be left out)


@dataclass(frozen=True)
class Candidate:
    """A cluster ClusterManager considered for a job."""

    cluster: str
    cluster_type: int = 0
    eligible: bool = False
    score: float = 0.0
    reasons: tuple[str, ...] = ()
    driver_address: str = ""


@dataclass(frozen=True)
class NativeSpec:
    media_type: str = ""
    content: str = ""
