"""Requests that cannot be decoded are the client's mistake: INVALID_ARGUMENT, never UNKNOWN.

grpc-python decodes a request with the handler's `request_deserializer` before the servicer
runs; a DecodeError there (truncated bytes, invalid UTF-8 in a string field, a wrong wire type)
ends the call as UNKNOWN with "Exception deserializing request". `DecodeErrors` replaces each
handler's deserializer with one that never raises: it hands the servicer's wrapper a
`_Undecodable` instead, and the wrapper aborts the call with INVALID_ARGUMENT and a message
naming the message type (and, where it can tell, the field). For a request stream the first
undecodable message aborts the call the same way.

Register it on the grpc.aio server: `grpc.aio.server(interceptors=[..., DecodeErrors()])`.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError, Message

# A method handler's context (grpc-stubs type it by the method's request and response).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
# A method's handler, whatever its request and response (grpc-stubs make it generic).
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
# A server interceptor of any method: grpc-stubs make it generic, grpc's own class is not
# subscriptable, so the parameters are the type checker's only.
if TYPE_CHECKING:
    Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
else:
    Interceptor = grpc.aio.ServerInterceptor

_MAX_DEPTH = 32


class _Undecodable:
    """Stands for a request message that did not decode."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    message_type = _message_type(deserializer)

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, UnicodeDecodeError, ValueError, RuntimeError) as exc:
            return _Undecodable(describe_decode_error(message_type, raw, exc))

    return deserialize


def _message_type(deserializer: Callable[[bytes], Any]) -> type[Message] | None:
    """The message class of a generated `Message.FromString` deserializer, if it is one."""
    owner = getattr(deserializer, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, Message):
        return owner
    return None


def describe_decode_error(
    message_type: type[Message] | None, raw: bytes, exc: BaseException
) -> str:
    name = message_type.DESCRIPTOR.full_name if message_type is not None else "request"
    where = ""
    if message_type is not None:
        try:
            where = _find_problem(message_type.DESCRIPTOR, raw, "", 0)
        except Exception:  # noqa: BLE001 - the explanation is best effort
            where = ""
    detail = where or f"{exc or type(exc).__name__}"
    return f"the request is not a valid {name} ({len(raw)} bytes): {detail}"


# ---- a small wire-format walk that names the broken field -------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise IndexError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def _find_problem(desc: Any, buf: bytes, path: str, depth: int) -> str:
    """A sentence on the first problem in `buf` as a `desc` message, or "" if none is seen."""
    counts: dict[str, int] = {}
    pos = 0
    while pos < len(buf):
        try:
            key, pos = _varint(buf, pos)
        except IndexError:
            return f"the bytes end inside a field tag{_at(path)}"
        number, wire = key >> 3, key & 7
        field = desc.fields_by_number.get(number)
        name = ""
        if field is not None:
            name = field.name
            if _repeated(field):
                index = counts.get(name, 0)
                counts[name] = index + 1
                name = f"{name}[{index}]"
        fpath = f"{path}.{name}" if path and name else (name or path)
        if number == 0:
            return f"field number 0 is not valid{_at(path)}"
        if wire == 0:
            try:
                _, pos = _varint(buf, pos)
            except IndexError:
                return f"the bytes end inside field {fpath or number}"
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
            if pos > len(buf):
                return f"the bytes end inside field {fpath or number}"
        elif wire == 2:
            try:
                size, pos = _varint(buf, pos)
            except IndexError:
                return f"the bytes end inside the length of field {fpath or number}"
            end = pos + size
            if end > len(buf):
                return (
                    f"field {fpath or number} declares {size} bytes but only "
                    f"{len(buf) - pos} follow (truncated)"
                )
            chunk = buf[pos:end]
            pos = end
            if field is None:
                continue
            if field.type == _descriptor.FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"field {fpath} is not valid UTF-8 (byte {exc.start})"
            elif field.type == _descriptor.FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
                inner = _find_problem(field.message_type, chunk, fpath, depth + 1)
                if inner:
                    return inner
        elif wire == 3 or wire == 4:
            return f"group wire types are not used by this API (field {fpath or number})"
        else:
            return f"unknown wire type {wire} (field {fpath or number})"
    return ""


def _repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; `label` is gone in 7
    if repeated is None:
        return bool(field.label == 3)  # LABEL_REPEATED
    return bool(repeated)


def _at(path: str) -> str:
    return f" in {path}" if path else ""


# ---- the interceptor ---------------------------------------------------------------------


async def _reject(context: Any, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
                return
            async for item in behavior(request, context):
                yield item

        return stream_out

    async def unary_out(request: Any, context: Context) -> Any:
        if isinstance(request, _Undecodable):
            await _reject(context, request)
            return None
        result = behavior(request, context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return unary_out


def _checked(requests: Any, context: Context) -> AsyncIterator[Any]:
    async def gen() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
                return
            yield request

    return gen()


def _stream_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests: Any, context: Context) -> AsyncIterator[Any]:
            async for item in behavior(_checked(requests, context), context):
                yield item

        return stream_out

    async def unary_out(requests: Any, context: Context) -> Any:
        result = behavior(_checked(requests, context), context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return unary_out


class DecodeErrors(Interceptor):
    """Undecodable request bytes -> INVALID_ARGUMENT naming the message type and the field."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behavior = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        if inspect.isgeneratorfunction(behavior):
            return handler  # a synchronous streaming servicer: not wrapped
        deserializer = _safe(handler.request_deserializer)
        serializer = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary_request(handler.unary_unary), deserializer, serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _unary_request(handler.unary_stream), deserializer, serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _stream_request(handler.stream_unary), deserializer, serializer
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _stream_request(handler.stream_stream), deserializer, serializer
            )
        return handler
