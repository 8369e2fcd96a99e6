"""An engine with kerneleval_server.engine's interface that acts out GPU behaviours on the CPU.

The kernel source is a JSON command:
  {"do": "illegal_address", "nvml": <fake NVML file>, "xid_delay": s}
      reports VERDICT_DEVICE_FAULT with a poisoned context, as the real engine does after
      cudaErrorIllegalAddress, and appends "xid <device> 31 pid=<pid>" to the fake NVML file
      after xid_delay seconds, as the driver would (NVML reports it ~2 s late).
  {"do": "segfault"}
      the worker process dies with SIGSEGV, as a kernel's wild host-side write does.
  {"do": "time", "log": <file>, "seconds": s}
      compiles and validates for s seconds, then asks for the timing grant and "times" for s
      seconds; appends "<phase> <start> <end> <pid>" lines to log.
Used with `serve --engine fe_fake_engine` (tests/frontend on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kerneleval.v1 import job_pb2


@dataclass
class EngineConfig:
    work_dir: Path
    limits: Any = None


@dataclass
class Outcome:
    result: job_pb2.EvalResult
    context_poisoned: bool = False


def configure_process_environment() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _record(path: str, phase: str, start: float, end: float) -> None:
    with open(path, "a") as f:
        f.write(f"{phase} {start} {end} {os.getpid()}\n")


def run_job(spec: Any, reporter: Any, config: EngineConfig) -> Outcome:
    cmd = json.loads(spec.kernel.source_code)
    result = job_pb2.EvalResult(compiled=True)
    reporter.phase(job_pb2.PHASE_COMPILING)
    if cmd["do"] == "segfault":
        reporter.phase(job_pb2.PHASE_VALIDATING)
        os.kill(os.getpid(), signal.SIGSEGV)
    if cmd["do"] == "illegal_address":
        reporter.phase(job_pb2.PHASE_VALIDATING)
        device = os.environ.get("KERNELEVAL_DEVICE_INDEX", "0")
        line = f"xid {device} 31 pid={os.getpid()}"
        # A detached writer: this process exits right after the result is sent.
        subprocess.Popen(
            [sys.executable, "-c",
             f"import time; time.sleep({cmd['xid_delay']}); "
             f"open({cmd['nvml']!r}, 'a').write({line!r} + '\\n')"],
            start_new_session=True,
        )  # fmt: skip
        result.verdict = job_pb2.VERDICT_DEVICE_FAULT
        result.error.message = "CUDA error: an illegal memory access was encountered"
        result.error.cuda_error_name = "cudaErrorIllegalAddress"
        result.error.cuda_error_code = 700
        return Outcome(result, context_poisoned=True)
    seconds = float(cmd["seconds"])
    start = time.time()
    time.sleep(seconds)
    reporter.phase(job_pb2.PHASE_VALIDATING)
    _record(cmd["log"], "prepare", start, time.time())
    reporter.phase(job_pb2.PHASE_PROFILING)
    start = time.time()
    time.sleep(seconds)
    _record(cmd["log"], "profile", start, time.time())
    result.verdict = job_pb2.VERDICT_OK
    result.correctness = True
    return Outcome(result)
