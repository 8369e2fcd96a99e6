"""The admin token: every method of OperationsService needs `authorization: Bearer <token>`.

Checked once, in a server interceptor (as gRPC's examples do auth), before the servicer runs:
the servicers hold no auth code, and a method added to the service later is covered too. A
call without a token is told what to send; one with a wrong token is told so, and where the
service's token is (never the token, nor the state folder's path).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

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

ADMIN_SERVICE = "/kerneleval.v1.OperationsService/"
MESSAGE = "OperationsService needs the metadata 'authorization: Bearer <admin token>'"
WRONG = "the admin token given is not this service's"
# Where the right token is, for a service that generated its own (main.admin_token).
IN_STATE_DIR = (
    "the service's token is in the file admin_token of its state folder (--state-dir), e.g. "
    "`kerneleval --admin-token-file state/admin_token ...`"
)
CONFIGURED = "the service's token is the one its --admin-token (KERNELEVAL_ADMIN_TOKEN) set"


def bearer_matches(metadata: Sequence[tuple[str, Any]] | None, token: bytes) -> bool:
    return refusal(metadata, token) is None


def refusal(
    metadata: Sequence[tuple[str, Any]] | None, token: bytes, where: str = ""
) -> str | None:
    """None when the metadata carries `token` as a Bearer token; else why not: none given, or
    a wrong one (and where the right one is)."""
    given = False
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, text = str(value).partition(" ")
            if scheme.lower() != "bearer":
                continue
            given = True
            if hmac.compare_digest(text.strip().encode(), token):
                return None
    tail = f"; {where}" if where else ""
    return (WRONG if given else MESSAGE) + tail


def _refuse(message: str) -> Any:
    async def refuse(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refuse


def _refuse_stream(message: str) -> Any:
    async def refuse(request: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    return refuse


class AdminAuth(Interceptor):
    """`where`: a sentence on where the right token is, said to a caller with a wrong one."""

    def __init__(self, token: str, where: str = IN_STATE_DIR) -> None:
        self._token = token.encode()
        self._where = where

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        method = getattr(details, "method", "") or ""
        if handler is None or not method.startswith(ADMIN_SERVICE):
            return handler
        why = refusal(getattr(details, "invocation_metadata", None), self._token, self._where)
        if why is None:
            return handler
        return refused_handler(handler, why)


def refused_handler(handler: Handler, why: str) -> Handler:
    """The same shape of handler, answering UNAUTHENTICATED before anything runs."""
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse(why), des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream(why), des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse(why), des, ser)
    return grpc.stream_stream_rpc_method_handler(_refuse_stream(why), des, ser)
