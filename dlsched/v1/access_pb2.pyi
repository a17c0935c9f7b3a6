import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_VIEWER: _ClassVar[Role]
    ROLE_MEMBER: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_VIEWER: Role
ROLE_MEMBER: Role
ROLE_ADMIN: Role

class RoleBinding(_message.Message):
    __slots__ = ("name", "uid", "principal", "project", "role", "create_time", "creator")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    principal: str
    project: str
    role: Role
    create_time: _timestamp_pb2.Timestamp
    creator: str
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., principal: _Optional[str] = ..., project: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., creator: _Optional[str] = ...) -> None: ...

class ApiToken(_message.Message):
    __slots__ = ("name", "uid", "service_account", "description", "expire_time", "create_time", "creator")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    service_account: str
    description: str
    expire_time: _timestamp_pb2.Timestamp
    create_time: _timestamp_pb2.Timestamp
    creator: str
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., service_account: _Optional[str] = ..., description: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., creator: _Optional[str] = ...) -> None: ...

class ProjectRole(_message.Message):
    __slots__ = ("project", "role")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    project: str
    role: Role
    def __init__(self, project: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...
