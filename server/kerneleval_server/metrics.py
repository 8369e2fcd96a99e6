"""Prometheus metrics, served over HTTP on --metrics-port (0 = off).

Names follow go-grpc-prometheus (grpc_server_handled_total, grpc_server_handling_seconds) so
the usual dashboards work. A private registry keeps tests that start several servers apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

# A method's handler, whatever its request and response (grpc-stubs make it generic).
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
# A server interceptor of any method: grpc-stubs make it generic, grpc's own class is not
# subscriptable, so the parameters are the type checker's only.
if TYPE_CHECKING:
    Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
else:
    Interceptor = grpc.aio.ServerInterceptor

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
except ImportError:  # a host without it (e.g. a bare GPU box) still serves; --metrics-port fails
    from kerneleval_server._nometrics import (  # type: ignore[assignment]
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        start_http_server,
    )


log = logging.getLogger("kerneleval.grpc")

# Why a job process exited: the `reason` of WorkerExitedEvent and of
# kerneleval_worker_restarts_total, as docs/OPERATIONS.md ("Watching events") lists them. The
# watchdog names the exit (watchdog/src: a signal it did not send is "crashed"); a kill the
# front end asked for is "killed:" + its KILL_* reason (jobs/manager.py).
KILL_TIMEOUT = "timeout"
KILL_CANCEL = "cancel"
KILL_PROTOCOL = "protocol"
KILL_LOST = "lost"
KILL_NO_CHANNEL = "no_channel"
KILL_AFTER_OUTCOME = "after_outcome"
KILL_STALLED = "stalled"  # a wait of its job passed --max-wait-s (jobs/waits.py)
KILL_REASONS = (
    KILL_TIMEOUT,
    KILL_CANCEL,
    KILL_PROTOCOL,
    KILL_LOST,
    KILL_NO_CHANNEL,
    KILL_AFTER_OUTCOME,
    KILL_STALLED,
    "gpu_outside_phase",  # the watchdog's own: GPU work outside a job's timing window
)
WATCHDOG_EXIT_REASONS = (
    "exited",
    "crashed",
    "oom",
    "xid",
    "reset",
    "restart",
    "stopped",
    "shutdown",
)
LOST_REASON = "lost"  # the front end lost the job process (no exit was reported)
WORKER_EXIT_REASONS = frozenset(
    (*WATCHDOG_EXIT_REASONS, LOST_REASON, *(f"killed:{k}" for k in KILL_REASONS))
)
OTHER_REASON = "other"  # a reason missing above: the label set stays bounded


def restart_reason(reason: str) -> str:
    """The metric's `reason` label of a job process's exit."""
    return reason if reason in WORKER_EXIT_REASONS else OTHER_REASON


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed, by method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=r,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "RPC handling time.",
            ["grpc_service", "grpc_method"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
            registry=r,
        )
        self.jobs = Counter("kerneleval_jobs_total", "Jobs by final state.", ["state"], registry=r)
        self.verdicts = Counter(
            "kerneleval_verdicts_total", "Finished jobs by verdict.", ["verdict"], registry=r
        )
        self.result_cache = Counter(
            "kerneleval_result_cache_total",
            "Submitted jobs by what the result cache did: hit (a cached result), shared (waited "
            "for an identical running job), miss (ran), bypass (bypass_cache or cache off).",
            ["outcome"],
            registry=r,
        )
        self.queue_depth = Gauge("kerneleval_queue_depth", "Jobs waiting.", registry=r)
        self.running = Gauge("kerneleval_running_jobs", "Jobs on a worker.", registry=r)
        self.job_seconds = Histogram(
            "kerneleval_job_run_seconds",
            "Time from start to end of a job.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 600),
            registry=r,
        )
        self.worker_restarts = Counter(
            "kerneleval_worker_restarts_total",
            "Job process exits other than a clean one after its job.",
            ["device", "reason"],
            registry=r,
        )
        self.protocol_violations = Counter(
            "kerneleval_protocol_violations_total",
            "Job processes killed for breaking the job channel's protocol.",
            registry=r,
        )
        self.sandbox_warnings = Gauge(
            "kerneleval_sandbox_warning",
            "1 for each sandbox feature the host refused (and other watchdog warnings).",
            ["feature"],
            registry=r,
        )
        self.xids = Counter("kerneleval_xids_total", "XIDs seen.", ["device", "xid"], registry=r)
        self.gpu_resets = Counter(
            "kerneleval_gpu_resets_total", "GPU resets.", ["device", "success"], registry=r
        )
        self.timing_window = Counter(
            "kerneleval_timing_window_seconds_total",
            "Time a job held a device's timing window (the GPU to itself), counted when it ends.",
            ["device"],
            registry=r,
        )

        # Per tenant (--tenants-file), counts only. The `tenant` label is a name from the
        # operator's tenants file, as the token resolved to it (api/tenants.py), or as a
        # gateway that resolved it stored it with the job: never a value a request carries.
        # Jobs of no tenant (the admin's, or tenants off) are in the totals above only.
        self.tenant_submitted = Counter(
            "kerneleval_tenant_jobs_submitted",
            "Jobs a tenant submitted that were taken (a cached answer too; an idempotent "
            "retry of one is not counted again).",
            ["tenant"],
            registry=r,
        )
        self.tenant_finished = Counter(
            "kerneleval_tenant_jobs_finished",
            "A tenant's jobs by final state.",
            ["tenant", "state"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "kerneleval_tenant_jobs_rejected",
            "A tenant's submissions refused RESOURCE_EXHAUSTED, by the limit: queue "
            "(--max-queue), queued (--tenant-max-queued), per_minute (--tenant-max-per-minute).",
            ["tenant", "quota"],
            registry=r,
        )

    def worker_restarted(self, device_index: int, reason: str) -> None:
        self.worker_restarts.labels(str(device_index), restart_reason(reason)).inc()

    def serve(self, host: str, port: int) -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return service, name


# Ends of an RPC that carry their own status: an abort, a cancel, a shutdown.
_PASS_THROUGH = (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)


class MetricsInterceptor(Interceptor):
    """Counts every RPC with its final status code and times it."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None:
            return handler
        service, method = _split(details.method)
        m = self._m

        def done(context: Any, start: float, exc: BaseException | None, code: str = "") -> None:
            code = code or _code_of(context, exc)
            m.handled.labels(service, method, code).inc()
            m.handling.labels(service, method).observe(time.monotonic() - start)

        async def internal(context: Any, start: float, exc: Exception) -> None:
            """A bug is INTERNAL with its message, never a bare UNKNOWN."""
            log.exception("internal error in %s", details.method, exc_info=exc)
            done(context, start, exc, "INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

        if handler.unary_unary or handler.stream_unary:
            inner: Any = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: Any) -> Any:
                start = time.monotonic()
                try:
                    resp = await inner(request, context)
                except _PASS_THROUGH as exc:
                    done(context, start, exc)
                    raise
                except Exception as exc:  # noqa: BLE001 - see internal()
                    await internal(context, start, exc)
                    raise
                done(context, start, None)
                return resp

            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler
            )
            return make(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        inner_stream: Any = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: Any) -> Any:
            start = time.monotonic()
            try:
                async for item in inner_stream(request, context):
                    yield item
            except _PASS_THROUGH as exc:
                done(context, start, exc)
                raise
            except Exception as exc:  # noqa: BLE001 - see internal()
                await internal(context, start, exc)
                raise
            done(context, start, None)

        make_stream = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return make_stream(
            streaming,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _code_of(context: Any, exc: BaseException | None) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpcio: no code() on aio contexts
        code = None
    if code is None or code == 0:
        if exc is not None:
            return "UNKNOWN"
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    try:
        return grpc.StatusCode(code).name if not isinstance(code, int) else _int_code(code)
    except ValueError:
        return str(code)


def _int_code(code: int) -> str:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)
