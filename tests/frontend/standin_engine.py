"""A tiny engine with the kerneleval_server.engine interface, for front-end tests.

It runs a TORCH-style source: exec it, build `Model`, call it on `get_inputs()`. Enough to
drive every phase, a crash (the source kills its own process) and a hang (it sleeps).
"""

from __future__ import annotations

import time
import traceback
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


def run_job(spec: Any, reporter: Any, config: EngineConfig) -> Outcome:
    result = job_pb2.EvalResult()
    reporter.phase(job_pb2.PHASE_COMPILING)
    scope: dict[str, Any] = {}
    try:
        exec(compile(spec.kernel.source_code, "kernel.py", "exec"), scope)
        model = scope["Model"](*scope.get("get_init_inputs", lambda: [])())
    except Exception as exc:  # noqa: BLE001
        result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        result.compilation_error = f"{type(exc).__name__}: {exc}"
        return Outcome(result)
    result.compiled = True
    reporter.phase(job_pb2.PHASE_VALIDATING)
    try:
        out = model(*scope["get_inputs"]())
        reporter.log(f"output {out!r}"[:200])
    except Exception as exc:  # noqa: BLE001
        result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
        result.error.message = str(exc)
        result.error.traceback = traceback.format_exc()
        return Outcome(result, context_poisoned="poison" in str(exc))
    reporter.progress(job_pb2.PHASE_VALIDATING, 1, 1)
    reporter.phase(job_pb2.PHASE_PROFILING)
    start = time.perf_counter()
    model(*scope["get_inputs"]())
    result.runtime.median_ms = (time.perf_counter() - start) * 1000
    result.runtime.trial_count = 1
    result.correctness = True
    result.verdict = job_pb2.VERDICT_OK
    return Outcome(result)
