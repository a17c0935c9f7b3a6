import datetime

from dlsched.v1 import cluster_pb2 as _cluster_pb2
from dlsched.v1 import job_pb2 as _job_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConfigureClusterRequest(_message.Message):
    __slots__ = ("cluster", "address", "credentials", "options", "cluster_type")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TYPE_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    address: str
    credentials: _cluster_pb2.ClusterCredentials
    options: _containers.ScalarMap[str, str]
    cluster_type: _job_pb2.ClusterType
    def __init__(self, cluster: _Optional[str] = ..., address: _Optional[str] = ..., credentials: _Optional[_Union[_cluster_pb2.ClusterCredentials, _Mapping]] = ..., options: _Optional[_Mapping[str, str]] = ..., cluster_type: _Optional[_Union[_job_pb2.ClusterType, str]] = ...) -> None: ...

class ConfigureClusterResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ClusterInfo
    def __init__(self, info: _Optional[_Union[ClusterInfo, _Mapping]] = ...) -> None: ...

class RemoveClusterRequest(_message.Message):
    __slots__ = ("cluster", "if_idle")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    IF_IDLE_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    if_idle: bool
    def __init__(self, cluster: _Optional[str] = ..., if_idle: _Optional[bool] = ...) -> None: ...

class RemoveClusterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("state", "message", "capacity", "supported_run_modes", "driver_version")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_RUN_MODES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: _cluster_pb2.ClusterState
    message: str
    capacity: _cluster_pb2.ClusterCapacity
    supported_run_modes: _containers.RepeatedScalarFieldContainer[_job_pb2.RunMode]
    driver_version: str
    def __init__(self, state: _Optional[_Union[_cluster_pb2.ClusterState, str]] = ..., message: _Optional[str] = ..., capacity: _Optional[_Union[_cluster_pb2.ClusterCapacity, _Mapping]] = ..., supported_run_modes: _Optional[_Iterable[_Union[_job_pb2.RunMode, str]]] = ..., driver_version: _Optional[str] = ...) -> None: ...

class GetClusterInfoRequest(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    def __init__(self, cluster: _Optional[str] = ...) -> None: ...

class GetClusterInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ClusterInfo
    def __init__(self, info: _Optional[_Union[ClusterInfo, _Mapping]] = ...) -> None: ...

class RenderJobRequest(_message.Message):
    __slots__ = ("cluster", "job_id", "spec")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job_id: str
    spec: _job_pb2.JobSpec
    def __init__(self, cluster: _Optional[str] = ..., job_id: _Optional[str] = ..., spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class RenderJobResponse(_message.Message):
    __slots__ = ("native_spec",)
    NATIVE_SPEC_FIELD_NUMBER: _ClassVar[int]
    native_spec: _job_pb2.NativeSpec
    def __init__(self, native_spec: _Optional[_Union[_job_pb2.NativeSpec, _Mapping]] = ...) -> None: ...

class LaunchJobRequest(_message.Message):
    __slots__ = ("cluster", "job_id", "spec", "attempt", "job_uid")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    JOB_UID_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job_id: str
    spec: _job_pb2.JobSpec
    attempt: int
    job_uid: str
    def __init__(self, cluster: _Optional[str] = ..., job_id: _Optional[str] = ..., spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., attempt: _Optional[int] = ..., job_uid: _Optional[str] = ...) -> None: ...

class LaunchJobResponse(_message.Message):
    __slots__ = ("backend_job_id", "native_spec", "observation")
    BACKEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NATIVE_SPEC_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    backend_job_id: str
    native_spec: _job_pb2.NativeSpec
    observation: JobObservation
    def __init__(self, backend_job_id: _Optional[str] = ..., native_spec: _Optional[_Union[_job_pb2.NativeSpec, _Mapping]] = ..., observation: _Optional[_Union[JobObservation, _Mapping]] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id", "backend_job_id", "job_uid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_UID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    backend_job_id: str
    job_uid: str
    def __init__(self, job_id: _Optional[str] = ..., backend_job_id: _Optional[str] = ..., job_uid: _Optional[str] = ...) -> None: ...

class JobObservation(_message.Message):
    __slots__ = ("job_id", "backend_job_id", "found", "state", "reason", "message", "exit_code", "replicas", "start_time", "end_time", "attempt", "backend_restarts", "job_uid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    JOB_UID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    backend_job_id: str
    found: bool
    state: _job_pb2.JobState
    reason: str
    message: str
    exit_code: int
    replicas: _containers.RepeatedCompositeFieldContainer[_job_pb2.ReplicaStatus]
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    attempt: int
    backend_restarts: int
    job_uid: str
    def __init__(self, job_id: _Optional[str] = ..., backend_job_id: _Optional[str] = ..., found: _Optional[bool] = ..., state: _Optional[_Union[_job_pb2.JobState, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., exit_code: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[_job_pb2.ReplicaStatus, _Mapping]]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., backend_restarts: _Optional[int] = ..., job_uid: _Optional[str] = ...) -> None: ...

class BatchGetJobObservationsRequest(_message.Message):
    __slots__ = ("cluster", "jobs")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobRef]
    def __init__(self, cluster: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobRef, _Mapping]]] = ...) -> None: ...

class BatchGetJobObservationsResponse(_message.Message):
    __slots__ = ("observations",)
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _containers.RepeatedCompositeFieldContainer[JobObservation]
    def __init__(self, observations: _Optional[_Iterable[_Union[JobObservation, _Mapping]]] = ...) -> None: ...

class WatchJobObservationsRequest(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    def __init__(self, cluster: _Optional[str] = ...) -> None: ...

class WatchJobObservationsResponse(_message.Message):
    __slots__ = ("observation", "snapshot_complete")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    observation: JobObservation
    snapshot_complete: bool
    def __init__(self, observation: _Optional[_Union[JobObservation, _Mapping]] = ..., snapshot_complete: _Optional[bool] = ...) -> None: ...

class TerminateJobRequest(_message.Message):
    __slots__ = ("cluster", "job", "grace_period")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job: JobRef
    grace_period: _duration_pb2.Duration
    def __init__(self, cluster: _Optional[str] = ..., job: _Optional[_Union[JobRef, _Mapping]] = ..., grace_period: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TerminateJobResponse(_message.Message):
    __slots__ = ("observation",)
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    observation: JobObservation
    def __init__(self, observation: _Optional[_Union[JobObservation, _Mapping]] = ...) -> None: ...

class CleanupJobRequest(_message.Message):
    __slots__ = ("cluster", "job")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job: JobRef
    def __init__(self, cluster: _Optional[str] = ..., job: _Optional[_Union[JobRef, _Mapping]] = ...) -> None: ...

class CleanupJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForgetJobsRequest(_message.Message):
    __slots__ = ("cluster", "jobs")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobRef]
    def __init__(self, cluster: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobRef, _Mapping]]] = ...) -> None: ...

class ForgetJobsResponse(_message.Message):
    __slots__ = ("forgotten",)
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    forgotten: int
    def __init__(self, forgotten: _Optional[int] = ...) -> None: ...

class TailJobLogsRequest(_message.Message):
    __slots__ = ("cluster", "job", "follow", "tail_lines", "since_time", "role", "replica_index", "streams")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    SINCE_TIME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job: JobRef
    follow: bool
    tail_lines: int
    since_time: _timestamp_pb2.Timestamp
    role: str
    replica_index: int
    streams: _containers.RepeatedScalarFieldContainer[_job_pb2.LogStream]
    def __init__(self, cluster: _Optional[str] = ..., job: _Optional[_Union[JobRef, _Mapping]] = ..., follow: _Optional[bool] = ..., tail_lines: _Optional[int] = ..., since_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., role: _Optional[str] = ..., replica_index: _Optional[int] = ..., streams: _Optional[_Iterable[_Union[_job_pb2.LogStream, str]]] = ...) -> None: ...

class TailJobLogsResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_job_pb2.LogEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[_job_pb2.LogEntry, _Mapping]]] = ...) -> None: ...

class MultiplexJobLogsRequest(_message.Message):
    __slots__ = ("tail_id", "open", "credit", "close")
    TAIL_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    tail_id: int
    open: OpenTail
    credit: int
    close: bool
    def __init__(self, tail_id: _Optional[int] = ..., open: _Optional[_Union[OpenTail, _Mapping]] = ..., credit: _Optional[int] = ..., close: _Optional[bool] = ...) -> None: ...

class OpenTail(_message.Message):
    __slots__ = ("request", "credit")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    request: TailJobLogsRequest
    credit: int
    def __init__(self, request: _Optional[_Union[TailJobLogsRequest, _Mapping]] = ..., credit: _Optional[int] = ...) -> None: ...

class MultiplexJobLogsResponse(_message.Message):
    __slots__ = ("tail_id", "batch", "end")
    TAIL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    tail_id: int
    batch: TailJobLogsResponse
    end: _status_pb2.Status
    def __init__(self, tail_id: _Optional[int] = ..., batch: _Optional[_Union[TailJobLogsResponse, _Mapping]] = ..., end: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class MeasureJobUsageRequest(_message.Message):
    __slots__ = ("cluster", "job")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job: JobRef
    def __init__(self, cluster: _Optional[str] = ..., job: _Optional[_Union[JobRef, _Mapping]] = ...) -> None: ...

class MeasureJobUsageResponse(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _job_pb2.JobUsage
    def __init__(self, usage: _Optional[_Union[_job_pb2.JobUsage, _Mapping]] = ...) -> None: ...
