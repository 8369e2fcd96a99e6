"""The admin token: every method of OperationsService needs `authorization: Bearer <token>`.

Checked once, in a server interceptor (as gRPC's examples do auth), before the servicer runs:
the servicers hold no auth code, and a method added to the service later is covered too.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

ADMIN_SERVICE = "/kerneleval.v1.OperationsService/"
MESSAGE = "OperationsService needs the metadata 'authorization: Bearer <admin token>'"


def bearer_matches(metadata: Sequence[tuple[str, Any]] | None, token: bytes) -> bool:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, given = str(value).partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token):
                return True
    return False


async def _refuse(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _refuse_stream(request: Any, context: Any) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover - abort raises


class AdminAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = getattr(details, "method", "") or ""
        if handler is None or not method.startswith(ADMIN_SERVICE):
            return handler
        if bearer_matches(getattr(details, "invocation_metadata", None), self._token):
            return handler
        # The same shape of handler, answering UNAUTHENTICATED before anything runs.
        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_refuse, des, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream, des, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_refuse, des, ser)
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, des, ser)
