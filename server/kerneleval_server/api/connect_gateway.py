"""HTTP/JSON beside gRPC: KernelEvalService and OperationsService over the Connect protocol.

`--http-port` serves both services with connectrpc (the official connect-python), whose
generated ASGI applications (`kerneleval.v1.*_connect`, made by `make gen` with
protoc-gen-connectrpc) speak Connect (JSON or binary protobuf, unary and streaming), gRPC-Web
and gRPC, run by hypercorn (HTTP/1.1, and HTTP/2 for bidirectional `RunBatch`) inside the
service's own event loop. JSON is the proto3 JSON mapping (google.protobuf's json_format:
lowerCamelCase names, 64-bit integers as strings, enums by name).

The handlers hold no API logic: each call is forwarded to the service's own gRPC listener
over a grpc.aio channel (its unix socket, or a loopback port opened for this), with the
caller's `authorization` header as metadata and its `connect-timeout-ms` as the deadline. A
gRPC status comes back as the Connect error of the same code, with the same message and
details (the `google.rpc.BadRequest` of a refused JobSpec), each detail with its JSON in
Connect's `debug` beside its bytes; to a JSON request, the field paths (in the details and the
message) are in the JSON names the request used (`spec.kernel.sourceCode`). So the admin
token (AdminAuth), validation and error mapping stay in one place, the gRPC interceptors and
servicers, and a method added to the proto is served here after `make gen` without a change
to this file.
A client that goes away cancels the gRPC call, as a gRPC client's cancel does.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from connectrpc.code import Code
from connectrpc.errors import ConnectError, ErrorDetail
from connectrpc.request import RequestContext
from google.protobuf import descriptor_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from kerneleval.v1 import (
    kernel_eval_service_connect,
    kernel_eval_service_pb2,
    kernel_eval_service_pb2_grpc,
    operations_service_connect,
    operations_service_pb2,
    operations_service_pb2_grpc,
)
from protobuf import Registry
from protobuf.wkt import Any as ConnectAny
from protobuf.wkt import FileDescriptorSet

log = logging.getLogger("kerneleval.http")

# Connect's codes are gRPC's, in lower case; only CANCELLED is spelled differently.
CODES: dict[grpc.StatusCode, Code] = {
    s: Code[s.name] for s in grpc.StatusCode if s.name in Code.__members__
} | {grpc.StatusCode.CANCELLED: Code.CANCELED}

# Request headers passed on to the gRPC call as metadata.
FORWARDED_HEADERS = ("authorization",)
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def _details_registry() -> Registry:
    """connectrpc's message runtime (protobuf-py) for google.rpc's error details, from
    google.protobuf's own descriptors: a detail it can decode goes out with its JSON too
    (Connect's `debug`), besides the bytes Connect clients decode."""
    files = descriptor_pb2.FileDescriptorSet()
    for desc in (duration_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR):
        proto = files.file.add()
        desc.CopyToProto(proto)
        _json_names(proto.message_type, desc.message_types_by_name)  # CopyToProto leaves them
    return FileDescriptorSet.from_binary(files.SerializeToString()).to_registry()


def _json_names(messages: Any, descriptors: Any) -> None:
    for proto in messages:
        desc = descriptors[proto.name]
        for field in proto.field:
            field.json_name = desc.fields_by_name[field.name].json_name
        _json_names(proto.nested_type, desc.nested_types_by_name)


DETAILS = _details_registry()
_PATH_PART = re.compile(r"\[[^\]]*\]|[A-Za-z_][A-Za-z0-9_]*")


def json_path(path: str) -> str:
    """A field path in the proto3 JSON mapping's names: spec.kernel.source_code ->
    spec.kernel.sourceCode (what is in brackets, an index or a map key, as it is)."""
    return _PATH_PART.sub(
        lambda m: m.group(0) if m.group(0)[0] == "[" else _camel(m.group(0)), path
    )


def _camel(name: str) -> str:
    """protobuf's json_name of a field name."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)


def connect_error(exc: grpc.aio.AioRpcError, json_names: bool = False) -> ConnectError:
    """The Connect error for a gRPC status: same code, message and details, each detail with
    its JSON (`debug`). `json_names`: the request was JSON, so the field paths of a
    google.rpc.BadRequest, and the message's mentions of them, are in its lowerCamelCase names
    (spec.kernel.sourceCode), as the request wrote them."""
    message = exc.details() or ""
    details: list[ErrorDetail] = []
    trailing: Any = exc.trailing_metadata() or ()
    for key, value in trailing:
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for d in status.details:
                raw = d.value
                if json_names and d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    raw, message = _json_field_paths(raw, message)
                detail = ConnectAny(type_url=d.type_url, value=raw)
                desc = DETAILS.message(d.TypeName())
                decoded = detail.unpack(desc) if desc is not None else None
                details.append(ErrorDetail(decoded if decoded is not None else detail))
    return ConnectError(CODES.get(exc.code(), Code.UNKNOWN), message, details)


def _json_field_paths(raw: bytes, message: str) -> tuple[bytes, str]:
    bad = error_details_pb2.BadRequest.FromString(raw)
    for v in bad.field_violations:
        renamed = json_path(v.field)
        if renamed != v.field:
            pattern = re.compile(rf"{re.escape(v.field)}(?![\w.\[])")
            message = pattern.sub(renamed.replace("\\", "\\\\"), message)
            v.field = renamed
    return bad.SerializeToString(), message


def _wants_json(ctx: RequestContext[Any, Any]) -> bool:
    """The request came as JSON (Connect's application/json or application/connect+json,
    gRPC-Web's +json): its errors name fields as JSON does."""
    return any("json" in value for value in ctx.request_headers.getall("content-type"))


def _call_options(ctx: RequestContext[Any, Any]) -> dict[str, Any]:
    metadata = [
        (name, value) for name in FORWARDED_HEADERS for value in ctx.request_headers.getall(name)
    ]
    remaining_ms = ctx.timeout_ms
    timeout = None if remaining_ms is None else max(remaining_ms, 0.0) / 1000.0
    return {"metadata": metadata, "timeout": timeout}


def _unary_response(multicallable: Any) -> Callable[..., Awaitable[Any]]:
    """A Connect handler (unary or client-streaming) that awaits the gRPC call."""

    async def handler(request: Any, ctx: RequestContext[Any, Any]) -> Any:
        call = multicallable(request, **_call_options(ctx))
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise connect_error(exc, _wants_json(ctx)) from None
        finally:
            call.cancel()  # a no-op once it ended; the caller left otherwise

    return handler


def _stream_response(multicallable: Any) -> Callable[..., AsyncIterator[Any]]:
    """A Connect handler (server- or bidirectional-streaming) that relays the gRPC stream."""

    async def handler(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        call = multicallable(request, **_call_options(ctx))
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise connect_error(exc, _wants_json(ctx)) from None
        finally:
            call.cancel()

    return handler


class Forwarder:
    """Stands for a generated Connect service protocol: each of its methods (`get_job`,
    `run_batch`, ...) is the gRPC method of the same name on `stub`, forwarded."""

    def __init__(self, stub: Any, service: Any) -> None:
        self._handlers: dict[str, Callable[..., Any]] = {}
        for method in service.methods:
            multicallable = getattr(stub, method.name)
            wrap = _stream_response if method.server_streaming else _unary_response
            # The generated code's snake_case name, whatever its rule for acronyms.
            self._handlers[method.name.lower()] = wrap(multicallable)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        handlers: dict[str, Callable[..., Any]] = self.__dict__.get("_handlers", {})
        try:
            return handlers[name.replace("_", "").lower()]
        except KeyError:
            raise AttributeError(name) from None


class Router:
    """The ASGI application: each request goes to its service's Connect application by
    path (`/kerneleval.v1.KernelEvalService/GetJob`)."""

    def __init__(self, apps: Sequence[Any]) -> None:
        self._apps = {app.path + "/": app for app in apps}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to start: the handlers need no lifespan
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope.get("path", "")
        for prefix, app in self._apps.items():
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
        if scope["type"] != "http":
            return
        body = b"no such service; Connect paths are /kerneleval.v1.<Service>/<Method>\n"
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [
                    (b"content-type", b"text/plain"),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def application(channel: grpc.aio.Channel, max_message_bytes: int) -> Router:
    """Both services' Connect applications, forwarding to `channel`."""
    kernel_eval = Forwarder(
        kernel_eval_service_pb2_grpc.KernelEvalServiceStub(channel),
        kernel_eval_service_pb2.DESCRIPTOR.services_by_name["KernelEvalService"],
    )
    operations = Forwarder(
        operations_service_pb2_grpc.OperationsServiceStub(channel),
        operations_service_pb2.DESCRIPTOR.services_by_name["OperationsService"],
    )
    return Router(
        [
            kernel_eval_service_connect.KernelEvalServiceASGIApplication(
                kernel_eval,
                read_max_bytes=max_message_bytes,
            ),
            operations_service_connect.OperationsServiceASGIApplication(
                operations,
                read_max_bytes=max_message_bytes,
            ),
        ]
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a taken port fails the start like gRPC's."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class HttpGateway:
    """The HTTP/JSON listener: `start()` in the service's loop, `close()` on shutdown."""

    def __init__(
        self,
        grpc_target: str,
        host: str,
        port: int,
        *,
        tls_cert: str = "",
        tls_key: str = "",
        max_message_bytes: int = 64 * 1024 * 1024,
        drain_s: float = 5.0,
    ) -> None:
        self.grpc_target = grpc_target
        self.max_message_bytes = max_message_bytes
        config = HypercornConfig()
        config.errorlog = log
        config.accesslog = None
        # Longer than the gRPC server's grace on stop, whose end of the forwarded calls ends
        # their HTTP responses with an error message rather than a cut connection.
        config.graceful_timeout = drain_s
        config.include_server_header = False
        if tls_cert:
            config.certfile, config.keyfile = tls_cert, tls_key
            config.create_ssl_context()  # unreadable files fail the start, as for gRPC
        self.scheme = "https" if tls_cert else "http"
        self._sock = bind(host, port)
        self.address = self._sock.getsockname()[:2]
        # hypercorn takes the bound socket over (its documented fd:// bind).
        config.bind = [f"fd://{self._sock.detach()}"]
        self._config = config
        self._stop = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host, port = self.address
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        self._channel = grpc.aio.insecure_channel(self.grpc_target, options=options)
        app = application(self._channel, self.max_message_bytes)
        self._task = asyncio.get_running_loop().create_task(
            hypercorn_serve(app, self._config, shutdown_trigger=self._stop.wait)
        )
        self._task.add_done_callback(self._served)
        log.info("HTTP/JSON (Connect) on %s, forwarding to %s", self.url, self.grpc_target)

    def _served(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the HTTP/JSON listener stopped: %s", task.exception())

    def stop_accepting(self) -> None:
        """No new connections; calls in flight go on until the gRPC server ends them."""
        self._stop.set()

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            # hypercorn gives up on connections after graceful_timeout itself.
            done, _ = await asyncio.wait([self._task], timeout=self._config.graceful_timeout + 5)
            if not done:
                self._task.cancel()
        if self._channel is not None:
            await self._channel.close(None)
