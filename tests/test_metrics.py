"""The metrics interceptor: codes counted, bugs turned into INTERNAL."""

from __future__ import annotations

import asyncio
from typing import Any


def test_interceptor_counts_codes_and_turns_bugs_into_internal() -> None:
    import types

    import grpc
    from kerneleval_server.metrics import Metrics, MetricsInterceptor

    class Context:
        def __init__(self) -> None:
            self.aborted: tuple[grpc.StatusCode, str] | None = None

        def code(self) -> None:
            return None

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.aborted = (code, details)
            raise grpc.aio.AbortError()

    async def ok(request: object, context: object) -> str:
        return "fine"

    async def buggy(request: object, context: object) -> str:
        raise ValueError("oops")

    async def scenario() -> Context:
        m = Metrics()
        icpt = MetricsInterceptor(m)
        results = []
        for fn, name in ((ok, "/svc.S/Ok"), (buggy, "/svc.S/Buggy")):
            details: Any = types.SimpleNamespace(method=name, invocation_metadata=())
            handler = grpc.unary_unary_rpc_method_handler(fn)

            async def cont(_: object, h: grpc.RpcMethodHandler = handler) -> grpc.RpcMethodHandler:
                return h

            wrapped = await icpt.intercept_service(cont, details)
            ctx = Context()
            try:
                results.append(await wrapped.unary_unary(None, ctx))
            except grpc.aio.AbortError:
                results.append(ctx)
        assert results[0] == "fine"
        text = m.handled.labels("svc.S", "Ok", "OK")._value.get()  # type: ignore[attr-defined]
        assert text == 1
        assert m.handled.labels("svc.S", "Buggy", "INTERNAL")._value.get() == 1  # type: ignore[attr-defined]
        assert isinstance(results[1], Context)
        return results[1]

    ctx = asyncio.run(scenario())
    assert ctx.aborted is not None and ctx.aborted[0] == grpc.StatusCode.INTERNAL
    assert "ValueError: oops" in ctx.aborted[1]
