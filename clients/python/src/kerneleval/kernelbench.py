"""JobSpecs from source files as they are (KernelBench problems and generated kernels).

The kernel type is read from the source text, so a KernelBench problem (`Model`) and a
generated file (`ModelNew` with load_inline, or with @triton.jit kernels) need no flags.
"""

from __future__ import annotations

import re
from pathlib import Path

from kerneleval.v1 import kernel_pb2

_TRITON = re.compile(r"@\s*triton\s*\.\s*(jit|autotune|heuristics)\b|\btriton\.jit\s*\(")
_LOAD_INLINE = re.compile(r"\bload_inline\s*\(|\bcpp_extension\b")
_PY_CODE = re.compile(r"^\s*(import|from)\s+\w", re.MULTILINE)
_GLOBAL = re.compile(r"__global__\s+\w")

# KernelBench's `eval_kernel_against_ref` defaults (ScalingIntelligence/KernelBench,
# src/kernelbench/eval.py and timing.py): seed_num=42, num_correct_trials=1, num_perf_trials=10,
# 3 warm-up runs (time_execution_with_cuda_event), fp32 tolerance 1e-4 for both atol and rtol
# (get_tolerance_for_precision), and the L2 cache thrashed before every timed trial
# (clear_l2_cache). docs/CLIENTS.md says what still differs.
KERNELBENCH_SEED = 42
KERNELBENCH_CORRECT_TRIALS = 1
KERNELBENCH_PERF_TRIALS = 10
KERNELBENCH_WARMUP = 3
KERNELBENCH_TOLERANCE = 1e-4


def kernelbench_options() -> kernel_pb2.EvalOptions:
    """EvalOptions equal to KernelBench's `eval_kernel_against_ref` defaults (timing on, as
    its eval_from_generations script asks with measure_performance=True)."""
    return kernel_pb2.EvalOptions(
        seed=KERNELBENCH_SEED,
        correct_trial_count=KERNELBENCH_CORRECT_TRIALS,
        perf_trial_count=KERNELBENCH_PERF_TRIALS,
        warmup_count=KERNELBENCH_WARMUP,
        atol=KERNELBENCH_TOLERANCE,
        rtol=KERNELBENCH_TOLERANCE,
        flush_l2=True,
    )


TYPE_NAMES = {
    "torch": kernel_pb2.KERNEL_TYPE_TORCH,
    "torch_cuda": kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
    "triton": kernel_pb2.KERNEL_TYPE_TRITON,
    "cuda": kernel_pb2.KERNEL_TYPE_CUDA,
}


def detect_kernel_type(source: str, filename: str = "") -> int:
    """KERNEL_TYPE_* for a source: CUDA for .cu/.cuh files or C++ with `__global__` and no
    Python imports, TRITON for @triton.jit, TORCH_CUDA for load_inline, TORCH otherwise."""
    suffix = Path(filename).suffix.lower()
    if suffix in (".cu", ".cuh") or (_GLOBAL.search(source) and not _PY_CODE.search(source)):
        return kernel_pb2.KERNEL_TYPE_CUDA
    if _TRITON.search(source):
        return kernel_pb2.KERNEL_TYPE_TRITON
    if _LOAD_INLINE.search(source):
        return kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    return kernel_pb2.KERNEL_TYPE_TORCH


def kernel_type(value: str | int | None, source: str, filename: str = "") -> int:
    """A KERNEL_TYPE_* from a name ("triton", "KERNEL_TYPE_CUDA"), a value, or detection."""
    if value is None or value == "" or value == "auto":
        return detect_kernel_type(source, filename)
    if isinstance(value, int):
        return value
    name = value.lower().removeprefix("kernel_type_")
    if name not in TYPE_NAMES:
        raise ValueError(f"unknown kernel type {value!r}; one of {sorted(TYPE_NAMES)} or auto")
    return TYPE_NAMES[name]


def kernel_source(
    source: str,
    *,
    filename: str = "",
    type: str | int | None = None,
    io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
) -> kernel_pb2.KernelSource:
    """A KernelSource for a source text; the type is detected unless given."""
    ks = kernel_pb2.KernelSource(
        type=kernel_type(type, source, filename),  # type: ignore[arg-type]
        source_code=source,
        entry_point=entry_point,
    )
    if io is not None:
        ks.io.CopyFrom(io)
    return ks


def load_kernel(
    path: str | Path,
    *,
    type: str | int | None = None,
    io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
) -> kernel_pb2.KernelSource:
    """A KernelSource from a file, read as it is."""
    p = Path(path)
    return kernel_source(
        p.read_text(encoding="utf-8"), filename=p.name, type=type, io=io, entry_point=entry_point
    )


def job_from_sources(
    kernel: str,
    reference: str | None = None,
    *,
    kernel_filename: str = "",
    reference_filename: str = "",
    options: kernel_pb2.EvalOptions | None = None,
    client_tag: str = "",
    kernel_type: str | int | None = None,
    io: kernel_pb2.IOContract | None = None,
    reference_io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
) -> kernel_pb2.JobSpec:
    """As `job_from_files`, from source texts (the file names only help detect the type)."""
    spec = kernel_pb2.JobSpec(client_tag=client_tag)
    spec.kernel.CopyFrom(
        kernel_source(
            kernel, filename=kernel_filename, type=kernel_type, io=io, entry_point=entry_point
        )
    )
    if reference is not None:
        # A KernelBench problem brings its own get_inputs(); reference_io overrides them.
        spec.reference.CopyFrom(
            kernel_source(reference, filename=reference_filename, io=reference_io)
        )
    if options is not None:
        spec.options.CopyFrom(options)
    return spec


def job_from_files(
    kernel: str | Path,
    reference: str | Path | None = None,
    *,
    options: kernel_pb2.EvalOptions | None = None,
    client_tag: str = "",
    kernel_type: str | int | None = None,
    io: kernel_pb2.IOContract | None = None,
    reference_io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
) -> kernel_pb2.JobSpec:
    """A JobSpec for a generated file, compared with a KernelBench problem file when given."""
    return job_from_sources(
        Path(kernel).read_text(encoding="utf-8"),
        None if reference is None else Path(reference).read_text(encoding="utf-8"),
        kernel_filename=Path(kernel).name,
        reference_filename="" if reference is None else Path(reference).name,
        options=options,
        client_tag=client_tag,
        kernel_type=kernel_type,
        io=io,
        reference_io=reference_io,
        entry_point=entry_point,
    )
