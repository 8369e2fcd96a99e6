"""The API's limits and status codes (issue 12, items 5-7): every client mistake through a real
gRPC server is INVALID_ARGUMENT, NOT_FOUND or OUT_OF_RANGE with a message naming the field and
the limit, never UNKNOWN or INTERNAL; nothing of a refused job is stored; a job's stored log
is capped with a note.

The server here is in-process: grpc.aio with the real KernelEvalService and OperationsService
over a real JobManager and store (no watchdog, no job processes: accepted jobs stay QUEUED),
and the interceptors the service registers (metrics, auth.AdminAuth, then api_errors.DecodeErrors).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_pb2, operations_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import kernel_eval_service_pb2_grpc as pb_grpc
from kerneleval.v1 import operations_service_pb2 as ops_pb
from kerneleval_server.api import auth
from kerneleval_server.api.auth import AdminAuth
from kerneleval_server.api.errors import DecodeErrors
from kerneleval_server.api.kernel_eval_service import KernelEvalService
from kerneleval_server.api.operations_service import OperationsService
from kerneleval_server.config import Config
from kerneleval_server.jobs.events import LOG_CUT_PREFIX, EventHub, OpsLog
from kerneleval_server.jobs.manager import JobManager
from kerneleval_server.jobs.service import JobService
from kerneleval_server.jobs.store import SqliteStore
from kerneleval_server.metrics import Metrics, MetricsInterceptor
from kerneleval_server.spec import validation

MIB = 1 << 20
MESSAGE_LIMIT = 64 * MIB
ADMIN = "test-admin-token"
AUTH = (("authorization", f"Bearer {ADMIN}"),)
SERVICE = "/kerneleval.v1.KernelEvalService/"
OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
]
ADD_MODEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(4), torch.randn(4)]
def get_init_inputs():
    return []
"""


def _identity(b: bytes) -> bytes:
    return b


class Harness:
    def __init__(self, channel: grpc.aio.Channel, manager: JobManager) -> None:
        self.channel = channel
        self.manager = manager
        self.stub = pb_grpc.KernelEvalServiceStub(channel)
        self.ops = operations_service_pb2_grpc.OperationsServiceStub(channel)

    def stored_jobs(self) -> list[job_pb2.Job]:
        return [job for _, job in self.manager.store.list(limit=100)]


@contextlib.asynccontextmanager
async def serve(tmp_path: Path) -> AsyncIterator[Harness]:
    store = SqliteStore(tmp_path / "jobs.db")
    metrics = Metrics()
    manager = JobManager(Config(), store, EventHub(store), OpsLog(), metrics, max_timeout_s=600.0)
    server = grpc.aio.server(
        interceptors=[MetricsInterceptor(metrics), AdminAuth(ADMIN), DecodeErrors()],
        options=OPTIONS,
    )
    pb_grpc.add_KernelEvalServiceServicer_to_server(
        KernelEvalService(JobService(manager), validation.Limits()), server
    )
    operations_service_pb2_grpc.add_OperationsServiceServicer_to_server(
        OperationsService(JobService(manager)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            yield Harness(channel, manager)
    finally:
        await server.stop(0)
        store.close()


def run(tmp_path: Path, scenario: Callable[[Harness], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        async with serve(tmp_path) as h:
            await asyncio.wait_for(scenario(h), 60)

    asyncio.run(main())


async def error_of(call: Coroutine[Any, Any, Any] | Any) -> grpc.aio.AioRpcError:
    """The error a unary call (a coroutine) or a streaming call (an async iterator) ends with."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded")


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    """google.rpc.BadRequest's field violations of an error, by field."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    out: dict[str, str] = {}
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.update({v.field: v.description for v in bad.field_violations})
    return out


def torch_spec(**kw: Any) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=ADD_MODEL)
    )
    for key, value in kw.items():
        setattr(spec, key, value)
    return spec


def literal_spec(*sizes: int) -> kernel_pb2.JobSpec:
    """A TORCH job whose inputs are literal uint8 tensors of these sizes."""
    spec = torch_spec()
    for i, size in enumerate(sizes):
        arg = spec.kernel.io.args.add(name=f"x{i}")
        arg.tensor.shape.append(size)
        arg.tensor.dtype = dtype_pb2.DTYPE_UINT8
        arg.tensor.data = b"\x01" * size
    return spec


# ---- specs that cannot be delivered or stored -----------------------------------------------


def test_20_mib_literal_tensor_is_refused_naming_the_field(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        err = await error_of(h.stub.Submit(pb.SubmitRequest(spec=literal_spec(20 * MIB))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "spec.kernel.io.args[0].tensor.data"
        assert f"{field}: {20 * MIB} bytes, the limit is {12 * MIB} bytes" in err.details()
        assert str(12 * MIB) in violations(err)[field]
        assert h.stored_jobs() == []  # never stored, never left RUNNING
        # Evaluate and Run refuse it the same way, before anything is queued.
        err = await error_of(h.stub.Evaluate(pb.EvaluateRequest(spec=literal_spec(20 * MIB))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
        err = await error_of(h.stub.Run(pb.RunRequest(spec=literal_spec(20 * MIB))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
        assert h.stored_jobs() == [] and len(h.manager.queue) == 0

    run(tmp_path, scenario)


def test_spec_over_the_frame_budget_in_pieces_is_refused(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        # Two literals, each under the limit, together over it: the whole spec is named.
        err = await error_of(h.stub.Submit(pb.SubmitRequest(spec=literal_spec(7 * MIB, 7 * MIB))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        v = violations(err)
        assert "the serialized JobSpec is" in v["spec"] and str(12 * MIB) in v["spec"]
        assert "spec.kernel.io.args[0].tensor.data" in v["spec"]
        # Just under the limit is accepted and queued.
        resp = await h.stub.Submit(pb.SubmitRequest(spec=literal_spec(11 * MIB)))
        assert resp.job.state == job_pb2.JOB_STATE_QUEUED
        assert [j.job_id for j in h.stored_jobs()] == [resp.job.job_id]

    run(tmp_path, scenario)


def test_15_mb_client_tag_is_refused(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        spec = torch_spec(client_tag="t" * 15_000_000)
        err = await error_of(h.stub.Submit(pb.SubmitRequest(spec=spec)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "spec.client_tag: 15000000 bytes, the limit is 256 bytes" in err.details()
        assert violations(err)["spec.client_tag"] == "15000000 bytes, the limit is 256 bytes"
        assert h.stored_jobs() == []
        # 256 bytes (in UTF-8: 128 two-byte characters) is fine; 257 is not.
        ok = await h.stub.Submit(pb.SubmitRequest(spec=torch_spec(client_tag="é" * 128)))
        assert ok.job.spec.client_tag == "é" * 128
        err = await error_of(
            h.stub.Submit(pb.SubmitRequest(spec=torch_spec(client_tag="é" * 128 + "x")))
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "257 bytes" in err.details()
        # The ListJobs filter has the same limit.
        err = await error_of(h.stub.ListJobs(pb.ListJobsRequest(client_tag="t" * 1000)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "client_tag: 1000 bytes, the limit is 256 bytes" in err.details()

    run(tmp_path, scenario)


def test_many_violations_still_fit_the_trailers(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        spec = torch_spec()
        for _ in range(64):
            spec.kernel.io.args.add(name="n" * 256 + "-", tensor=kernel_pb2.TensorSpec(shape=[-1]))
        err = await error_of(h.stub.Submit(pb.SubmitRequest(spec=spec)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # not a trailer-size error
        v = violations(err)
        assert len(v) <= 17 and "more violations" in v["..."]

    run(tmp_path, scenario)


def test_free_strings_have_limits(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        spec = torch_spec()
        spec.kernel.entry_point = "E" * 300
        err = await error_of(h.stub.Submit(pb.SubmitRequest(spec=spec)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "spec.kernel.entry_point: 300 characters, the limit is 256" in err.details()
        for method, request in (
            (h.stub.GetJob, pb.GetJobRequest(job_id="j" * MIB)),
            (h.stub.CancelJob, pb.CancelJobRequest(job_id="j" * MIB)),
        ):
            err = await error_of(method(request))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"job_id: {MIB} bytes, the limit is 128 bytes" in err.details()
        err = await error_of(h.stub.Watch(pb.WatchRequest(job_id="j" * 200)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in err.details()
        err = await error_of(h.stub.GetJob(pb.GetJobRequest(job_id="nope")))
        assert err.code() == grpc.StatusCode.NOT_FOUND

    run(tmp_path, scenario)


def test_run_batch_refuses_a_long_request_tag_and_goes_on(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        requests = [
            pb.RunBatchRequest(spec=torch_spec(), request_tag="x" * 1000),
            pb.RunBatchRequest(spec=literal_spec(20 * MIB), request_tag="big"),
        ]
        responses = [r async for r in h.stub.RunBatch(iter(requests))]
        by_tag = {r.request_tag: r for r in responses}
        tag_error = by_tag["x" * 1000].error
        assert tag_error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert tag_error.field_violations[0].field == "request_tag"
        assert "1000 bytes, the limit is 256 bytes" in tag_error.message
        big = by_tag["big"].error
        assert big.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "spec.kernel.io.args[0].tensor.data" in big.message
        assert h.stored_jobs() == []

    run(tmp_path, scenario)


# ---- request bytes that do not decode --------------------------------------------------------


def _raw_unary(h: Harness, method: str) -> Any:
    return h.channel.unary_unary(
        SERVICE + method, request_serializer=_identity, response_deserializer=_identity
    )


def test_invalid_utf8_is_invalid_argument_naming_the_field(tmp_path: Path) -> None:
    good = pb.SubmitRequest(spec=torch_spec(client_tag="TAGTAG")).SerializeToString()
    bad = good.replace(b"TAGTAG", b"TAG\xff\xfeG")
    assert len(bad) == len(good)

    async def scenario(h: Harness) -> None:
        await _raw_unary(h, "Submit")(good)  # the hand-made bytes are otherwise fine
        before = len(h.stored_jobs())
        err = await error_of(_raw_unary(h, "Submit")(bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kerneleval.v1.SubmitRequest" in err.details()
        assert "spec.client_tag is not valid UTF-8" in err.details()
        assert len(h.stored_jobs()) == before
        # A unary-stream method (Watch) and the request stream of RunBatch.
        watch = h.channel.unary_stream(
            SERVICE + "Watch", request_serializer=_identity, response_deserializer=_identity
        )
        raw = pb.WatchRequest(job_id="abcdef").SerializeToString().replace(b"abcdef", b"ab\xc3(ef")
        err = await error_of(watch(raw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job_id is not valid UTF-8" in err.details()
        batch = h.channel.stream_stream(
            SERVICE + "RunBatch", request_serializer=_identity, response_deserializer=_identity
        )
        bad_batch = (
            pb.RunBatchRequest(spec=torch_spec(), request_tag="RTAG")
            .SerializeToString()
            .replace(b"RTAG", b"R\x80AG")
        )
        err = await error_of(batch(iter([bad_batch])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_tag is not valid UTF-8" in err.details()

    run(tmp_path, scenario)


def test_truncated_bytes_are_invalid_argument(tmp_path: Path) -> None:
    whole = pb.SubmitRequest(spec=torch_spec(client_tag="tag")).SerializeToString()

    async def scenario(h: Harness) -> None:
        for cut in (1, 7, len(whole) // 2, len(whole) - 1):
            err = await error_of(_raw_unary(h, "Submit")(whole[:cut]))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, cut
            assert "not a valid kerneleval.v1.SubmitRequest" in err.details()
        err = await error_of(_raw_unary(h, "Submit")(whole[:-1]))
        assert "truncated" in err.details() or "end inside" in err.details()
        err = await error_of(_raw_unary(h, "GetJob")(b"\x0a\x7f" + b"x" * 10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job_id declares 127 bytes but only 10 follow" in err.details()
        assert h.stored_jobs() == []
        # Operations too, with the token; without it, the token check comes first and says
        # nothing about the request.
        ops_call = h.channel.unary_unary(
            "/kerneleval.v1.OperationsService/RestartWorkers",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        err = await error_of(ops_call(b"\x08", metadata=AUTH))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = await error_of(ops_call(b"\x08"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in err.details()

    run(tmp_path, scenario)


# ---- numbers past int64 and malformed tokens -------------------------------------------------


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def test_page_tokens_past_int64_or_malformed(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        for _ in range(3):
            await h.stub.Submit(pb.SubmitRequest(spec=torch_spec()))
        page = await h.stub.ListJobs(pb.ListJobsRequest(page_size=2))
        assert len(page.jobs) == 2 and page.next_page_token
        rest = await h.stub.ListJobs(pb.ListJobsRequest(page_token=page.next_page_token))
        assert len(rest.jobs) == 1
        for token in (
            _token(f"r{2**64}"),
            _token(f"r{2**63}"),
            _token("r" + "9" * 5000),
            _token("r-5"),
            _token("r0"),
            _token("r 12"),
            _token("r١٢"),  # Arabic-Indic digits: int() takes them, a token never has them
            "!!!not base64",
            "é",
            "A" * 10_000,
        ):
            err = await error_of(h.stub.ListJobs(pb.ListJobsRequest(page_token=token)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, token[:40]
            assert "page_token: not a token from ListJobs" in err.details()
        err = await error_of(h.stub.ListJobs(pb.ListJobsRequest(page_size=-1)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = await error_of(h.stub.ListJobs(pb.ListJobsRequest(state=99)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(tmp_path, scenario)


def test_after_sequence_past_int64_is_out_of_range(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        job = (await h.stub.Submit(pb.SubmitRequest(spec=torch_spec()))).job
        for after in (2**63, 2**64 - 1):
            err = await error_of(
                h.stub.Watch(pb.WatchRequest(job_id=job.job_id, after_sequence=after))
            )
            assert err.code() == grpc.StatusCode.OUT_OF_RANGE
            assert f"after_sequence: {after} is past the largest sequence" in err.details()
        # The largest valid value replays nothing and follows the (queued) job.
        call = h.stub.Watch(pb.WatchRequest(job_id=job.job_id, after_sequence=2**63 - 1))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call.read(), 0.3)
        call.cancel()

    run(tmp_path, scenario)


def test_store_never_overflows_on_client_numbers(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    assert store.events_after("j", 2**64 - 1) == []
    assert store.list(limit=2**70, before_rowid=2**80, state=2**40) == []
    store.close()


# ---- operations ------------------------------------------------------------------------------


class _FakeWatchdog:
    def __init__(self) -> None:
        self.restarted: list[int] = []

    async def restart_workers(self, device_index: int) -> None:
        self.restarted.append(device_index)


def test_unknown_devices_are_not_found(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        err = await error_of(h.ops.RestartWorkers(ops_pb.RestartWorkersRequest(), metadata=AUTH))
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # no watchdog here: not INTERNAL
        watchdog = _FakeWatchdog()
        h.manager.watchdog = watchdog  # type: ignore[assignment]
        h.manager.fleet.device_indices = lambda: [-1, 0]  # type: ignore[method-assign]
        for device in (99, -2, -7, 2**31 - 1):
            err = await error_of(
                h.ops.RestartWorkers(
                    ops_pb.RestartWorkersRequest(device_index=device), metadata=AUTH
                )
            )
            assert err.code() == grpc.StatusCode.NOT_FOUND, device
            assert f"device_index: no device {device} here (devices: [-1, 0])" in err.details()
        await h.ops.RestartWorkers(ops_pb.RestartWorkersRequest(device_index=0), metadata=AUTH)
        await h.ops.RestartWorkers(ops_pb.RestartWorkersRequest(), metadata=AUTH)
        assert watchdog.restarted == [0, -2]
        err = await error_of(h.ops.ResetGpu(ops_pb.ResetGpuRequest(device_index=99), metadata=AUTH))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "device_index: no GPU 99 here" in err.details()
        err = await error_of(h.ops.ResetGpu(ops_pb.ResetGpuRequest(device_index=-1), metadata=AUTH))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a GPU" in err.details()
        request = ops_pb.ResetGpuRequest(device_index=0)
        request.grace_period.seconds = 10**12  # would overflow the watchdog's int32 grace_ms
        err = await error_of(h.ops.ResetGpu(request, metadata=AUTH))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "grace_period" in err.details()
        request.grace_period.seconds = -1
        err = await error_of(h.ops.ResetGpu(request, metadata=AUTH))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Without the token: UNAUTHENTICATED before anything else.
        err = await error_of(h.ops.RestartWorkers(ops_pb.RestartWorkersRequest(device_index=99)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details().startswith(auth.MESSAGE) and "admin_token" in err.details()
        # A wrong one is told so, and where the right one is (not the token, not the path).
        wrong = [("authorization", "Bearer not-it")]
        err = await error_of(h.ops.RestartWorkers(ops_pb.RestartWorkersRequest(), metadata=wrong))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details() == f"{auth.WRONG}; {auth.IN_STATE_DIR}"
        assert ADMIN not in err.details() and str(tmp_path) not in err.details()

    run(tmp_path, scenario)


# ---- the log cap (the events layer) ----------------------------------------------------------


def _log(hub: EventHub, job_id: str, text: str) -> None:
    event = hub.next_event(job_id)
    event.log.text = text
    hub.publish(event)


def _stored(store: SqliteStore, job_id: str) -> list[job_pb2.JobEvent]:
    return store.events_after(job_id, 0)


def test_log_flood_is_capped_with_a_note(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    hub = EventHub(store, max_log_bytes=10_000)
    seen: list[job_pb2.JobEvent] = []

    async def flood() -> None:
        async def watch() -> None:
            async for event in hub.watch("j", 0):
                seen.append(event)

        job = job_pb2.Job(job_id="j", state=job_pb2.JOB_STATE_RUNNING)
        first = hub.next_event("j")
        first.queued.position = 0
        store.insert(job, first)
        hub.publish(first, persisted=True)
        task = asyncio.create_task(watch())
        await asyncio.sleep(0)
        for _ in range(5_000):  # 5 MB offered
            _log(hub, "j", "y" * 1000)
        end = hub.next_event("j")
        end.finished.job_id = "j"
        hub.publish(end)
        await asyncio.wait_for(task, 5)

    asyncio.run(flood())
    events = _stored(store, "j")
    logs = [e for e in events if e.HasField("log")]
    text = sum(len(e.log.text) for e in logs[:-1])
    assert text + 64 * len(logs[:-1]) <= 10_000
    note = logs[-1].log.text
    assert note.startswith(LOG_CUT_PREFIX) and f"after {text} bytes" in note
    assert "10000 bytes" in note
    # Sequences still have no gaps, the note is the last log, watchers saw what was stored.
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert events[-1].HasField("finished") and events[-2] == logs[-1]
    assert [e.sequence for e in seen] == [e.sequence for e in events]
    store.close()


def test_log_cap_counts_lines_and_survives_a_restart(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    hub = EventHub(store, max_log_bytes=1000)
    for _ in range(100):  # empty lines count 64 bytes each
        _log(hub, "j", "")
    logs = [e for e in _stored(store, "j") if e.HasField("log")]
    assert len(logs) == 1000 // 64 + 1 and logs[-1].log.text.startswith(LOG_CUT_PREFIX)
    # A multi-byte line that crosses the cap is cut on a character boundary.
    _log(hub, "k", "a" * 801)
    _log(hub, "k", "é" * 100)  # 200 bytes; 1000 - (801 + 64) - 64 = 71 fit: 35 characters
    k = [e.log.text for e in _stored(store, "k")]
    assert k[:2] == ["a" * 801, "é" * 35] and len(k) == 3
    assert k[2].startswith(LOG_CUT_PREFIX) and "after 871 bytes" in k[2]
    # A line that does not fit at all is dropped, its sequence given back.
    _log(hub, "m", "a" * 900)
    _log(hub, "m", "b" * 100)
    m = _stored(store, "m")
    assert [e.log.text[:1] for e in m] == ["a", "["] and [e.sequence for e in m] == [1, 2]
    # A front end restarted while the job runs does not start the count again.
    count = len(_stored(store, "j"))
    hub2 = EventHub(store, max_log_bytes=1000)
    _log(hub2, "j", "more")
    assert len(_stored(store, "j")) == count
    # Another job has its own budget; the default comes from validation.Limits (1 MiB).
    _log(hub2, "other", "fine")
    assert _stored(store, "other")[-1].log.text == "fine"
    assert EventHub(store).max_log_bytes == validation.Limits().max_log_bytes == MIB
    store.close()


def test_spec_limit_cannot_be_raised_past_one_frame() -> None:
    """KERNELEVAL_LIMIT_MAX_SPEC_BYTES above what a job process can receive would accept specs
    that are never delivered: it is held at the ceiling; lower values are kept."""
    from kerneleval_server.framing import MAX_FRAME
    from kerneleval_server.spec import validation

    high = validation.Limits.from_env({"KERNELEVAL_LIMIT_MAX_SPEC_BYTES": str(64 << 20)})
    assert high.max_spec_bytes == validation.SPEC_BYTES_CEILING < MAX_FRAME
    low = validation.Limits.from_env({"KERNELEVAL_LIMIT_MAX_SPEC_BYTES": str(1 << 20)})
    assert low.max_spec_bytes == 1 << 20


def test_static_checks_of_a_small_source_run_on_the_loop_a_large_one_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KernelBench-sized source is checked on the event loop, after its job was queued and
    dispatched (no thread hand-off, no parsing on the way to its start); a large one in a
    thread first. Both are flagged alike, in Submit's answer and in the store (here no job
    process takes them: they stay queued, and their run starts from the stored job)."""
    import threading

    from kerneleval_server.api import kernel_eval_service

    ran_on: list[str] = []
    real = kernel_eval_service.static_checks.check

    def check(spec: kernel_pb2.JobSpec) -> list[job_pb2.IntegrityFlag]:
        ran_on.append(threading.current_thread().name)
        return real(spec)

    monkeypatch.setattr(kernel_eval_service.static_checks, "check", check)
    small = ADD_MODEL + "import threading\n"
    large = small + "#" * kernel_eval_service.INLINE_STATIC_CHECK_CHARS + "\n"

    async def scenario(h: Harness) -> None:
        loop_thread = threading.current_thread().name
        for source in (small, large):
            spec = torch_spec()
            spec.kernel.source_code = source
            job = (await h.stub.Submit(pb.SubmitRequest(spec=spec))).job
            assert [f.rule_id for f in job.result.flags] == ["thread_or_process"]
            stored = (await h.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))).job
            assert stored.state == job_pb2.JOB_STATE_QUEUED
            assert list(stored.result.flags) == list(job.result.flags)
        assert ran_on[0] == loop_thread and ran_on[1] != loop_thread

    run(tmp_path, scenario)
