"""KernelEvalService: the evaluation API over the job service (jobs/service.py).

With tenants (api/tenants.py) each call has a scope: a tenant sees, follows and cancels its
own jobs only (another tenant's job id is NOT_FOUND, as an unknown one is), and its jobs are
submitted as its own; the admin token's scope, and every call's without tenants, is all jobs.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol, TypeAlias, cast

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

from kerneleval_server.api.tenants import Tenants
from kerneleval_server.jobs import static_checks
from kerneleval_server.jobs.admission import KeyReused, QueueFull
from kerneleval_server.jobs.service import JobService
from kerneleval_server.spec import placement, validation

log = logging.getLogger("kerneleval.service")
# A servicer method's context (grpc-stubs type it by the method's request and response).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

DEFAULT_PAGE = 50
_BROKEN = pb.RunBatchResponse()  # sentinel: the request stream failed
MAX_PAGE = 1000
# google.rpc.BadRequest rides in the trailers, which clients cap (grpc: 8 KiB by default):
# at most this many violations, each description cut to this many characters, go there (the
# message and RunBatch's SubmissionError are not capped by count).
MAX_DETAIL_VIOLATIONS = 16
MAX_DETAIL_CHARS = 300
# The static checks of a source of up to this many characters run on the event loop, after
# its job started (0.6-1.1 ms for a tiny kernel on the H100 machine, a few for 8 KiB; handing
# them to a thread and back cost 0.4-1.3 ms more); a larger source is checked in a thread
# first, so that other calls go on meanwhile.
INLINE_STATIC_CHECK_CHARS = 8 << 10


class Refused(Exception):
    """A submission refused before it was queued."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        violations: list[validation.FieldViolation],
        retry_after_s: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = violations
        self.retry_after_s = retry_after_s  # > 0: a google.rpc.RetryInfo goes with it

    def status(self) -> grpc.Status:
        shown = self.violations[:MAX_DETAIL_VIOLATIONS]
        detail = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=_cut(v.field), description=_cut(v.description)
                )
                for v in shown
            ]
        )
        if len(self.violations) > len(shown):
            detail.field_violations.add(
                field="...", description=f"{len(self.violations) - len(shown)} more violations"
            )
        st = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.violations:
            st.details.add().Pack(detail)
        if self.retry_after_s > 0:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            st.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return rpc_status.to_status(st)

    def submission_error(self) -> pb.SubmissionError:
        return pb.SubmissionError(
            code=self.code.value[0],
            message=self.message,
            field_violations=[
                pb.FieldViolation(field=v.field, description=v.description) for v in self.violations
            ],
        )


def _cut(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def invalid(field: str, description: str) -> Refused:
    return Refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{field}: {description}",
        [validation.FieldViolation(field, description)],
    )


class _AbortsWithStatus(Protocol):
    """grpc.aio's ServicerContext has abort_with_status; grpc-stubs do not list it."""

    async def abort_with_status(self, status: grpc.Status) -> NoReturn: ...


async def abort(context: Context, err: Refused) -> NoReturn:
    await cast(_AbortsWithStatus, context).abort_with_status(err.status())
    raise AssertionError("unreachable")


class KernelEvalService(kernel_eval_service_pb2_grpc.KernelEvalServiceServicer):
    def __init__(
        self, jobs: JobService, limits: validation.Limits, tenants: Tenants | None = None
    ) -> None:
        self.jobs = jobs
        self.limits = limits
        self.tenants = tenants

    async def _scope(self, context: Context) -> str | None:
        """The caller's tenant; None: every job (tenants off, or the admin token). TenantAuth
        refused a call without a valid token before it came here; refused again if not."""
        if self.tenants is None or not self.tenants.on:
            return None
        scope, why = self.tenants.resolve(context.invocation_metadata())
        if why:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        return scope

    # ---- submission -------------------------------------------------------------------

    async def _submit(
        self,
        spec: kernel_pb2.JobSpec,
        require_reference: bool = False,
        idempotency_key: str = "",
        tenant: str = "",
    ) -> job_pb2.Job:
        """Validates and queues; raises Refused. A large source's static checks run in a
        thread first; a small one's in the manager, after its job started (JobManager.submit)."""
        if self.jobs.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the service is shutting down", [])
        violations = validation.validate_spec(
            spec, self.limits, require_reference=require_reference
        )
        validation.check_string(
            "idempotency_key", idempotency_key, self.limits.max_idempotency_key_bytes, violations
        )
        known = self.jobs.device_indices()
        if spec.options.HasField("device_index") and known and spec.options.device_index >= 0:
            if spec.options.device_index not in known:
                violations.append(
                    validation.FieldViolation(
                        "spec.options.device_index",
                        f"no device {spec.options.device_index} here (devices: {known})",
                    )
                )
        if spec.options.device_model and not violations:
            why = placement.refusal(spec, self.jobs.device_names())
            if why:
                violations.append(validation.FieldViolation("spec.options.device_model", why))
        if violations:
            summary = "; ".join(f"{v.field}: {v.description}" for v in violations[:5])
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"invalid JobSpec: {summary}", violations
            )
        flags = None  # a millisecond or less: on the event loop, while the job starts
        if len(spec.kernel.source_code) > INLINE_STATIC_CHECK_CHARS:
            flags = await asyncio.to_thread(static_checks.check, spec)
        if self.jobs.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the service is shutting down", [])
        try:
            return self.jobs.submit(spec, flags, idempotency_key, tenant)
        except QueueFull as exc:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), [], exc.retry_after_s
            ) from exc
        except KeyReused as exc:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, str(exc), []) from exc

    async def _submit_or_abort(
        self,
        spec: kernel_pb2.JobSpec,
        context: Context,
        require_reference: bool = False,
        idempotency_key: str = "",
    ) -> job_pb2.Job:
        tenant = await self._scope(context) or ""
        try:
            return await self._submit(spec, require_reference, idempotency_key, tenant)
        except Refused as err:
            await abort(context, err)

    async def _run_to_end(self, job_id: str) -> job_pb2.Job:
        job = await self.jobs.finished(job_id)
        assert job is not None
        return job

    async def Evaluate(self, request: pb.EvaluateRequest, context: Context) -> pb.EvaluateResponse:
        job = await self._submit_or_abort(request.spec, context)
        try:
            return pb.EvaluateResponse(job=await self._run_to_end(job.job_id))
        except asyncio.CancelledError:
            await self._cancel_quietly(job.job_id)
            raise

    async def Compare(self, request: pb.CompareRequest, context: Context) -> pb.CompareResponse:
        job = await self._submit_or_abort(request.spec, context, require_reference=True)
        try:
            return pb.CompareResponse(job=await self._run_to_end(job.job_id))
        except asyncio.CancelledError:
            await self._cancel_quietly(job.job_id)
            raise

    async def _cancel_quietly(self, job_id: str) -> None:
        if self.jobs.draining:
            return  # the service is stopping, not the client: the job runs after the restart
        log.info("client went away: cancelling", extra={"job_id": job_id})
        self.jobs.cancel_soon(job_id)

    async def Run(self, request: pb.RunRequest, context: Context) -> AsyncIterator[pb.RunResponse]:
        job = await self._submit_or_abort(request.spec, context)
        finished = False
        try:
            async for event in self.jobs.watch(job.job_id, 0):
                finished = event.HasField("finished")
                yield pb.RunResponse(event=event)
        finally:
            if not finished and not request.keep_on_disconnect:
                await self._cancel_quietly(job.job_id)

    async def Submit(self, request: pb.SubmitRequest, context: Context) -> pb.SubmitResponse:
        job = await self._submit_or_abort(
            request.spec, context, idempotency_key=request.idempotency_key
        )
        return pb.SubmitResponse(job=job)

    async def _job_or_abort(
        self, job_id: str, context: Context, include_spec: bool = True
    ) -> job_pb2.Job:
        if not job_id:
            await abort(context, invalid("job_id", "required"))
        too_long = validation.check_string("job_id", job_id, self.limits.max_job_id_bytes)
        if too_long is not None:
            await abort(context, invalid(too_long.field, too_long.description))
        scope = await self._scope(context)
        job = self.jobs.get(job_id, include_spec=include_spec)
        if job is not None and scope is not None and job.tenant != scope:
            job = None  # another tenant's: as if there were none
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        assert job is not None
        return job

    async def Watch(
        self, request: pb.WatchRequest, context: Context
    ) -> AsyncIterator[pb.WatchResponse]:
        if request.after_sequence > validation.INT64_MAX:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"after_sequence: {request.after_sequence} is past the largest sequence a job "
                f"can have ({validation.INT64_MAX})",
            )
        await self._job_or_abort(request.job_id, context, include_spec=False)
        async for event in self.jobs.watch(request.job_id, request.after_sequence):
            yield pb.WatchResponse(event=event)

    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.GetJobResponse:
        return pb.GetJobResponse(job=await self._job_or_abort(request.job_id, context))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        if request.page_size < 0:
            await abort(context, invalid("page_size", "must be >= 0"))
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        before = None
        if request.page_token:
            too_long = validation.check_string(
                "page_token", request.page_token, self.limits.max_page_token_bytes
            )
            if too_long is not None:
                await abort(context, invalid("page_token", "not a token from ListJobs"))
            before = _decode_token(request.page_token)
            if before is None:
                await abort(context, invalid("page_token", "not a token from ListJobs"))
        if request.state and request.state not in job_pb2.JobState.values():
            await abort(context, invalid("state", f"unknown JobState {request.state}"))
        too_long = validation.check_string(
            "client_tag", request.client_tag, self.limits.max_client_tag_bytes
        )
        if too_long is not None:
            await abort(context, invalid(too_long.field, too_long.description))
        bad_labels: list[validation.FieldViolation] = []
        validation.check_labels("labels", request.labels, self.limits, bad_labels)
        if bad_labels:
            await abort(context, invalid(bad_labels[0].field, bad_labels[0].description))
        scope = await self._scope(context)
        rows = self.jobs.list_jobs(
            limit=size + 1,
            before_rowid=before,
            state=request.state,
            client_tag=request.client_tag,
            labels=request.labels,
            include_spec=request.include_spec,
            tenant=scope,
        )
        resp = pb.ListJobsResponse(jobs=[job for _, job in rows[:size]])
        if len(rows) > size:
            resp.next_page_token = _encode_token(rows[size - 1][0])
        return resp

    async def CancelJob(
        self, request: pb.CancelJobRequest, context: Context
    ) -> pb.CancelJobResponse:
        await self._job_or_abort(request.job_id, context, include_spec=False)
        job = await self.jobs.cancel(request.job_id)
        assert job is not None
        return pb.CancelJobResponse(job=job)

    async def RunBatch(
        self, request_iterator: AsyncIterator[pb.RunBatchRequest], context: Context
    ) -> AsyncIterator[pb.RunBatchResponse]:
        tenant = await self._scope(context) or ""
        out: asyncio.Queue[pb.RunBatchResponse | None] = asyncio.Queue()
        followers: set[asyncio.Task[None]] = set()
        unfinished: set[str] = set()

        async def follow(job_id: str, tag: str) -> None:
            async for event in self.jobs.watch(job_id, 0):
                if event.HasField("finished"):
                    unfinished.discard(job_id)
                await out.put(pb.RunBatchResponse(event=event, request_tag=tag))

        async def read() -> None:
            async for req in request_iterator:
                try:
                    too_long = validation.check_string(
                        "request_tag", req.request_tag, self.limits.max_request_tag_bytes
                    )
                    if too_long is not None:
                        raise invalid(too_long.field, too_long.description)
                    job = await self._submit(req.spec, tenant=tenant)
                except Refused as err:
                    await out.put(
                        pb.RunBatchResponse(
                            request_tag=req.request_tag, error=err.submission_error()
                        )
                    )
                    continue
                if not req.keep_on_disconnect:
                    unfinished.add(job.job_id)
                followers.add(
                    asyncio.get_running_loop().create_task(follow(job.job_id, req.request_tag))
                )

        async def close_when_done() -> None:
            try:
                await read()
            except grpc.aio.AbortError:
                await out.put(_BROKEN)  # the call ended with its status (an undecodable request)
                return
            except Exception as exc:  # noqa: BLE001 - a broken request stream ends the batch
                log.info("RunBatch request stream ended: %s", exc)
                await out.put(_BROKEN)
                return
            if followers:
                await asyncio.gather(*followers)
            await out.put(None)

        closer = asyncio.get_running_loop().create_task(close_when_done())
        clean = False
        try:
            while True:
                item = await out.get()
                if item is None:
                    clean = True
                    break
                if item is _BROKEN:
                    break
                yield item
        finally:
            closer.cancel()
            for task in followers:
                task.cancel()
            if not clean:
                # The client dropped the stream: its jobs would run for nobody (but those it
                # asked to keep, which it can follow again with Watch).
                for job_id in list(unfinished):
                    await self._cancel_quietly(job_id)


def _encode_token(rowid: int) -> str:
    return base64.urlsafe_b64encode(f"r{rowid}".encode()).decode().rstrip("=")


def _decode_token(token: str) -> int | None:
    """The rowid in a token from _encode_token, or None (also for any number SQLite cannot
    hold: a rowid is 1 to 2**63 - 1)."""
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        digits = text[1:]
        if not text.startswith("r") or not digits.isascii() or not digits.isdigit():
            return None
        if len(digits) > 19:
            return None
        rowid = int(digits)
    except (ValueError, UnicodeDecodeError):
        return None
    return rowid if 0 < rowid <= validation.INT64_MAX else None
