"""End to end through real gRPC to a real service process with real workers (on the CPU)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import fe_kernels as k
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from ke_service import ServiceProcess
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


@pytest.fixture(scope="module")
def svc(kerneleval_service: ServiceProcess) -> ServiceProcess:
    return kerneleval_service


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


@pytest.fixture(scope="module")
def opstub(svc: ServiceProcess) -> Iterator[ops_grpc.OperationsServiceStub]:
    with svc.channel() as ch:
        yield ops_grpc.OperationsServiceStub(ch)


def evaluate(
    stub: kernel_eval_service_pb2_grpc.KernelEvalServiceStub, spec: kernel_pb2.JobSpec
) -> job_pb2.Job:
    return stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=180).job


def wait_terminal(stub, job_id: str, timeout: float = 120) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
        if job.state in TERMINAL or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def violations(err: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        fields += [v.field for v in bad.field_violations]
    return fields


# ---- standard parts ---------------------------------------------------------------------


def test_health_and_reflection(svc: ServiceProcess) -> None:
    with svc.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kerneleval.v1.KernelEvalService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        names = {
            s.name
            for r in refl.ServerReflectionInfo(reqs)
            for s in r.list_services_response.service
        }
        assert {"kerneleval.v1.KernelEvalService", "kerneleval.v1.OperationsService"} <= names
        reqs = iter(
            [reflection_pb2.ServerReflectionRequest(file_containing_symbol="kerneleval.v1.JobSpec")]
        )
        files = [
            r.file_descriptor_response.file_descriptor_proto
            for r in refl.ServerReflectionInfo(reqs)
        ]
        assert files and files[0]


def test_unix_socket_listener(svc: ServiceProcess) -> None:
    with grpc.insecure_channel(f"unix:{svc.unix_socket}") as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetJob(pb.GetJobRequest(job_id="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ---- evaluation RPCs --------------------------------------------------------------------


def test_evaluate_and_get(stub) -> None:  # type: ignore[no-untyped-def]
    job = evaluate(stub, k.spec(client_tag="eval"))
    assert job.state == job_pb2.JOB_STATE_DONE, job
    assert job.result.verdict == job_pb2.VERDICT_OK, job.result
    assert job.result.compiled and job.attempt_count == 1 and job.worker_id
    got = stub.GetJob(pb.GetJobRequest(job_id=job.job_id)).job
    assert got.result == job.result and got.spec.kernel.source_code == k.GOOD


def test_every_job_gets_a_fresh_job_process(stub) -> None:  # type: ignore[no-untyped-def]
    first, second = evaluate(stub, k.spec()), evaluate(stub, k.spec())
    assert first.result.verdict == second.result.verdict == job_pb2.VERDICT_OK
    assert first.worker_id != second.worker_id


def test_garbage_on_the_job_channel_ends_the_job(stub) -> None:  # type: ignore[no-untyped-def]
    # The job process's channel is its descriptor 3: a candidate that writes a frame header
    # of 4 GiB there breaks the protocol; the process is killed, the job ends with a verdict.
    source = k.GOOD.replace(
        "        return x * 2.0 + 1.0",
        "        import os\n        os.write(3, b'\\xff\\xff\\xff\\xff')\n"
        "        import time\n        time.sleep(60)\n        return x",
    )
    job = evaluate(stub, k.spec(source, timeout_s=30))
    assert job.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, job.result
    assert job.result.error.exception_type == "ProtocolViolation"
    assert "4294967295" in job.result.error.message
    assert job.attempt_count == 1
    assert evaluate(stub, k.spec()).result.verdict == job_pb2.VERDICT_OK


def test_device_index_is_honoured(stub) -> None:  # type: ignore[no-untyped-def]
    spec = k.spec()
    spec.options.device_index = 0
    job = evaluate(stub, spec)
    assert job.device_index == 0 and job.result.verdict == job_pb2.VERDICT_OK


def test_compare_needs_reference_and_runs(stub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        stub.Compare(pb.CompareRequest(spec=k.spec()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.reference" in violations(info.value)
    job = stub.Compare(pb.CompareRequest(spec=k.spec(reference=k.GOOD)), timeout=180).job
    assert job.state == job_pb2.JOB_STATE_DONE
    assert job.result.verdict == job_pb2.VERDICT_OK, job.result


def test_run_streams_numbered_events(stub) -> None:  # type: ignore[no-untyped-def]
    events = [r.event for r in stub.Run(pb.RunRequest(spec=k.spec()), timeout=180)]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    kinds = [e.WhichOneof("kind") for e in events]
    assert kinds[0] == "queued" and kinds[1] == "started" and kinds[-1] == "finished"
    assert "phase" in kinds
    phases = [e.phase.phase for e in events if e.HasField("phase")]
    assert job_pb2.PHASE_COMPILING in phases
    assert events[-1].finished.result.verdict == job_pb2.VERDICT_OK


def test_watch_resumes_after_dropped_stream(stub) -> None:  # type: ignore[no-untyped-def]
    job = stub.Submit(pb.SubmitRequest(spec=k.spec(perf_trials=20))).job
    assert job.state == job_pb2.JOB_STATE_QUEUED
    first = []
    call = stub.Watch(pb.WatchRequest(job_id=job.job_id))
    for resp in call:
        first.append(resp.event)
        if len(first) == 2:
            call.cancel()  # the connection "drops"
            break
    rest = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job.job_id, after_sequence=2))]
    seqs = [e.sequence for e in first + rest]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert rest[-1].HasField("finished")
    # A finished job replays in full.
    again = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job.job_id))]
    assert [e.sequence for e in again] == seqs
    assert [e.SerializeToString() for e in again] == [e.SerializeToString() for e in first + rest]
    # Re-attaching after the end: nothing more, and the stream ends.
    tail = stub.Watch(pb.WatchRequest(job_id=job.job_id, after_sequence=seqs[-1]), timeout=10)
    assert list(tail) == []


def test_list_jobs_pages_and_filters(stub) -> None:  # type: ignore[no-untyped-def]
    tag = f"list-{time.time_ns()}"
    ids = [stub.Submit(pb.SubmitRequest(spec=k.spec(client_tag=tag))).job.job_id for _ in range(5)]
    seen, token = [], ""
    while True:
        resp = stub.ListJobs(pb.ListJobsRequest(page_size=2, page_token=token, client_tag=tag))
        assert len(resp.jobs) <= 2
        seen += [j.job_id for j in resp.jobs]
        assert all(not j.HasField("spec") for j in resp.jobs)
        token = resp.next_page_token
        if not token:
            break
    assert seen == ids[::-1]  # newest first
    for job_id in ids:
        wait_terminal(stub, job_id)
    done = stub.ListJobs(
        pb.ListJobsRequest(client_tag=tag, state=job_pb2.JOB_STATE_DONE, include_spec=True)
    )
    assert {j.job_id for j in done.jobs} == set(ids)
    assert all(j.spec.kernel.source_code == k.GOOD for j in done.jobs)
    with pytest.raises(grpc.RpcError) as info:
        stub.ListJobs(pb.ListJobsRequest(page_token="garbage!"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_job_is_not_found(stub) -> None:  # type: ignore[no-untyped-def]
    for call in (
        lambda: stub.GetJob(pb.GetJobRequest(job_id="missing")),
        lambda: stub.CancelJob(pb.CancelJobRequest(job_id="missing")),
        lambda: list(stub.Watch(pb.WatchRequest(job_id="missing"))),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_input_of_every_kind(stub) -> None:  # type: ignore[no-untyped-def]
    cases: list[tuple[kernel_pb2.JobSpec, str]] = []
    cases.append((kernel_pb2.JobSpec(), "spec.kernel"))
    s = k.spec()
    s.kernel.type = kernel_pb2.KERNEL_TYPE_UNSPECIFIED
    cases.append((s, "spec.kernel.type"))
    s = k.spec()
    s.kernel.type = 99  # type: ignore[assignment]
    cases.append((s, "spec.kernel.type"))
    s = k.spec()
    s.kernel.source_code = ""
    cases.append((s, "spec.kernel.source_code"))
    s = k.spec()
    s.kernel.source_code = "x" * (2 << 20)
    cases.append((s, "spec.kernel.source_code"))
    s = k.spec(kind=kernel_pb2.KERNEL_TYPE_CUDA, source="__global__ void f(float* x) {}")
    arg = s.kernel.io.args.add(name="x", role=kernel_pb2.ARG_ROLE_OUTPUT)
    arg.tensor.shape.extend([4, -1])
    arg.tensor.dtype = dtype_pb2.DTYPE_FLOAT32
    cases.append((s, "spec.kernel.io.args[0].tensor.shape[1]"))
    s = k.spec(kind=kernel_pb2.KERNEL_TYPE_CUDA, source="__global__ void f(float* x) {}")
    arg = s.kernel.io.args.add(name="x", role=kernel_pb2.ARG_ROLE_OUTPUT)
    arg.tensor.shape.extend([4])
    cases.append((s, "spec.kernel.io.args[0].tensor.dtype"))
    s = k.spec()
    s.options.correct_trial_count = -1
    cases.append((s, "spec.options.correct_trial_count"))
    s = k.spec()
    s.options.timeout.seconds = 10**6
    cases.append((s, "spec.options.timeout"))
    s = k.spec()
    s.options.atol = float("nan")
    cases.append((s, "spec.options.atol"))
    s = k.spec()
    s.options.device_index = 7
    cases.append((s, "spec.options.device_index"))
    for spec, field in cases:
        for call in (
            lambda s: stub.Submit(pb.SubmitRequest(spec=s)),
            lambda s: stub.Evaluate(pb.EvaluateRequest(spec=s)),
            lambda s: list(stub.Run(pb.RunRequest(spec=s))),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(spec)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            fields = violations(info.value)
            assert any(f == field or f.startswith(field) for f in fields), (field, fields)


# ---- faults -----------------------------------------------------------------------------


def test_hanging_kernel_times_out_and_next_job_runs(stub) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    job = evaluate(stub, k.spec(k.HANG, timeout_s=3))
    assert job.result.verdict == job_pb2.VERDICT_TIMEOUT, job.result
    assert job.state == job_pb2.JOB_STATE_DONE
    assert job.result.fault.worker_restarted
    assert "timeout" in job.result.fault.description
    assert time.monotonic() - start < 30
    nxt = evaluate(stub, k.spec())
    assert nxt.result.verdict == job_pb2.VERDICT_OK
    assert nxt.worker_id != job.worker_id


def test_timed_out_job_hands_its_slot_to_a_warm_spare(stub, opstub, svc) -> None:  # type: ignore[no-untyped-def]
    # One job at a time on the GPU (--workers-per-device 1): the job queued behind a hung one
    # starts on a promoted spare as soon as the timeout fires, not when the hung process has
    # died, and the GPU never gets a second job-taking process for it.
    hang = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=3))).job
    deadline = time.monotonic() + 60
    while stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    nxt = evaluate(stub, k.spec())
    hung = stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job
    assert hung.result.verdict == job_pb2.VERDICT_TIMEOUT
    assert nxt.result.verdict == job_pb2.VERDICT_OK
    gap = nxt.start_time.ToNanoseconds() - hung.end_time.ToNanoseconds()
    assert -0.1e9 < gap < 1e9, gap / 1e9
    for _ in range(30):
        device = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices[0]
        slots = [w for w in device.workers if not w.spare and not w.standing_judge]
        assert len(slots) <= 1, device.workers
        time.sleep(0.1)


def test_crashing_kernel_is_crashed_and_next_job_runs(stub) -> None:  # type: ignore[no-untyped-def]
    job = evaluate(stub, k.spec(k.SEGFAULT))
    assert job.result.verdict == job_pb2.VERDICT_CRASHED, job.result
    assert job.result.fault.signal == 11
    assert job.attempt_count == 1  # a kernel's own crash is not retried
    start = time.monotonic()
    nxt = evaluate(stub, k.spec())
    assert nxt.result.verdict == job_pb2.VERDICT_OK
    assert nxt.worker_id != job.worker_id
    assert time.monotonic() - start < 20


def test_cancel_queued_and_running(stub) -> None:  # type: ignore[no-untyped-def]
    tag = f"cancel-{time.time_ns()}"
    hang = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=60, client_tag=tag))).job
    deadline = time.monotonic() + 60
    while stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    queued = stub.Submit(pb.SubmitRequest(spec=k.spec(client_tag=tag))).job
    got = stub.CancelJob(pb.CancelJobRequest(job_id=queued.job_id)).job
    assert got.state == job_pb2.JOB_STATE_CANCELLED and got.state_reason
    got = stub.CancelJob(pb.CancelJobRequest(job_id=hang.job_id), timeout=30).job
    assert got.state == job_pb2.JOB_STATE_CANCELLED
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=hang.job_id))]
    assert events[-1].finished.state == job_pb2.JOB_STATE_CANCELLED
    # Cancelling a finished job changes nothing.
    again = stub.CancelJob(pb.CancelJobRequest(job_id=hang.job_id)).job
    assert again.state == job_pb2.JOB_STATE_CANCELLED and again.end_time == got.end_time
    assert evaluate(stub, k.spec()).result.verdict == job_pb2.VERDICT_OK


def test_run_cancelled_by_client_cancels_job(stub) -> None:  # type: ignore[no-untyped-def]
    call = stub.Run(pb.RunRequest(spec=k.spec(k.HANG, timeout_s=60)))
    job_id = ""
    for resp in call:
        job_id = resp.event.job_id
        if resp.event.HasField("started"):
            call.cancel()
            break
    job = wait_terminal(stub, job_id, timeout=30)
    assert job.state == job_pb2.JOB_STATE_CANCELLED
    # keep_on_disconnect keeps it.
    call = stub.Run(pb.RunRequest(spec=k.spec(), keep_on_disconnect=True))
    first = next(iter(call))
    call.cancel()
    job = wait_terminal(stub, first.event.job_id)
    assert job.state == job_pb2.JOB_STATE_DONE and job.result.verdict == job_pb2.VERDICT_OK


def test_dropped_run_batch_cancels_its_jobs_but_those_kept(stub) -> None:  # type: ignore[no-untyped-def]
    hold = threading.Event()

    def requests() -> Iterator[pb.RunBatchRequest]:
        yield pb.RunBatchRequest(spec=k.spec(k.HANG, timeout_s=60), request_tag="dropped")
        yield pb.RunBatchRequest(spec=k.spec(), request_tag="kept", keep_on_disconnect=True)
        hold.wait(60)  # the stream stays open until the client drops it

    call = stub.RunBatch(requests(), timeout=120)
    ids: dict[str, str] = {}
    for resp in call:
        ids.setdefault(resp.request_tag, resp.event.job_id)
        if len(ids) == 2:
            break
    call.cancel()
    hold.set()
    dropped = wait_terminal(stub, ids["dropped"], timeout=60)
    assert dropped.state == job_pb2.JOB_STATE_CANCELLED
    kept = wait_terminal(stub, ids["kept"])
    assert kept.state == job_pb2.JOB_STATE_DONE and kept.result.verdict == job_pb2.VERDICT_OK
    # Followed again with Watch: the whole event log, through to the result.
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=ids["kept"]), timeout=30)]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert events[-1].finished.state == job_pb2.JOB_STATE_DONE


def test_run_batch_50_jobs(stub) -> None:  # type: ignore[no-untyped-def]
    def requests() -> Iterator[pb.RunBatchRequest]:
        for i in range(50):
            yield pb.RunBatchRequest(
                spec=k.spec(client_tag="batch", perf_trials=1), request_tag=f"r{i}"
            )
        yield pb.RunBatchRequest(spec=kernel_pb2.JobSpec(), request_tag="bad")

    finished: dict[str, job_pb2.Job] = {}
    errors: dict[str, pb.SubmissionError] = {}
    seqs: dict[str, list[int]] = {}
    tags: dict[str, str] = {}
    for resp in stub.RunBatch(requests(), timeout=240):
        if resp.HasField("error"):
            errors[resp.request_tag] = resp.error
            continue
        ev = resp.event
        assert ev.job_id
        assert tags.setdefault(ev.job_id, resp.request_tag) == resp.request_tag
        seqs.setdefault(ev.job_id, []).append(ev.sequence)
        if ev.HasField("finished"):
            finished[resp.request_tag] = ev.finished
    assert set(errors) == {"bad"}
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert any(v.field == "spec.kernel" for v in errors["bad"].field_violations)
    assert set(finished) == {f"r{i}" for i in range(50)}
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in finished.values())
    for s in seqs.values():
        assert s == list(range(1, len(s) + 1))


# ---- operations -------------------------------------------------------------------------


def test_operations_need_the_token(svc: ServiceProcess, opstub) -> None:  # type: ignore[no-untyped-def]
    for call in (
        lambda md: opstub.ListDevices(ops.ListDevicesRequest(), metadata=md),
        lambda md: opstub.GetStats(ops.GetStatsRequest(), metadata=md),
        lambda md: opstub.ResetGpu(ops.ResetGpuRequest(device_index=0), metadata=md),
        lambda md: opstub.Cleanup(ops.CleanupRequest(), metadata=md),
        lambda md: opstub.RestartWorkers(ops.RestartWorkersRequest(), metadata=md),
        lambda md: next(iter(opstub.WatchEvents(ops.WatchEventsRequest(), metadata=md))),
        lambda md: opstub.ListBuilders(ops.ListBuildersRequest(), metadata=md),
    ):
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", svc.admin_token)]):
            with pytest.raises(grpc.RpcError) as info:
                call(md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_list_devices_and_stats(svc: ServiceProcess, stub, opstub) -> None:  # type: ignore[no-untyped-def]
    evaluate(stub, k.spec())
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
    assert [d.index for d in devices] == [0]
    gpu = devices[0]
    assert gpu.name == "FakeGPU-H200" and gpu.uuid == "GPU-fake-0000"
    assert gpu.memory_total_bytes == 150000000000
    assert gpu.health == ops.DEVICE_HEALTH_HEALTHY
    # One job-taking process and three warm spares; the one that ran the job has exited (a
    # spare took its place), so none lists a completed job.
    deadline = time.monotonic() + 30
    while True:
        workers = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices[0]
        shape = (len([w for w in workers.workers if not w.spare]), len(workers.workers))
        if shape == (1, 4) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert shape == (1, 4), workers
    stats = opstub.GetStats(ops.GetStatsRequest(), metadata=svc.auth())
    assert stats.jobs_by_state["JOB_STATE_DONE"] >= 1
    assert stats.jobs_by_verdict["VERDICT_OK"] >= 1
    assert stats.run_latency.sample_count >= 1 and stats.uptime.seconds >= 0
    # A job process has run: the sandbox is known, and complete unless a feature is named.
    missing = [w.feature for w in stats.sandbox_warnings if w.sandbox_feature]
    assert stats.sandbox_state == (
        ops.SANDBOX_STATE_INCOMPLETE if missing else ops.SANDBOX_STATE_COMPLETE
    ), stats


def test_list_builders_on_sqlite_is_empty(svc: ServiceProcess, opstub) -> None:  # type: ignore[no-untyped-def]
    """The embedded store has no builders (they need a shared PostgreSQL store): an empty list,
    and this service's own versions, those of its job processes."""
    deadline = time.monotonic() + 30
    while True:
        resp = opstub.ListBuilders(ops.ListBuildersRequest(), metadata=svc.auth())
        if resp.versions:
            break
        assert time.monotonic() < deadline, "no job process reported its versions"
        time.sleep(0.1)
    assert list(resp.builders) == []
    (versions,) = resp.versions
    assert versions.startswith("torch ") and "|recipe " in versions


def test_xid_shows_in_watch_events_and_list_devices(svc: ServiceProcess, opstub) -> None:  # type: ignore[no-untyped-def]
    got: list[ops.OpsEvent] = []
    call = opstub.WatchEvents(ops.WatchEventsRequest(replay_count=5), metadata=svc.auth())

    def read() -> None:
        for resp in call:
            got.append(resp.event)
            if resp.event.HasField("xid") and resp.event.xid.xid == 79:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)
    with open(svc.fake_nvml, "a") as f:  # type: ignore[attr-defined]
        f.write("xid 0 79\n")
    reader.join(30)
    call.cancel()
    xids = [e for e in got if e.HasField("xid")]
    assert xids and xids[-1].xid.xid == 79 and xids[-1].device_index == 0, got
    seqs = [e.sequence for e in got]
    assert seqs == sorted(set(seqs))
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
    assert any(x.xid == 79 for x in devices[0].recent_xids)


def test_reset_gpu_with_token_runs_the_recording_command(svc: ServiceProcess, stub, opstub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        opstub.ResetGpu(ops.ResetGpuRequest(device_index=0))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    req = ops.ResetGpuRequest(device_index=0)
    req.grace_period.seconds = 5
    resp = opstub.ResetGpu(req, metadata=svc.auth(), timeout=120)
    steps = [s.step for s in resp.steps]
    assert "reset" in steps, resp
    assert resp.success, resp
    assert "reset 0" in svc.resets_log.read_text()  # type: ignore[attr-defined]
    svc.wait_serving(60)
    assert evaluate(stub, k.spec()).result.verdict == job_pb2.VERDICT_OK


def test_restart_workers_and_cleanup(svc: ServiceProcess, stub, opstub) -> None:  # type: ignore[no-untyped-def]
    # The last test's job process answered before it exited (the outcome goes out before the
    # cleanup): its replacement may not be up yet, and there must be one to restart.
    deadline = time.monotonic() + 60
    while not any(
        w.pid
        for d in opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
        for w in d.workers
    ):
        assert time.monotonic() < deadline, "no job process came up"
        time.sleep(0.05)
    resp = opstub.RestartWorkers(ops.RestartWorkersRequest(), metadata=svc.auth())
    assert resp.restarted_count >= 1
    svc.wait_serving(60)
    assert evaluate(stub, k.spec()).result.verdict == job_pb2.VERDICT_OK
    tag = f"cleanup-{time.time_ns()}"
    job = evaluate(stub, k.spec(client_tag=tag))
    req = ops.CleanupRequest()
    req.older_than.seconds = 3600
    assert opstub.Cleanup(req, metadata=svc.auth()).deleted_job_count == 0
    req.older_than.seconds = 0
    assert opstub.Cleanup(req, metadata=svc.auth()).deleted_job_count >= 1
    with pytest.raises(grpc.RpcError) as info:
        stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_endpoint(svc: ServiceProcess, stub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError):
        stub.GetJob(pb.GetJobRequest(job_id="missing-for-metrics"))
    url = f"http://127.0.0.1:{svc.metrics_port}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'grpc_server_handled_total{grpc_code="NOT_FOUND",grpc_method="GetJob"' in text
    assert "grpc_server_handling_seconds_bucket" in text
    assert "kerneleval_queue_depth" in text


def test_triton_oob_crashes_worker_and_next_job_runs(stub) -> None:  # type: ignore[no-untyped-def]
    job = evaluate(stub, k.spec(k.TRITON_OOB, kernel_pb2.KERNEL_TYPE_TRITON))
    assert job.result.verdict == job_pb2.VERDICT_CRASHED, job.result
    assert job.result.fault.signal in (11, 7), job.result.fault  # SIGSEGV or SIGBUS
    assert job.result.fault.worker_restarted
    start = time.monotonic()
    nxt = evaluate(stub, k.spec())
    assert nxt.result.verdict == job_pb2.VERDICT_OK, nxt.result
    assert time.monotonic() - start < 20
