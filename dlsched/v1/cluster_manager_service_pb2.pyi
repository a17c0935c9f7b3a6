from dlsched.v1 import cluster_pb2 as _cluster_pb2
from dlsched.v1 import job_pb2 as _job_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import field_mask_pb2 as _field_mask_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateClusterRequest(_message.Message):
    __slots__ = ("cluster_id", "cluster", "request_id")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    cluster: _cluster_pb2.Cluster
    request_id: str
    def __init__(self, cluster_id: _Optional[str] = ..., cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateClusterResponse(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.Cluster
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ...) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetClusterResponse(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.Cluster
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ...) -> None: ...

class ListClustersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "filter")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    filter: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., filter: _Optional[str] = ...) -> None: ...

class ListClustersResponse(_message.Message):
    __slots__ = ("clusters", "next_page_token")
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Cluster]
    next_page_token: str
    def __init__(self, clusters: _Optional[_Iterable[_Union[_cluster_pb2.Cluster, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateClusterRequest(_message.Message):
    __slots__ = ("cluster", "update_mask", "etag")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.Cluster
    update_mask: _field_mask_pb2.FieldMask
    etag: str
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ..., update_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class UpdateClusterResponse(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.Cluster
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ...) -> None: ...

class DeleteClusterRequest(_message.Message):
    __slots__ = ("name", "allow_missing", "etag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOW_MISSING_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    allow_missing: bool
    etag: str
    def __init__(self, name: _Optional[str] = ..., allow_missing: _Optional[bool] = ..., etag: _Optional[str] = ...) -> None: ...

class DeleteClusterResponse(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.Cluster
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ...) -> None: ...

class WatchClustersRequest(_message.Message):
    __slots__ = ("filter", "resume_token")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    filter: str
    resume_token: str
    def __init__(self, filter: _Optional[str] = ..., resume_token: _Optional[str] = ...) -> None: ...

class WatchClustersResponse(_message.Message):
    __slots__ = ("type", "cluster", "resume_token")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    type: _job_pb2.WatchEventType
    cluster: _cluster_pb2.Cluster
    resume_token: str
    def __init__(self, type: _Optional[_Union[_job_pb2.WatchEventType, str]] = ..., cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class MatchClustersRequest(_message.Message):
    __slots__ = ("spec", "project")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    project: str
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., project: _Optional[str] = ...) -> None: ...

class MatchClustersResponse(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.ClusterCandidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[_cluster_pb2.ClusterCandidate, _Mapping]]] = ...) -> None: ...
