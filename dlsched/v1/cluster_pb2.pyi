import datetime

from dlsched.v1 import job_pb2 as _job_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLUSTER_STATE_UNSPECIFIED: _ClassVar[ClusterState]
    CLUSTER_STATE_PENDING: _ClassVar[ClusterState]
    CLUSTER_STATE_READY: _ClassVar[ClusterState]
    CLUSTER_STATE_UNREACHABLE: _ClassVar[ClusterState]
    CLUSTER_STATE_DRIVER_UNAVAILABLE: _ClassVar[ClusterState]
    CLUSTER_STATE_DEGRADED: _ClassVar[ClusterState]
CLUSTER_STATE_UNSPECIFIED: ClusterState
CLUSTER_STATE_PENDING: ClusterState
CLUSTER_STATE_READY: ClusterState
CLUSTER_STATE_UNREACHABLE: ClusterState
CLUSTER_STATE_DRIVER_UNAVAILABLE: ClusterState
CLUSTER_STATE_DEGRADED: ClusterState

class SshCredentials(_message.Message):
    __slots__ = ("username", "private_key", "known_host_keys")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_KEY_FIELD_NUMBER: _ClassVar[int]
    KNOWN_HOST_KEYS_FIELD_NUMBER: _ClassVar[int]
    username: str
    private_key: str
    known_host_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, username: _Optional[str] = ..., private_key: _Optional[str] = ..., known_host_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KubernetesCredentials(_message.Message):
    __slots__ = ("kubeconfig", "token", "ca_cert")
    KUBECONFIG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CA_CERT_FIELD_NUMBER: _ClassVar[int]
    kubeconfig: str
    token: str
    ca_cert: str
    def __init__(self, kubeconfig: _Optional[str] = ..., token: _Optional[str] = ..., ca_cert: _Optional[str] = ...) -> None: ...

class TokenCredentials(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class ClusterCredentials(_message.Message):
    __slots__ = ("ssh", "kubernetes", "token")
    SSH_FIELD_NUMBER: _ClassVar[int]
    KUBERNETES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ssh: SshCredentials
    kubernetes: KubernetesCredentials
    token: TokenCredentials
    def __init__(self, ssh: _Optional[_Union[SshCredentials, _Mapping]] = ..., kubernetes: _Optional[_Union[KubernetesCredentials, _Mapping]] = ..., token: _Optional[_Union[TokenCredentials, _Mapping]] = ...) -> None: ...

class GpuInventory(_message.Message):
    __slots__ = ("gpu_type", "total", "free")
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    gpu_type: str
    total: int
    free: int
    def __init__(self, gpu_type: _Optional[str] = ..., total: _Optional[int] = ..., free: _Optional[int] = ...) -> None: ...

class ClusterCapacity(_message.Message):
    __slots__ = ("nodes_total", "nodes_free", "cpus_total", "cpus_free", "memory_bytes_total", "memory_bytes_free", "gpus_total", "gpus_free", "gpus", "max_cpus_per_node", "max_memory_bytes_per_node", "max_gpus_per_node")
    NODES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NODES_FREE_FIELD_NUMBER: _ClassVar[int]
    CPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    GPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    nodes_total: int
    nodes_free: int
    cpus_total: float
    cpus_free: float
    memory_bytes_total: int
    memory_bytes_free: int
    gpus_total: int
    gpus_free: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInventory]
    max_cpus_per_node: float
    max_memory_bytes_per_node: int
    max_gpus_per_node: int
    def __init__(self, nodes_total: _Optional[int] = ..., nodes_free: _Optional[int] = ..., cpus_total: _Optional[float] = ..., cpus_free: _Optional[float] = ..., memory_bytes_total: _Optional[int] = ..., memory_bytes_free: _Optional[int] = ..., gpus_total: _Optional[int] = ..., gpus_free: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInventory, _Mapping]]] = ..., max_cpus_per_node: _Optional[float] = ..., max_memory_bytes_per_node: _Optional[int] = ..., max_gpus_per_node: _Optional[int] = ...) -> None: ...

class Cluster(_message.Message):
    __slots__ = ("name", "uid", "type", "address", "credentials", "labels", "driver_address", "options", "state", "state_message", "capacity", "supported_run_modes", "has_credentials", "create_time", "update_time", "last_heartbeat_time", "etag", "allowed_projects", "tracking_replica")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DRIVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_RUN_MODES_FIELD_NUMBER: _ClassVar[int]
    HAS_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_PROJECTS_FIELD_NUMBER: _ClassVar[int]
    TRACKING_REPLICA_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    type: _job_pb2.ClusterType
    address: str
    credentials: ClusterCredentials
    labels: _containers.ScalarMap[str, str]
    driver_address: str
    options: _containers.ScalarMap[str, str]
    state: ClusterState
    state_message: str
    capacity: ClusterCapacity
    supported_run_modes: _containers.RepeatedScalarFieldContainer[_job_pb2.RunMode]
    has_credentials: bool
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    last_heartbeat_time: _timestamp_pb2.Timestamp
    etag: str
    allowed_projects: _containers.RepeatedScalarFieldContainer[str]
    tracking_replica: str
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., type: _Optional[_Union[_job_pb2.ClusterType, str]] = ..., address: _Optional[str] = ..., credentials: _Optional[_Union[ClusterCredentials, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., driver_address: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[ClusterState, str]] = ..., state_message: _Optional[str] = ..., capacity: _Optional[_Union[ClusterCapacity, _Mapping]] = ..., supported_run_modes: _Optional[_Iterable[_Union[_job_pb2.RunMode, str]]] = ..., has_credentials: _Optional[bool] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., etag: _Optional[str] = ..., allowed_projects: _Optional[_Iterable[str]] = ..., tracking_replica: _Optional[str] = ...) -> None: ...

class ClusterCandidate(_message.Message):
    __slots__ = ("cluster", "cluster_type", "eligible", "score", "reasons", "driver_address")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TYPE_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    DRIVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    cluster_type: _job_pb2.ClusterType
    eligible: bool
    score: float
    reasons: _containers.RepeatedScalarFieldContainer[str]
    driver_address: str
    def __init__(self, cluster: _Optional[str] = ..., cluster_type: _Optional[_Union[_job_pb2.ClusterType, str]] = ..., eligible: _Optional[bool] = ..., score: _Optional[float] = ..., reasons: _Optional[_Iterable[str]] = ..., driver_address: _Optional[str] = ...) -> None: ...
