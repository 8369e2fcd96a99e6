"""Sync (`Client`) and asyncio (`AsyncClient`) clients of KernelEvalService and OperationsService.

    with Client("127.0.0.1:50051") as c:
        job = c.evaluate(job_from_files("model_new.py", "model.py"))
        for event in c.run(spec):          # typed JobEvents, the last one `finished`
            ...

Streams that follow a job (`run`, `watch`) re-attach after a dropped connection with
`Watch(after_sequence=last seen)`, so no event is lost or repeated; `on_note` hears what they
go through (a `StreamNote`: lost, waiting for the server, re-attached), which is how the CLI
says it. Every failed call raises a typed `kerneleval.errors.KernelEvalError`.

Retries: the channel retries the idempotent calls (GetJob, ListJobs, CancelJob, ListDevices,
GetStats, ListBuilders) on UNAVAILABLE, up to 5 attempts with exponential back-off (a gRPC
service config); `submit` retries by itself on UNAVAILABLE and RESOURCE_EXHAUSTED (a full
queue), waiting what the server's google.rpc.RetryInfo asks or else backing off exponentially
with jitter, within `retry_timeout` seconds (default 30), and sends an idempotency key so that
a retried Submit never makes a second job. `retry_timeout=0` turns both off. Evaluate, Compare,
Run and RunBatch make jobs without a key and are never retried.

The logic (requests, retry schedules, re-attach book-keeping) lives in `_Base` and the helpers
beside it; `Client` and `AsyncClient` only do the I/O, so that the two stay alike
(tests/clients/test_client_parity.py checks their methods and parameters).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf import duration_pb2

from kerneleval import errors
from kerneleval.v1 import (
    job_pb2,
    kernel_eval_service_pb2,
    kernel_eval_service_pb2_grpc,
    kernel_pb2,
    operations_service_pb2,
    operations_service_pb2_grpc,
)

DEFAULT_PORT = 50051
# gRPC target schemes whose addresses have no port to add (dns: is handled on its own).
_TARGET_SCHEMES = frozenset({"unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds"})
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
ADDRESS_ENV = "KERNELEVAL_ADDRESS"
ADMIN_TOKEN_ENV = "KERNELEVAL_ADMIN_TOKEN"
# A tenant's token (a service with --tenants-file): sent on every KernelEvalService call.
TENANT_TOKEN_ENV = "KERNELEVAL_TENANT_TOKEN"

# Codes after which a stream that follows a job is re-attached: the connection dropped or the
# server went away, not a refusal of the request.
_REATTACH_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
)
# A wait_ready health check that ended so has not reached the server (it is down, stopping, or
# the time ran out); any other answer came from it.
_NOT_READY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Before a re-attach, a server that does not answer within this many seconds is said to be
# waited for (StreamNote "waiting"); one that answers at once is not.
_QUIET_WAIT = 0.5
# Large sources and results: raise gRPC's 4 MiB default.
_CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
DEFAULT_RETRY_TIMEOUT = 30.0
# Calls the channel may send again on UNAVAILABLE: they read, or (CancelJob) do what a second
# call would find done. Submit is retried by the client, with an idempotency key.
_IDEMPOTENT_METHODS: dict[str, tuple[str, ...]] = {
    "kerneleval.v1.KernelEvalService": ("GetJob", "ListJobs", "CancelJob"),
    "kerneleval.v1.OperationsService": ("ListDevices", "GetStats", "ListBuilders"),
}
# gRPC caps maxAttempts at 5; the back-off before attempt n+1 is about
# min(initialBackoff * backoffMultiplier^(n-1), maxBackoff), jittered: 0.05 + 0.1 + 0.2 + 0.4 s,
# so a server that stays away costs a call under a second more before its UNAVAILABLE (a
# blip, a connection reset, a GOAWAY race is what these retries are for; `watch` and `run`
# ride out longer outages with their own re-attach).
_RETRY_POLICY: dict[str, str | int | list[str]] = {
    "maxAttempts": 5,
    "initialBackoff": "0.05s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# round_robin: a name that resolves to several gateways (a headless Service, docs/DEPLOY.md)
# gets each call on the next one; a single address is one subchannel, as with pick_first.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [
                    {"service": service, "method": method}
                    for service, methods in _IDEMPOTENT_METHODS.items()
                    for method in methods
                ],
                "retryPolicy": _RETRY_POLICY,
            }
        ],
    }
)
# Submit's own retries: the codes, and the back-off without a RetryInfo (seconds).
_SUBMIT_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
_SUBMIT_BACKOFF_INITIAL = 0.1
_SUBMIT_BACKOFF_MAX = 5.0
_SUBMIT_MIN_DELAY = 0.01

Event = job_pb2.JobEvent
JobSpecLike = kernel_pb2.JobSpec | kernel_pb2.KernelSource
BatchItem = kernel_pb2.JobSpec | tuple[str, kernel_pb2.JobSpec]
Metadata = tuple[tuple[str, str], ...]
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def resolve_address(address: str | None = None) -> str:
    """The address to use: the argument, else $KERNELEVAL_ADDRESS, else 127.0.0.1:50051; a
    host without a port gets the service's (50051), where gRPC would dial 443.

    `unix:/path/to.sock` reaches a unix socket."""
    return with_default_port(address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS)


def with_default_port(address: str) -> str:
    """`host`, `[v6]`, a bare IPv6 address or `dns:[//authority/]host` without a port: with
    the service's port (DEFAULT_PORT); any other target (a port given, unix:, ipv4:, ...) as
    it is."""
    scheme = address.split(":", 1)[0]
    if scheme in _TARGET_SCHEMES:
        return address
    prefix, host = "", address
    if scheme == "dns":
        prefix, host = "dns:", address[4:]
        if host.startswith("//"):
            authority, _, host = host[2:].partition("/")
            prefix += f"//{authority}/"
    if not host or "/" in host:
        return address
    if host.startswith("["):  # [v6] or [v6]:port
        return address if "]:" in host else f"{prefix}{host}:{DEFAULT_PORT}"
    colons = host.count(":")
    if colons == 1:  # host:port
        return address
    if colons > 1:  # a bare IPv6 address
        return f"{prefix}[{host}]:{DEFAULT_PORT}"
    return f"{prefix}{host}:{DEFAULT_PORT}"


def resolve_admin_token(token: str | None = None) -> str | None:
    return token or os.environ.get(ADMIN_TOKEN_ENV) or None


def resolve_tenant_token(token: str | None = None) -> str | None:
    return token or os.environ.get(TENANT_TOKEN_ENV) or None


def is_terminal(event: job_pb2.JobEvent) -> bool:
    """Whether this is the job's last event."""
    return event.HasField("finished")


def event_kind(event: job_pb2.JobEvent) -> str:
    """ "queued", "started", "phase", "progress", "log", "fault" or "finished"."""
    return event.WhichOneof("kind") or ""


@dataclass(frozen=True)
class BatchEvent:
    """One response of `run_batch`: an event of a job, or the refusal of a submission."""

    request_tag: str
    event: job_pb2.JobEvent | None = None
    error: kernel_eval_service_pb2.SubmissionError | None = None

    @property
    def job_id(self) -> str:
        return self.event.job_id if self.event is not None else ""

    @property
    def done(self) -> bool:
        """The submission is over: its job finished or it was refused."""
        return self.error is not None or (self.event is not None and is_terminal(self.event))

    def raise_for_error(self) -> None:
        """Raise the typed exception of a refused submission."""
        if self.error is None:
            return
        code = _status_code(self.error.code)
        cls = errors._BY_CODE.get(code, errors.KernelEvalError)
        raise cls(
            self.error.message,
            code=code,
            field_violations=[
                errors.FieldViolation(v.field, v.description) for v in self.error.field_violations
            ],
        )


def _status_code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def _as_spec(
    spec: JobSpecLike,
    options: kernel_pb2.EvalOptions | None,
    labels: Mapping[str, str] | None = None,
) -> kernel_pb2.JobSpec:
    """A copy of the spec (the caller's is never changed) with the options and labels given;
    `labels` are added to the spec's own, replacing those of the same keys."""
    out = kernel_pb2.JobSpec()
    if isinstance(spec, kernel_pb2.KernelSource):
        out.kernel.CopyFrom(spec)
    else:
        out.CopyFrom(spec)
    if options is not None:
        out.options.CopyFrom(options)
    if labels:
        out.labels.update(labels)
    return out


def _list_request(
    request: kernel_eval_service_pb2.ListJobsRequest | None,
    *,
    page_token: str = "",
    page_size: int = 0,
    state: int = job_pb2.JOB_STATE_UNSPECIFIED,
    client_tag: str = "",
    include_spec: bool = False,
    labels: Mapping[str, str] | None = None,
) -> kernel_eval_service_pb2.ListJobsRequest:
    """A ListJobsRequest: a copy of `request` (or an empty one) with every keyword that is not
    its default set on it, the labels added to its own."""
    req = kernel_eval_service_pb2.ListJobsRequest()
    if request is not None:
        req.CopyFrom(request)
    if page_token:
        req.page_token = page_token
    if page_size:
        req.page_size = page_size
    if state:
        req.state = state  # type: ignore[assignment]
    if client_tag:
        req.client_tag = client_tag
    if include_spec:
        req.include_spec = True
    if labels:
        req.labels.update(labels)
    return req


def _message_too_large(error: errors.KernelEvalError) -> bool:
    """RESOURCE_EXHAUSTED for a message over a size limit: sending it again cannot help."""
    return "larger than max" in error.details or "message too large" in error.details.lower()


class _SubmitRetry:
    """The schedule of a retried Submit: which failures are retried and how long to wait.

    UNAVAILABLE and RESOURCE_EXHAUSTED (but a message over a size limit) are retried: after the
    server's google.rpc.RetryInfo delay when it gave one, else after an exponential back-off
    (0.1 s doubling to 5 s, each wait drawn from [half, all] of it), until the next attempt
    would start more than `budget` seconds after the first."""

    def __init__(self, budget: float) -> None:
        self.deadline = time.monotonic() + budget
        self.budget = budget
        self._backoff = _SUBMIT_BACKOFF_INITIAL

    def delay(self, error: errors.KernelEvalError) -> float | None:
        """Seconds to wait before the next attempt; None: give up and raise `error`."""
        if self.budget <= 0 or error.code not in _SUBMIT_RETRY_CODES:
            return None
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and _message_too_large(error):
            return None
        if error.retry_delay is not None:
            delay = max(error.retry_delay, _SUBMIT_MIN_DELAY)
        else:
            delay = random.uniform(self._backoff / 2, self._backoff)
            self._backoff = min(self._backoff * 2, _SUBMIT_BACKOFF_MAX)
        if time.monotonic() + delay > self.deadline:
            return None
        return delay


def _duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _batch_request(
    index: int, item: BatchItem, keep_on_disconnect: bool
) -> kernel_eval_service_pb2.RunBatchRequest:
    tag, spec = item if isinstance(item, tuple) else (str(index), item)
    return kernel_eval_service_pb2.RunBatchRequest(
        spec=spec, request_tag=tag, keep_on_disconnect=keep_on_disconnect
    )


def _rpc_code(error: BaseException | None) -> grpc.StatusCode | None:
    """The status code of a failed call (None for anything else)."""
    code = getattr(error, "code", None)
    result = code() if callable(code) else None
    return result if isinstance(result, grpc.StatusCode) else None


def _reattachable(error: grpc.RpcError) -> bool:
    code = _rpc_code(error)
    if code in _REATTACH_CODES:
        return True
    details = (error.details() if callable(getattr(error, "details", None)) else "") or ""
    return code == grpc.StatusCode.INTERNAL and "RST_STREAM" in details


@dataclass(frozen=True)
class StreamNote:
    """What the stream of a followed job (`run`, `watch`) goes through, for `on_note`:

    - "lost": the stream dropped after event `sequence` (`code`: how; None when it ended
      without the job's last event); the client re-attaches within `reconnect_timeout`.
      Said once until the next event arrives.
    - "waiting": the server does not answer; the client waits up to `seconds` for it.
    - "answers": it answers again after "waiting".
    - "reattached": a Watch re-attached to the job; `sequence` is its first new event.
    """

    kind: Literal["lost", "waiting", "answers", "reattached"]
    job_id: str
    sequence: int
    code: grpc.StatusCode | None = None
    seconds: float = 0.0


NoteHandler = Callable[[StreamNote], None]


class _EventResponse(Protocol):
    """RunResponse and WatchResponse: each carries one JobEvent."""

    @property
    def event(self) -> job_pb2.JobEvent: ...


class _Stream(Protocol):
    """A followed job's server stream (Run's or Watch's) on the blocking channel."""

    def __iter__(self) -> Iterator[_EventResponse]: ...
    def cancel(self) -> bool: ...


class _AsyncStream(Protocol):
    """A followed job's server stream on the asyncio channel."""

    def __aiter__(self) -> AsyncIterator[_EventResponse]: ...
    def cancel(self) -> bool: ...


class _Follow:
    """Book-keeping of a followed job: the last sequence seen, the re-attach budget, and the
    notes to the caller's `on_note` about both."""

    def __init__(
        self,
        job_id: str,
        after_sequence: int,
        reconnect_timeout: float,
        on_note: NoteHandler | None = None,
    ) -> None:
        self.job_id = job_id
        self.last = after_sequence
        self.reconnect_timeout = reconnect_timeout
        self._on_note = on_note
        self._deadline: float | None = None
        self._backoff = 0.05
        self._lost = False  # a "lost" was said and no event came since

    def note(
        self,
        kind: Literal["lost", "waiting", "answers", "reattached"],
        *,
        code: grpc.StatusCode | None = None,
        seconds: float = 0.0,
    ) -> None:
        if self._on_note is not None:
            self._on_note(StreamNote(kind, self.job_id, self.last, code, seconds))

    def accept(self, event: job_pb2.JobEvent) -> bool:
        """Whether the event is new (re-attached streams replay nothing twice)."""
        if not self.job_id:
            self.job_id = event.job_id
        if event.sequence <= self.last:
            return False
        self.last = event.sequence
        self._deadline = None
        self._backoff = 0.05
        if self._lost:
            self._lost = False
            self.note("reattached")
        return True

    def next_delay(self, cause: BaseException | None) -> float:
        """Seconds to wait before re-attaching; raises Unavailable when the budget is spent."""
        if not self.job_id:
            # Nothing was received, so there is no job to re-attach to.
            if isinstance(cause, grpc.RpcError):
                raise errors.from_rpc_error(cause)
            raise errors.Unavailable("the stream ended before the job was known")
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.reconnect_timeout
        if not self._lost:
            self._lost = True
            self.note("lost", code=_rpc_code(cause))
        if now >= self._deadline:
            raise errors.Unavailable(
                f"lost the stream of job {self.job_id} after sequence {self.last} and could not "
                f"re-attach within {self.reconnect_timeout:g} s"
            ) from cause
        delay = min(self._backoff, self._deadline - now)
        self._backoff = min(self._backoff * 2, 2.0)
        return delay

    def remaining(self) -> float:
        """Seconds left of the re-attach budget (its clock starts at the first trouble)."""
        if self._deadline is None:
            return self.reconnect_timeout
        return max(0.0, self._deadline - time.monotonic())

    def gave_up(self) -> errors.Unavailable:
        return errors.Unavailable(
            f"could not reach the server to follow job {self.job_id} (after sequence "
            f"{self.last}) within {self.reconnect_timeout:g} s"
        )

    def watch_request(self) -> kernel_eval_service_pb2.WatchRequest:
        return kernel_eval_service_pb2.WatchRequest(job_id=self.job_id, after_sequence=self.last)


class _Base:
    """What the sync and asyncio clients share: settings, requests and retry schedules."""

    def __init__(
        self,
        address: str | None,
        timeout: float | None,
        admin_token: str | None,
        reconnect_timeout: float,
        retry_timeout: float,
        tenant_token: str | None = None,
    ) -> None:
        self.address = resolve_address(address)
        self.timeout = timeout
        self.admin_token = resolve_admin_token(admin_token)
        self.tenant_token = resolve_tenant_token(tenant_token)
        self.reconnect_timeout = reconnect_timeout
        self.retry_timeout = max(0.0, retry_timeout)

    def _channel_options(self) -> list[tuple[str, str | int]]:
        """Channel options: message limits, and the retry policy of the idempotent calls."""
        if self.retry_timeout <= 0:
            return list(_CHANNEL_OPTIONS)
        return [
            *_CHANNEL_OPTIONS,
            ("grpc.enable_retries", 1),
            ("grpc.service_config", SERVICE_CONFIG),
        ]

    def _admin_metadata(self) -> Metadata:
        if not self.admin_token:
            raise errors.Unauthenticated(
                f"operations calls need an admin token (argument or ${ADMIN_TOKEN_ENV})"
            )
        return (("authorization", f"Bearer {self.admin_token}"),)

    def _job_metadata(self) -> Metadata | None:
        """What KernelEvalService calls carry: the tenant token, else the admin token (which
        a service with tenants takes too, seeing every job), else nothing."""
        token = self.tenant_token or self.admin_token
        return (("authorization", f"Bearer {token}"),) if token else None

    def _submit_request(
        self,
        spec: JobSpecLike,
        options: kernel_pb2.EvalOptions | None,
        labels: Mapping[str, str] | None,
        idempotency_key: str | None,
    ) -> kernel_eval_service_pb2.SubmitRequest:
        """The request every attempt of one `submit` sends: one idempotency key for them all."""
        return kernel_eval_service_pb2.SubmitRequest(
            spec=_as_spec(spec, options, labels),
            idempotency_key=idempotency_key or str(uuid.uuid4()),
        )

    def _submit_retry(self) -> _SubmitRetry:
        return _SubmitRetry(self.retry_timeout)

    def _run_request(
        self,
        spec: JobSpecLike,
        options: kernel_pb2.EvalOptions | None,
        labels: Mapping[str, str] | None,
        keep_on_disconnect: bool,
    ) -> kernel_eval_service_pb2.RunRequest:
        return kernel_eval_service_pb2.RunRequest(
            spec=_as_spec(spec, options, labels), keep_on_disconnect=keep_on_disconnect
        )


class Client(_Base):
    """Blocking client. Thread-safe; close it (or use `with`) to release the channel.

    `timeout`: deadline of each call (each attempt of a retried one), seconds; None: none.
    `reconnect_timeout`: how long `run` and `watch` try to re-attach to a job's stream.
    `retry_timeout`: how long `submit` keeps retrying UNAVAILABLE and RESOURCE_EXHAUSTED;
    0 turns off its retries and the channel's (see the module's docstring). A `channel` of
    your own is used as it is (no retry policy unless you gave it `SERVICE_CONFIG`)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        admin_token: str | None = None,
        reconnect_timeout: float = 60.0,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        tenant_token: str | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        super().__init__(
            address, timeout, admin_token, reconnect_timeout, retry_timeout, tenant_token
        )
        options = self._channel_options()
        if channel is not None:
            self.channel = channel
        elif credentials is not None:
            self.channel = grpc.secure_channel(self.address, credentials, options)
        else:
            self.channel = grpc.insecure_channel(self.address, options)
        self._stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(self.channel)
        self._ops = operations_service_pb2_grpc.OperationsServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: grpc.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
        metadata: Metadata | None = None,
    ) -> _Resp:
        try:
            return method(request, timeout=self.timeout, metadata=metadata or self._job_metadata())
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e

    def _health_check(self) -> grpc.UnaryUnaryMultiCallable[str, str]:
        """grpc.health.v1.Health/Check (its messages coded here, see _encode_health_request)."""
        check: grpc.UnaryUnaryMultiCallable[str, str] = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )
        return check

    # --- KernelEvalService ---------------------------------------------------------------

    def evaluate(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> job_pb2.Job:
        """Evaluates (or compares, when spec.reference is set) and returns the finished job.

        `options` replace the spec's; `labels` are added to the spec's (JobSpec.labels: your
        own bookkeeping, e.g. {"problem": "19", "step": "420"}, filterable in `list_jobs`)."""
        req = kernel_eval_service_pb2.EvaluateRequest(spec=_as_spec(spec, options, labels))
        return self._call(self._stub.Evaluate, req).job

    def compare(
        self,
        spec: kernel_pb2.JobSpec,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> job_pb2.Job:
        """Compares spec.kernel with spec.reference and returns the finished job."""
        req = kernel_eval_service_pb2.CompareRequest(spec=_as_spec(spec, options, labels))
        return self._call(self._stub.Compare, req).job

    def submit(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> job_pb2.Job:
        """Queues a job and returns it at once (QUEUED).

        Retried on UNAVAILABLE and RESOURCE_EXHAUSTED within `retry_timeout`, every attempt
        with the same `idempotency_key` (a new uuid4 per call unless given; at most 128
        bytes), so the server makes one job however many attempts reach it. Pass your own key
        to make retries of your own (e.g. after a restart of your process) safe too."""
        req = self._submit_request(spec, options, labels, idempotency_key)
        retry = self._submit_retry()
        while True:
            try:
                return self._call(self._stub.Submit, req).job
            except errors.KernelEvalError as e:
                delay = retry.delay(e)
                if delay is None:
                    raise
            time.sleep(delay)

    def run(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
        keep_on_disconnect: bool = False,
        reconnect: bool = True,
        on_note: NoteHandler | None = None,
    ) -> Iterator[job_pb2.JobEvent]:
        """Submits a job and yields its events to the last (`finished`), re-attaching with
        Watch when the stream drops (unless `reconnect` is False); `on_note` hears about it."""
        req = self._run_request(spec, options, labels, keep_on_disconnect)
        follow = _Follow("", 0, self.reconnect_timeout, on_note)
        md = self._job_metadata()
        opener = lambda: self._stub.Run(req, timeout=self.timeout, metadata=md)  # noqa: E731
        yield from self._follow(follow, opener, reconnect)

    def watch(
        self,
        job_id: str,
        after_sequence: int = 0,
        *,
        reconnect: bool = True,
        on_note: NoteHandler | None = None,
    ) -> Iterator[job_pb2.JobEvent]:
        """Yields a job's events after `after_sequence` (0: all) to the last (`finished`),
        waiting for a server that is down and re-attaching as `run` does."""
        follow = _Follow(job_id, after_sequence, self.reconnect_timeout, on_note)
        yield from self._follow(follow, None, reconnect)

    def _reach_server(self, follow: _Follow) -> None:
        """Returns once the server answers, within the re-attach budget (a Watch with
        wait_for_ready would wait forever); a wait longer than a moment is noted."""
        budget = follow.remaining()
        started = time.monotonic()
        if self.wait_ready(min(_QUIET_WAIT, budget)):
            return
        follow.note("waiting", seconds=max(0.0, budget - (time.monotonic() - started)))
        if not self.wait_ready(max(0.0, budget - (time.monotonic() - started))):
            raise follow.gave_up()
        follow.note("answers")

    def _follow(
        self,
        follow: _Follow,
        first: Callable[[], _Stream] | None,
        reconnect: bool,
    ) -> Iterator[job_pb2.JobEvent]:
        opener = first
        while True:
            cause: BaseException | None = None
            call: _Stream
            if opener is not None:
                call = opener()
            else:
                self._reach_server(follow)
                call = self._stub.Watch(
                    follow.watch_request(), timeout=self.timeout, metadata=self._job_metadata()
                )
            opener = None
            try:
                for response in call:
                    event = response.event
                    if follow.accept(event):
                        yield event
                        if is_terminal(event):
                            return
            except grpc.RpcError as e:
                if not reconnect or not _reattachable(e):
                    raise errors.from_rpc_error(e) from e
                cause = e
            finally:
                call.cancel()
            if not reconnect:
                raise errors.Unavailable(f"the stream of job {follow.job_id} ended early")
            time.sleep(follow.next_delay(cause))

    def get_job(self, job_id: str) -> job_pb2.Job:
        req = kernel_eval_service_pb2.GetJobRequest(job_id=job_id)
        return self._call(self._stub.GetJob, req).job

    def list_jobs_page(
        self,
        request: kernel_eval_service_pb2.ListJobsRequest | None = None,
        *,
        page_token: str = "",
        page_size: int = 0,
        state: int = job_pb2.JOB_STATE_UNSPECIFIED,
        client_tag: str = "",
        include_spec: bool = False,
        labels: Mapping[str, str] | None = None,
    ) -> kernel_eval_service_pb2.ListJobsResponse:
        """One page of jobs, newest first, and the token of the next (`next_page_token`).

        The request is `request` (or an empty one) with the keywords given set on it; `labels`
        keeps jobs carrying every one of these labels with these values; page_size 0 is the
        server's default (50)."""
        req = _list_request(
            request,
            page_token=page_token,
            page_size=page_size,
            state=state,
            client_tag=client_tag,
            include_spec=include_spec,
            labels=labels,
        )
        return self._call(self._stub.ListJobs, req)

    def list_jobs(
        self,
        *,
        state: int = job_pb2.JOB_STATE_UNSPECIFIED,
        client_tag: str = "",
        labels: Mapping[str, str] | None = None,
        include_spec: bool = False,
        page_size: int = 100,
        limit: int | None = None,
    ) -> Iterator[job_pb2.Job]:
        """Jobs, newest first, fetched page by page; at most `limit` of them. Filters: `state`,
        `client_tag`, and `labels` (jobs carrying every one of them)."""
        req = _list_request(
            None,
            page_size=page_size,
            state=state,
            client_tag=client_tag,
            include_spec=include_spec,
            labels=labels,
        )
        count = 0
        while True:
            page = self.list_jobs_page(req)
            for job in page.jobs:
                if limit is not None and count >= limit:
                    return
                count += 1
                yield job
            if not page.next_page_token:
                return
            req.page_token = page.next_page_token

    def cancel_job(self, job_id: str) -> job_pb2.Job:
        req = kernel_eval_service_pb2.CancelJobRequest(job_id=job_id)
        return self._call(self._stub.CancelJob, req).job

    def run_batch(
        self,
        jobs: Iterable[BatchItem],
        *,
        max_in_flight: int | None = None,
        keep_on_disconnect: bool = False,
    ) -> Iterator[BatchEvent]:
        """Runs many jobs on one stream, yielding every event tagged with its request tag.

        Items are JobSpecs (tagged "0", "1", ... by position) or (tag, JobSpec) pairs. With
        `max_in_flight`, the next job is sent only when one of those in flight is done. With
        `keep_on_disconnect`, jobs outlive a dropped stream: follow them again with
        `watch(job_id, after_sequence=...)`; by default the server cancels them."""
        slots = threading.Semaphore(max_in_flight) if max_in_flight else None
        stop = threading.Event()

        def requests() -> Iterator[kernel_eval_service_pb2.RunBatchRequest]:
            for i, item in enumerate(jobs):
                if slots is not None:
                    while not slots.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                if stop.is_set():
                    return
                yield _batch_request(i, item, keep_on_disconnect)

        md = self._job_metadata()
        call = self._stub.RunBatch(requests(), timeout=self.timeout, metadata=md)
        try:
            for response in call:
                if response.HasField("error"):
                    out = BatchEvent(response.request_tag, error=response.error)
                else:
                    out = BatchEvent(response.request_tag, event=response.event)
                if out.done and slots is not None:
                    slots.release()
                yield out
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e
        finally:
            stop.set()
            call.cancel()

    # --- OperationsService (admin token) --------------------------------------------------

    def _ops_call(self, method: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        return self._call(method, request, metadata=self._admin_metadata())

    def list_devices(self) -> list[operations_service_pb2.Device]:
        resp = self._ops_call(self._ops.ListDevices, operations_service_pb2.ListDevicesRequest())
        return list(resp.devices)

    def readiness(self) -> list[operations_service_pb2.JobKindReadiness]:
        """Whether the service is ready for each kind of job ("jobs", "load_inline",
        "built_ahead"), and what it waits for (ListDevices' `readiness`)."""
        resp = self._ops_call(self._ops.ListDevices, operations_service_pb2.ListDevicesRequest())
        return list(resp.readiness)

    def watch_events(self, replay_count: int = 0) -> Iterator[operations_service_pb2.OpsEvent]:
        """Operations events (XIDs, worker exits, resets, health) as they happen."""
        req = operations_service_pb2.WatchEventsRequest(replay_count=replay_count)
        call = self._ops.WatchEvents(req, timeout=self.timeout, metadata=self._admin_metadata())
        try:
            for response in call:
                yield response.event
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e
        finally:
            call.cancel()

    def reset_gpu(
        self, device_index: int, *, grace_period: float | None = None, node: str = ""
    ) -> operations_service_pb2.ResetGpuResponse:
        """`node`: on a gateway, the node that owns the GPU (ListDevices' `Device.node`)."""
        req = operations_service_pb2.ResetGpuRequest(
            device_index=device_index, grace_period=_duration(grace_period), node=node
        )
        return self._ops_call(self._ops.ResetGpu, req)

    def restart_workers(self, device_index: int | None = None, *, node: str = "") -> int:
        """`node`: on a gateway, the node whose job processes restart."""
        req = operations_service_pb2.RestartWorkersRequest(device_index=device_index, node=node)
        return self._ops_call(self._ops.RestartWorkers, req).restarted_count

    def cleanup(self, older_than: float | None = None) -> operations_service_pb2.CleanupResponse:
        req = operations_service_pb2.CleanupRequest(older_than=_duration(older_than))
        return self._ops_call(self._ops.Cleanup, req)

    def get_stats(self) -> operations_service_pb2.GetStatsResponse:
        return self._ops_call(self._ops.GetStats, operations_service_pb2.GetStatsRequest())

    def list_builders(self) -> operations_service_pb2.ListBuildersResponse:
        """The builders (`--role builder`) in the shared store, live and recently lost, and
        the server's own versions (`versions`) that each builder's are compared with."""
        return self._ops_call(self._ops.ListBuilders, operations_service_pb2.ListBuildersRequest())

    # --- grpc.health.v1 -------------------------------------------------------------------

    def health(self, service: str = "") -> str:
        """The health status name ("SERVING", "NOT_SERVING", ...) from grpc.health.v1."""
        return self._call(self._health_check(), service)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server answers within `timeout` seconds (waiting for a server that is
        down or restarting). A health check that waits for the connection, not
        grpc.channel_ready_future: that one's connectivity-polling thread outlives it and
        raises "Channel closed!" in the background once the channel is closed."""
        check = self._health_check()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                check("", timeout=left, wait_for_ready=True)
                return True
            except grpc.RpcError as e:
                if e.code() not in _NOT_READY:
                    return True  # it answered (e.g. UNIMPLEMENTED: no health service)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))  # e.g. it is stopping
        return False


class AsyncClient(_Base):
    """asyncio client (grpc.aio); the same calls and parameters as `Client`, awaited or
    async-iterated."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        admin_token: str | None = None,
        reconnect_timeout: float = 60.0,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        tenant_token: str | None = None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        super().__init__(
            address, timeout, admin_token, reconnect_timeout, retry_timeout, tenant_token
        )
        options = self._channel_options()
        if channel is not None:
            self.channel = channel
        elif credentials is not None:
            self.channel = grpc.aio.secure_channel(self.address, credentials, options)
        else:
            self.channel = grpc.aio.insecure_channel(self.address, options)
        self._stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(self.channel)
        self._ops = operations_service_pb2_grpc.OperationsServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
        metadata: Metadata | None = None,
    ) -> _Resp:
        try:
            return await method(
                request, timeout=self.timeout, metadata=metadata or self._job_metadata()
            )
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e

    def _health_check(self) -> grpc.aio.UnaryUnaryMultiCallable[str, str]:
        """As `Client._health_check`."""
        check: grpc.aio.UnaryUnaryMultiCallable[str, str] = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )
        return check

    async def evaluate(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> job_pb2.Job:
        """As `Client.evaluate`."""
        req = kernel_eval_service_pb2.EvaluateRequest(spec=_as_spec(spec, options, labels))
        return (await self._call(self._stub.Evaluate, req)).job

    async def compare(
        self,
        spec: kernel_pb2.JobSpec,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> job_pb2.Job:
        """As `Client.compare`."""
        req = kernel_eval_service_pb2.CompareRequest(spec=_as_spec(spec, options, labels))
        return (await self._call(self._stub.Compare, req)).job

    async def submit(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> job_pb2.Job:
        """As `Client.submit`: retried within `retry_timeout`, with one idempotency key."""
        req = self._submit_request(spec, options, labels, idempotency_key)
        retry = self._submit_retry()
        while True:
            try:
                return (await self._call(self._stub.Submit, req)).job
            except errors.KernelEvalError as e:
                delay = retry.delay(e)
                if delay is None:
                    raise
            await asyncio.sleep(delay)

    def run(
        self,
        spec: JobSpecLike,
        *,
        options: kernel_pb2.EvalOptions | None = None,
        labels: Mapping[str, str] | None = None,
        keep_on_disconnect: bool = False,
        reconnect: bool = True,
        on_note: NoteHandler | None = None,
    ) -> AsyncIterator[job_pb2.JobEvent]:
        """As `Client.run`."""
        req = self._run_request(spec, options, labels, keep_on_disconnect)
        follow = _Follow("", 0, self.reconnect_timeout, on_note)
        md = self._job_metadata()
        return self._follow(
            follow, lambda: self._stub.Run(req, timeout=self.timeout, metadata=md), reconnect
        )

    def watch(
        self,
        job_id: str,
        after_sequence: int = 0,
        *,
        reconnect: bool = True,
        on_note: NoteHandler | None = None,
    ) -> AsyncIterator[job_pb2.JobEvent]:
        """As `Client.watch`."""
        follow = _Follow(job_id, after_sequence, self.reconnect_timeout, on_note)
        return self._follow(follow, None, reconnect)

    async def _reach_server(self, follow: _Follow) -> None:
        """As `Client._reach_server`."""
        budget = follow.remaining()
        started = time.monotonic()
        if await self.wait_ready(min(_QUIET_WAIT, budget)):
            return
        follow.note("waiting", seconds=max(0.0, budget - (time.monotonic() - started)))
        if not await self.wait_ready(max(0.0, budget - (time.monotonic() - started))):
            raise follow.gave_up()
        follow.note("answers")

    async def _follow(
        self,
        follow: _Follow,
        first: Callable[[], _AsyncStream] | None,
        reconnect: bool,
    ) -> AsyncIterator[job_pb2.JobEvent]:
        opener = first
        while True:
            cause: BaseException | None = None
            call: _AsyncStream
            if opener is not None:
                call = opener()
            else:
                await self._reach_server(follow)
                call = self._stub.Watch(
                    follow.watch_request(), timeout=self.timeout, metadata=self._job_metadata()
                )
            opener = None
            try:
                async for response in call:
                    event = response.event
                    if follow.accept(event):
                        yield event
                        if is_terminal(event):
                            return
            except grpc.RpcError as e:
                if not reconnect or not _reattachable(e):
                    raise errors.from_rpc_error(e) from e
                cause = e
            finally:
                call.cancel()
            if not reconnect:
                raise errors.Unavailable(f"the stream of job {follow.job_id} ended early")
            await asyncio.sleep(follow.next_delay(cause))

    async def get_job(self, job_id: str) -> job_pb2.Job:
        req = kernel_eval_service_pb2.GetJobRequest(job_id=job_id)
        return (await self._call(self._stub.GetJob, req)).job

    async def list_jobs_page(
        self,
        request: kernel_eval_service_pb2.ListJobsRequest | None = None,
        *,
        page_token: str = "",
        page_size: int = 0,
        state: int = job_pb2.JOB_STATE_UNSPECIFIED,
        client_tag: str = "",
        include_spec: bool = False,
        labels: Mapping[str, str] | None = None,
    ) -> kernel_eval_service_pb2.ListJobsResponse:
        """As `Client.list_jobs_page`."""
        req = _list_request(
            request,
            page_token=page_token,
            page_size=page_size,
            state=state,
            client_tag=client_tag,
            include_spec=include_spec,
            labels=labels,
        )
        return await self._call(self._stub.ListJobs, req)

    async def list_jobs(
        self,
        *,
        state: int = job_pb2.JOB_STATE_UNSPECIFIED,
        client_tag: str = "",
        labels: Mapping[str, str] | None = None,
        include_spec: bool = False,
        page_size: int = 100,
        limit: int | None = None,
    ) -> AsyncIterator[job_pb2.Job]:
        """As `Client.list_jobs`."""
        req = _list_request(
            None,
            page_size=page_size,
            state=state,
            client_tag=client_tag,
            include_spec=include_spec,
            labels=labels,
        )
        count = 0
        while True:
            page = await self.list_jobs_page(req)
            for job in page.jobs:
                if limit is not None and count >= limit:
                    return
                count += 1
                yield job
            if not page.next_page_token:
                return
            req.page_token = page.next_page_token

    async def cancel_job(self, job_id: str) -> job_pb2.Job:
        req = kernel_eval_service_pb2.CancelJobRequest(job_id=job_id)
        return (await self._call(self._stub.CancelJob, req)).job

    async def run_batch(
        self,
        jobs: Iterable[BatchItem] | AsyncIterable[BatchItem],
        *,
        max_in_flight: int | None = None,
        keep_on_disconnect: bool = False,
    ) -> AsyncIterator[BatchEvent]:
        """As `Client.run_batch`; `jobs` may be an async iterable."""
        slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None

        async def items() -> AsyncIterator[BatchItem]:
            if isinstance(jobs, AsyncIterable):
                async for item in jobs:
                    yield item
            else:
                for item in jobs:
                    yield item

        async def requests() -> AsyncIterator[kernel_eval_service_pb2.RunBatchRequest]:
            i = 0
            async for item in items():
                if slots is not None:
                    await slots.acquire()
                yield _batch_request(i, item, keep_on_disconnect)
                i += 1

        md = self._job_metadata()
        call = self._stub.RunBatch(requests(), timeout=self.timeout, metadata=md)
        try:
            async for response in call:
                if response.HasField("error"):
                    out = BatchEvent(response.request_tag, error=response.error)
                else:
                    out = BatchEvent(response.request_tag, event=response.event)
                if out.done and slots is not None:
                    slots.release()
                yield out
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e
        finally:
            call.cancel()

    async def list_devices(self) -> list[operations_service_pb2.Device]:
        resp = await self._call(
            self._ops.ListDevices,
            operations_service_pb2.ListDevicesRequest(),
            metadata=self._admin_metadata(),
        )
        return list(resp.devices)

    async def readiness(self) -> list[operations_service_pb2.JobKindReadiness]:
        """Client.readiness, awaited."""
        resp = await self._call(
            self._ops.ListDevices,
            operations_service_pb2.ListDevicesRequest(),
            metadata=self._admin_metadata(),
        )
        return list(resp.readiness)

    async def watch_events(
        self, replay_count: int = 0
    ) -> AsyncIterator[operations_service_pb2.OpsEvent]:
        req = operations_service_pb2.WatchEventsRequest(replay_count=replay_count)
        call = self._ops.WatchEvents(req, timeout=self.timeout, metadata=self._admin_metadata())
        try:
            async for response in call:
                yield response.event
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from e
        finally:
            call.cancel()

    async def reset_gpu(
        self, device_index: int, *, grace_period: float | None = None, node: str = ""
    ) -> operations_service_pb2.ResetGpuResponse:
        """As `Client.reset_gpu`."""
        req = operations_service_pb2.ResetGpuRequest(
            device_index=device_index, grace_period=_duration(grace_period), node=node
        )
        return await self._call(self._ops.ResetGpu, req, metadata=self._admin_metadata())

    async def restart_workers(self, device_index: int | None = None, *, node: str = "") -> int:
        """As `Client.restart_workers`."""
        req = operations_service_pb2.RestartWorkersRequest(device_index=device_index, node=node)
        resp = await self._call(self._ops.RestartWorkers, req, metadata=self._admin_metadata())
        return resp.restarted_count

    async def cleanup(
        self, older_than: float | None = None
    ) -> operations_service_pb2.CleanupResponse:
        req = operations_service_pb2.CleanupRequest(older_than=_duration(older_than))
        return await self._call(self._ops.Cleanup, req, metadata=self._admin_metadata())

    async def get_stats(self) -> operations_service_pb2.GetStatsResponse:
        return await self._call(
            self._ops.GetStats,
            operations_service_pb2.GetStatsRequest(),
            metadata=self._admin_metadata(),
        )

    async def list_builders(self) -> operations_service_pb2.ListBuildersResponse:
        """As `Client.list_builders`."""
        return await self._call(
            self._ops.ListBuilders,
            operations_service_pb2.ListBuildersRequest(),
            metadata=self._admin_metadata(),
        )

    async def health(self, service: str = "") -> str:
        """As `Client.health`."""
        return await self._call(self._health_check(), service)

    async def wait_ready(self, timeout: float) -> bool:
        """As `Client.wait_ready` (grpc.aio's channel_ready polls nothing in the background)."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), max(0.0, timeout))
            return True
        except asyncio.TimeoutError:
            return False


# grpc.health.v1 without grpcio-health-checking: HealthCheckRequest {string service = 1},
# HealthCheckResponse {ServingStatus status = 1}.
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _encode_health_request(service: str) -> bytes:
    raw = service.encode()
    if not raw:
        return b""
    return b"\x0a" + _varint(len(raw)) + raw


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode_health_response(raw: bytes) -> str:
    # Field 1, varint: tag byte 0x08 then the value (small enum, one byte).
    if len(raw) >= 2 and raw[0] == 0x08:
        return _HEALTH_STATUS.get(raw[1], str(raw[1]))
    return "UNKNOWN"
