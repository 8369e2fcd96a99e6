"""JobSpec checks, shared by the front end (INVALID_ARGUMENT with google.rpc.BadRequest) and
the engine (which re-checks before it runs anything).

Every violation names the exact field path, e.g. "spec.kernel.io.args[0].tensor.shape[1]".

Also the API's other limits: the free strings a client sends (tags, ids, page tokens) and the
log output stored per job, so that the front end, the store and the engine agree on them.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kerneleval.contracts import ITEMSIZE  # bytes per element of every DType
from kerneleval.v1 import dtype_pb2, kernel_pb2

from kerneleval_server.framing import MAX_FRAME
from kerneleval_server.spec import placement

# The largest spec a job process can receive: one frame less the AssignJob wrapper's room.
SPEC_BYTES_CEILING = MAX_FRAME - (4 << 20)

_KERNEL_TYPES = {
    kernel_pb2.KERNEL_TYPE_TORCH,
    kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
    kernel_pb2.KERNEL_TYPE_TRITON,
    kernel_pb2.KERNEL_TYPE_CUDA,
    kernel_pb2.KERNEL_TYPE_GPU_MODE,
}
GPU_MODE = kernel_pb2.KERNEL_TYPE_GPU_MODE
# A module both sides of a GPU_MODE job import; not a name the harness gives its own files.
_MODULE_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.py")
_HARNESS_FILES = frozenset({"submission.py", "reference.py", "eval.py"})
_ROLES = {
    kernel_pb2.ARG_ROLE_UNSPECIFIED,
    kernel_pb2.ARG_ROLE_INPUT,
    kernel_pb2.ARG_ROLE_OUTPUT,
    kernel_pb2.ARG_ROLE_INOUT,
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# What one stored log event counts against Limits.max_log_bytes besides its text.
LOG_EVENT_OVERHEAD = 64
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """What one job may ask for. The defaults suit a GPU with tens of GiB."""

    max_source_bytes: int = 1 << 20  # 1 MiB per source
    max_tensor_elements: int = 1 << 31  # elements of one tensor
    max_total_tensor_bytes: int = 16 << 30  # all tensors of one kernel's IOContract
    max_rank: int = 8
    max_args: int = 64
    max_trial_count: int = 10_000  # correct_trial_count and perf_trial_count
    max_warmup_count: int = 10_000
    max_timeout_seconds: float = 600.0
    min_timeout_seconds: float = 1.0
    max_launch_dim: int = 2**31 - 1
    max_entry_point_length: int = 256  # characters of KernelSource.entry_point
    max_arg_name_length: int = 256  # characters of ArgSpec.name
    # The serialized JobSpec. A job process receives it in one job-channel frame (at most
    # framing.MAX_FRAME, 16 MiB) wrapped in an AssignJob: 4 MiB is left for the wrapper.
    max_spec_bytes: int = 12 << 20
    max_client_tag_bytes: int = 256  # JobSpec.client_tag and ListJobsRequest.client_tag
    max_labels: int = 16  # JobSpec.labels and ListJobsRequest.labels
    max_label_value_bytes: int = 256  # a label's value (keys: LABEL_KEY)
    max_idempotency_key_bytes: int = 128  # SubmitRequest.idempotency_key
    max_request_tag_bytes: int = 256  # RunBatchRequest.request_tag (echoed on every event)
    max_job_id_bytes: int = 128  # job ids in GetJob, Watch, CancelJob (the service's are 32)
    max_page_token_bytes: int = 128  # ListJobsRequest.page_token
    max_task_cases: int = 256  # GpuModeTask.tests, and GpuModeTask.benchmarks
    max_task_files: int = 16  # GpuModeTask.files
    max_task_string_bytes: int = 256  # a TaskArg's string_value (and a TaskValue's, a key's)
    max_task_values: int = 4096  # values of one case's lists and mappings, all levels counted
    max_task_depth: int = 8  # lists and mappings inside each other in one argument
    # Log text stored per job (JobLog events); each log event also counts LOG_EVENT_OVERHEAD
    # bytes, so that a flood of empty lines is bounded too. Past it: one note, then nothing.
    max_log_bytes: int = 1 << 20

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """Defaults overridden by KERNELEVAL_LIMIT_<FIELD> variables (e.g.
        KERNELEVAL_LIMIT_MAX_SOURCE_BYTES=2097152), so workers can share the front end's."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("KERNELEVAL_LIMIT_" + f.name.upper())
            if raw and not isinstance(getattr(cls, f.name, None), tuple):
                values[f.name] = type(getattr(cls(), f.name))(float(raw))
        # A spec past one frame could be accepted but never delivered: never above the ceiling.
        if values.get("max_spec_bytes", 0) > SPEC_BYTES_CEILING:
            values["max_spec_bytes"] = SPEC_BYTES_CEILING
        return cls(**values)


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_string(
    field: str, value: str, limit: int, out: list[FieldViolation] | None = None
) -> FieldViolation | None:
    """A violation when `value` is longer than `limit` bytes in UTF-8 (also appended to out)."""
    size = utf8_size(value)
    if size <= limit:
        return None
    v = FieldViolation(field, f"{size} bytes, the limit is {limit} bytes")
    if out is not None:
        out.append(v)
    return v


# A label's key: lower case, as Kubernetes' and Prometheus' names, so labels travel to either.
LABEL_KEY = re.compile(r"[a-z][a-z0-9_.-]{0,62}")


def check_labels(
    field: str, labels: Mapping[str, str], limits: Limits, out: list[FieldViolation]
) -> None:
    if len(labels) > limits.max_labels:
        out.append(FieldViolation(field, f"{len(labels)} labels; at most {limits.max_labels}"))
    for key, value in sorted(labels.items())[: limits.max_labels + 1]:
        if not LABEL_KEY.fullmatch(key):
            out.append(
                FieldViolation(
                    f"{field}[{key[:64]!r}]",
                    "a key is 1-63 characters of [a-z0-9_.-] starting with a letter",
                )
            )
        check_string(f"{field}[{key[:64]!r}]", value, limits.max_label_value_bytes, out)


def validate_spec(
    spec: kernel_pb2.JobSpec, limits: Limits = Limits(), *, require_reference: bool = False
) -> list[FieldViolation]:
    """Every problem with `spec`, or an empty list. Never raises."""
    out: list[FieldViolation] = []
    check_string("spec.client_tag", spec.client_tag, limits.max_client_tag_bytes, out)
    check_labels("spec.labels", spec.labels, limits, out)
    literals: list[tuple[int, str]] = []  # (bytes, field) of every literal tensor
    if not spec.HasField("kernel"):
        out.append(FieldViolation("spec.kernel", "required"))
    else:
        _check_kernel("spec.kernel", spec.kernel, limits, out, literals)
    if spec.HasField("reference"):
        _check_kernel("spec.reference", spec.reference, limits, out, literals)
    elif require_reference:
        out.append(FieldViolation("spec.reference", "required by Compare"))
    _check_gpu_mode(spec, limits, out)
    _check_options("spec.options", spec.options, limits, out)
    _check_spec_size(spec, limits, out, literals)
    return out


def _check_gpu_mode(spec: kernel_pb2.JobSpec, limits: Limits, out: list[FieldViolation]) -> None:
    """A GPU_MODE kernel comes with a GPU_MODE reference (its inputs and its judge) and the
    task's cases; neither comes without it."""
    kernel_is = spec.kernel.type == GPU_MODE
    reference_is = spec.HasField("reference") and spec.reference.type == GPU_MODE
    if kernel_is and not spec.HasField("reference"):
        out.append(
            FieldViolation(
                "spec.reference",
                "required by a KERNEL_TYPE_GPU_MODE kernel: generate_input, ref_kernel and "
                "check_implementation (the judge) come from the reference",
            )
        )
    elif kernel_is != reference_is and spec.HasField("reference"):
        out.append(
            FieldViolation(
                "spec.reference.type",
                "KERNEL_TYPE_GPU_MODE goes with KERNEL_TYPE_GPU_MODE: the kernel is "
                f"{kernel_pb2.KernelType.Name(spec.kernel.type)}, the reference "
                f"{kernel_pb2.KernelType.Name(spec.reference.type)}",
            )
        )
    if reference_is and spec.reference.entry_point:
        out.append(
            FieldViolation(
                "spec.reference.entry_point",
                "a GPU_MODE reference's functions have fixed names: leave it empty",
            )
        )
    if not kernel_is:
        if spec.HasField("gpu_mode"):
            out.append(FieldViolation("spec.gpu_mode", "only for KERNEL_TYPE_GPU_MODE jobs"))
        return
    task = spec.gpu_mode
    if len(task.tests) == 0:
        out.append(
            FieldViolation("spec.gpu_mode.tests", "required: at least one test case (task.yml)")
        )
    for name, given in (("tests", task.tests), ("benchmarks", task.benchmarks)):
        if len(given) > limits.max_task_cases:
            out.append(
                FieldViolation(
                    f"spec.gpu_mode.{name}", f"{len(given)} cases; at most {limits.max_task_cases}"
                )
            )
        for i, case in enumerate(given[: limits.max_task_cases]):
            _check_case(f"spec.gpu_mode.{name}[{i}]", case, limits, out)
    _check_files("spec.gpu_mode.files", task.files, limits, out)


def _check_case(
    path: str, case: kernel_pb2.TaskCase, limits: Limits, out: list[FieldViolation]
) -> None:
    if len(case.args) > limits.max_args:
        out.append(
            FieldViolation(f"{path}.args", f"{len(case.args)} args; at most {limits.max_args}")
        )
    names: set[str] = set()
    for j, arg in enumerate(case.args[: limits.max_args]):
        ap = f"{path}.args[{j}]"
        if len(arg.name) > limits.max_arg_name_length or not _IDENTIFIER.fullmatch(arg.name):
            out.append(
                FieldViolation(
                    f"{ap}.name",
                    f"{arg.name[:64]!r} is not an identifier of at most "
                    f"{limits.max_arg_name_length} characters",
                )
            )
        elif arg.name in names:
            out.append(FieldViolation(f"{ap}.name", f"duplicate argument name {arg.name!r}"))
        names.add(arg.name)
    total = sum(_task_values(arg) for arg in case.args[: limits.max_args])
    if total > limits.max_task_values:
        out.append(
            FieldViolation(
                f"{path}.args",
                f"{total} values in lists and mappings; at most {limits.max_task_values}",
            )
        )
    for j, arg in enumerate(case.args[: limits.max_args]):
        _check_task_value(f"{path}.args[{j}]", arg, limits, out, 1, total <= limits.max_task_values)


def _task_values(v: kernel_pb2.TaskArg | kernel_pb2.TaskValue) -> int:
    """The values inside v's lists and mappings, at every level (protobuf's own parser keeps
    the nesting under 100)."""
    which = v.WhichOneof("value")
    if which == "list_value":
        return sum(1 + _task_values(x) for x in v.list_value.values)
    if which == "map_value":
        return sum(1 + _task_values(e.value) for e in v.map_value.entries)
    return 0


def _check_task_value(
    path: str,
    v: kernel_pb2.TaskArg | kernel_pb2.TaskValue,
    limits: Limits,
    out: list[FieldViolation],
    depth: int,
    descend: bool,
) -> None:
    """One value of a case (TaskArg and TaskValue name their oneofs alike), and with
    `descend` the values in its lists and mappings."""
    which = v.WhichOneof("value")
    if which is None:
        out.append(
            FieldViolation(f"{path}.value", "required: an int, float, string, bool, list or map")
        )
    elif which == "float_value" and not math.isfinite(v.float_value):
        out.append(FieldViolation(f"{path}.float_value", "must be finite"))
    elif which == "string_value":
        check_string(f"{path}.string_value", v.string_value, limits.max_task_string_bytes, out)
    elif which in ("list_value", "map_value") and descend:
        if depth > limits.max_task_depth:
            out.append(
                FieldViolation(
                    f"{path}.{which}",
                    f"lists and mappings nested deeper than {limits.max_task_depth}",
                )
            )
            return
        if which == "list_value":
            for i, x in enumerate(v.list_value.values):
                _check_task_value(f"{path}.list_value.values[{i}]", x, limits, out, depth + 1, True)
            return
        keys: set[str] = set()
        for i, e in enumerate(v.map_value.entries):
            ep = f"{path}.map_value.entries[{i}]"
            if check_string(f"{ep}.key", e.key, limits.max_task_string_bytes, out) is None:
                if e.key in keys:
                    out.append(FieldViolation(f"{ep}.key", f"duplicate key {e.key[:64]!r}"))
                keys.add(e.key)
            _check_task_value(f"{ep}.value", e.value, limits, out, depth + 1, True)


def _check_files(path: str, files: Any, limits: Limits, out: list[FieldViolation]) -> None:
    if len(files) > limits.max_task_files:
        out.append(FieldViolation(path, f"{len(files)} files; at most {limits.max_task_files}"))
    names: set[str] = set()
    for i, f in enumerate(files[: limits.max_task_files]):
        fp = f"{path}[{i}]"
        if not _MODULE_FILE.fullmatch(f.name) or len(f.name) > limits.max_arg_name_length:
            out.append(
                FieldViolation(
                    f"{fp}.name", f"{f.name[:64]!r} is not a module file name such as utils.py"
                )
            )
        elif f.name in _HARNESS_FILES:
            out.append(
                FieldViolation(
                    f"{fp}.name",
                    f"{f.name} is the harness's own: the sources travel as kernel and reference",
                )
            )
        elif f.name in names:
            out.append(FieldViolation(f"{fp}.name", f"duplicate file {f.name!r}"))
        names.add(f.name)
        check_string(f"{fp}.content", f.content, limits.max_source_bytes, out)


def _check_spec_size(
    spec: kernel_pb2.JobSpec,
    limits: Limits,
    out: list[FieldViolation],
    literals: list[tuple[int, str]],
) -> None:
    """The whole spec must fit in one job-channel frame; a literal tensor that alone is over
    the limit was named by _check_tensor already."""
    if any(size > limits.max_spec_bytes for size, _ in literals):
        return
    total = spec.ByteSize()
    if total <= limits.max_spec_bytes:
        return
    biggest = sorted(literals, reverse=True)[:3]
    where = ", ".join(f"{name} has {size} bytes" for size, name in biggest)
    out.append(
        FieldViolation(
            "spec",
            f"the serialized JobSpec is {total} bytes, the limit is {limits.max_spec_bytes} "
            f"bytes (sources and literal tensor data together)" + (f"; {where}" if where else ""),
        )
    )


def _check_kernel(
    path: str,
    k: kernel_pb2.KernelSource,
    limits: Limits,
    out: list[FieldViolation],
    literals: list[tuple[int, str]],
) -> None:
    if k.type not in _KERNEL_TYPES:
        what = "required" if k.type == 0 else f"unknown kernel type {k.type}"
        out.append(FieldViolation(f"{path}.type", what))
    size = len(k.source_code.encode("utf-8"))
    if size == 0:
        out.append(FieldViolation(f"{path}.source_code", "required"))
    elif size > limits.max_source_bytes:
        out.append(
            FieldViolation(
                f"{path}.source_code",
                f"{size} bytes is over the limit of {limits.max_source_bytes} bytes",
            )
        )
    if len(k.entry_point) > limits.max_entry_point_length:
        out.append(
            FieldViolation(
                f"{path}.entry_point",
                f"{len(k.entry_point)} characters, the limit is {limits.max_entry_point_length}",
            )
        )
    elif k.entry_point and not _IDENTIFIER.fullmatch(k.entry_point):
        out.append(
            FieldViolation(f"{path}.entry_point", f"{k.entry_point!r} is not a valid identifier")
        )
    has_args = len(k.io.args) > 0
    if k.type == GPU_MODE and (has_args or k.io.HasField("launch")):
        out.append(
            FieldViolation(
                f"{path}.io", "a GPU_MODE source has no IOContract: generate_input makes the data"
            )
        )
    if k.type == kernel_pb2.KERNEL_TYPE_CUDA and not has_args:
        out.append(
            FieldViolation(f"{path}.io.args", "a CUDA kernel is launched from its IOContract")
        )
    if (
        k.type == kernel_pb2.KERNEL_TYPE_TRITON
        and not has_args
        and "ModelNew" not in (k.source_code)
    ):
        out.append(FieldViolation(f"{path}.io.args", _triton_without_model_new(k.source_code)))
    if k.type in (kernel_pb2.KERNEL_TYPE_CUDA, kernel_pb2.KERNEL_TYPE_TRITON) and has_args:
        launch_needed = k.type == kernel_pb2.KERNEL_TYPE_CUDA or "ModelNew" not in k.source_code
        if launch_needed and not k.io.launch.HasField("grid"):
            out.append(FieldViolation(f"{path}.io.launch.grid", "required to launch the kernel"))
    _check_io(f"{path}.io", k.io, limits, out, literals)


_CLASS = re.compile(r"^class\s+([A-Za-z_]\w*)", re.MULTILINE)


def _triton_without_model_new(source: str) -> str:
    """What to do about a Triton source that is neither launched from an IOContract nor run
    through a ModelNew; a class whose name is close to ModelNew is named."""
    text = (
        "a TRITON source without a ModelNew class is launched from its IOContract: give its "
        "args (the kernel's arguments) and launch.grid"
    )
    near = [
        name
        for name in _CLASS.findall(source)
        if name.replace("_", "").lower() == "modelnew"
        or difflib.get_close_matches(name, ["ModelNew"], n=1, cutoff=0.75)
    ]
    if near:
        text += f"; or, to run it through its class {near[0]}, name that class ModelNew"
    return text


def _check_io(
    path: str,
    io: kernel_pb2.IOContract,
    limits: Limits,
    out: list[FieldViolation],
    literals: list[tuple[int, str]],
) -> None:
    if len(io.args) > limits.max_args:
        out.append(
            FieldViolation(f"{path}.args", f"{len(io.args)} args; at most {limits.max_args}")
        )
    names: set[str] = set()
    total_bytes = 0
    for i, arg in enumerate(io.args):
        ap = f"{path}.args[{i}]"
        if len(arg.name) > limits.max_arg_name_length:
            out.append(
                FieldViolation(
                    f"{ap}.name",
                    f"{len(arg.name)} characters, the limit is {limits.max_arg_name_length}",
                )
            )
        elif arg.name:
            if not _IDENTIFIER.fullmatch(arg.name):
                out.append(FieldViolation(f"{ap}.name", f"{arg.name!r} is not a valid identifier"))
            elif arg.name in names:
                out.append(FieldViolation(f"{ap}.name", f"duplicate argument name {arg.name!r}"))
            names.add(arg.name)
        if arg.role not in _ROLES:
            out.append(FieldViolation(f"{ap}.role", f"unknown role {arg.role}"))
        which = arg.WhichOneof("value")
        if which is None:
            out.append(FieldViolation(f"{ap}.value", "required: a tensor or a scalar"))
            continue
        if which == "tensor":
            if arg.meta:
                out.append(FieldViolation(f"{ap}.meta", "only scalar arguments can be meta"))
            total_bytes += _check_tensor(f"{ap}.tensor", arg.tensor, limits, out, literals)
        else:
            if arg.role in (kernel_pb2.ARG_ROLE_OUTPUT, kernel_pb2.ARG_ROLE_INOUT):
                out.append(FieldViolation(f"{ap}.role", "a scalar can only be an input"))
            if which == "float_value" and not math.isfinite(arg.float_value) and arg.meta:
                out.append(FieldViolation(f"{ap}.float_value", "a meta value must be finite"))
    if total_bytes > limits.max_total_tensor_bytes:
        out.append(
            FieldViolation(
                f"{path}.args",
                f"tensors take {total_bytes} bytes, over the limit of "
                f"{limits.max_total_tensor_bytes} bytes",
            )
        )
    launch = io.launch
    for dim_name in ("grid", "block"):
        d = getattr(launch, dim_name)
        for axis in ("x", "y", "z"):
            v = getattr(d, axis)
            if v > limits.max_launch_dim:
                out.append(
                    FieldViolation(
                        f"{path}.launch.{dim_name}.{axis}", f"{v} is over {limits.max_launch_dim}"
                    )
                )
    if launch.num_warps < 0 or launch.num_warps > 64:
        out.append(FieldViolation(f"{path}.launch.num_warps", "must be in [0, 64]"))
    elif launch.num_warps & (launch.num_warps - 1):
        out.append(FieldViolation(f"{path}.launch.num_warps", "must be a power of two"))
    if launch.num_stages < 0 or launch.num_stages > 16:
        out.append(FieldViolation(f"{path}.launch.num_stages", "must be in [0, 16]"))
    if launch.shared_memory_bytes < 0:
        out.append(FieldViolation(f"{path}.launch.shared_memory_bytes", "must be >= 0"))


def _check_tensor(
    path: str,
    t: kernel_pb2.TensorSpec,
    limits: Limits,
    out: list[FieldViolation],
    literals: list[tuple[int, str]],
) -> int:
    """Checks one tensor; returns its size in bytes (0 when the size is unknown)."""
    itemsize = ITEMSIZE.get(t.dtype)
    oversized = False
    if t.WhichOneof("source") == "data":
        literals.append((len(t.data), f"{path}.data"))
        if len(t.data) > limits.max_spec_bytes:
            out.append(
                FieldViolation(
                    f"{path}.data",
                    f"{len(t.data)} bytes, the limit is {limits.max_spec_bytes} bytes for the "
                    "whole JobSpec (use `init` to generate large inputs on the device)",
                )
            )
            oversized = True  # its length is not checked against the shape too
    if itemsize is None:
        what = "required" if t.dtype == 0 else f"unknown dtype {t.dtype}"
        out.append(FieldViolation(f"{path}.dtype", what))
    if len(t.shape) > limits.max_rank:
        out.append(
            FieldViolation(f"{path}.shape", f"rank {len(t.shape)} is over {limits.max_rank}")
        )
        return 0
    bad_shape = False
    for j, d in enumerate(t.shape):
        if d < 0:
            out.append(FieldViolation(f"{path}.shape[{j}]", f"{d} is negative"))
            bad_shape = True
    if bad_shape:
        return 0
    elements = math.prod(t.shape)
    if elements > limits.max_tensor_elements:
        out.append(
            FieldViolation(
                f"{path}.shape",
                f"{elements} elements is over the limit of {limits.max_tensor_elements}",
            )
        )
        return 0
    which = t.WhichOneof("source")
    if which == "data" and itemsize is not None and not oversized:
        want = elements * itemsize
        if len(t.data) != want:
            out.append(
                FieldViolation(
                    f"{path}.data",
                    f"{len(t.data)} bytes, but shape {list(t.shape)} of "
                    f"{dtype_pb2.DType.Name(t.dtype)} needs {want} bytes",
                )
            )
    elif which == "init":
        init = t.init
        kind = init.WhichOneof("kind")
        if kind == "randint" and init.randint.high <= init.randint.low:
            out.append(
                FieldViolation(
                    f"{path}.init.randint.high",
                    f"high ({init.randint.high}) must be greater than low ({init.randint.low})",
                )
            )
        if kind == "uniform" and init.uniform.high < init.uniform.low:
            out.append(FieldViolation(f"{path}.init.uniform.high", "must be >= low"))
        if kind == "randn" and init.randn.std < 0:
            out.append(FieldViolation(f"{path}.init.randn.std", "must be >= 0"))
        for name, v in _init_floats(init):
            if not math.isfinite(v):
                out.append(FieldViolation(f"{path}.init.{kind}.{name}", "must be finite"))
    return elements * (itemsize or 0)


def _init_floats(init: kernel_pb2.TensorInit) -> list[tuple[str, float]]:
    kind = init.WhichOneof("kind")
    if kind == "randn":
        return [("mean", init.randn.mean), ("std", init.randn.std)]
    if kind == "uniform":
        return [("low", init.uniform.low), ("high", init.uniform.high)]
    if kind == "arange":
        return [("start", init.arange.start), ("step", init.arange.step)]
    return []


def _check_options(
    path: str, o: kernel_pb2.EvalOptions, limits: Limits, out: list[FieldViolation]
) -> None:
    if o.HasField("correct_trial_count") and not 1 <= o.correct_trial_count <= (
        limits.max_trial_count
    ):
        out.append(
            FieldViolation(
                f"{path}.correct_trial_count", f"must be in [1, {limits.max_trial_count}]"
            )
        )
    if o.HasField("perf_trial_count") and not 0 <= o.perf_trial_count <= limits.max_trial_count:
        out.append(
            FieldViolation(f"{path}.perf_trial_count", f"must be in [0, {limits.max_trial_count}]")
        )
    if o.HasField("warmup_count") and not 0 <= o.warmup_count <= limits.max_warmup_count:
        out.append(
            FieldViolation(f"{path}.warmup_count", f"must be in [0, {limits.max_warmup_count}]")
        )
    for name in ("atol", "rtol"):
        if o.HasField(name):
            v = getattr(o, name)
            if not (math.isfinite(v) and v >= 0):
                out.append(FieldViolation(f"{path}.{name}", "must be a finite number >= 0"))
    if o.HasField("timeout"):
        secs = o.timeout.seconds + o.timeout.nanos / 1e9
        if not limits.min_timeout_seconds <= secs <= limits.max_timeout_seconds:
            out.append(
                FieldViolation(
                    f"{path}.timeout",
                    f"{secs:g} s is outside [{limits.min_timeout_seconds:g}, "
                    f"{limits.max_timeout_seconds:g}] s",
                )
            )
    if o.HasField("device_index") and o.device_index < 0:
        out.append(FieldViolation(f"{path}.device_index", "must be >= 0"))
    if o.device_model and (
        len(o.device_model) > placement.MAX_MODEL_CHARS
        or not placement.MODEL_PATTERN.fullmatch(o.device_model)
    ):
        out.append(
            FieldViolation(
                f"{path}.device_model",
                f"letters, digits, spaces, '.' and '-' (starting with a letter or digit), at "
                f"most {placement.MAX_MODEL_CHARS} characters: a part of a GPU's name as "
                "ListDevices gives it, such as 'H100'",
            )
        )


def is_triton_launch(k: kernel_pb2.KernelSource) -> bool:
    """TRITON runs from its IOContract unless it goes through a ModelNew (or Model) class."""
    if k.type != kernel_pb2.KERNEL_TYPE_TRITON or len(k.io.args) == 0:
        return False
    if k.entry_point:
        return k.entry_point not in ("ModelNew", "Model")
    return re.search(r"^class\s+ModelNew\b", k.source_code, re.MULTILINE) is None


def is_timed(o: kernel_pb2.EvalOptions) -> bool:
    """The job times its kernel: perf_trial_count unset (the default, 100) or over 0."""
    return not o.HasField("perf_trial_count") or o.perf_trial_count > 0
