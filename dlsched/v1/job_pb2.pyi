import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_MODE_UNSPECIFIED: _ClassVar[RunMode]
    RUN_MODE_SINGLE_PROCESS: _ClassVar[RunMode]
    RUN_MODE_MULTI_PROCESS: _ClassVar[RunMode]
    RUN_MODE_PS_WORKER: _ClassVar[RunMode]
    RUN_MODE_MASTER_WORKER: _ClassVar[RunMode]
    RUN_MODE_MPI: _ClassVar[RunMode]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_STOPPING: _ClassVar[JobState]
    JOB_STATE_STOPPED: _ClassVar[JobState]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_PENDING: _ClassVar[ReplicaState]
    REPLICA_STATE_RUNNING: _ClassVar[ReplicaState]
    REPLICA_STATE_SUCCEEDED: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
    REPLICA_STATE_STOPPED: _ClassVar[ReplicaState]

class LogStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_STREAM_UNSPECIFIED: _ClassVar[LogStream]
    LOG_STREAM_STDOUT: _ClassVar[LogStream]
    LOG_STREAM_STDERR: _ClassVar[LogStream]

class ClusterType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLUSTER_TYPE_UNSPECIFIED: _ClassVar[ClusterType]
    CLUSTER_TYPE_LOCAL: _ClassVar[ClusterType]
    CLUSTER_TYPE_SLURM: _ClassVar[ClusterType]
    CLUSTER_TYPE_KUBERNETES: _ClassVar[ClusterType]
    CLUSTER_TYPE_RAY: _ClassVar[ClusterType]

class WatchEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WATCH_EVENT_TYPE_UNSPECIFIED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_EXISTING: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_CREATED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_UPDATED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_DELETED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_HEARTBEAT: _ClassVar[WatchEventType]
RUN_MODE_UNSPECIFIED: RunMode
RUN_MODE_SINGLE_PROCESS: RunMode
RUN_MODE_MULTI_PROCESS: RunMode
RUN_MODE_PS_WORKER: RunMode
RUN_MODE_MASTER_WORKER: RunMode
RUN_MODE_MPI: RunMode
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_STOPPING: JobState
JOB_STATE_STOPPED: JobState
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_PENDING: ReplicaState
REPLICA_STATE_RUNNING: ReplicaState
REPLICA_STATE_SUCCEEDED: ReplicaState
REPLICA_STATE_FAILED: ReplicaState
REPLICA_STATE_STOPPED: ReplicaState
LOG_STREAM_UNSPECIFIED: LogStream
LOG_STREAM_STDOUT: LogStream
LOG_STREAM_STDERR: LogStream
CLUSTER_TYPE_UNSPECIFIED: ClusterType
CLUSTER_TYPE_LOCAL: ClusterType
CLUSTER_TYPE_SLURM: ClusterType
CLUSTER_TYPE_KUBERNETES: ClusterType
CLUSTER_TYPE_RAY: ClusterType
WATCH_EVENT_TYPE_UNSPECIFIED: WatchEventType
WATCH_EVENT_TYPE_EXISTING: WatchEventType
WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE: WatchEventType
WATCH_EVENT_TYPE_CREATED: WatchEventType
WATCH_EVENT_TYPE_UPDATED: WatchEventType
WATCH_EVENT_TYPE_DELETED: WatchEventType
WATCH_EVENT_TYPE_HEARTBEAT: WatchEventType

class Resources(_message.Message):
    __slots__ = ("cpu", "memory_bytes", "gpus", "gpu_type")
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    cpu: float
    memory_bytes: int
    gpus: int
    gpu_type: str
    def __init__(self, cpu: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., gpus: _Optional[int] = ..., gpu_type: _Optional[str] = ...) -> None: ...

class ReplicaGroup(_message.Message):
    __slots__ = ("role", "replicas", "processes_per_replica", "command", "args", "image", "env", "working_dir", "resources")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    processes_per_replica: int
    command: _containers.RepeatedScalarFieldContainer[str]
    args: _containers.RepeatedScalarFieldContainer[str]
    image: str
    env: _containers.ScalarMap[str, str]
    working_dir: str
    resources: Resources
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., processes_per_replica: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., args: _Optional[_Iterable[str]] = ..., image: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ...) -> None: ...

class ClusterSelector(_message.Message):
    __slots__ = ("cluster", "cluster_type", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TYPE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    cluster_type: ClusterType
    labels: _containers.ScalarMap[str, str]
    def __init__(self, cluster: _Optional[str] = ..., cluster_type: _Optional[_Union[ClusterType, str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("run_mode", "replica_groups", "cluster_selector", "queue", "time_limit", "max_retries", "labels", "project")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    run_mode: RunMode
    replica_groups: _containers.RepeatedCompositeFieldContainer[ReplicaGroup]
    cluster_selector: ClusterSelector
    queue: str
    time_limit: _duration_pb2.Duration
    max_retries: int
    labels: _containers.ScalarMap[str, str]
    project: str
    def __init__(self, run_mode: _Optional[_Union[RunMode, str]] = ..., replica_groups: _Optional[_Iterable[_Union[ReplicaGroup, _Mapping]]] = ..., cluster_selector: _Optional[_Union[ClusterSelector, _Mapping]] = ..., queue: _Optional[str] = ..., time_limit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_retries: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., project: _Optional[str] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("role", "index", "state", "exit_code", "host", "message")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    state: ReplicaState
    exit_code: int
    host: str
    message: str
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., exit_code: _Optional[int] = ..., host: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("name", "uid", "spec", "state", "reason", "message", "exit_code", "replicas", "cluster", "backend_job_id", "create_time", "update_time", "start_time", "end_time", "labels", "attempt", "etag", "backend_restarts", "owner", "project")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    BACKEND_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    spec: JobSpec
    state: JobState
    reason: str
    message: str
    exit_code: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    cluster: str
    backend_job_id: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    attempt: int
    etag: str
    backend_restarts: int
    owner: str
    project: str
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., exit_code: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., cluster: _Optional[str] = ..., backend_job_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., attempt: _Optional[int] = ..., etag: _Optional[str] = ..., backend_restarts: _Optional[int] = ..., owner: _Optional[str] = ..., project: _Optional[str] = ...) -> None: ...

class LogEntry(_message.Message):
    __slots__ = ("role", "replica_index", "stream", "text", "time")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    role: str
    replica_index: int
    stream: LogStream
    text: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, role: _Optional[str] = ..., replica_index: _Optional[int] = ..., stream: _Optional[_Union[LogStream, str]] = ..., text: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReplicaUsage(_message.Message):
    __slots__ = ("role", "replica_index", "cpu_seconds", "memory_bytes", "peak_memory_bytes", "gpu_utilization_percent", "gpu_memory_bytes", "running")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    role: str
    replica_index: int
    cpu_seconds: float
    memory_bytes: int
    peak_memory_bytes: int
    gpu_utilization_percent: float
    gpu_memory_bytes: int
    running: bool
    def __init__(self, role: _Optional[str] = ..., replica_index: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., gpu_utilization_percent: _Optional[float] = ..., gpu_memory_bytes: _Optional[int] = ..., running: _Optional[bool] = ...) -> None: ...

class JobUsage(_message.Message):
    __slots__ = ("replicas", "sample_time")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaUsage]
    sample_time: _timestamp_pb2.Timestamp
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaUsage, _Mapping]]] = ..., sample_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class NativeSpec(_message.Message):
    __slots__ = ("media_type", "content")
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    media_type: str
    content: str
    def __init__(self, media_type: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...
