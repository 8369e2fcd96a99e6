"""An engine with kerneleval_server.engine's interface that acts out GPU behaviours on the CPU.

It runs inside the sealed job process: it sees none of the test's files, and nothing it starts
outlives its job. What it has to tell the test goes back in the result's notes.

The kernel source is a JSON command:
  {"do": "oom", "seconds": s}
      checks for s seconds, then reports the assertion torch's allocator raises for an
      out-of-memory where NVML cannot start (as in the sandbox).
  {"do": "illegal_address"}
      reports VERDICT_DEVICE_FAULT with a poisoned context, as the real engine does after
      cudaErrorIllegalAddress (the test writes the XID into the fake NVML file, as the driver
      would, ~2 s late).
  {"do": "segfault"}
      the job process dies with SIGSEGV, as a kernel's wild host-side write does.
  {"do": "time", "seconds": s, "check_seconds": c}
      compiles for s seconds, asks for the GPU to check and "checks" for c seconds (0 if not
      given), then asks for the timing window and "times" for s seconds; the result's notes
      hold "<phase> <start> <end>" for prepare, check and profile. With "crash_in_window":
      true the job process dies with SIGSEGV half way through its window; with "busy_for": b
      its window starts as if the GPU stayed busy with others' queued work for b seconds
      (DrainStatus busy, then not busy). With "peak": n it reports n bytes as its peak device
      memory (the front end learns its problem's footprint from it: jobs with the same
      reference share one); with "outside": n, n bytes more it made outside torch's
      allocator (Outcome.outside_allocator_bytes, which the job process adds to its peak).
  {"do": "spin", "cpu_seconds": c}
      burns c seconds of CPU in its compile phase (which asks for no GPU), noting the wall
      time every few ms; the notes hold "stall <start> <end>", its longest pause (a job process
      frozen for another job's timing window pauses there).
Built ahead (a CUDA kernel with an IOContract, `--build-processes`): `build_job` acts out the
build process and `run_job(..., prebuilt=...)` the launch process:
  {"do": "build"}            one artifact per source (a fake cubin); the launch notes
                             "launched <function> by <worker id> job <n>" (n counts this
                             process's jobs) and whether the build process saw a GPU
  {"do": "build", "poison": true}   the launch reports a poisoned context
  {"do": "build", "launch_seconds": s}   the launch checks for s seconds
  {"do": "build", "build_hangs": true} / "build_crashes"   the build never ends / faults
  {"do": "build_error"}      the build ends the job with VERDICT_COMPILE_ERROR
  {"do": "build_whole"}      the build says: run it whole (then it runs as {"do": "time"})
  {"do": "build_bad"}        the build process answers an artifact that is no cubin
  {"do": "flags"}            OK with a runtime flag, one of an unknown rule and a "static" one
  {"do": "forge_reusable"}   (run whole) writes its own JobOutcome, reusable, to its channel
                             and stays, as hostile host code could
Used with `serve --engine fe_fake_engine` (tests/frontend on PYTHONPATH).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

_launches = 0  # jobs this process launched prebuilt


@dataclass
class EngineConfig:
    work_dir: Path
    limits: Any = None


@dataclass
class Outcome:
    result: job_pb2.EvalResult
    context_poisoned: bool = False
    peak_memory_bytes: int = 0
    outside_allocator_bytes: int = 0


def configure_process_environment() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _record(result: job_pb2.EvalResult, phase: str, start: float, end: float) -> None:
    result.notes.append(f"{phase} {start} {end}")


def _spin(result: job_pb2.EvalResult, cpu_seconds: float) -> None:
    stall = (0.0, 0.0)
    last = time.time()
    end_cpu = time.process_time() + cpu_seconds
    while time.process_time() < end_cpu:
        sum(range(2000))  # ~50 us of work between looks at the clock
        now = time.time()
        if now - last > stall[1] - stall[0]:
            stall = (last, now)
        last = now
    _record(result, "stall", *stall)


def build_job(spec: Any, reporter: Any, config: EngineConfig, arch: str, prebuilt: Any = ()) -> Any:
    cmd = json.loads(spec.kernel.source_code)
    reporter.phase(job_pb2.PHASE_COMPILING)
    out = job_channel_pb2.BuildOutcome()
    if cmd.get("build_hangs"):
        time.sleep(3600)
    if cmd.get("build_crashes"):
        ctypes.string_at(0)  # a candidate's module top level that faults in the build
    if cmd["do"] == "build_error":
        out.result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        out.result.error.message = "fake nvcc: error"
        return out
    if cmd["do"] not in ("build", "build_bad"):
        out.run_whole = f"{cmd['do']} is not built ahead"
        return out
    gpu = os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES", "") != ""
    # As the real build: a reference with host code (not CUDA here) is left to the judge.
    buildable = spec.HasField("reference") and spec.reference.type == kernel_pb2.KERNEL_TYPE_CUDA
    roles = ["kernel", "reference"] if buildable else ["kernel"]
    roles = [r for r in roles if r not in {a.role for a in prebuilt}]  # given: not built again
    for role in roles:
        cubin = b"not a cubin" if cmd["do"] == "build_bad" else b"\x7fELF fake " + role.encode()
        out.artifacts.add(role=role, cubin=cubin, function=f"{role}_fn", arch=arch)
    out.artifacts[0].notes.append(
        f"built for {arch}; build process sees a GPU: {gpu}, nice {os.nice(0)}"
    )
    out.artifacts[0].notes.append(f"the build process built {roles}")
    return out


def run_job(spec: Any, reporter: Any, config: EngineConfig, prebuilt: Any = ()) -> Outcome:
    global _launches
    cmd = json.loads(spec.kernel.source_code)
    result = job_pb2.EvalResult(compiled=True)
    reporter.phase(job_pb2.PHASE_COMPILING)
    if prebuilt:
        _launches += 1
        reporter.phase(job_pb2.PHASE_VALIDATING)
        time.sleep(float(cmd.get("launch_seconds", 0)))
        untimed = spec.options.HasField("perf_trial_count") and spec.options.perf_trial_count == 0
        if not untimed:  # as the engine: no timing phase without timed trials
            reporter.phase(job_pb2.PHASE_PROFILING)
            result.runtime.median_ms, result.runtime.trial_count = 0.01, 3
        result.notes.extend(prebuilt[0].notes)
        result.notes.append(
            f"launched {prebuilt[0].function} by {os.environ.get('KERNELEVAL_WORKER_ID')} "
            f"job {_launches}"
        )
        result.notes.append(f"artifacts launched: {[a.role for a in prebuilt]}")
        if cmd.get("poison"):
            result.verdict = job_pb2.VERDICT_DEVICE_FAULT
            return Outcome(result, context_poisoned=True)
        result.verdict = job_pb2.VERDICT_OK
        result.correctness = True
        return Outcome(result)
    if cmd["do"] == "build_whole":
        cmd = {"do": "time", "seconds": 0}
    if cmd["do"] == "flags":  # what an engine's runtime checks report, and what it may not
        result.verdict = job_pb2.VERDICT_OK
        result.correctness = True
        for rule, source in (("output_aliases_input", job_pb2.FLAG_SOURCE_RUNTIME),
                             ("made_up_rule", job_pb2.FLAG_SOURCE_RUNTIME),
                             ("timer_patch", job_pb2.FLAG_SOURCE_STATIC)):  # fmt: skip
            result.flags.add(rule_id=rule, message="x" * 2000, source=source)
        return Outcome(result)
    if cmd["do"] == "forge_reusable":
        forged = job_channel_pb2.JobProcessMessage()
        forged.outcome.job_id = reporter._job_id  # noqa: SLF001 - hostile code reads it too
        forged.outcome.reusable = True
        forged.outcome.result.verdict = job_pb2.VERDICT_OK
        data = forged.SerializeToString()
        os.write(3, struct.pack(">I", len(data)) + data)
        time.sleep(30)
    if cmd["do"] == "segfault":
        reporter.phase(job_pb2.PHASE_VALIDATING)
        # A real fault: PID 1 of the job's PID namespace ignores a plain kill(SIGSEGV).
        ctypes.string_at(0)
    if cmd["do"] == "oom":
        # As torch's allocator in a sandbox without NVML says an out-of-memory (a neighbour's
        # memory or its own: the job process cannot tell).
        reporter.phase(job_pb2.PHASE_VALIDATING)
        time.sleep(float(cmd.get("seconds", 0)))
        result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
        result.error.message = (
            "NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "
            '"/pytorch/c10/cuda/CUDACachingAllocator.cpp":1135'
        )
        result.notes.append(f"ran {time.time()}")
        return Outcome(result)
    if cmd["do"] == "illegal_address":
        reporter.phase(job_pb2.PHASE_VALIDATING)
        result.verdict = job_pb2.VERDICT_DEVICE_FAULT
        result.error.message = "CUDA error: an illegal memory access was encountered"
        result.error.cuda_error_name = "cudaErrorIllegalAddress"
        result.error.cuda_error_code = 700
        return Outcome(result, context_poisoned=True)
    if cmd["do"] == "compile":
        # Acts out a compiler with a cache: lists what its cache folder held, then "compiles"
        # (writes a file named after the kernel), as Triton does into TRITON_CACHE_DIR.
        cache = os.environ["TRITON_CACHE_DIR"]
        found = sorted(
            os.path.relpath(os.path.join(d, f), cache)
            for d, _, names in os.walk(cache)
            for f in names
        )
        result.notes.append("cache held " + json.dumps(found))
        os.makedirs(os.path.join(cache, "abc"), exist_ok=True)
        with open(os.path.join(cache, "abc", f"{cmd['name']}.cubin"), "w") as f:
            f.write(cmd["name"])
        result.verdict = job_pb2.VERDICT_OK
        result.correctness = True
        result.timing_window.exclusive = True  # a claim the service must not pass on
        return Outcome(result)
    if cmd["do"] == "spin":
        _spin(result, float(cmd["cpu_seconds"]))
        reporter.phase(job_pb2.PHASE_VALIDATING)
        result.verdict = job_pb2.VERDICT_OK
        result.correctness = True
        return Outcome(result)
    seconds = float(cmd["seconds"])
    start = time.time()
    time.sleep(seconds)
    reporter.phase(job_pb2.PHASE_VALIDATING)  # returns once the GPU gate lets it check
    _record(result, "prepare", start, time.time())
    if cmd.get("check_seconds"):
        start = time.time()
        time.sleep(float(cmd["check_seconds"]))
        _record(result, "check", start, time.time())
    reporter.phase(job_pb2.PHASE_PROFILING)
    start = time.time()
    if cmd.get("busy_for"):
        reporter.drain_status(True)
        time.sleep(float(cmd["busy_for"]))
        reporter.drain_status(False)
    if cmd.get("crash_in_window"):
        time.sleep(seconds / 2)
        ctypes.string_at(0)
    time.sleep(seconds)
    _record(result, "profile", start, time.time())
    result.verdict = job_pb2.VERDICT_OK
    result.correctness = True
    return Outcome(
        result, peak_memory_bytes=int(cmd.get("peak", 0)),
        outside_allocator_bytes=int(cmd.get("outside", 0)),
    )  # fmt: skip
