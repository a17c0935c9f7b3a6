from dlsched.v1 import access_pb2 as _access_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetCallerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCallerResponse(_message.Message):
    __slots__ = ("principal", "admin", "roles")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    principal: str
    admin: bool
    roles: _containers.RepeatedCompositeFieldContainer[_access_pb2.ProjectRole]
    def __init__(self, principal: _Optional[str] = ..., admin: _Optional[bool] = ..., roles: _Optional[_Iterable[_Union[_access_pb2.ProjectRole, _Mapping]]] = ...) -> None: ...

class CreateRoleBindingRequest(_message.Message):
    __slots__ = ("role_binding",)
    ROLE_BINDING_FIELD_NUMBER: _ClassVar[int]
    role_binding: _access_pb2.RoleBinding
    def __init__(self, role_binding: _Optional[_Union[_access_pb2.RoleBinding, _Mapping]] = ...) -> None: ...

class CreateRoleBindingResponse(_message.Message):
    __slots__ = ("role_binding",)
    ROLE_BINDING_FIELD_NUMBER: _ClassVar[int]
    role_binding: _access_pb2.RoleBinding
    def __init__(self, role_binding: _Optional[_Union[_access_pb2.RoleBinding, _Mapping]] = ...) -> None: ...

class ListRoleBindingsRequest(_message.Message):
    __slots__ = ("principal", "project", "page_size", "page_token")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    principal: str
    project: str
    page_size: int
    page_token: str
    def __init__(self, principal: _Optional[str] = ..., project: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRoleBindingsResponse(_message.Message):
    __slots__ = ("role_bindings", "next_page_token")
    ROLE_BINDINGS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    role_bindings: _containers.RepeatedCompositeFieldContainer[_access_pb2.RoleBinding]
    next_page_token: str
    def __init__(self, role_bindings: _Optional[_Iterable[_Union[_access_pb2.RoleBinding, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteRoleBindingRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteRoleBindingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateApiTokenRequest(_message.Message):
    __slots__ = ("api_token",)
    API_TOKEN_FIELD_NUMBER: _ClassVar[int]
    api_token: _access_pb2.ApiToken
    def __init__(self, api_token: _Optional[_Union[_access_pb2.ApiToken, _Mapping]] = ...) -> None: ...

class CreateApiTokenResponse(_message.Message):
    __slots__ = ("api_token", "secret")
    API_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    api_token: _access_pb2.ApiToken
    secret: str
    def __init__(self, api_token: _Optional[_Union[_access_pb2.ApiToken, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListApiTokensRequest(_message.Message):
    __slots__ = ("service_account", "page_size", "page_token")
    SERVICE_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    service_account: str
    page_size: int
    page_token: str
    def __init__(self, service_account: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListApiTokensResponse(_message.Message):
    __slots__ = ("api_tokens", "next_page_token")
    API_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    api_tokens: _containers.RepeatedCompositeFieldContainer[_access_pb2.ApiToken]
    next_page_token: str
    def __init__(self, api_tokens: _Optional[_Iterable[_Union[_access_pb2.ApiToken, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteApiTokenRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteApiTokenResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
