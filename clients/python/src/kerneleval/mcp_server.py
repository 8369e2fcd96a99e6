"""`kerneleval mcp`: the service as tools for LLM agents (Model Context Protocol).

Built on the official `mcp` SDK (`pip install 'kerneleval-client[mcp]'`; the base client does
not need it). It forwards every tool call to a kerneleval server over gRPC, so it runs
wherever the agent does: over stdio (the agent starts it) or streamable HTTP.

Tools: `evaluate_kernel` (a kernel alone, or against a reference), `compare_kernels` (the
reference required), `get_job`, `cancel_job`, and, only when an admin token is configured,
`list_devices`. Every parameter says what it is, its bounds and its default; every answer
has a typed output schema (`JobAnswer`), and the tools carry MCP's annotations (read-only,
destructive, idempotent). A kernel launched from an IOContract (a bare `@triton.jit` or
`__global__` kernel) takes it as `io`, in the proto3 JSON mapping, with a JSON Schema made
from the proto's own descriptor. While a job runs the tool sends progress notifications, one
series of bars per phase (progress.PhaseBars), as the CLI shows them. Bad input is a tool
error that says what to fix; a kernel's own failure is a verdict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from . import errors, kernelbench, progress, render
from .client import AsyncClient
from .v1 import job_pb2, kernel_pb2

T = TypeVar("T")
MAX_TEXT_LINES = 12  # of a compiler's or a traceback's output, in the text an LLM reads

# The service's default limits (server: spec/validation.py Limits); a server configured
# otherwise answers a value past its own limits with a tool error naming the field.
MAX_TRIALS = 10_000
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1, 600

INSTRUCTIONS = """Compile, check and time GPU kernels on a kerneleval server.
Sources use KernelBench's format: the candidate defines `class ModelNew` (PyTorch, Triton, or
CUDA through torch.utils.cpp_extension.load_inline), the reference `class Model` with
`get_inputs()` and `get_init_inputs()`. A bare Triton (`@triton.jit`) or CUDA (`__global__`)
kernel without a ModelNew is launched from an IOContract: pass it as `io` (its arguments,
shapes, dtypes and roles, and the launch grid). A verdict of OK with a speedup above 1 means
the candidate is correct and faster than the reference. CANNOT_RUN_HERE means the server's
host lacks the GPU the kernel needs: it was not evaluated, which is not a failure of the
kernel. `timing_source` says whether times are GPU times (cuda_events) or the host's clock
(cpu_wall_clock, a server without a GPU: not comparable with GPU times)."""

# How MCP's progress messages name the bars (progress.PhaseBars' labels).
_PROGRESS_WORDS = {
    "waiting in the queue": "waiting in the queue",
    "compiling": "compiling",
    "validating": "checking correctness",
    "profiling": "timing",
    "profiling kernel": "timing the kernel",
    "profiling reference": "timing the reference",
}

# --- the answers' schema ------------------------------------------------------------------


class Flag(BaseModel):
    """An integrity flag the service raised about the candidate."""

    model_config = ConfigDict(extra="forbid")
    rule_id: str = Field(description="the rule, e.g. timer_patch, decoy_kernel, replayed_outputs")
    message: str = Field(description="what was seen and where")
    source: Literal["static", "runtime", "unspecified"] = Field(
        description="static: the source's checks before it ran; runtime: seen while it ran"
    )


class Case(BaseModel):
    """One test or benchmark case of a GPU MODE task."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["test", "benchmark"]
    args: str = Field(description="generate_input's arguments, as GPU MODE writes them")
    passed: bool
    message: str | None = Field(None, description="check_implementation's message or the error")
    median_ms: float | None = Field(None, description="the submission's median (benchmarks)")
    speedup: float | None = Field(None, description="ref_kernel's median over the submission's")


class JobAnswer(BaseModel):
    """A job as an agent acts on it. Keys without a value are left out."""

    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(description="for get_job and cancel_job")
    state: Literal["QUEUED", "RUNNING", "DONE", "FAILED", "CANCELLED", "UNSPECIFIED"] = Field(
        description="DONE: it ran to a verdict; FAILED: the service could not run it"
    )
    verdict: str = Field(
        description="OK, COMPILE_ERROR, INCORRECT, RUNTIME_ERROR, DEVICE_FAULT, CRASHED, TIMEOUT, "
        "OUT_OF_MEMORY, RESOURCE_LIMIT, REJECTED, CANNOT_RUN_HERE (UNSPECIFIED before the end)"
    )
    evaluated: bool = Field(
        description="false for CANNOT_RUN_HERE: the server's host lacks what the kernel needs; "
        "neither correct nor wrong"
    )
    correct: bool = Field(description="true only when outputs were compared and matched")
    correctness: str = Field(description="yes, no, or why it was not checked")
    compiled: bool = Field(description="the candidate built")
    failed_side: Literal["kernel", "reference"] | None = Field(
        None, description="whose failure the verdict is (reference: the candidate was not judged)"
    )
    median_ms: float | None = Field(None, description="the candidate's median time, ms")
    reference_median_ms: float | None = Field(None, description="the reference's median, ms")
    reference_time_age_s: float | None = Field(
        None, description="set when the reference's time is an earlier job's: how old it is"
    )
    speedup: float | None = Field(None, description="reference median / candidate median")
    compiled_reference_median_ms: float | None = Field(
        None, description="compile_baseline: the reference under torch.compile, its median, ms"
    )
    compiled_speedup: float | None = Field(
        None, description="compile_baseline: torch.compile'd reference median / candidate median"
    )
    compile_time_s: float | None = Field(
        None, description="compile_baseline: torch.compile's compile time (untimed), seconds"
    )
    speedup_suspicious: bool | None = Field(
        None, description="true over 10x: check the candidate before trusting it"
    )
    timed_trials: int | None = Field(None, description="timed trials behind median_ms")
    timing_source: Literal["cuda_events", "cpu_wall_clock", "outside_bound"] | None = Field(
        None,
        description="cuda_events: GPU time from CUDA events; cpu_wall_clock: the host's clock on "
        "a server without a GPU, not comparable with GPU times; outside_bound: the judge's own "
        "clock around each call, because the kernel's own times disagreed with it (flagged)",
    )
    timed_from_outside: bool | None = Field(
        None,
        description="true: the judge drove the timed calls from outside the kernel's process "
        "and bounded them on its own clock; false: the kernel's own process timed it (no "
        "reference, or its data could not be shared), a time the kernel's code could forge",
    )
    trials_passed: str | None = Field(None, description='correctness trials, e.g. "5/5"')
    max_abs_error: float | None = Field(None, description="the largest absolute difference seen")
    worst_output: str | None = Field(None, description="the output with the worst mismatch")
    first_mismatch_index: list[int] | None = Field(None, description="its first bad element")
    compile_errors: str | None = Field(None, description="the compiler's error lines only")
    error: str | None = Field(None, description="the failure's message (its first lines)")
    flags: list[Flag] | None = Field(None, description="integrity flags (empty: none)")
    notes: list[str] | None = Field(
        None, description="what the service says of how the job ran (what it could not honour, "
        "where the reference's time came from, ...)",
    )  # fmt: skip
    state_reason: str | None = Field(None, description="why the job ended so (FAILED, CANCELLED)")
    cases: list[Case] | None = Field(None, description="a GPU MODE task's cases")
    summary: str = Field(description="the same in a few lines")


class DeviceRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = Field(description="GPU index (-1: the CPU)")
    name: str
    health: str = Field(description="HEALTHY, DEGRADED, UNHEALTHY, RESETTING, ...")


class Devices(BaseModel):
    """The server's devices."""

    model_config = ConfigDict(extra="forbid")
    devices: list[DeviceRow]
    summary: str


def summary(job: job_pb2.Job) -> dict[str, Any]:
    """What an agent acts on, as plain JSON values (JobAnswer's keys less the summary).
    `correct` is true only when outputs were compared and matched (correctness_status), not
    when nothing was checked; a kernel that could not run on the server's host has
    `evaluated` false: neither correct nor wrong."""
    r = job.result
    correctness = render.correctness_text(job)
    out: dict[str, Any] = {
        "job_id": job.job_id,
        "state": render.state_name(job.state),
        "verdict": render.verdict_name(r.verdict),
        "evaluated": r.verdict != job_pb2.VERDICT_CANNOT_RUN_HERE,
        "correct": correctness == "yes",
        "correctness": correctness,
        "compiled": bool(r.compiled),
    }
    if r.failed_side != job_pb2.SIDE_UNSPECIFIED:
        out["failed_side"] = render.enum_name(r.failed_side, job_pb2.Side, "SIDE_").lower()
    if r.runtime.median_ms:
        out["median_ms"] = r.runtime.median_ms
        out["timed_trials"] = r.runtime.trial_count
        out["timed_from_outside"] = r.runtime.timed_from_outside
    if r.runtime.source != job_pb2.TIMING_SOURCE_UNSPECIFIED:
        source = render.enum_name(r.runtime.source, job_pb2.TimingSource, "TIMING_SOURCE_")
        out["timing_source"] = source.lower()
    if r.reference_runtime.median_ms:
        out["reference_median_ms"] = r.reference_runtime.median_ms
    if r.HasField("reference_runtime_age"):  # an earlier job's time of the same reference
        out["reference_time_age_s"] = r.reference_runtime_age.ToMilliseconds() / 1e3
    if r.speedup:
        out["speedup"] = r.speedup
        out["speedup_suspicious"] = r.speedup_suspicious
    if r.compiled_reference_runtime.median_ms:  # EvalOptions.compile_baseline
        out["compiled_reference_median_ms"] = r.compiled_reference_runtime.median_ms
    if r.compiled_speedup:
        out["compiled_speedup"] = r.compiled_speedup
    if r.HasField("compile_time"):
        out["compile_time_s"] = r.compile_time.ToMilliseconds() / 1e3
    v = r.validation
    if v.trial_count:
        out["trials_passed"] = f"{v.trials_passed}/{v.trial_count}"
        out["max_abs_error"] = v.max_abs_error
        if v.output_name:
            out["worst_output"] = v.output_name
            out["first_mismatch_index"] = list(v.first_mismatch_index)
    if r.compilation_error:
        out["compile_errors"] = first_errors(r.compilation_error)
    message = r.validation_error or r.error.message or r.fault.description
    if message:
        out["error"] = _head(message)
    out["flags"] = [_flag(f) for f in r.flags]
    if r.notes:
        out["notes"] = [render.printable(n) for n in r.notes]
    if job.state_reason:
        out["state_reason"] = job.state_reason
    cases = [("test", c) for c in r.test_cases] + [("benchmark", c) for c in r.benchmark_cases]
    if cases:  # a GPU MODE task's
        out["cases"] = [_case(kind, c) for kind, c in cases]
    return out


def _flag(f: job_pb2.IntegrityFlag) -> dict[str, Any]:
    source = render.enum_name(f.source, job_pb2.FlagSource, "FLAG_SOURCE_").lower()
    return {"rule_id": f.rule_id, "message": render.printable(f.message), "source": source}


def _case(kind: str, c: job_pb2.CaseResult) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "args": c.spec, "passed": c.passed}
    if c.message:
        out["message"] = _head(c.message, 3)
    if c.runtime.median_ms:
        out["median_ms"] = c.runtime.median_ms
    if c.speedup:
        out["speedup"] = c.speedup
    return out


def answer(job: job_pb2.Job) -> dict[str, Any]:
    """summary() with its text under "summary": what every tool about a job returns."""
    s = summary(job)
    s["summary"] = text_of(s)
    return s


def text_of(s: dict[str, Any]) -> str:
    """The same, as a few lines."""
    lines = [f"{s['verdict']} ({s['state']}), job {s['job_id']}"]
    if not s["evaluated"]:
        lines.append(
            f"{render.NOT_RUN_HERE}: the server's host lacks what the kernel needs; not a "
            "failure of the kernel, nothing was checked or timed"
        )
    clock = " (host clock, no GPU)" if s.get("timing_source") == "cpu_wall_clock" else ""
    if "speedup" in s:
        lines.append(
            f"speedup {s['speedup']:.3g}x: {s['median_ms']:.4f} ms vs the reference's "
            f"{s['reference_median_ms']:.4f} ms{clock}"
        )
        if "compiled_speedup" in s:
            lines.append(
                f"speedup over torch.compile {s['compiled_speedup']:.3g}x: the compiled "
                f"reference's {s['compiled_reference_median_ms']:.4f} ms{clock}"
            )
        if s.get("speedup_suspicious"):
            lines.append("the speedup is over 10x: suspicious, check the candidate")
    elif "median_ms" in s:
        lines.append(f"median {s['median_ms']:.4f} ms{clock}")
    if "trials_passed" in s:
        worst = f" (worst: {s['worst_output']})" if "worst_output" in s else ""
        lines.append(
            f"correctness: {s['trials_passed']} trials passed, max abs error "
            f"{s['max_abs_error']:.3g}{worst}"
        )
    if s["correctness"] not in ("yes", "no"):
        lines.append(f"correctness: {s['correctness']}")
    if "compile_errors" in s:
        lines.append("compile errors:\n" + s["compile_errors"])
    if "error" in s:
        lines.append("error: " + s["error"])
    for f in s.get("flags", []):
        lines.append(f"integrity flag {f['rule_id']}: {f['message']}")
    for note in s.get("notes", []):
        lines.append("note: " + note)
    failed = [c for c in s.get("cases", []) if not c["passed"]]
    if failed:
        c = failed[0]
        lines.append(
            f"{len(failed)} of {len(s['cases'])} cases failed; first: {c['kind']} "
            f"({c['args']}): {c.get('message', '')}".rstrip(": ")
        )
    return "\n".join(lines)


def _head(text: str, limit: int = MAX_TEXT_LINES) -> str:
    lines = render.printable(text.strip()).splitlines()
    more = f"\n... ({len(lines) - limit} more lines)" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


_ERROR_LINE = re.compile(r"(error|Error|ERROR)\b")


def first_errors(log: str) -> str:
    """The compiler's error lines (and the line after each: the source it points at), not the
    pages of header and build-tool noise around them."""
    lines = log.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and line not in picked:
            picked.append(line)
            if i + 1 < len(lines) and not _ERROR_LINE.search(lines[i + 1]):
                picked.append(lines[i + 1])
        if len(picked) >= MAX_TEXT_LINES:
            break
    return _head("\n".join(picked) if picked else log)


# --- the IOContract's JSON Schema, from the proto's descriptor ----------------------------

# What each field of an IOContract is (the .proto's comments, which the generated code does
# not carry); tests/clients/test_mcp.py checks that every field has one.
FIELD_NOTES = {
    "kerneleval.v1.IOContract.args": "the kernel's arguments, in its signature's order",
    "kerneleval.v1.IOContract.launch": "how to launch it; grid required",
    "kerneleval.v1.ArgSpec.name": "as in the kernel's signature (an identifier)",
    "kerneleval.v1.ArgSpec.role": "INPUT (read), OUTPUT (written; compared with the "
    "reference) or INOUT; unset: INPUT",
    "kerneleval.v1.ArgSpec.meta": "a Triton tl.constexpr (scalars only)",
    "kerneleval.v1.ArgSpec.tensor": "a tensor on the device",
    "kerneleval.v1.ArgSpec.intValue": "an integer scalar",
    "kerneleval.v1.ArgSpec.floatValue": "a floating-point scalar",
    "kerneleval.v1.ArgSpec.boolValue": "a boolean scalar",
    "kerneleval.v1.TensorSpec.shape": "size of each dimension, e.g. [1024] or [64, 128]",
    "kerneleval.v1.TensorSpec.dtype": "element type",
    "kerneleval.v1.TensorSpec.init": "generated contents (unset: randn(0, 1), fresh each trial)",
    "kerneleval.v1.TensorSpec.data": "literal contents, base64 of the little-endian bytes (small "
    "tensors only)",
    "kerneleval.v1.TensorInit.seed": "0: the job's seed mixed with the argument's position",
    "kerneleval.v1.TensorInit.randn": "normal: mean, std (0 means 1)",
    "kerneleval.v1.TensorInit.uniform": "uniform over [low, high)",
    "kerneleval.v1.TensorInit.randint": "integers over [low, high)",
    "kerneleval.v1.TensorInit.full": "every element `value`",
    "kerneleval.v1.TensorInit.zeros": "zeros: {}",
    "kerneleval.v1.TensorInit.ones": "ones: {}",
    "kerneleval.v1.TensorInit.arange": "start, start + step, ...",
    "kerneleval.v1.RandnInit.mean": "mean",
    "kerneleval.v1.RandnInit.std": "standard deviation; 0 means 1",
    "kerneleval.v1.UniformInit.low": "lower bound, inclusive",
    "kerneleval.v1.UniformInit.high": "upper bound, exclusive",
    "kerneleval.v1.RandintInit.low": "lower bound, inclusive",
    "kerneleval.v1.RandintInit.high": "upper bound, exclusive",
    "kerneleval.v1.FullInit.value": "the value",
    "kerneleval.v1.ArangeInit.start": "first value",
    "kerneleval.v1.ArangeInit.step": "increment; 0 means 1",
    "kerneleval.v1.LaunchConfig.grid": "blocks (CUDA) or programs (Triton) per axis",
    "kerneleval.v1.LaunchConfig.block": "threads per block (CUDA only)",
    "kerneleval.v1.LaunchConfig.numWarps": "Triton num_warps; 0: Triton's default",
    "kerneleval.v1.LaunchConfig.numStages": "Triton num_stages; 0: Triton's default",
    "kerneleval.v1.LaunchConfig.sharedMemoryBytes": "dynamic shared memory per block (CUDA)",
    "kerneleval.v1.Dim3.x": "x extent (0 means 1)",
    "kerneleval.v1.Dim3.y": "y extent (0 means 1)",
    "kerneleval.v1.Dim3.z": "z extent (0 means 1)",
}
_FD = _descriptor.FieldDescriptor
_INTEGERS = {
    _FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_UINT32, _FD.TYPE_UINT64, _FD.TYPE_SINT32,
    _FD.TYPE_SINT64, _FD.TYPE_FIXED32, _FD.TYPE_FIXED64, _FD.TYPE_SFIXED32, _FD.TYPE_SFIXED64,
}  # fmt: skip


def message_json_schema(desc: Any) -> dict[str, Any]:  # a message Descriptor
    """A JSON Schema of `desc` in the proto3 JSON mapping (json_format.ParseDict reads it):
    lowerCamelCase keys, enums by name, a oneof's members named in its description."""
    props: dict[str, Any] = {}
    for f in desc.fields:
        props[f.json_name] = _field_schema(f)
        note = FIELD_NOTES.get(f"{desc.full_name}.{f.json_name}")
        own = props[f.json_name].get("description")  # a message's oneofs
        if note:
            props[f.json_name]["description"] = f"{note} ({own})" if own else note
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    oneofs = [o for o in desc.oneofs if not o.name.startswith("_")]  # not proto3 `optional`
    if oneofs:
        schema["description"] = "; ".join(
            "at most one of " + ", ".join(f.json_name for f in o.fields) for o in oneofs
        )
    return schema


def _field_schema(f: Any) -> dict[str, Any]:  # a FieldDescriptor
    if f.type == _FD.TYPE_MESSAGE:
        one = message_json_schema(f.message_type)
    elif f.type == _FD.TYPE_ENUM:
        one = {"type": "string", "enum": [v.name for v in f.enum_type.values if v.number]}
    elif f.type in _INTEGERS:
        one = {"type": "integer"}
    elif f.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        one = {"type": "number"}
    elif f.type == _FD.TYPE_BOOL:
        one = {"type": "boolean"}
    elif f.type == _FD.TYPE_BYTES:
        one = {"type": "string", "contentEncoding": "base64"}
    else:
        one = {"type": "string"}
    if f.is_repeated:
        return {"type": "array", "items": one}
    return one


IO_SCHEMA = message_json_schema(kernel_pb2.IOContract.DESCRIPTOR)
IO_EXAMPLE = {
    "args": [
        {"name": "x_ptr", "tensor": {"shape": [4096], "dtype": "DTYPE_FLOAT32"}},
        {"name": "y_ptr", "tensor": {"shape": [4096], "dtype": "DTYPE_FLOAT32"}},
        {"name": "out_ptr", "role": "ARG_ROLE_OUTPUT",
         "tensor": {"shape": [4096], "dtype": "DTYPE_FLOAT32"}},
        {"name": "n", "intValue": 4096},
        {"name": "BLOCK", "intValue": 1024, "meta": True},
    ],
    "launch": {"grid": {"x": 4}},
}  # fmt: skip
_IO_HELP = (
    "The IOContract of a kernel launched without a ModelNew (a bare @triton.jit or __global__ "
    "kernel), in the proto3 JSON mapping: its arguments in signature order (tensors with shape, "
    "dtype and role; scalars; Triton constexprs with meta) and the launch grid. A Triton add: "
    + json.dumps(IO_EXAMPLE)
    + ". Against a `Model` reference, forward() takes the INPUT and INOUT tensors in order and "
    "returns the outputs in OUTPUT/INOUT order. Leave it out for a ModelNew source."
)


def _optional_object(schema: dict[str, Any], description: str) -> Any:
    return WithJsonSchema(
        {"anyOf": [schema, {"type": "null"}], "default": None, "description": description}
    )


# --- the tools' parameters ----------------------------------------------------------------

KernelType = Literal["auto", "torch", "torch_cuda", "triton", "cuda"]
Source = Annotated[
    str,
    Field(
        description="the candidate's source: a KernelBench `ModelNew` (PyTorch, Triton, or CUDA "
        "through load_inline), or a bare @triton.jit / __global__ kernel launched from `io`"
    ),
]
Kind = Annotated[
    KernelType,
    Field(
        description="auto: detected from the source (__global__ without Python: cuda; "
        "@triton.jit: triton; load_inline: torch_cuda; else torch)"
    ),
]
ReferenceSource = Annotated[
    str,
    Field(
        description="the reference: a KernelBench `Model` with get_inputs() and "
        "get_init_inputs() (or another kernel with its own io); empty: nothing to compare"
    ),
]
IO = Annotated[dict[str, Any] | None, _optional_object(IO_SCHEMA, _IO_HELP)]
ReferenceIO = Annotated[
    dict[str, Any] | None,
    _optional_object(IO_SCHEMA, "the reference's IOContract, when it too is a bare kernel"),
]
EntryPoint = Annotated[
    str,
    Field(
        max_length=256,
        description="the class or kernel to run; empty: ModelNew, then Model (or the only kernel)",
    ),
]
CorrectTrials = Annotated[
    int,
    Field(ge=1, le=MAX_TRIALS, description="correctness trials, each on fresh inputs"),
]
PerfTrials = Annotated[
    int,
    Field(ge=0, le=MAX_TRIALS, description="timed trials (the median is reported); 0: no timing"),
]
Warmup = Annotated[int, Field(ge=0, le=MAX_TRIALS, description="untimed runs before timing")]
_BY_DTYPE = "by the output's dtype (1e-4 float32/float64, 1e-2 float16/bfloat16, exact for ints)"
Atol = Annotated[
    float | None,
    Field(ge=0, description=f"absolute tolerance of the output check; unset: {_BY_DTYPE}"),
]
Rtol = Annotated[
    float | None,
    Field(ge=0, description=f"relative tolerance of the output check; unset: {_BY_DTYPE}"),
]
Seed = Annotated[
    int | None,
    Field(ge=0, le=2**64 - 1, description="seed of inputs and weights; unset: 42"),
]
CompileBaseline = Annotated[
    bool,
    Field(
        description="also time the reference (a KernelBench Model) under torch.compile, as "
        "KernelBench's run_and_check.py: the result adds compiled_speedup (its compile time is "
        "not timed; costs the compile, seconds to a minute)"
    ),
]
TimeoutS = Annotated[
    int,
    Field(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S, description="the whole job's limit, seconds"),
]
JobId = Annotated[
    str, Field(min_length=1, max_length=128, description="the job_id an evaluation returned")
]

_JOB_OUTPUT = Annotated[CallToolResult, JobAnswer]
_DEVICES_OUTPUT = Annotated[CallToolResult, Devices]


def build_spec(
    source: str,
    kernel_type: str,
    reference_source: str,
    reference_type: str,
    correct_trials: int,
    perf_trials: int,
    timeout_s: int,
    *,
    io: dict[str, Any] | None = None,
    reference_io: dict[str, Any] | None = None,
    entry_point: str = "",
    warmup: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int | None = None,
    compile_baseline: bool = False,
) -> kernel_pb2.JobSpec:
    if not source.strip():
        raise ToolError("source is empty: pass the candidate's code (a ModelNew or a kernel)")
    try:
        spec = kernel_pb2.JobSpec(client_tag="mcp")
        spec.kernel.CopyFrom(
            kernelbench.kernel_source(
                source, type=kernel_type, io=_io(io, "io"), entry_point=entry_point
            )
        )
        if reference_source.strip():
            spec.reference.CopyFrom(
                kernelbench.kernel_source(
                    reference_source, type=reference_type, io=_io(reference_io, "reference_io")
                )
            )
    except ValueError as e:
        raise ToolError(str(e)) from e
    o = spec.options
    o.correct_trial_count = correct_trials
    o.perf_trial_count = perf_trials
    o.timeout.seconds = timeout_s
    for name, value in (("warmup_count", warmup), ("atol", atol), ("rtol", rtol), ("seed", seed)):
        if value is not None:
            setattr(o, name, value)
    o.compile_baseline = compile_baseline
    return spec


def _io(value: dict[str, Any] | None, name: str) -> kernel_pb2.IOContract | None:
    if not value:
        return None
    try:
        return json_format.ParseDict(value, kernel_pb2.IOContract())
    except json_format.ParseError as e:
        raise ToolError(f"{name} is not an IOContract: {e} (e.g. {json.dumps(IO_EXAMPLE)})") from e


def tool_error(e: errors.KernelEvalError) -> ToolError:
    """A service error as what the agent should change."""
    return ToolError(str(e))


def _result(structured: dict[str, Any]) -> CallToolResult:
    """The answer as structured content, and the same JSON as text for clients without it."""
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(structured, indent=2))],
        structured_content=structured,
    )


READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
RUNS_A_JOB = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)
CANCELS = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
)


def make_server(
    address: str,
    *,
    admin_token: str | None = None,
    credentials: Any = None,
    tenant_token: str | None = None,
) -> MCPServer:
    """`tenant_token`: a service with tenants (else $KERNELEVAL_TENANT_TOKEN, as any client)."""
    server = MCPServer("kerneleval", instructions=INSTRUCTIONS)

    def client() -> AsyncClient:
        return AsyncClient(
            address, admin_token=admin_token, credentials=credentials, tenant_token=tenant_token
        )

    async def call(method: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """One call to the server; its errors as tool errors."""
        async with client() as c:
            try:
                return await method(c)
            except errors.KernelEvalError as e:
                raise tool_error(e) from e

    async def run(spec: kernel_pb2.JobSpec, ctx: Context) -> CallToolResult:
        bars = progress.PhaseBars.for_spec(spec)
        step = 0  # MCP's progress only grows: one step per bar moved
        job: job_pb2.Job | None = None
        async with client() as c:
            try:
                async for event in c.run(spec):
                    messages = [_progress_text(b) for b in bars.event(event)]
                    if event.WhichOneof("kind") == "queued":
                        messages.insert(0, "waiting in the queue")
                    for message in messages:
                        step += 1
                        await ctx.report_progress(step, None, message)
                    if event.WhichOneof("kind") == "finished":
                        job = event.finished
            except errors.KernelEvalError as e:
                raise tool_error(e) from e
        if job is None:
            raise ToolError("the server ended the job's stream without its result; get_job")
        return _result(answer(job))

    @server.tool(annotations=RUNS_A_JOB)
    async def evaluate_kernel(
        source: Source,
        ctx: Context,
        kernel_type: Kind = "auto",
        reference_source: ReferenceSource = "",
        reference_type: Kind = "auto",
        io: IO = None,
        reference_io: ReferenceIO = None,
        entry_point: EntryPoint = "",
        correct_trials: CorrectTrials = 5,
        perf_trials: PerfTrials = 100,
        warmup: Warmup = 10,
        atol: Atol = None,
        rtol: Rtol = None,
        seed: Seed = None,
        compile_baseline: CompileBaseline = False,
        timeout_s: TimeoutS = 120,
    ) -> _JOB_OUTPUT:
        """Compile, check and time a kernel on the server's GPU. `source`: the candidate (a
        KernelBench `ModelNew`; PyTorch, Triton or load_inline CUDA; or a bare Triton or CUDA
        kernel with its `io`); with `reference_source` (a `Model` with get_inputs) it is checked
        against it and its speedup measured. Returns the verdict (OK, INCORRECT,
        COMPILE_ERROR, RUNTIME_ERROR, ...), the median time and where it came from, the
        speedup, the worst mismatch, the first compiler errors, integrity flags and the
        service's notes."""
        spec = build_spec(
            source, kernel_type, reference_source, reference_type, correct_trials, perf_trials,
            timeout_s, io=io, reference_io=reference_io, entry_point=entry_point, warmup=warmup,
            atol=atol, rtol=rtol, seed=seed, compile_baseline=compile_baseline,
        )  # fmt: skip
        return await run(spec, ctx)

    @server.tool(annotations=RUNS_A_JOB)
    async def compare_kernels(
        source: Source,
        reference_source: ReferenceSource,
        ctx: Context,
        kernel_type: Kind = "auto",
        reference_type: Kind = "auto",
        io: IO = None,
        reference_io: ReferenceIO = None,
        entry_point: EntryPoint = "",
        correct_trials: CorrectTrials = 5,
        perf_trials: PerfTrials = 100,
        warmup: Warmup = 10,
        atol: Atol = None,
        rtol: Rtol = None,
        seed: Seed = None,
        compile_baseline: CompileBaseline = False,
        timeout_s: TimeoutS = 120,
    ) -> _JOB_OUTPUT:
        """Check a candidate kernel against a reference and time both: correctness over
        `correct_trials` fresh inputs (within atol/rtol), then the speedup (reference median /
        candidate median over `perf_trials` timed trials)."""
        if not reference_source.strip():
            raise ToolError("reference_source is empty: compare_kernels needs the reference")
        spec = build_spec(
            source, kernel_type, reference_source, reference_type, correct_trials, perf_trials,
            timeout_s, io=io, reference_io=reference_io, entry_point=entry_point, warmup=warmup,
            atol=atol, rtol=rtol, seed=seed, compile_baseline=compile_baseline,
        )  # fmt: skip
        return await run(spec, ctx)

    @server.tool(annotations=READ_ONLY)
    async def get_job(job_id: JobId) -> _JOB_OUTPUT:
        """A job's state and result, by the job_id an evaluation returned."""
        return _result(answer(await call(lambda c: c.get_job(job_id))))

    @server.tool(annotations=CANCELS)
    async def cancel_job(job_id: JobId) -> _JOB_OUTPUT:
        """Cancels a queued or running job (its process is killed); returns it as it ended.
        A job that has ended already is returned as it is."""
        return _result(answer(await call(lambda c: c.cancel_job(job_id))))

    if admin_token:  # an operations tool without the token would only ever fail

        @server.tool(annotations=READ_ONLY)
        async def list_devices() -> _DEVICES_OUTPUT:
            """The server's GPUs (or its CPU, index -1) and their health."""
            devices = await call(lambda c: c.list_devices())
            rows = [
                {"index": d.index, "name": d.name, "health": render.health_name(d.health)}
                for d in devices
            ]
            text = "\n".join(f"{r['index']}: {r['name']} {r['health']}" for r in rows)
            return _result({"devices": rows, "summary": text})

    return server


def _progress_text(bar: progress.Bar) -> str:
    words = _PROGRESS_WORDS.get(bar.label, bar.label)
    return f"{words} {bar.done}/{bar.total}" if bar.total else words


def serve(
    address: str,
    *,
    admin_token: str | None = None,
    credentials: Any = None,
    http_port: int = 0,
    http_host: str = "127.0.0.1",
    tenant_token: str | None = None,
) -> int:
    """Runs the MCP server: over stdio, or streamable HTTP on `http_port` (path /mcp)."""
    server = make_server(
        address, admin_token=admin_token, credentials=credentials, tenant_token=tenant_token
    )
    if http_port:
        server.run("streamable-http", host=http_host, port=http_port)
    else:
        server.run("stdio")
    return 0
