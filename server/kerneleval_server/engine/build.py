"""build_job: compiles a job's kernels ahead of time, in a process without a GPU, for a GPU of
architecture `arch`; run_job(..., prebuilt=...) then launches them in a process that never
imports the job's sources.

What can be built ahead: TRITON launched from its IOContract (a plain @triton.jit function)
and CUDA with an IOContract, for the kernel and the reference alike. A kernel that is anything
else (TORCH, TORCH_CUDA, a ModelNew, an autotuned Triton kernel) or a debug aid sets
`run_whole`: the job runs whole, as before. A reference that is anything else is left out:
only the kernel is built, and the reference runs in the job's judge. A failure the job itself
causes (a compile error, an exception at the module's top level, an invalid spec) is the
job's `result`, with the verdict run_job gives.

Triton compiles for a GPU only where it was imported without TRITON_INTERPRET=1 (its own
@jit library functions, tl.cdiv and the like, are made at import); a process without a GPU
sets it for its interpreter (configure_process_environment). There build_job compiles in a
child started for the job with TRITON_INTERPRET=0 (about a second more):
    python -m kerneleval_server.engine.build --spec S --out O --work-dir D --arch sm_90
A build process that sets TRITON_INTERPRET=0 before it imports triton compiles in-process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from . import loader
from .backends import BuildContext, is_triton_launch
from .backends.cuda import check_without_gpu, compile_cuda, cuda_notes, pick_kernel
from .backends.triton_build import (
    RunWhole,
    compile_kernel,
    compiled_mode,
    import_kernel,
    triton_compiles_here,
)
from .device import DeviceLimits
from .runner import preserved_torch_state
from .stops import ReporterError as _ReporterError
from .stops import SafeReporter as _SafeReporter
from .stops import Stop as _Stop
from .stops import build_failure, internal_error, invalid_spec
from .types import EngineConfig, Reporter

CHILD_ENV = "KERNELEVAL_BUILD_CHILD"


def build_job(
    spec: kernel_pb2.JobSpec,
    reporter: Reporter,
    config: EngineConfig,
    arch: str,
    prebuilt: Sequence[job_channel_pb2.KernelArtifact] = (),
) -> job_channel_pb2.BuildOutcome:
    """Builds every source of the job for `arch` ("sm_90"), but those of a role in
    `prebuilt` (the front end built them for an earlier job: a raw CUDA reference). Needs no
    GPU and never touches one; never raises for anything the job's code does. job_id is left
    for the caller."""
    b = _Build(spec, _SafeReporter(reporter), config, arch)
    b.given = {a.role for a in prebuilt}
    try:
        with preserved_torch_state(), loader.forgetting_modules(), compiled_mode():
            b.run()
    except _Stop:
        pass
    except _Built:
        return b.out
    except RunWhole as e:
        b.out.run_whole = _one_line(str(e))
    except _ReporterError as e:
        raise (e.__cause__ or e) from None
    except Exception as e:  # a bug in the engine: still an answer, with the traceback
        internal_error(b.result, e)
    if b.out.run_whole or b.result.verdict != job_pb2.VERDICT_UNSPECIFIED:
        del b.out.artifacts[:]
    if b.result.verdict != job_pb2.VERDICT_UNSPECIFIED and not b.out.run_whole:
        if b.notes:
            b.result.notes.extend(b.notes)
        b.out.result.CopyFrom(b.result)
    return b.out


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line[:500]


def _device_info() -> job_pb2.DeviceInfo:
    """What the build ran with, without asking for a GPU (a build process has none)."""
    import triton

    return job_pb2.DeviceInfo(
        name="cpu", index=-1, torch_version=torch.__version__, triton_version=triton.__version__
    )


class _Built(Exception):
    """The outcome is complete (a child built it)."""


class _Build:
    def __init__(
        self, spec: kernel_pb2.JobSpec, reporter: _SafeReporter, config: EngineConfig, arch: str
    ) -> None:
        self.spec = spec
        self.reporter = reporter
        self.config = config
        self.arch = arch
        self.out = job_channel_pb2.BuildOutcome()
        self.result = job_pb2.EvalResult(device=_device_info())
        self.notes: list[str] = []
        self.given: set[str] = set()  # roles built already (build_job's prebuilt)

    def run(self) -> None:
        if invalid_spec(self.spec, self.config, self.result):
            raise _Stop
        self.reporter.phase(job_pb2.PHASE_COMPILING)
        o = self.spec.options
        for aid in ("launch_blocking", "device_side_assertions", "sanitize", "device_metrics"):
            if getattr(o, aid):
                raise RunWhole(f"{aid} runs the job in a process started for it")
        if reason := _cannot_build(self.spec.kernel):  # before anything is imported
            raise RunWhole(f"kernel: {reason}")
        roles = [("kernel", self.spec.kernel)]
        # A reference with host code is not built: it runs in the job's judge only (the
        # front end launches the kernel alone where it can judge, else runs the job whole).
        if self.spec.HasField("reference") and not _cannot_build(self.spec.reference):
            roles.append(("reference", self.spec.reference))
        roles = [(role, k) for role, k in roles if role not in self.given]
        if any(k.type == kernel_pb2.KERNEL_TYPE_TRITON for _, k in roles):
            if not triton_compiles_here():
                if os.environ.get(CHILD_ENV) == "1":
                    raise RuntimeError("triton runs under its interpreter in the build child")
                self.out = _build_in_child(self.spec, self.config, self.arch, self.reporter)
                raise _Built
        # The arguments every launch gets: the kernel's IOContract (see run_job's inputs).
        inputs = self.spec.kernel.io
        ctx = BuildContext(
            work_dir=self.config.work_dir,
            seed=0,
            device=torch.device("cpu"),
            limits=self.config.device_limits,
            log=self.reporter.log,
        )
        # As run_job: every source is imported (or nvcc-compiled) first, then Triton compiles.
        triton_kernels: dict[str, object] = {}
        artifacts: dict[str, job_channel_pb2.KernelArtifact] = {}
        for role, k in roles:
            with self._guard(role, ctx):
                if k.type == kernel_pb2.KERNEL_TYPE_CUDA:
                    artifacts[role] = self._cuda(k, role, ctx)
                else:
                    triton_kernels[role] = import_kernel(k, role, ctx)
        for role, k in roles:
            if role in triton_kernels:
                with self._guard(role, ctx):
                    artifacts[role] = compile_kernel(
                        triton_kernels[role], k, role, inputs, self.arch
                    )
                    self.reporter.log(artifacts[role].build_log)
        self.out.artifacts.extend(artifacts[role] for role, _ in roles)

    def _cuda(
        self, k: kernel_pb2.KernelSource, role: str, ctx: BuildContext
    ) -> job_channel_pb2.KernelArtifact:
        compiled = compile_cuda(k.source_code, ctx, self.arch)
        name = pick_kernel(compiled.kernels, k.entry_point)
        if ctx.limits is not None:  # the checks that need no GPU
            check_without_gpu(k.io.launch, ctx.limits, compiled.log, name)
        return job_channel_pb2.KernelArtifact(
            role=role,
            type=kernel_pb2.KERNEL_TYPE_CUDA,
            cubin=compiled.cubin,
            function=name,
            arch=self.arch,
            build_log=f"$ {compiled.command}\n{compiled.log}".strip(),
            notes=cuda_notes(compiled.log, name, self.arch),
        )

    @contextlib.contextmanager
    def _guard(self, role: str, ctx: BuildContext) -> Iterator[None]:
        """Any exception of the job's code or its compilation becomes the build's result."""
        who = "" if role == "kernel" else "reference: "
        try:
            # No GPU here: .cuda() at a module's top level returns the CPU tensor, as in a
            # job process without one (and without asking CUDA whether there is a GPU).
            with loader.cpu_as_device(force=True):
                yield
        except (_Stop, RunWhole, _ReporterError, KeyboardInterrupt):
            raise
        except BaseException as e:  # SystemExit at a module's top level is its failure too
            build_failure(e, who, self.result, ctx, self.notes)
            raise _Stop from None


def _cannot_build(k: kernel_pb2.KernelSource) -> str:
    """Why this source cannot be built ahead ("" when it can)."""
    kind = kernel_pb2.KernelType.Name(k.type)
    if k.type == kernel_pb2.KERNEL_TYPE_CUDA:
        return "" if len(k.io.args) > 0 else "a CUDA kernel without IOContract args"
    if k.type == kernel_pb2.KERNEL_TYPE_TRITON:
        if len(k.io.args) == 0:
            return "a Triton source without IOContract args"
        return "" if is_triton_launch(k) else "a Triton ModelNew (Python host code)"
    return f"{kind} runs Python host code"


# -- a child with Triton in compiled mode ---------------------------------------------------


def _build_in_child(
    spec: kernel_pb2.JobSpec, config: EngineConfig, arch: str, reporter: _SafeReporter
) -> job_channel_pb2.BuildOutcome:
    from .isolated import import_path as _import_path

    folder = config.work_dir / "build-child"
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = folder / "spec.pb", folder / "outcome.pb", folder / "log.json"
    for p in (out_path, log_path):
        p.unlink(missing_ok=True)
    spec_path.write_bytes(spec.SerializeToString())
    settings = {
        "limits": dataclasses.asdict(config.limits),
        "device_limits": (
            dataclasses.asdict(config.device_limits) if config.device_limits is not None else None
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "kerneleval_server.engine.build",
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
        "--log",
        str(log_path),
        "--work-dir",
        str(folder / "work"),
        "--arch",
        arch,
        "--settings",
        json.dumps(settings),
    ]
    env = {
        **os.environ,
        CHILD_ENV: "1",
        "TRITON_INTERPRET": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": _import_path(),
    }
    timeout = (spec.options.timeout.seconds or 120) * 2
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_die_with_parent,
        )
        output = (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired:
        output = f"the build child ran past {timeout} s"
    try:
        for line in json.loads(log_path.read_text()):
            reporter.log(str(line))
    except (OSError, ValueError):
        pass
    out = job_channel_pb2.BuildOutcome()
    if out_path.exists():
        out.ParseFromString(out_path.read_bytes())
        return out
    out.result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
    out.result.device.CopyFrom(_device_info())
    out.result.error.message = f"internal engine error: the build child failed: {output}"
    out.result.error.exception_type = "BuildChildFailed"
    return out


def _die_with_parent() -> None:
    """The child is killed with the build process (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - not Linux: the child may outlive a killed parent
        pass


class _LogReporter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def phase(self, phase: int) -> None:
        pass

    def progress(self, phase: int, done: int, total: int) -> None:
        pass

    def log(self, text: str) -> None:
        self.lines.append(text)


def main() -> None:
    p = argparse.ArgumentParser(description="Builds a job's kernels ahead (build.py).")
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--arch", required=True)
    p.add_argument("--settings", default="{}")
    a = p.parse_args()
    settings: dict[str, Any] = json.loads(a.settings)
    config = EngineConfig(work_dir=Path(a.work_dir))
    config.work_dir.mkdir(parents=True, exist_ok=True)
    if settings.get("limits"):
        config.limits = type(config.limits)(**settings["limits"])
    if dl := settings.get("device_limits"):
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in dl.items()}
        config.device_limits = DeviceLimits(**fields)
    spec = kernel_pb2.JobSpec()
    spec.ParseFromString(Path(a.spec).read_bytes())
    reporter = _LogReporter()
    out = build_job(spec, reporter, config, a.arch)
    Path(a.log).write_text(json.dumps(reporter.lines))
    Path(a.out).write_bytes(out.SerializeToString())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
