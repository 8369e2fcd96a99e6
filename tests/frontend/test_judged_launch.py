"""A kernel built ahead compared with a reference that has host code (prebuild.py:
reference_judged), with the fake engine whose job processes judge: a launch process runs the
kernel alone and records its outputs, and the reference runs only in the job's judge, a
process the kernel never ran in that stays for later jobs of the same reference. The launch
process takes job after job, and a job its judge finds wrong does not change that."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fe_service import fake_engine_service
from ke_service import ServiceProcess
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval_server.jobs.builds import prebuild

REFERENCE = "class Model: the eager reference (host code)"


def _judging_service(root: Path, workers_per_device: int, *flags: str) -> Iterator[object]:
    """The judging fake engine's service with --judge-launches (and `flags`), and a stub."""
    service: ServiceProcess = fake_engine_service(
        root, "--workers-per-device", str(workers_per_device), "--build-processes", "1",
        "--build-pch", "false", "--judge-launches", "true", *flags,
        engine="fe_fake_engine_judges",
    )  # fmt: skip
    try:
        service.start()
        with service.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            stub.service = service  # type: ignore[attr-defined]  # its log: timing windows
            yield stub
    finally:
        service.stop()


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    yield from _judging_service(tmp_path_factory.mktemp("judged-launch"), 2)


def launch_spec(**cmd: object) -> kernel_pb2.JobSpec:
    """A raw CUDA kernel from its IOContract (distinct code each time) against a TORCH
    reference, the same each time."""
    spec = kernel_pb2.JobSpec(client_tag="judged-launch")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.kernel.source_code = json.dumps({"do": "build", **cmd, "code": uuid.uuid4().hex})
    out = spec.kernel.io.args.add(name="out", role=kernel_pb2.ARG_ROLE_OUTPUT)
    out.tensor.shape.append(4)
    out.tensor.dtype = dtype_pb2.DTYPE_FLOAT32
    spec.kernel.io.args.add(name="n", int_value=4)
    spec.kernel.io.launch.grid.x = spec.kernel.io.launch.block.x = 1
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = REFERENCE
    spec.options.timeout.seconds = 60
    return spec


def evaluate(stub, spec: kernel_pb2.JobSpec) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:  # type: ignore[no-untyped-def]
    job = stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=120).job
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job.job_id), timeout=30)]
    return job, events


def note(job: job_pb2.Job, start: str) -> str:
    return next((n for n in job.result.notes if n.startswith(start)), "")


def test_the_kernel_is_launched_alone_and_its_reference_runs_in_the_judge(stub) -> None:  # type: ignore[no-untyped-def]
    jobs = [evaluate(stub, launch_spec()) for _ in range(3)]
    launchers, judges = set(), set()
    for job, events in jobs:
        assert job.result.verdict == job_pb2.VERDICT_OK, job
        launched = note(job, "launched ")
        assert launched.startswith("launched kernel_fn by "), job.result.notes
        launchers.add(launched.split()[3])
        judged = note(job, "judged by ")
        # The launch process had the kernel's artifact only, and recorded for the judge.
        assert "prebuilt ['kernel'], reference judged elsewhere: True" in judged, judged
        judges.add(judged.split()[2])
        logs = [e.log.text for e in events if e.WhichOneof("kind") == "log"]
        assert any("a process its code never ran in" in t for t in logs), logs
    assert len(launchers) == 1, "one launch process takes job after job"
    assert len(judges) == 1 and not judges & launchers, "a standing judge, never the launcher"
    assert [note(j, "launched ").split()[-1] for j, _ in jobs] == ["1", "2", "3"]
    # --judge-ahead: once a judge of the reference stands, it starts with the next kernels.
    assert [", ahead)" in note(j, "judged by ") for j, _ in jobs] == [False, True, True]


def test_a_launch_its_judge_finds_wrong_is_incorrect_and_the_next_is_ok(stub) -> None:  # type: ignore[no-untyped-def]
    wrong, _ = evaluate(stub, launch_spec(judged_wrong=True))
    assert wrong.result.verdict == job_pb2.VERDICT_INCORRECT, wrong
    assert note(wrong, "judged by "), wrong.result.notes
    nxt, _ = evaluate(stub, launch_spec())
    assert nxt.result.verdict == job_pb2.VERDICT_OK, nxt
    assert note(nxt, "launched ") and note(nxt, "judged by ")


def test_a_kernel_with_host_code_runs_whole_and_is_judged(stub) -> None:  # type: ignore[no-untyped-def]
    spec = launch_spec()
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH  # a ModelNew: host code
    spec.kernel.source_code = json.dumps({"do": "time", "seconds": 0})
    spec.kernel.io.Clear()
    job, _ = evaluate(stub, spec)
    assert job.result.verdict == job_pb2.VERDICT_OK, job
    assert not note(job, "launched ")
    assert "prebuilt [], reference judged elsewhere: False" in note(job, "judged by ")


def test_which_jobs_are_launched_alone_and_judged() -> None:
    """prebuild.kind: a reference with host code keeps a job from being built ahead unless
    the node judges; judged_launch_fits: what its judge reads must fit the record or shares."""
    spec = launch_spec()
    assert prebuild.reference_judged(spec)
    assert prebuild.kind(spec) == "" and prebuild.kind(spec, judged=True) == "cuda"
    bare = kernel_pb2.JobSpec()
    bare.kernel.CopyFrom(spec.kernel)
    assert not prebuild.reference_judged(bare) and prebuild.kind(bare) == "cuda"
    debug = launch_spec()
    debug.options.sanitize = True  # a debug aid re-runs the job's source: never built ahead
    assert prebuild.kind(debug, judged=True) == ""
    modelnew = launch_spec()
    modelnew.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    assert prebuild.kind(modelnew, judged=True) == ""
    # Built, the reference is not among the artifacts wanted.
    kernel_only = [job_channel_pb2.KernelArtifact(role="kernel", cubin=b"\x7fELF", function="f")]
    assert prebuild.check_artifacts(spec, kernel_only) == ""
    assert "wanted ['kernel']" in prebuild.check_artifacts(spec, kernel_only * 2)

    mib = 1 << 20
    big = launch_spec()
    big.kernel.io.args[0].tensor.shape[:] = [64 * mib]  # 256 MiB of float32 a trial
    big.options.correct_trial_count = 3  # with the replayed timed trial, 4 are recorded
    assert prebuild.judged_launch_fits(big, 1100 * mib, 0)
    assert not prebuild.judged_launch_fits(big, 1000 * mib, 0)
    assert prebuild.judged_launch_fits(big, 1000 * mib, 1024 * mib)  # by descriptor
    assert not prebuild.judged_launch_fits(big, 1000 * mib, 1000 * mib)
    assert not prebuild.judged_launch_fits(big, 2 * mib, 2048 * mib)  # the headers must fit


def test_judges_and_launches_taking_processes_in_one_dispatch_lose_no_job(stub) -> None:  # type: ignore[no-untyped-def]
    """Judged jobs (whole, and launched alone) and jobs built ahead whole, in one batch: a
    judge started in a dispatch took the fresh process that the same dispatch then gave a
    built job, assign refused, and that job, already off the launch queue, never ran (4 to
    7 of 150 in the issue's io mix on an H100). Every job ends, each as it should."""
    specs = []
    for i in range(36):
        spec = launch_spec()  # a judged launch
        if i % 3 == 1:  # run whole (host code), then judged
            spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
            spec.kernel.source_code = json.dumps({"do": "time", "seconds": 0, "n": i})
            spec.kernel.io.Clear()
        elif i % 3 == 2:  # built ahead whole: its reference raw CUDA too
            spec.reference.CopyFrom(spec.kernel)
        specs.append(spec)
    requests = [pb.RunBatchRequest(spec=s, request_tag=str(i)) for i, s in enumerate(specs)]
    finished: dict[str, job_pb2.Job] = {}
    for r in stub.RunBatch(iter(requests), timeout=60):
        assert not r.HasField("error"), r.error
        if r.event.WhichOneof("kind") == "finished":
            finished[r.request_tag] = r.event.finished
    assert len(finished) == len(specs), sorted(set(map(str, range(36))) - set(finished))
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in finished.values())
    judged = [t for t, j in finished.items() if note(j, "judged by ")]
    assert sorted(judged, key=int) == [str(i) for i in range(36) if i % 3 != 2]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One job process a GPU (the default --workers-per-device)."""
    yield from _judging_service(tmp_path_factory.mktemp("judged-launch-one-slot"), 1)


def test_with_one_slot_a_launch_process_leaves_it_for_the_judge(one_slot) -> None:  # type: ignore[no-untyped-def]
    """The launch process stays, job after job, in the GPU's only slot, and a judge needs a
    fresh process there: the first launched job waited for ever (seen on an H100 with
    bench_overhead, which runs the default of one). An idle launch process now leaves, and
    the spare that takes its slot judges; each job ends in seconds."""
    spec = launch_spec()
    spec.options.perf_trial_count = 0
    for _ in range(3):
        job = one_slot.Evaluate(pb.EvaluateRequest(spec=spec), timeout=20).job
        assert job.result.verdict == job_pb2.VERDICT_OK, job
        assert note(job, "launched ") and note(job, "judged by "), job.result.notes
    # A new reference at once: its judge needs the slot again within the second.
    for i in range(2):
        spec.reference.source_code = f"{REFERENCE} {i}"
        job = one_slot.Evaluate(pb.EvaluateRequest(spec=spec), timeout=20).job
        assert job.result.verdict == job_pb2.VERDICT_OK, job


def test_the_front_ends_copies_of_the_engines_sizes_match_it() -> None:
    """prebuild.py sizes what a judge reads without importing the engine (torch): its copies
    of the record's and the shares' sizes and of the default correctness trials are the
    engine's own."""
    from kerneleval_server.engine import device_share, options, record

    assert prebuild.RECORD_HEADER == record.MAX_HEADER and prebuild.RECORD_ALIGN == record.ALIGN
    assert prebuild.SHARE_GRANULARITY == device_share.GRANULARITY
    assert prebuild.MAX_SHARES == device_share.MAX_SHARES
    assert prebuild.DEFAULT_CORRECT_TRIALS == options.DEFAULT_CORRECT_TRIALS


def profiled(events: list[job_pb2.JobEvent]) -> int:
    """Timing phases the job's processes entered (the kernel's, and its judge's if it timed
    the reference)."""
    return sum(e.phase.phase == job_pb2.PHASE_PROFILING for e in events if e.HasField("phase"))


def test_a_reference_timed_by_one_judge_is_given_to_the_next_jobs(stub) -> None:  # type: ignore[no-untyped-def]
    """The reference is the same for every candidate of a problem: its time, measured by
    the first job's judge, is the next jobs' (no timing window of their judges' own), while
    a job with other inputs or timing settings, or with bypass_cache, times it again."""

    def spec_with(**options: object) -> kernel_pb2.JobSpec:
        spec = launch_spec()
        spec.reference.source_code = f"{REFERENCE}, timed once"
        for name, value in options.items():
            setattr(spec.options, name, value)
        return spec

    def windows() -> int:
        log = stub.service.log_path.read_text(errors="replace")
        return log.count('"timing window opened"')

    before = windows()
    first, events = evaluate(stub, spec_with())
    assert first.result.verdict == job_pb2.VERDICT_OK, first
    measured = first.result.reference_runtime.median_ms
    assert measured > 0 and profiled(events) == 2, (first.result, events)
    assert not note(first, "reference time given")
    assert not first.result.HasField("reference_runtime_age")
    # The launch's check and timing in one window, the judge's timing in another.
    assert windows() - before == 2

    before = windows()
    later, events = evaluate(stub, spec_with())
    assert later.result.verdict == job_pb2.VERDICT_OK, later
    assert later.result.reference_runtime.median_ms == measured
    assert note(later, "reference time given"), later.result.notes
    assert 0 < later.result.reference_runtime_age.ToNanoseconds() < 60e9, later.result
    assert profiled(events) == 1, "only the kernel's process was timed"
    # The judge's check shares the GPU: no window of its own for a few milliseconds' work.
    assert windows() - before == 1
    logs = [e.log.text for e in events if e.HasField("log")]
    assert any("its time an earlier job's" in t for t in logs), logs

    for other in (spec_with(seed=7), spec_with(warmup_count=2), spec_with(bypass_cache=True)):
        job, events = evaluate(stub, other)
        assert job.result.verdict == job_pb2.VERDICT_OK, job
        assert not note(job, "reference time given") and profiled(events) == 2, job.result
        assert job.result.reference_runtime.median_ms not in (0, measured)
        assert not job.result.HasField("reference_runtime_age")


@pytest.mark.parametrize("ahead", [True, False], ids=["judge-ahead", "judge-after"])
def test_a_judges_measure_of_its_own_path_is_the_next_judges(
    stub: object, tmp_path: Path, ahead: bool
) -> None:
    """Issue 44: what a judge measured of its own path (JobOutcome.path_measures) the front
    end keeps per GPU and reference, and gives to the reference's next judges
    (JudgeRequest.path_measures: a judge started ahead gets them with its job, one started
    after the kernel with its request), which then take none of their own. Hostile: a
    kernel's process that puts a measure in its outcome is not believed (the next judge is
    given the judge's one only)."""
    service = None if ahead else _judging_service(tmp_path, 2, "--judge-ahead", "false")
    try:
        on = stub if service is None else next(service)
        spec = launch_spec(forged_paths=True)
        spec.reference.source_code = f"{REFERENCE}, its path measured once"
        first, _ = evaluate(on, spec)
        assert first.result.verdict == job_pb2.VERDICT_OK, first
        assert note(first, "path measures given: 0"), first.result.notes
        spec.kernel.source_code = json.dumps({"do": "build", "code": uuid.uuid4().hex})
        later, _ = evaluate(on, spec)
        assert later.result.verdict == job_pb2.VERDICT_OK, later
        assert note(later, "path measures given: 1"), later.result.notes
        assert (", ahead)" in note(later, "judged by")) == ahead, later.result.notes
    finally:
        if service is not None:
            service.close()
