"""Server reflection under both names: grpc.reflection.v1 (what grpcurl and newer tools ask
first) and grpc.reflection.v1alpha.

grpcio-reflection serves only v1alpha. The v1 protocol is the same messages under another
package, so its bytes are v1alpha's: the one servicer answers both names. The v1 file
descriptor (v1alpha's, renamed) goes into the default pool, so that a client can also describe
the v1 service itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
METHOD = "ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from v1alpha's descriptor."""
    alpha = reflection_pb2.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.CopyToProto(proto)
    old = f".{alpha.package}."
    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java/csharp package options name v1alpha
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):  # a message or enum field
                f.type_name = f.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    return proto


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:  # not there yet (a newer grpcio-reflection may have added it)
        pool.Add(_v1_file())


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection for `service_names` and for itself, as v1 and as v1alpha."""
    _register_v1_descriptor(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)  # type: ignore[attr-defined]
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        generic = grpc.method_handlers_generic_handler(name, {METHOD: handler})
        server.add_generic_rpc_handlers((generic,))
