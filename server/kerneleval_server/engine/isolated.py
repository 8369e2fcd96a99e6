"""The debug aids of EvalOptions need a process started for the job:
launch_blocking (CUDA_LAUNCH_BLOCKING=1), device_side_assertions (TORCH_USE_CUDA_DSA=1),
sanitize (compute-sanitizer memcheck; timing is skipped) and device_metrics (Nsight Compute on
the kernel's launches, beside the normal in-process evaluation).

Child: python -m kerneleval_server.engine.isolated_child --spec S --out R --work-dir D
(isolated_child.py) reads a JobSpec, runs run_job, writes the EvalResult.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.spec.validation import is_timed

from . import device
from .device import has_gpu
from .types import EngineConfig, Outcome, Reporter

NCU_METRICS = (
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
    "l1tex__t_sector_hit_rate.pct",
    "lts__t_sector_hit_rate.pct",
)
CHILD_ENV = "KERNELEVAL_ISOLATED"


def cuda_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(p := os.path.join(home, "bin", name)):
            return p
    return None


def maybe_run_isolated(
    spec: kernel_pb2.JobSpec,
    config: EngineConfig,
    result: job_pb2.EvalResult,
    reporter: Reporter | None = None,
) -> Outcome | None:
    """Runs the job in a child when a debug aid asks for it; None means: evaluate in-process
    (notes in `result` say which aids could not be honoured)."""
    o = spec.options
    if not (o.launch_blocking or o.device_side_assertions or o.sanitize or o.device_metrics):
        return None
    if os.environ.get(CHILD_ENV) == "1":
        return None
    if not has_gpu():
        for flag in ("launch_blocking", "device_side_assertions", "sanitize", "device_metrics"):
            if getattr(o, flag):
                result.notes.append(f"{flag} needs a CUDA GPU; this worker has none: not applied")
        return None
    if o.device_metrics:
        _collect_metrics(spec, config, result)
    env: dict[str, str] = {}
    if o.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    if o.device_side_assertions:
        env["TORCH_USE_CUDA_DSA"] = "1"
    if o.sanitize:
        sanitizer = cuda_tool("compute-sanitizer")
        if sanitizer is None:
            result.notes.append("sanitize: compute-sanitizer was not found: not applied")
        else:
            return _sanitize(spec, config, result, sanitizer, env)
    if env:
        if reporter is not None:
            reporter.phase(job_pb2.PHASE_COMPILING)
            if is_timed(o):
                reporter.phase(job_pb2.PHASE_PROFILING)  # the child times: hold the GPU's turn
        child = _run_child(spec, config, env, prefix=[])
        child.result.notes[:0] = list(result.notes)
        child.result.notes.append(f"ran in a process started for this job with {sorted(env)}")
        if result.HasField("device_metrics"):
            child.result.device_metrics.CopyFrom(result.device_metrics)
        return Outcome(result=child.result, context_poisoned=False)
    return None


def _sanitize(
    spec: kernel_pb2.JobSpec,
    config: EngineConfig,
    result: job_pb2.EvalResult,
    sanitizer: str,
    env: dict[str, str],
) -> Outcome:
    s = kernel_pb2.JobSpec()
    s.CopyFrom(spec)
    s.options.perf_trial_count = 0
    s.options.correct_trial_count = 1
    env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # so memcheck sees each tensor's bounds
    # API errors off: the engine's own probing (cuFuncGetParamInfo past the last parameter)
    # would fill the report; the kernel's bad accesses and launch failures stay in it.
    prefix = [
        sanitizer,
        "--tool",
        "memcheck",
        "--print-limit",
        "20",
        "--report-api-errors",
        "no",
        "--target-processes",
        "all",
    ]
    child = _run_child(s, config, env, prefix=prefix)
    report = child.log
    child.result.notes[:0] = list(result.notes)
    child.result.sanitizer_report = report[-32000:]
    child.result.notes.append("ran under compute-sanitizer memcheck: 1 trial, not timed")
    m = re.search(r"ERROR SUMMARY: (\d+) error", report)
    if m and int(m.group(1)) > 0 and child.result.verdict == job_pb2.VERDICT_OK:
        child.result.verdict = job_pb2.VERDICT_DEVICE_FAULT
        child.result.correctness = False
        child.result.error.message = f"compute-sanitizer memcheck found {m.group(1)} errors"
    return Outcome(result=child.result, context_poisoned=False)


def _collect_metrics(
    spec: kernel_pb2.JobSpec, config: EngineConfig, result: job_pb2.EvalResult
) -> None:
    ncu = cuda_tool("ncu")
    if ncu is None:
        result.notes.append("device_metrics: ncu was not found: not collected")
        return
    s = kernel_pb2.JobSpec()
    s.CopyFrom(spec)
    s.ClearField("reference")  # profile the kernel alone
    s.options.perf_trial_count = 0
    s.options.sanitize = False
    prefix = [
        ncu,
        "--target-processes",
        "all",
        "--nvtx",
        "--nvtx-include",
        "kerneleval_kernel/",
        "--metrics",
        ",".join(NCU_METRICS),
        "--csv",
    ]
    child = _run_child(s, config, {"KERNELEVAL_NVTX": "1"}, prefix=prefix)
    metrics = parse_ncu_csv(child.log)
    if metrics is None:
        result.notes.append("device_metrics: ncu reported no kernel (see device_metrics.report)")
        result.device_metrics.report = child.log[-8000:]
        return
    result.device_metrics.CopyFrom(metrics)


def parse_ncu_csv(text: str) -> job_pb2.DeviceMetrics | None:
    """Metrics of the first profiled kernel; gpu__time_duration.sum adds up every kernel."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    if len(rows) < 2:
        return None
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    out = job_pb2.DeviceMetrics()
    first_id = None
    total_ns = 0.0
    for row in reader:
        name, value = row.get("Metric Name"), row.get("Metric Value", "")
        if not name:
            continue
        try:
            v = float(value.replace(",", ""))
        except ValueError:
            continue
        unit = row.get("Metric Unit", "")
        if name == "gpu__time_duration.sum":
            v *= {"usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1.0)
            total_ns += v
        if first_id is None:
            first_id = row.get("ID")
            out.kernel_name = row.get("Kernel Name", "")
        if row.get("ID") == first_id:
            out.values[name] = v
    if first_id is None:
        return None
    out.values["gpu__time_duration.sum"] = total_ns
    out.report = "\n".join(rows)[-8000:]
    return out


def import_path() -> str:
    """PYTHONPATH for the child: where this package and the generated code were loaded from."""
    import kerneleval

    import kerneleval_server

    here = [
        str(Path(m.__file__ or "").resolve().parents[1]) for m in (kerneleval_server, kerneleval)
    ]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(here + rest))


class _Child:
    def __init__(self, result: job_pb2.EvalResult, log: str) -> None:
        self.result = result
        self.log = log


def _run_child(
    spec: kernel_pb2.JobSpec, config: EngineConfig, env: dict[str, str], prefix: list[str]
) -> _Child:
    folder = config.work_dir / "isolated"
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = folder / "spec.pb", folder / "result.pb"
    out_path.unlink(missing_ok=True)
    spec_path.write_bytes(spec.SerializeToString())
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "kerneleval_server.engine.isolated_child",
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
        "--work-dir",
        str(folder / "work"),
    ]
    child_env = {**os.environ, **env, CHILD_ENV: "1", "PYTHONPATH": import_path()}
    timeout = spec.options.timeout.seconds or 120
    try:
        proc = subprocess.run(
            cmd, env=child_env, capture_output=True, text=True, timeout=timeout * 3
        )
        log = proc.stdout + proc.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired as e:
        r = job_pb2.EvalResult(verdict=job_pb2.VERDICT_TIMEOUT, device=device.device_info())
        r.notes.append("the process started for this job ran past its timeout")
        return _Child(r, str(e.stdout or "") + str(e.stderr or ""))
    if out_path.exists():
        r = job_pb2.EvalResult()
        r.ParseFromString(out_path.read_bytes())
        return _Child(r, log)
    r = job_pb2.EvalResult(verdict=job_pb2.VERDICT_CRASHED, device=device.device_info())
    if code < 0:
        r.fault.signal = -code
        r.fault.description = (
            f"the process started for this job died of {signal.Signals(-code).name}"
        )
    else:
        r.fault.exit_code = code
        r.fault.description = f"the process started for this job exited with {code}"
    r.error.message = log[-4000:]
    return _Child(r, log)
