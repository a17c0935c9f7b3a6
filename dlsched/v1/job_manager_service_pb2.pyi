import datetime

from dlsched.v1 import cluster_pb2 as _cluster_pb2
from dlsched.v1 import job_pb2 as _job_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_id", "spec", "request_id", "dry_run")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: _job_pb2.JobSpec
    request_id: str
    dry_run: bool
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class DryRunResult(_message.Message):
    __slots__ = ("cluster", "candidates", "native_spec")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    NATIVE_SPEC_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    candidates: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.ClusterCandidate]
    native_spec: _job_pb2.NativeSpec
    def __init__(self, cluster: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[_cluster_pb2.ClusterCandidate, _Mapping]]] = ..., native_spec: _Optional[_Union[_job_pb2.NativeSpec, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "dry_run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    dry_run: DryRunResult
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ..., dry_run: _Optional[_Union[DryRunResult, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("name", "min_etag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_etag: str
    def __init__(self, name: _Optional[str] = ..., min_etag: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "filter", "min_etag")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    MIN_ETAG_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    filter: str
    min_etag: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., filter: _Optional[str] = ..., min_etag: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_job_pb2.Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_job_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("name", "request_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    request_id: str
    def __init__(self, name: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class StopJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("name", "allow_missing", "etag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOW_MISSING_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    allow_missing: bool
    etag: str
    def __init__(self, name: _Optional[str] = ..., allow_missing: _Optional[bool] = ..., etag: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ...) -> None: ...

class WatchJobsRequest(_message.Message):
    __slots__ = ("filter", "resume_token")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    filter: str
    resume_token: str
    def __init__(self, filter: _Optional[str] = ..., resume_token: _Optional[str] = ...) -> None: ...

class WatchJobsResponse(_message.Message):
    __slots__ = ("type", "job", "resume_token")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    type: _job_pb2.WatchEventType
    job: _job_pb2.Job
    resume_token: str
    def __init__(self, type: _Optional[_Union[_job_pb2.WatchEventType, str]] = ..., job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class StreamJobLogsRequest(_message.Message):
    __slots__ = ("name", "follow", "tail_lines", "since_time", "role", "replica_index", "streams", "resume_cursor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    SINCE_TIME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_CURSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    follow: bool
    tail_lines: int
    since_time: _timestamp_pb2.Timestamp
    role: str
    replica_index: int
    streams: _containers.RepeatedScalarFieldContainer[_job_pb2.LogStream]
    resume_cursor: str
    def __init__(self, name: _Optional[str] = ..., follow: _Optional[bool] = ..., tail_lines: _Optional[int] = ..., since_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., role: _Optional[str] = ..., replica_index: _Optional[int] = ..., streams: _Optional[_Iterable[_Union[_job_pb2.LogStream, str]]] = ..., resume_cursor: _Optional[str] = ...) -> None: ...

class StreamJobLogsResponse(_message.Message):
    __slots__ = ("entries", "resume_cursor")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RESUME_CURSOR_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_job_pb2.LogEntry]
    resume_cursor: str
    def __init__(self, entries: _Optional[_Iterable[_Union[_job_pb2.LogEntry, _Mapping]]] = ..., resume_cursor: _Optional[str] = ...) -> None: ...

class GetJobUsageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetJobUsageResponse(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _job_pb2.JobUsage
    def __init__(self, usage: _Optional[_Union[_job_pb2.JobUsage, _Mapping]] = ...) -> None: ...
