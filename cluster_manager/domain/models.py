"""The cluster model, as plain dataclasses.

Enum members carry the proto value names without their prefix
(``ClusterType.SLURM`` is ``CLUSTER_TYPE_SLURM``); ``convert.py`` maps them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from datetime import datetime

from dlsched.resources import CpuRule


class ClusterType(enum.Enum):
    UNSPECIFIED = "UNSPECIFIED"
    LOCAL = "LOCAL"
    SLURM = "SLURM"
    KUBERNETES = "KUBERNETES"
    RAY = "RAY"


class ClusterState(enum.Enum):
    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    READY = "READY"
    UNREACHABLE = "UNREACHABLE"
    DRIVER_UNAVAILABLE = "DRIVER_UNAVAILABLE"
    DEGRADED = "DEGRADED"


class RunMode(enum.Enum):
    UNSPECIFIED = "UNSPECIFIED"
    SINGLE_PROCESS = "SINGLE_PROCESS"
    MULTI_PROCESS = "MULTI_PROCESS"
    PS_WORKER = "PS_WORKER"
    MASTER_WORKER = "MASTER_WORKER"
    MPI = "MPI"


class CredentialsKind(enum.Enum):
    SSH = "ssh"
    KUBERNETES = "kubernetes"
    TOKEN = "token"


class AddressKind(enum.Enum):
    """What a cluster's ``address`` is, for its type."""

    OPTIONAL = "optional"  # nothing required (the driver's own host)
    HOST_PORT = "host[:port]"  # an SSH login node
    URL = "http(s) URL"  # an HTTP API


@dataclass(frozen=True)
class Backend:
    """What ClusterManager knows of one backend type: the one registration of a backend.

    Everything else about it lives in its driver package (which checks the
    address and credentials again, in the backend's own terms)."""

    credentials: CredentialsKind | None  # None: takes no credentials
    address: AddressKind
    address_help: str  # what the address is, for error messages
    cpus: CpuRule  # how the backend hands out CPUs (dlsched.resources): what the matcher counts
    #: takes a job whose groups name container images: runs them (Kubernetes) or, the local
    #: development backend, ignores them as the API documents; else such a job never matches
    takes_images: bool = False


#: The backends, by type. Adding one: its enum value (here and in the API's
#: ``ClusterType``), one row here, one driver package (ARCHITECTURE.md).
BACKENDS: dict[ClusterType, Backend] = {
    ClusterType.LOCAL: Backend(None, AddressKind.OPTIONAL, "unused", CpuRule.AS_GIVEN, takes_images=True),
    ClusterType.SLURM: Backend(CredentialsKind.SSH, AddressKind.HOST_PORT, "the login node host[:port]",
                               CpuRule.WHOLE_TASKS),
    ClusterType.KUBERNETES: Backend(CredentialsKind.KUBERNETES, AddressKind.URL, "the API server URL",
                                    CpuRule.AS_GIVEN, takes_images=True),
    ClusterType.RAY: Backend(CredentialsKind.TOKEN, AddressKind.URL, "the dashboard URL", CpuRule.AS_GIVEN),
}

# Which credentials each cluster type takes; LOCAL takes none.
CREDENTIALS_FOR_TYPE: dict[ClusterType, CredentialsKind | None] = {t: b.credentials for t, b in BACKENDS.items()}


@dataclass(frozen=True)
class Credentials:
    """Write-only secrets. Every secret field is left out of ``repr`` so a
    stray log line or traceback never shows it."""

    kind: CredentialsKind
    username: str = ""
    private_key: str = field(default="", repr=False)
    known_host_keys: tuple[str, ...] = field(default=(), repr=False)
    kubeconfig: str = field(default="", repr=False)
    token: str = field(default="", repr=False)
    ca_cert: str = field(default="", repr=False)


@dataclass(frozen=True)
class GpuInventory:
    gpu_type: str
    total: int
    free: int


@dataclass(frozen=True)
class Capacity:
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

    def materially_differs(self, other: Capacity) -> bool:
        """Whether a change is worth an etcd write (and a watch event).

        Totals, per-node maxima, node counts, GPU counts and the inventory must
        match exactly; free CPU and memory may drift by up to 5 % of the total
        (a host's free memory moves every second; we do not write every poll).
        """
        exact = (
            "nodes_total", "nodes_free", "cpus_total", "memory_bytes_total", "gpus_total",
            "gpus_free", "gpus", "max_cpus_per_node", "max_memory_bytes_per_node",
            "max_gpus_per_node",
        )
        if any(getattr(self, f) != getattr(other, f) for f in exact):
            return True
        if abs(self.cpus_free - other.cpus_free) > max(0.5, 0.05 * self.cpus_total):
            return True
        return abs(self.memory_bytes_free - other.memory_bytes_free) > 0.05 * max(
            self.memory_bytes_total, 1
        )


@dataclass(frozen=True)
class Observation:
    """What a driver reports of a cluster (or what we conclude when it does not answer)."""

    state: ClusterState
    message: str = ""
    capacity: Capacity | None = None
    supported_run_modes: tuple[RunMode, ...] = ()

    @property
    def driver_answered(self) -> bool:
        return self.state is not ClusterState.DRIVER_UNAVAILABLE


@dataclass(frozen=True)
class Cluster:
    """A registered cluster. ``cluster_id`` is the last part of ``name``."""

    cluster_id: str
    type: ClusterType
    driver_address: str
    address: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)
    uid: str = ""
    state: ClusterState = ClusterState.PENDING
    state_message: str = ""
    capacity: Capacity | None = None
    supported_run_modes: tuple[RunMode, ...] = ()
    has_credentials: bool = False
    create_time: datetime | None = None
    update_time: datetime | None = None
    last_heartbeat_time: datetime | None = None
    etag: str = ""
    allowed_projects: tuple[str, ...] = ()  # empty: every project

    @property
    def name(self) -> str:
        return cluster_name(self.cluster_id)

    def observation(self) -> Observation:
        return Observation(self.state, self.state_message, self.capacity, self.supported_run_modes)

    def with_observation(self, obs: Observation, now: datetime) -> Cluster:
        """The cluster as observed at ``now``. last_heartbeat_time moves only
        when the driver answered (not for DRIVER_UNAVAILABLE)."""
        return replace(
            self,
            state=obs.state,
            state_message=obs.message,
            capacity=obs.capacity if obs.capacity is not None else self.capacity,
            supported_run_modes=obs.supported_run_modes,
            last_heartbeat_time=now if obs.driver_answered else self.last_heartbeat_time,
        )


def observation_changed(old: Observation, new: Observation) -> bool:
    if (old.state, old.message, old.supported_run_modes) != (
        new.state, new.message, new.supported_run_modes
    ):
        return True
    if new.capacity is None:
        return False
    if old.capacity is None:
        return True
    return old.capacity.materially_differs(new.capacity)


def cluster_name(cluster_id: str) -> str:
    return f"clusters/{cluster_id}"


# --- the job, as far as matching needs it -----------------------------------


@dataclass(frozen=True)
class Resources:
    cpu: float = 0.0
    memory_bytes: int = 0
    gpus: int = 0
    gpu_type: str = ""


@dataclass(frozen=True)
class ReplicaGroup:
    role: str
    replicas: int
    processes_per_replica: int = 1
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True)
class Selector:
    cluster: str = ""
    cluster_type: ClusterType = ClusterType.UNSPECIFIED
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobRequirements:
    run_mode: RunMode
    replica_groups: tuple[ReplicaGroup, ...]
    selector: Selector = field(default_factory=Selector)
    project: str = ""  # the job's project; "" skips the project check
    image: bool = False  # a replica group names a container image


@dataclass(frozen=True)
class Candidate:
    cluster: str
    cluster_type: ClusterType
    eligible: bool
    score: float
    reasons: tuple[str, ...]
    driver_address: str
