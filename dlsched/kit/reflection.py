"""gRPC server reflection, v1 beside v1alpha.

grpcio-reflection ships only ``grpc.reflection.v1alpha``; current tools
(grpcurl, Postman, grpcui, Buf Studio) ask ``grpc.reflection.v1`` first. The
two protocols are the same messages with the same field numbers under another
package (``grpc/reflection/v1/reflection.proto`` is v1alpha renamed), so one
servicer answers both: v1 requests decode with the v1alpha classes, and the
v1 file descriptor, built here from v1alpha's with the package renamed, is
added to the default pool so that v1 can describe itself too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection as alpha
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as alpha_pb2_grpc

from dlsched.kit.handlers import WrappingRegistrar

V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE = alpha.SERVICE_NAME
SERVICE_NAMES = (V1_SERVICE, V1ALPHA_SERVICE)


def _rename(type_name: str) -> str:
    old = f".{alpha_pb2.DESCRIPTOR.package}."
    return f".{V1_PACKAGE}." + type_name[len(old):] if type_name.startswith(old) else type_name


def _rename_messages(messages: Sequence[descriptor_pb2.DescriptorProto]) -> None:
    for m in messages:
        for f in m.field:
            if f.type_name:
                f.type_name = _rename(f.type_name)
        _rename_messages(m.nested_type)


def v1_file() -> FileDescriptor:
    """The v1 reflection file, in the default pool (added once)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = V1_FILE, V1_PACKAGE
    fdp.options.Clear()
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.java_multiple_files = True
    fdp.options.java_outer_classname = "ServerReflectionProto"
    _rename_messages(fdp.message_type)
    for svc in fdp.service:
        for method in svc.method:
            method.input_type, method.output_type = _rename(method.input_type), _rename(method.output_type)
    pool.AddSerializedFile(fdp.SerializeToString())
    return pool.FindFileByName(V1_FILE)


def enable(service_names: Sequence[str], server: grpc.aio.Server | WrappingRegistrar) -> None:
    """Serve reflection v1 and v1alpha for ``service_names`` (both reflection services listed)."""
    v1_file()
    servicer = alpha.aio.ReflectionServicer([*service_names, *SERVICE_NAMES])
    alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=alpha_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        V1_SERVICE, {"ServerReflectionInfo": handler}),))

