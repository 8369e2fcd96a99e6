"""The job process's runtime: jobs through the engine, over the channel on descriptor 3.

`main(channel_fd)` is the default KERNELEVAL_JOB_MAIN. It runs after the zygote's child has
sandboxed the process (docs/INTERNALS.md, "Processes"; docs/TRUST.md, "The sandbox"):

    Hello (device info, pid) -> AssignJob -> phases / progress / logs -> JobOutcome -> exit
    a build process:            AssignJob(build_only) -> BuildOutcome -> exit
    a launch process:           AssignJob(prebuilt) -> ... -> JobOutcome(reusable) -> AssignJob ...
    a judge:                    AssignJob(judge) -> ... -> JobOutcome(reusable) -> AssignJob ...

A job whose code runs on the host (a Model, a Triton module's top level, an extension) is the
process's only one. A job whose every kernel came prebuilt from a build process runs none of
its code here, so the process may take another such job once it has cleaned up (`reusable`).
A judge ran only a job's reference: it may judge another job once it has cleaned up, and the
front end gives it only jobs with that same reference (jobs/judging.py, a standing judge).
It never waits for a Welcome (one is ignored), reads the next AssignJob only once the job before
is over and the process clean, waits for a grant after sending PHASE_VALIDATING or
PHASE_PROFILING, and returns POISONED_EXIT when the
engine says the CUDA context is poisoned, 0 otherwise. If the channel closes before a job, or
while one runs, the front end is gone: it exits 0.

`load_engine()` and `warm_up()` are the steps before that (startup.py): the zygote calls
`load_engine()` once, and each job process calls `warm_up()` before its privileges drop. This
module holds the job loop; what it uses lives beside it: the channel to the front end and the
engine's Reporter on it (channel.py), a job's folders and compile cache (job_dirs.py), the
cleanup of the GPU's memory between jobs and a job's peak (hygiene.py).

Standalone (tests, debugging): python -m kerneleval_server.jobproc.runtime [FD]
"""

import functools
import gc
import importlib
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2

from . import (
    DEFAULT_ENGINE,
    ENGINE_ENV,
    MAX_JOBS_PER_LAUNCH_PROCESS,
    OK_EXIT,
    PCH_DIR_ENV,
    POISONED_EXIT,
    WORKER_ID_ENV,
)
from .channel import _Channel, _Reporter
from .hygiene import _clean_for_next_job, _peak_memory, _reset_peak_memory
from .job_dirs import _job_dirs, compile_cache_added, make_job_dirs

# warm_up is also looked up here, as the job main module's (zygote.resolve_job_main).
from .startup import device_info, load_engine, warm_up

MAX_LIBRARY_BYTES = 12 << 20  # a built extension travels in one frame (framing.MAX_FRAME)
MAX_BUILD_LOG = 64 << 10


def _engine_error(exc: Exception) -> job_pb2.EvalResult:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.error.message = f"engine error: {exc}"
    result.error.exception_type = type(exc).__name__
    result.error.traceback = traceback.format_exc()[-8000:]
    return result


def _build_one(engine: ModuleType, channel: _Channel, assign: job_channel_pb2.AssignJob) -> None:
    """A build job: compile the spec's kernels for assign.build_arch, or the load_inline call
    in assign.extension; send BuildOutcome."""
    reporter = _Reporter(channel, assign.job_id)
    job_dir, cache_dir, _ = _job_dirs(assign)
    channel.job_running = True
    try:
        if assign.HasField("extension"):
            built = job_channel_pb2.BuildOutcome(
                extension=_build_extension(assign, job_dir, reporter)
            )
        else:
            # Sources the front end has built already (a raw CUDA reference): not built again.
            given = {"prebuilt": list(assign.prebuilt)} if assign.prebuilt else {}
            built = engine.build_job(
                assign.spec, reporter, engine.EngineConfig(work_dir=job_dir), assign.build_arch,
                **given,
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the engine should not raise; report, not die
        built = job_channel_pb2.BuildOutcome(result=_engine_error(exc))
    built.job_id = assign.job_id
    channel.finishing = True
    channel.send(job_channel_pb2.JobProcessMessage(build=built))


def _build_extension(
    assign: job_channel_pb2.AssignJob, job_dir: Path, reporter: "_Reporter"
) -> job_channel_pb2.ExtensionBuilt:
    """A load_inline call the service sent (fast_build/extension.py), with the service's
    precompiled headers (read-only here) when it made them."""
    from kerneleval_server.fast_build import extension

    pch = os.environ.get(PCH_DIR_ENV, "")
    started = time.monotonic()
    built = extension.build_answer(
        assign.extension.arguments_json,
        assign.build_arch,
        job_dir,
        Path(pch) if pch and os.path.isdir(pch) else None,
        lambda step: reporter.log(f"kerneleval build: {step} ({time.monotonic() - started:.1f} s)"),
        assign.extension.main_object,
    )
    answer = job_channel_pb2.ExtensionBuilt(
        job_id=assign.job_id,
        library=built.library,
        error=built.error,
        log=built.log[-MAX_BUILD_LOG:],
        fast=built.fast,
    )
    if len(built.main_object) <= MAX_LIBRARY_BYTES:
        answer.main_object = built.main_object
    if len(built.library) > MAX_LIBRARY_BYTES:
        answer.library = b""
        answer.error = f"the extension is {len(built.library)} bytes, over {MAX_LIBRARY_BYTES}"
    answer.build_time.FromNanoseconds(int(built.seconds * 1e9))
    return answer


def _launch_only(assign: job_channel_pb2.AssignJob, reference_judged: bool) -> bool:
    """Every source of the job that ran here came prebuilt: none of its code ran on this host
    (a reference not built ahead ran in its judge only)."""
    roles = {a.role for a in assign.prebuilt}
    spec = assign.spec
    return "kernel" in roles and (
        not spec.HasField("reference") or "reference" in roles or reference_judged
    )


def _run_one(
    engine: ModuleType, channel: _Channel, assign: job_channel_pb2.AssignJob, last: bool
) -> tuple[bool, bool]:
    """Runs the job and sends its outcome. Returns (the CUDA context is poisoned, the process
    may take another job: it ran prebuilt kernels only, or judged, and cleaned up). `last`: it
    may not."""
    reporter = _Reporter(channel, assign.job_id)
    job_dir, cache_dir, seeded = _job_dirs(assign)
    channel.job_running = True
    prebuilt = list(assign.prebuilt)
    # The record (a memfd), and with share_max_bytes the record's socket (its outputs past the
    # record, by descriptor: engine/device_share.py).
    fds = channel.record_fds.pop(assign.job_id, [])
    record_fd = fds[0] if fds else -1
    share_fd = fds[1] if len(fds) > 1 and assign.share_max_bytes else -1
    judging = assign.HasField("judge") and record_fd >= 0
    recorder = None
    launch_only = False  # every source came prebuilt: the process may take another job
    outcome: Any = None
    try:
        config = engine.EngineConfig(work_dir=job_dir)
        if not prebuilt and hasattr(config, "extension_builder"):
            config.extension_builder = functools.partial(channel.build_extension, assign.job_id)
        if judging:
            # The reference is client code too, and its time must cost what the kernel's
            # does: the judge runs armed as well.
            _arm_tamper_checks()
            go = functools.partial(_judge_go, channel, reporter, assign.job_id)
            outcome = engine.judge_job(
                assign.spec, reporter, config, assign.judge.candidate, record_fd,
                assign.record_max_bytes, share_fd, assign.share_max_bytes,
                assign.judge.kernel_gone, _reference_time(assign.judge),
                go=go if assign.judge.ahead else None,
                **({"kernel_serves": True} if assign.judge.kernel_serves else {}),
                **({"kernel_must_serve": True} if assign.judge.kernel_timed_by_judge else {}),
                **({"path_measures": _path_measures(engine, assign.judge)}
                   if assign.judge.path_measures else {}),
            )  # fmt: skip
        else:
            if assign.record_max_bytes and record_fd >= 0:
                recorder = engine.Recorder(
                    record_fd, assign.record_max_bytes, share_fd, assign.share_max_bytes
                )
                config.recorder = recorder
                # A launch's reference, not built ahead (it has host code), runs only in
                # its judge: never in a process that takes job after job.
                config.reference_judged = bool(prebuilt)
                if hasattr(config, "timed_by_judge"):
                    config.timed_by_judge = assign.timed_by_judge and share_fd >= 0
            launch_only = _launch_only(assign, recorder is not None)
            if prebuilt and not launch_only:
                # Its reference's host code would run in a process that ran others' jobs.
                raise RuntimeError("a launch whose reference was not built came without a record")
            if prebuilt:
                outcome = engine.run_job(assign.spec, reporter, config, prebuilt=prebuilt)
            else:
                _arm_tamper_checks()  # job code is imported from here on
                outcome = engine.run_job(assign.spec, reporter, config)
        result, poisoned = outcome.result, bool(outcome.context_poisoned)
        peak = getattr(outcome, "peak_memory_bytes", 0) or (0 if poisoned else _peak_memory())
    except Exception as exc:  # noqa: BLE001 - the engine should not raise; report, not die
        result, poisoned, peak = _engine_error(exc), False, 0
    serve = getattr(outcome, "serve", None)
    serving = serve is not None and share_fd >= 0 and not poisoned and not judging
    for fd in fds:
        if not (serving and fd == share_fd):  # the record: closed, so that it can be sealed
            os.close(fd)
    shared = recorder.shared_bytes if recorder is not None else 0
    # Device memory outside torch's allocator: handed over (held until the process exits),
    # and a judge's timed-call buffers.
    peak += shared + getattr(outcome, "outside_allocator_bytes", 0)
    reusable = (
        not last
        and not poisoned
        and (judging or launch_only)
        and not result.HasField("error")  # a reference that failed or tampered: not again
    )
    channel.finishing = True
    added = compile_cache_added(cache_dir, seeded) if result.compiled and not poisoned else []
    outcome_msg = job_channel_pb2.JobOutcome(
        job_id=assign.job_id,
        result=result,
        context_poisoned=poisoned,
        compile_cache=added,
        window_drained=reporter.window_drain[1],
        reusable=reusable,
        peak_memory_bytes=peak,
        shared_bytes=shared,
        serves_timed_calls=serving,
        path_measures=[
            job_channel_pb2.PathMeasure(lead=m.lead, output_bytes=m.output_bytes, ns=m.ns)
            for m in getattr(outcome, "path_measures", ())
        ],
    )
    outcome_msg.window_drain.FromNanoseconds(int(reporter.window_drain[0] * 1e9))
    channel.send(job_channel_pb2.JobProcessMessage(outcome=outcome_msg))
    if serving:
        # Its judge drives the kernel's timed calls now (engine/timed_calls.py); then this
        # process exits as after any job.
        assert serve is not None
        try:
            serve(share_fd)
        except Exception:  # noqa: BLE001 - the judge sees the calls end, and says why
            pass
        finally:
            os.close(share_fd)
    # The result (and the GPU's timing window) does not wait for the cleanup; the next job
    # does: it is read only once the process is clean, and a failed cleanup ends the process
    # (a job given meanwhile runs again elsewhere: the exit is not its doing). The job's
    # folders go with a private /tmp, which goes with the process; without one, and before a
    # launch process's next job, they are removed here.
    if not poisoned:
        shutil.rmtree(job_dir, ignore_errors=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    if reusable and _clean_for_next_job():
        channel.accept_next(assign.job_id)
    else:
        reusable = False
    return poisoned, reusable


def _judge_go(
    channel: _Channel, reporter: _Reporter, job_id: str
) -> tuple[Any, bool, tuple[Any, float] | None, bool, bool] | None:
    """A judge started ahead has run the reference: it says so (the front end takes back its
    GPU grant: the kernel's timing must not wait for it) and waits for the kernel's report.
    Its grant is let go before it says so: the front end may ask for its next one as soon as
    it has read that (GpuUse.ask_early), and that grant may be in before this thread runs on."""
    reporter.let_go(job_pb2.PHASE_VALIDATING)
    channel.send(
        job_channel_pb2.JobProcessMessage(
            judge_prepared=job_channel_pb2.JudgePrepared(job_id=job_id)
        )
    )
    go = channel.wait_go(job_id)
    if go is None or go.abandon:
        return None
    r = go.request
    return r.candidate, r.kernel_gone, _reference_time(r), r.kernel_serves, r.kernel_timed_by_judge


def _path_measures(engine: ModuleType, judge: job_channel_pb2.JudgeRequest) -> list[Any]:
    """Earlier judges' measures of their own path, as the engine takes them."""
    make = engine.PathMeasure
    return [make(m.lead, tuple(m.output_bytes), m.ns) for m in judge.path_measures]


def _reference_time(judge: job_channel_pb2.JudgeRequest) -> tuple[Any, float] | None:
    """An earlier job's time of the reference, and its age, when the front end gave one."""
    if not judge.HasField("reference_runtime"):
        return None
    return judge.reference_runtime, judge.reference_runtime_age_s


def _arm_tamper_checks(prepare_only: bool = False) -> None:
    """Job code runs in this process from here on (engine/tamper.py): its refusals and the
    timing snapshot, for the rest of the process. Only the service's engine has them.
    `prepare_only`: the snapshot only, taken as the process starts (not on a job's path)."""
    tamper = sys.modules.get(f"{DEFAULT_ENGINE}.tamper")
    if tamper is not None and prepare_only:
        tamper.prepare()
    elif tamper is not None:
        tamper.arm()


def main(channel_fd: int) -> int:
    """The job process: Hello, then one job and its outcome; a build job's BuildOutcome; or,
    while it only launches prebuilt kernels, one job after another. The exit code to use."""
    # Everything made so far (modules, the warm-up's objects) is the process's own: a full
    # collection after each job (_clean_for_next_job) then scans only what the job made.
    gc.freeze()
    # A job's sources are imported once, from its private /tmp: writing their bytecode next
    # to them is work for nobody (everything else here is read-only).
    sys.dont_write_bytecode = True
    engine = importlib.import_module(os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE)
    _arm_tamper_checks(prepare_only=True)  # before Hello: ready means ready to arm at once
    sock = socket.socket(fileno=channel_fd)
    channel = _Channel(sock)
    device_index = int(os.environ.get("KERNELEVAL_DEVICE_INDEX", "-1"))
    try:
        channel.send(
            job_channel_pb2.JobProcessMessage(
                hello=job_channel_pb2.Hello(
                    worker_id=os.environ.get(WORKER_ID_ENV, ""),
                    pid=os.getpid(),
                    device_index=device_index,
                    device=device_info(device_index),
                    judges=hasattr(engine, "judge_job"),
                )
            )
        )
    except OSError:
        return OK_EXIT  # the front end is gone
    threading.Thread(target=channel.read_loop, name="job-channel", daemon=True).start()
    for done in range(MAX_JOBS_PER_LAUNCH_PROCESS):
        # Made while the process waits for its job, not on the job's way: its folders, and
        # its peak memory's start (nothing runs on the GPU in between: the warm-up, the last
        # job's cleanup are done).
        make_job_dirs()
        _reset_peak_memory()
        assign = channel.assigned.get()
        if assign is None:
            return OK_EXIT
        try:
            if assign.build_only:
                _build_one(engine, channel, assign)
                return OK_EXIT
            last = done + 1 == MAX_JOBS_PER_LAUNCH_PROCESS
            poisoned, reusable = _run_one(engine, channel, assign, last)
        except OSError:  # the channel broke while reporting
            return OK_EXIT
        if not reusable:
            return POISONED_EXIT if poisoned else OK_EXIT
    return OK_EXIT


def _standalone() -> None:
    fd = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    try:
        load_engine()
        warm_up()
        code = main(fd)
    except BaseException:  # noqa: BLE001 - say why, then leave without the normal teardown
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a poisoned CUDA context can hang the normal teardown


if __name__ == "__main__":
    _standalone()
