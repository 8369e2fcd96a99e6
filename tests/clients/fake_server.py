"""An in-process KernelEvalService/OperationsService with canned jobs, for client tests.

It speaks real gRPC on a real socket; jobs finish with a scripted event sequence. Knobs let
tests drop streams (UNAVAILABLE mid-stream), fail calls (`FakeState.fail`: a status, with a
google.rpc.RetryInfo when asked) and check what the client sent. Submit keeps idempotency keys,
ListJobs filters by labels, events carry the job's labels, a source containing "CACHED"
finishes as a cached result (result_origin CACHE), and one containing "JUDGED" (with a
reference) sends its judge's phases after its own, as the service's judge process does.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from kerneleval.v1 import (
    job_pb2,
    kernel_eval_service_pb2,
    kernel_eval_service_pb2_grpc,
    kernel_pb2,
    operations_service_pb2,
    operations_service_pb2_grpc,
)

ADMIN_TOKEN = "s3cret"
PROGRESS_STEPS = 3


def violations(spec: kernel_pb2.JobSpec, require_reference: bool = False) -> list[tuple[str, str]]:
    out = []
    if not spec.kernel.source_code:
        out.append(("spec.kernel.source_code", "must not be empty"))
    if spec.kernel.type == kernel_pb2.KERNEL_TYPE_UNSPECIFIED:
        out.append(("spec.kernel.type", "must be set"))
    for i, arg in enumerate(spec.kernel.io.args):
        for j, d in enumerate(arg.tensor.shape):
            if d < 0:
                out.append((f"spec.kernel.io.args[{i}].tensor.shape[{j}]", "must be >= 0"))
    if "REFUSE_WITHOUT_IO" in spec.kernel.source_code and not spec.kernel.io.args:
        # The service's words for a Triton source without a ModelNew (spec/validation.py); the
        # other tests' Triton files without --io are accepted here.
        out.append(("spec.kernel.io.args", "a TRITON source without a ModelNew class is "
                    "launched from its IOContract: give its args and launch.grid"))  # fmt: skip
    if require_reference and not spec.HasField("reference"):
        out.append(("spec.reference", "required by Compare"))
    return out


def bad_request(context: grpc.ServicerContext, bad: list[tuple[str, str]]) -> None:
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in bad
            ]
        )
    )
    summary = "; ".join(f"{f}: {d}" for f, d in bad[:5])  # as the service writes it
    status = status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT, message=f"invalid JobSpec: {summary}", details=[detail]
    )
    context.abort_with_status(rpc_status.to_status(status))


def abort_with(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    retry_delay: float | None = None,
) -> None:
    """Ends the call with `code`, and a google.rpc.RetryInfo when retry_delay is given."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if retry_delay is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromNanoseconds(int(retry_delay * 1e9))
        status.details.add().Pack(info)
    context.abort_with_status(rpc_status.to_status(status))


@dataclass
class Failure:
    """A scripted failure of one call."""

    code: grpc.StatusCode
    message: str = "failed (test)"
    retry_delay: float | None = None


def verdict_for(spec: kernel_pb2.JobSpec) -> int:
    """Scripted outcome: sources containing "COMPILE_ERROR" or "INCORRECT" get that verdict."""
    if "COMPILE_ERROR" in spec.kernel.source_code:
        return job_pb2.VERDICT_COMPILE_ERROR
    if "INCORRECT" in spec.kernel.source_code:
        return job_pb2.VERDICT_INCORRECT
    if "CRASH" in spec.kernel.source_code:
        return job_pb2.VERDICT_CRASHED
    return job_pb2.VERDICT_OK


@dataclass
class FakeJob:
    job: job_pb2.Job
    events: list[job_pb2.JobEvent] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class FakeState:
    """Jobs shared by every servicer instance (it survives a server restart)."""

    def __init__(self, event_delay: float = 0.0) -> None:
        self.jobs: dict[str, FakeJob] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.event_delay = event_delay
        self.drop_after: int | None = None  # abort the next stream after this many events
        self.received: list[Any] = []  # requests, for assertions
        self.metadata: list[dict[str, str]] = []
        self.reset_calls: list[int] = []
        self.failures: dict[str, list[Failure]] = {}  # method name -> the next calls' failures
        self.attempts: dict[str, int] = {}  # method name -> calls received
        self.idempotency: dict[tuple[str, str], str] = {}  # (client_tag, key) -> job id

    def fail(self, method: str, *failures: Failure) -> None:
        """The next len(failures) calls of `method` (e.g. "Submit") fail, one each."""
        with self.lock:
            self.failures.setdefault(method, []).extend(failures)

    def check_failure(self, method: str, context: grpc.ServicerContext) -> None:
        """Counts the call; aborts it when a failure is scripted for it."""
        with self.lock:
            self.attempts[method] = self.attempts.get(method, 0) + 1
            queue = self.failures.get(method)
            failure = queue.pop(0) if queue else None
        if failure is not None:
            abort_with(context, failure.code, failure.message, failure.retry_delay)

    def new_job(self, spec: kernel_pb2.JobSpec) -> FakeJob:
        with self.lock:
            job_id = f"job-{len(self.order) + 1:04d}"
            job = job_pb2.Job(job_id=job_id, state=job_pb2.JOB_STATE_QUEUED, spec=spec)
            job.create_time.GetCurrentTime()
            fj = FakeJob(job)
            self.jobs[job_id] = fj
            self.order.append(job_id)
        self._emit(fj, queued=job_pb2.JobQueued(position=0))
        return fj

    def _emit(self, fj: FakeJob, **kind: Any) -> None:
        with fj.cond:
            ev = job_pb2.JobEvent(
                job_id=fj.job.job_id,
                sequence=len(fj.events) + 1,
                labels=fj.job.spec.labels,
                **kind,
            )
            ev.time.GetCurrentTime()
            fj.events.append(ev)
            fj.cond.notify_all()

    def execute(self, fj: FakeJob) -> None:
        """Runs the scripted life of a job (in its own thread)."""
        spec = fj.job.spec
        if fj.job.state == job_pb2.JOB_STATE_CANCELLED:
            return
        self._sleep()
        fj.job.state = job_pb2.JOB_STATE_RUNNING
        fj.job.worker_id = "w0"
        fj.job.device_index = -1
        fj.job.attempt_count = 1
        self._emit(fj, started=job_pb2.JobStarted(worker_id="w0", device_index=-1, attempt=1))
        verdict = verdict_for(spec)
        result = job_pb2.EvalResult(verdict=verdict)
        result.device.name = "cpu"
        result.device.index = -1
        for phase in (job_pb2.PHASE_COMPILING, job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING):
            if fj.job.state == job_pb2.JOB_STATE_CANCELLED:
                return
            self._sleep()
            self._emit(fj, phase=job_pb2.JobPhase(phase=phase))
            if phase == job_pb2.PHASE_COMPILING and verdict == job_pb2.VERDICT_COMPILE_ERROR:
                self._emit(fj, log=job_pb2.JobLog(text="error: expected ';'"))
                result.compilation_error = "error: expected ';'"
                break
            if phase != job_pb2.PHASE_COMPILING:
                for done in range(1, PROGRESS_STEPS + 1):
                    self._sleep()
                    self._emit(
                        fj,
                        progress=job_pb2.JobProgress(
                            phase=phase, done_count=done, total_count=PROGRESS_STEPS
                        ),
                    )
            if phase == job_pb2.PHASE_VALIDATING and verdict == job_pb2.VERDICT_CRASHED:
                result.compiled = True
                result.fault.signal = 11
                result.fault.worker_restarted = True
                result.fault.description = "worker w0 killed by SIGSEGV in PHASE_VALIDATING"
                self._emit(fj, fault=result.fault)
                break
            if phase == job_pb2.PHASE_VALIDATING and verdict == job_pb2.VERDICT_INCORRECT:
                result.compiled = True
                result.validation_error = "output 0: 12 of 1024 elements differ"
                result.validation.max_abs_error = 0.5
                result.validation.trial_count = 1
                break
        else:
            result.compiled = True
            result.correctness = True
            result.runtime.median_ms = 1.25
            result.runtime.mean_ms = 1.3
            result.runtime.min_ms = 1.2
            result.runtime.max_ms = 1.6
            result.runtime.p95_ms = 1.5
            result.runtime.trial_count = 100
            result.runtime.source = job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK
            if spec.HasField("reference"):
                result.reference_runtime.median_ms = 2.5
                result.speedup = 2.0
            if "JUDGED" in spec.kernel.source_code and spec.HasField("reference"):
                self._judge_series(fj)
        fj.job.result.CopyFrom(result)
        if "CACHED" in spec.kernel.source_code:
            fj.job.result_origin = job_pb2.RESULT_ORIGIN_CACHE
            fj.job.result_job_id = "job-cached-0001"
        else:
            fj.job.result_origin = job_pb2.RESULT_ORIGIN_RUN
        self._finish(fj, job_pb2.JOB_STATE_DONE)

    def _judge_series(self, fj: FakeJob) -> None:
        """A source marked JUDGED: after its kernel's process, the job's judge (a process of
        its own, as the service's) sends its phases again: it builds the reference, checks
        the recorded trials and times the reference."""
        for phase in (job_pb2.PHASE_COMPILING, job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING):
            self._emit(fj, phase=job_pb2.JobPhase(phase=phase))
            for done in range(1, PROGRESS_STEPS + 1) if phase != job_pb2.PHASE_COMPILING else ():
                p = job_pb2.JobProgress(phase=phase, done_count=done, total_count=PROGRESS_STEPS)
                self._emit(fj, progress=p)

    def _finish(self, fj: FakeJob, state: int, reason: str = "") -> None:
        fj.job.state = state  # type: ignore[assignment]
        fj.job.state_reason = reason
        fj.job.end_time.GetCurrentTime()
        self._emit(fj, finished=fj.job)

    def cancel(self, fj: FakeJob) -> None:
        if fj.job.state in (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING):
            self._finish(fj, job_pb2.JOB_STATE_CANCELLED, "cancelled by a client")

    def start(self, fj: FakeJob) -> None:
        threading.Thread(target=self.execute, args=(fj,), daemon=True).start()

    def _sleep(self) -> None:
        if self.event_delay:
            time.sleep(self.event_delay)

    def follow(self, fj: FakeJob, after: int, context: grpc.ServicerContext) -> Any:
        """Yields events after `after` until the finished one; honours drop_after."""
        sent = 0
        drop, self.drop_after = self.drop_after, None
        i = after
        while context.is_active():
            with fj.cond:
                while len(fj.events) <= i:
                    fj.cond.wait(0.1)
                    if not context.is_active():
                        return
                ev = fj.events[i]
            if drop is not None and sent >= drop:
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped (test)")
            yield ev
            sent += 1
            i += 1
            if ev.HasField("finished"):
                return


class FakeEvalService(kernel_eval_service_pb2_grpc.KernelEvalServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.s = state

    def _accept(
        self, request: Any, context: grpc.ServicerContext, compare: bool = False
    ) -> FakeJob:
        self.s.received.append(request)
        self.s.check_failure(type(request).__name__.removesuffix("Request"), context)
        bad = violations(request.spec, require_reference=compare)
        if bad:
            bad_request(context, bad)
        return self.s.new_job(request.spec)

    def _wait(self, fj: FakeJob) -> job_pb2.Job:
        self.s.execute(fj)
        return fj.job

    def Evaluate(self, request, context):  # noqa: N802
        fj = self._accept(request, context)
        return kernel_eval_service_pb2.EvaluateResponse(job=self._wait(fj))

    def Compare(self, request, context):  # noqa: N802
        fj = self._accept(request, context, compare=True)
        return kernel_eval_service_pb2.CompareResponse(job=self._wait(fj))

    def Run(self, request, context):  # noqa: N802
        fj = self._accept(request, context)
        self.s.start(fj)
        for ev in self.s.follow(fj, 0, context):
            yield kernel_eval_service_pb2.RunResponse(event=ev)

    def Submit(self, request, context):  # noqa: N802
        key = (request.spec.client_tag, request.idempotency_key)
        if request.idempotency_key and key in self.s.idempotency:
            self.s.received.append(request)
            self.s.check_failure("Submit", context)
            first = self.s.jobs[self.s.idempotency[key]]
            if first.job.spec != request.spec:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, "idempotency key used by another")
            return kernel_eval_service_pb2.SubmitResponse(job=first.job)
        fj = self._accept(request, context)
        if request.idempotency_key:
            self.s.idempotency[key] = fj.job.job_id
        job = job_pb2.Job()
        job.CopyFrom(fj.job)
        self.s.start(fj)
        # "Submit.after": the job is made, then the answer is lost (a retry must not make
        # another).
        self.s.check_failure("Submit.after", context)
        return kernel_eval_service_pb2.SubmitResponse(job=job)

    def _get(self, job_id: str, context: grpc.ServicerContext) -> FakeJob:
        fj = self.s.jobs.get(job_id)
        if fj is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id}")
        assert fj is not None
        return fj

    def Watch(self, request, context):  # noqa: N802
        self.s.received.append(request)
        fj = self._get(request.job_id, context)
        for ev in self.s.follow(fj, request.after_sequence, context):
            yield kernel_eval_service_pb2.WatchResponse(event=ev)

    def GetJob(self, request, context):  # noqa: N802
        self.s.check_failure("GetJob", context)
        return kernel_eval_service_pb2.GetJobResponse(job=self._get(request.job_id, context).job)

    def ListJobs(self, request, context):  # noqa: N802
        self.s.received.append(request)
        self.s.check_failure("ListJobs", context)
        ids = list(reversed(self.s.order))
        jobs = [self.s.jobs[i].job for i in ids]
        if request.state:
            jobs = [j for j in jobs if j.state == request.state]
        if request.client_tag:
            jobs = [j for j in jobs if j.spec.client_tag == request.client_tag]
        if request.labels:
            jobs = [
                j for j in jobs if all(j.spec.labels.get(k) == v for k, v in request.labels.items())
            ]
        start = int(request.page_token or 0)
        size = request.page_size or 50
        page = jobs[start : start + size]
        out = kernel_eval_service_pb2.ListJobsResponse()
        for j in page:
            c = out.jobs.add()
            c.CopyFrom(j)
            if not request.include_spec:
                c.ClearField("spec")
        if start + size < len(jobs):
            out.next_page_token = str(start + size)
        return out

    def CancelJob(self, request, context):  # noqa: N802
        self.s.check_failure("CancelJob", context)
        fj = self._get(request.job_id, context)
        self.s.cancel(fj)
        return kernel_eval_service_pb2.CancelJobResponse(job=fj.job)

    def RunBatch(self, request_iterator, context):  # noqa: N802
        out: list[kernel_eval_service_pb2.RunBatchResponse] = []
        cond = threading.Condition()
        pending = [0]
        done_reading = [False]

        def pump(fj: FakeJob, tag: str) -> None:
            self.s.execute(fj)
            with cond:
                for ev in fj.events:
                    out.append(kernel_eval_service_pb2.RunBatchResponse(event=ev, request_tag=tag))
                pending[0] -= 1
                cond.notify_all()

        def reader() -> None:
            for req in request_iterator:
                self.s.received.append(req)
                bad = violations(req.spec)
                with cond:
                    if bad:
                        err = kernel_eval_service_pb2.SubmissionError(
                            code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="invalid"
                        )
                        for f, d in bad:
                            err.field_violations.add(field=f, description=d)
                        out.append(
                            kernel_eval_service_pb2.RunBatchResponse(
                                error=err, request_tag=req.request_tag
                            )
                        )
                        cond.notify_all()
                        continue
                    pending[0] += 1
                fj = self.s.new_job(req.spec)
                threading.Thread(target=pump, args=(fj, req.request_tag), daemon=True).start()
            with cond:
                done_reading[0] = True
                cond.notify_all()

        threading.Thread(target=reader, daemon=True).start()
        sent = 0
        while context.is_active():
            with cond:
                while sent >= len(out) and not (done_reading[0] and pending[0] == 0):
                    cond.wait(0.1)
                batch = out[sent:]
                sent = len(out)
                finished = done_reading[0] and pending[0] == 0
            yield from batch
            if finished and sent == len(out):
                return


class FakeOpsService(operations_service_pb2_grpc.OperationsServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.s = state

    def _auth(self, context: grpc.ServicerContext) -> None:
        md = dict(context.invocation_metadata())
        self.s.metadata.append(md)  # type: ignore[arg-type]
        if md.get("authorization") != f"Bearer {ADMIN_TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin token required")

    def ListDevices(self, request, context):  # noqa: N802
        self._auth(context)
        self.s.check_failure("ListDevices", context)
        gpu = operations_service_pb2.Device(
            index=0,
            name="NVIDIA H200",
            uuid="GPU-1234",
            health=operations_service_pb2.DEVICE_HEALTH_HEALTHY,
            memory_total_bytes=141 * 2**30,
            memory_used_bytes=2 * 2**30,
            temperature_celsius=35,
            utilization_percent=7,
            driver_version="570.86",
        )
        gpu.recent_xids.add(xid=31, category="application", action="restart_worker", pid=684)
        gpu.workers.add(worker_id="w0", pid=1000, device_index=0)
        gpu.workers.add(worker_id="w1", pid=1001, device_index=0, spare=True)
        bad = operations_service_pb2.Device(
            index=1,
            name="NVIDIA H200",
            health=operations_service_pb2.DEVICE_HEALTH_UNHEALTHY,
            health_reason="XID 79: fell off the bus",
        )
        return operations_service_pb2.ListDevicesResponse(devices=[gpu, bad])

    def WatchEvents(self, request, context):  # noqa: N802
        self._auth(context)
        ev1 = operations_service_pb2.OpsEvent(sequence=1, device_index=0)
        ev1.xid.xid = 31
        ev1.xid.category = "application"
        ev1.xid.action = "restart_worker"
        ev2 = operations_service_pb2.OpsEvent(sequence=2, device_index=0)
        ev2.worker_exited.worker.worker_id = "w0"
        ev2.worker_exited.reason = "poisoned_context"
        ev2.worker_exited.restarting = True
        for ev in (ev1, ev2)[-request.replay_count :] if request.replay_count else (ev1, ev2):
            yield operations_service_pb2.WatchEventsResponse(event=ev)

    def ResetGpu(self, request, context):  # noqa: N802
        self._auth(context)
        self.s.reset_calls.append(request.device_index)
        resp = operations_service_pb2.ResetGpuResponse(success=True)
        for step in ("drain", "stop_workers", "reset", "check_health", "start_workers"):
            resp.steps.add(step=step, ok=True, message="recorded")
        return resp

    def RestartWorkers(self, request, context):  # noqa: N802
        self._auth(context)
        return operations_service_pb2.RestartWorkersResponse(restarted_count=2)

    def Cleanup(self, request, context):  # noqa: N802
        self._auth(context)
        return operations_service_pb2.CleanupResponse(deleted_job_count=request.older_than.seconds)

    def GetStats(self, request, context):  # noqa: N802
        self._auth(context)
        resp = operations_service_pb2.GetStatsResponse(queue_depth=0, fault_count=1, xid_count=1)
        resp.jobs_by_state["JOB_STATE_DONE"] = len(self.s.jobs)
        resp.sandbox_state = operations_service_pb2.SANDBOX_STATE_COMPLETE
        resp.sandbox_warnings.add(feature="kmsg", message="cannot read /dev/kmsg (EACCES)")
        occupancy = resp.device_occupancy.add(device_index=0, timing_window_count=40)
        occupancy.timing_window.FromMilliseconds(9_800)
        occupancy.timing_wanted.FromMilliseconds(10_000)
        return resp

    def ListBuilders(self, request, context):  # noqa: N802
        self._auth(context)
        self.s.check_failure("ListBuilders", context)
        mine = "torch 2.13.0|cuda 13.0|g++ 13|nvcc 13.0|recipe 3"
        resp = operations_service_pb2.ListBuildersResponse(versions=[mine])
        now = time.time()
        live = resp.builders.add(
            builder_id="cpu-1-builder-0a1b2c3d", address="10.0.0.5:50051", build_slots=6,
            versions=mine, versions_match=True, built_count=41, leased_request_count=3,
            waiting_request_count=2,
        )  # fmt: skip
        live.last_heartbeat_time.FromNanoseconds(int((now - 2) * 1e9))
        live.expire_time.FromNanoseconds(int((now + 8) * 1e9))
        lost = resp.builders.add(
            builder_id="cpu-2-builder-4e5f6a7b", address="10.0.0.6:50051", build_slots=6,
            versions="torch 2.12.0|cuda 12.8|g++ 13|nvcc 12.8|recipe 3", expired=True,
        )  # fmt: skip
        lost.last_heartbeat_time.FromNanoseconds(int((now - 300) * 1e9))
        lost.expire_time.FromNanoseconds(int((now - 290) * 1e9))
        return resp


class FakeServer:
    """A real grpc.server on 127.0.0.1 (a fixed port survives restart())."""

    def __init__(self, state: FakeState | None = None, port: int = 0) -> None:
        self.state = state or FakeState()
        self.port = port
        self.server: grpc.Server | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        kernel_eval_service_pb2_grpc.add_KernelEvalServiceServicer_to_server(
            FakeEvalService(self.state), server
        )
        operations_service_pb2_grpc.add_OperationsServiceServicer_to_server(
            FakeOpsService(self.state), server
        )
        hs = health.HealthServicer()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None).wait()
            self.server = None

    def restart(self) -> None:
        self.stop()
        self.start()
