"""GPU behaviours on the CPU: a fake engine acts out an illegal address (poisoned context,
XID from the fake NVML) and timed phases on a fake GPU with two job-taking processes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import fe_kernels as k
import pytest
from fe_service import ONE_GPU, fake_engine_service
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("gpu-fakes")
    service = fake_engine_service(
        root,
        "--workers-per-device", "2",
        "--xid-wait-s", "5",
        "--max-restarts", "1",
        # One attempt per job: a re-run alone (it ran out of memory beside others) is part of
        # it, so it still runs (the GPU run's case: a job whose node died, then crowded).
        "--max-attempts", "1",
        nvml=ONE_GPU + "clocks 0 sm=1410 mem=2619 temperature=45 power_mw=301500 reasons=0x5\n",
    )  # fmt: skip
    service.fake_nvml = root / "fake_nvml"  # type: ignore[attr-defined]
    service.root = root  # type: ignore[attr-defined]
    try:
        service.start()
        yield service
    finally:
        service.stop()


def command_spec(cmd: dict[str, object], problem: str = "") -> kernel_pb2.JobSpec:
    """The fake engine's command; `problem` names a reference (what GPU memory admission
    learns footprints by: jobs of one problem share one)."""
    return k.spec(json.dumps(cmd), reference=f"# {problem}\n" if problem else None)


def test_illegal_address_carries_the_xid_and_does_not_hold_up_the_next_job(
    svc: ServiceProcess,
) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    spec = command_spec({"do": "illegal_address"})
    fault = stub.Submit(pb.SubmitRequest(spec=spec)).job
    deadline = time.monotonic() + 30
    while stub.GetJob(pb.GetJobRequest(job_id=fault.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    start = time.monotonic()
    nxt = stub.Evaluate(
        pb.EvaluateRequest(spec=command_spec({"do": "time", "seconds": 0.05})), timeout=60
    ).job
    assert nxt.result.verdict == job_pb2.VERDICT_OK
    assert time.monotonic() - start < 3  # not held up by the wait for the XID
    # The driver's XID, late as NVML's are (the fault job waits up to --xid-wait-s for it).
    with open(svc.fake_nvml, "a") as f:  # type: ignore[attr-defined]
        f.write("xid 0 31\n")
    deadline = time.monotonic() + 30
    job = stub.GetJob(pb.GetJobRequest(job_id=fault.job_id)).job
    while job.state != job_pb2.JOB_STATE_DONE and time.monotonic() < deadline:
        time.sleep(0.05)
        job = stub.GetJob(pb.GetJobRequest(job_id=fault.job_id)).job
    assert job.result.verdict == job_pb2.VERDICT_DEVICE_FAULT
    assert job.result.error.cuda_error_code == 700
    assert job.result.fault.xid == 31, job.result.fault
    assert job.result.fault.worker_restarted
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
    assert any(x.xid == 31 for x in devices[0].recent_xids)
    stats = opstub.GetStats(ops.GetStatsRequest(), metadata=svc.auth())
    assert stats.xid_count >= 1 and stats.fault_count >= 1


def test_out_of_memory_beside_another_job_runs_again_alone(svc: ServiceProcess) -> None:
    """A job that runs out of GPU memory while another job held some of the GPU is run again,
    once, with the GPU to itself: no other job starts on it meanwhile, and its attempts for
    losses (--max-attempts 1 here) do not stop it. Alone, it is not."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    neighbour = stub.Submit(pb.SubmitRequest(spec=command_spec({"do": "time", "seconds": 1.5}))).job
    hungry = command_spec({"do": "oom", "seconds": 0.5}, problem="runs out of memory")
    oom = stub.Submit(pb.SubmitRequest(spec=hungry)).job
    time.sleep(0.3)  # both running: two job processes on the GPU
    later = stub.Submit(pb.SubmitRequest(spec=command_spec({"do": "time", "seconds": 0.2}))).job
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=oom.job_id), timeout=60)]
    done = stub.GetJob(pb.GetJobRequest(job_id=oom.job_id)).job
    assert done.attempt_count == 1, done  # the run alone is the same attempt
    assert done.result.verdict == job_pb2.VERDICT_OUT_OF_MEMORY or "nvmlInit" in (
        done.result.error.message
    )
    assert any("runs again with GPU 0 to itself" in e.log.text for e in events)
    started = [e for e in events if e.WhichOneof("kind") == "started"]
    assert len(started) == 2
    assert [e.started.attempt for e in started] == [1, 1]
    # The second run had the GPU alone: every other job used the GPU (from its check's grant to
    # the end of its timing) before it started, or after it ended.
    rerun = (started[1].time.ToNanoseconds() / 1e9, done.end_time.ToNanoseconds() / 1e9)
    for other_id in (neighbour.job_id, later.job_id):
        other = _wait_done(stub, other_id)
        assert other.result.verdict == job_pb2.VERDICT_OK
        spans = _spans(other)
        gpu_use = (spans["prepare"][1], spans["profile"][1])
        assert not _overlap(gpu_use, rerun), (other_id, gpu_use, rerun)
    alone = stub.Evaluate(
        pb.EvaluateRequest(spec=command_spec({"do": "oom"}, problem="runs out of memory")),
        timeout=60,
    ).job
    assert alone.attempt_count == 1  # nothing else ran: its own memory, its own result


def _spans(job: job_pb2.Job) -> dict[str, tuple[float, float]]:
    """The fake engine's "<phase> <start> <end>" notes."""
    return {p: (float(a), float(b)) for p, a, b in (n.split() for n in job.result.notes)}


def _overlap(x: tuple[float, float], y: tuple[float, float]) -> bool:
    return x[0] < y[1] - 0.02 and y[0] < x[1] - 0.02


def test_jobs_of_a_problem_that_fills_the_gpu_check_one_at_a_time(svc: ServiceProcess) -> None:
    """GPU memory admission (fleet/gpu_memory.py): once a problem's jobs were seen to hold
    600 kB of the fake GPU's 1 MB (0.85 of it may be held), two of its jobs never use the GPU
    at once; the second says what it waits for, as where 500 kB of those 600 were made
    outside torch's allocator (a judge's timed-call buffers). Jobs of a problem seen to hold
    100 kB still check together."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    tag = str(time.time_ns())

    def run_two(cmd: dict[str, object], problem: str) -> tuple[list[job_pb2.Job], list[str]]:
        learn = stub.Evaluate(
            pb.EvaluateRequest(spec=command_spec({**cmd, "seconds": 0.05}, problem)), timeout=60
        ).job
        assert learn.result.verdict == job_pb2.VERDICT_OK, learn.result
        _wait_idle_workers(svc, 2)
        spec = command_spec(cmd, problem)
        ids = [stub.Submit(pb.SubmitRequest(spec=spec)).job.job_id for _ in range(2)]
        logs = [
            r.event.log.text
            for i in ids
            for r in stub.Watch(pb.WatchRequest(job_id=i), timeout=60)
            if r.event.HasField("log")
        ]
        return [_wait_done(stub, i) for i in ids], logs

    cmd: dict[str, object] = {"do": "time", "seconds": 0.2, "check_seconds": 0.5}
    big, logs = run_two({**cmd, "peak": 600_000}, f"big {tag}")
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in big), [j.result for j in big]
    a, b = (_spans(j) for j in big)
    gpu_use = [(s["check"][0], s["profile"][1]) for s in (a, b)]
    assert not _overlap(*gpu_use), gpu_use
    assert any("waits for 0.6 MiB of GPU 0's memory" in t for t in logs), logs
    outside, logs = run_two({**cmd, "peak": 100_000, "outside": 500_000}, f"outside {tag}")
    a, b = (_spans(j) for j in outside)
    assert not _overlap((a["check"][0], a["profile"][1]), (b["check"][0], b["profile"][1]))
    assert any("waits for 0.6 MiB of GPU 0's memory" in t for t in logs), logs
    small, logs = run_two({**cmd, "peak": 100_000}, f"small {tag}")
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in small)
    a, b = (_spans(j) for j in small)
    assert _overlap(a["check"], b["check"]), (a, b)  # 2 x 100 kB fit: they check together
    assert not any("waits for" in t for t in logs), logs


def test_a_forged_peak_does_not_hold_back_the_next_tenants_jobs(svc: ServiceProcess) -> None:
    """Hostile: a job reports an absurd peak for a problem (its process could write any
    JobOutcome). What the problem needs is the median of its jobs' peaks, so the next
    tenant's two jobs of it still check together, and are correct."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    problem = f"forged {time.time_ns()}"
    for peak in (100_000, 100_000, 10**15):
        cmd = {"do": "time", "seconds": 0.05, "peak": peak}
        job = stub.Evaluate(pb.EvaluateRequest(spec=command_spec(cmd, problem)), timeout=60).job
        assert job.result.verdict == job_pb2.VERDICT_OK
    _wait_idle_workers(svc, 2)
    spec = command_spec({"do": "time", "seconds": 0.2, "check_seconds": 0.5}, problem)
    ids = [stub.Submit(pb.SubmitRequest(spec=spec)).job.job_id for _ in range(2)]
    a, b = (_wait_done(stub, i) for i in ids)
    assert a.result.verdict == b.result.verdict == job_pb2.VERDICT_OK
    assert _overlap(_spans(a)["check"], _spans(b)["check"]), (_spans(a), _spans(b))


def _wait_idle_workers(svc: ServiceProcess, count: int) -> None:
    """Until `count` job-taking processes of GPU 0 are up and hold no job."""
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
        idle = [
            w for d in devices if d.index == 0 for w in d.workers
            if w.pid and not w.spare and not w.job_id
        ]  # fmt: skip
        if len(idle) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("job processes did not come up")


def _wait_done(stub, job_id: str) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 60
    while True:
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
        if job.state == job_pb2.JOB_STATE_DONE or time.monotonic() > deadline:
            return job
        time.sleep(0.05)


def test_one_timing_phase_at_a_time_per_device(svc: ServiceProcess) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    spec = command_spec({"do": "time", "seconds": 0.6})
    with ThreadPoolExecutor(4) as pool:
        jobs = list(
            pool.map(
                lambda _: stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=60).job, range(4)
            )
        )
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in jobs)
    rows = [note.split() for j in jobs for note in j.result.notes if note.startswith("pr")]
    profile = sorted((float(a), float(b)) for p, a, b in rows if p == "profile")
    prepare = sorted((float(a), float(b)) for p, a, b in rows if p == "prepare")
    assert len(profile) == 4 and len(prepare) == 4
    for (_, end), (start, _) in zip(profile, profile[1:], strict=False):
        assert start >= end - 0.01, profile  # never two timings at once on one device
    # (The other job process is frozen while one times: see the spinner test below.)
    assert len({j.worker_id for j in jobs}) == 4  # one job process a job


def test_checks_share_the_gpu_and_never_run_during_a_timing_window(svc: ServiceProcess) -> None:
    """The GPU gate: two job processes on the device check at the same time, but no check runs
    while another job times."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    spec = command_spec({"do": "time", "seconds": 0.3, "check_seconds": 0.3})
    with ThreadPoolExecutor(4) as pool:
        jobs = list(
            pool.map(
                lambda _: stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=60).job, range(4)
            )
        )
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in jobs), [j.result for j in jobs]
    spans = {
        phase: sorted((float(a), float(b)) for p, a, b in rows if p == phase)
        for rows in [[n.split() for j in jobs for n in j.result.notes if n[:1] in "pc"]]
        for phase in ("check", "profile")
    }
    assert len(spans["check"]) == len(spans["profile"]) == 4

    def overlap(x: tuple[float, float], y: tuple[float, float]) -> bool:
        return x[0] < y[1] - 0.02 and y[0] < x[1] - 0.02

    assert not [(c, p) for c in spans["check"] for p in spans["profile"] if overlap(c, p)]
    checks = spans["check"]
    assert any(overlap(a, b) for i, a in enumerate(checks) for b in checks[i + 1 :]), checks
    # Each result says how its window was given: alone on the GPU, after how long a wait (the
    # four windows of 0.3 s came one after another, so some waited).
    windows = [j.result.timing_window for j in jobs]
    assert all(w.exclusive for w in windows), windows
    assert max(w.waited.ToNanoseconds() for w in windows) > 0.1e9, windows
    # The windows' time is counted per device, grant to release (at least the four timings).
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    (occupancy,) = opstub.GetStats(ops.GetStatsRequest(), metadata=svc.auth()).device_occupancy
    held = occupancy.timing_window.ToNanoseconds() / 1e9
    assert occupancy.device_index == 0 and occupancy.timing_window_count >= 4
    assert held >= sum(b - a for a, b in spans["profile"]) - 0.05, (held, spans["profile"])


def test_a_timing_window_freezes_the_other_job_process_and_its_timeout_stands_still(
    svc: ServiceProcess,
) -> None:
    """A neighbour that burns CPU in a phase that asks for no GPU (as a candidate's background
    thread would launch kernels) is frozen while another job times: it makes no progress during
    the window, resumes after, and its 2.5 s timeout does not count the frozen time (1.2 s of
    work + a 1.6 s window)."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    timed = command_spec({"do": "time", "seconds": 1.6})
    spinner = command_spec({"do": "spin", "cpu_seconds": 1.2})
    spinner.options.timeout.FromNanoseconds(2_500_000_000)
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(lambda: stub.Evaluate(pb.EvaluateRequest(spec=timed), timeout=60).job)
        time.sleep(1.0)  # the spinner still spins when the window opens (after a 1.6 s prepare)
        b = pool.submit(lambda: stub.Evaluate(pb.EvaluateRequest(spec=spinner), timeout=60).job)
        timed_job, spin_job = a.result(), b.result()
    assert timed_job.result.verdict == job_pb2.VERDICT_OK, timed_job.result
    assert spin_job.result.verdict == job_pb2.VERDICT_OK, spin_job.result  # no TIMEOUT
    assert spin_job.worker_id != timed_job.worker_id

    def span(job: job_pb2.Job, phase: str) -> tuple[float, float]:
        (row,) = [n.split() for n in job.result.notes if n.startswith(phase + " ")]
        return float(row[1]), float(row[2])

    window = span(timed_job, "profile")
    stall = span(spin_job, "stall")
    # The spinner stood still for the whole window (give or take the freeze's round trips).
    assert stall[0] <= window[0] + 0.1 and stall[1] >= window[1] - 0.1, (stall, window)
    w = timed_job.result.timing_window
    assert w.exclusive and w.others_frozen and w.drained, w
    for conditions in (w.at_start, w.at_end):  # the fake NVML's clocks line
        assert conditions.known and conditions.sm_clock_mhz == 1410, conditions
        assert conditions.memory_clock_mhz == 2619 and conditions.temperature_celsius == 45
        assert conditions.power_watts == pytest.approx(301.5)
        assert list(conditions.throttle_reasons) == ["gpu_idle", "sw_power_cap"]


def test_a_window_ends_when_its_holder_dies_and_a_frozen_job_can_be_cancelled(
    svc: ServiceProcess,
) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    spinner = command_spec({"do": "spin", "cpu_seconds": 1.0})
    spinner.options.timeout.FromSeconds(4)

    def frozen_for(holder: kernel_pb2.JobSpec) -> tuple[job_pb2.Job, str]:
        """Starts the holder, then a spinner once the holder's window is open."""
        held = stub.Submit(pb.SubmitRequest(spec=holder)).job
        deadline = time.monotonic() + 30
        while stub.GetJob(pb.GetJobRequest(job_id=held.job_id)).job.state != (
            job_pb2.JOB_STATE_RUNNING
        ):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.2)  # its 1 s "compile" and into its window
        return held, stub.Submit(pb.SubmitRequest(spec=spinner)).job.job_id

    def wait_done(job_id: str) -> job_pb2.Job:
        deadline = time.monotonic() + 30
        while True:
            job = stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
            if job.state not in (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING):
                return job
            assert time.monotonic() < deadline, job
            time.sleep(0.05)

    # The holder dies in its window: the window ends, the frozen spinner thaws and finishes.
    crasher, spin_id = frozen_for(
        command_spec({"do": "time", "seconds": 1.0, "crash_in_window": True})
    )
    done = wait_done(crasher.job_id)
    assert done.result.verdict == job_pb2.VERDICT_CRASHED, done.result
    spun = wait_done(spin_id)
    assert spun.result.verdict == job_pb2.VERDICT_OK, spun.result
    # A job cancelled while frozen ends at once, and the window's holder is unaffected.
    holder, spin_id = frozen_for(command_spec({"do": "time", "seconds": 1.0}))
    time.sleep(0.2)
    start = time.monotonic()
    cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=spin_id), timeout=30).job
    assert cancelled.state == job_pb2.JOB_STATE_CANCELLED and time.monotonic() - start < 3
    timed = wait_done(holder.job_id)
    assert timed.result.verdict == job_pb2.VERDICT_OK and timed.result.timing_window.others_frozen


def test_a_frozen_job_whose_queued_gpu_work_runs_into_a_window_is_stopped(
    svc: ServiceProcess,
) -> None:
    """The window's holder finds the GPU busy although the others are frozen (their queued
    work); NVML (here the fake's utilization line) names the frozen process whose work it is:
    that job is killed with a verdict saying why, and the holder's job is unaffected."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    svc.wait_serving()
    holder = stub.Submit(
        pb.SubmitRequest(spec=command_spec({"do": "time", "seconds": 0.5, "busy_for": 4.0}))
    ).job

    def running(job_id: str) -> job_pb2.Job:
        deadline = time.monotonic() + 30
        while True:
            job = stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
            if job.state != job_pb2.JOB_STATE_QUEUED:
                return job
            assert time.monotonic() < deadline
            time.sleep(0.02)

    running(holder.job_id)
    time.sleep(0.8)  # through its 0.5 s "compile", into its window
    spinner = command_spec({"do": "spin", "cpu_seconds": 5.0})
    spin = running(stub.Submit(pb.SubmitRequest(spec=spinner)).job.job_id)
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
    (pid,) = [w.pid for d in devices for w in d.workers if w.worker_id == spin.worker_id]
    time.sleep(0.3)  # the watchdog counts NVML samples from 250 ms after a process's freeze
    with open(svc.fake_nvml, "a") as f:  # type: ignore[attr-defined]
        f.write(f"utilization 0 {pid} sm=80\n")
    deadline = time.monotonic() + 30
    while (job := stub.GetJob(pb.GetJobRequest(job_id=spin.job_id)).job).state in (
        job_pb2.JOB_STATE_QUEUED,
        job_pb2.JOB_STATE_RUNNING,
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, job.result
    assert "frozen for another job's timing window" in job.result.fault.description
    assert job.result.error.exception_type == "GpuWorkOutsidePhase"
    held = stub.Evaluate(pb.EvaluateRequest(spec=command_spec({"do": "time", "seconds": 0.1})))
    assert held.job.result.verdict == job_pb2.VERDICT_OK
    deadline = time.monotonic() + 30
    while (job := stub.GetJob(pb.GetJobRequest(job_id=holder.job_id)).job).state != (
        job_pb2.JOB_STATE_DONE
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job.result.verdict == job_pb2.VERDICT_OK and job.result.timing_window.others_frozen
    # The holder's own events said why its window waited.
    logs = [r.event.log.text for r in stub.Watch(pb.WatchRequest(job_id=holder.job_id))]
    assert any("waits for GPU work that other jobs queued" in t for t in logs), logs


def test_crashing_kernels_do_not_take_the_device_out_of_service(svc: ServiceProcess) -> None:
    # --max-restarts 1: the watchdog gives up on a device after two worker failures. Workers
    # that die running a job were killed by its kernel, which is no failure of the device.
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    svc.wait_serving()
    for _ in range(3):
        job = stub.Evaluate(
            pb.EvaluateRequest(spec=command_spec({"do": "segfault"})), timeout=90
        ).job
        assert job.result.verdict == job_pb2.VERDICT_CRASHED, job.result
    spec = command_spec({"do": "time", "seconds": 0.01})
    job = stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=90).job
    assert job.result.verdict == job_pb2.VERDICT_OK
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    (device,) = opstub.ListDevices(
        ops.ListDevicesRequest(), metadata=svc.auth(), timeout=10
    ).devices
    assert device.health == ops.DEVICE_HEALTH_HEALTHY, device.health_reason


def test_compile_cache_reaches_only_jobs_with_the_same_code(svc: ServiceProcess) -> None:
    """What a job compiled comes back to the front end and is written into the private cache
    of a later job with exactly the same code, in another job process; never into another's."""
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())

    def held(name: str) -> tuple[list[str], str]:
        job = stub.Evaluate(
            pb.EvaluateRequest(spec=command_spec({"do": "compile", "name": name})), timeout=60
        ).job
        assert job.result.verdict == job_pb2.VERDICT_OK, job.result
        assert not job.result.HasField("timing_window")  # not timed: the job's claim is dropped
        (note,) = [n for n in job.result.notes if n.startswith("cache held ")]
        return json.loads(note.removeprefix("cache held ")), job.worker_id

    first, w1 = held("alpha")
    assert first == []
    second, w2 = held("alpha")
    assert second == ["abc/alpha.cubin"] and w2 != w1
    other, _ = held("beta")
    assert other == []  # other code: nothing of alpha's
    third, _ = held("alpha")
    assert third == ["abc/alpha.cubin"]  # beta's file went to beta's entry only


def test_runtime_flags_are_kept_only_as_runtime_flags_of_known_rules(svc: ServiceProcess) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    job = stub.Evaluate(pb.EvaluateRequest(spec=command_spec({"do": "flags"})), timeout=60).job
    assert job.result.verdict == job_pb2.VERDICT_OK
    assert [(f.rule_id, f.source) for f in job.result.flags] == [
        ("output_aliases_input", job_pb2.FLAG_SOURCE_RUNTIME)
    ]
    assert len(job.result.flags[0].message) == 500  # cut
    spec = command_spec({"do": "flags"})
    spec.options.reject_flagged = True
    rejected = stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=60).job
    assert rejected.result.verdict == job_pb2.VERDICT_REJECTED and not rejected.result.correctness
    assert "runtime checks flagged ['output_aliases_input']" in rejected.state_reason
