"""GPU MODE's problem format (gpu-mode/reference-kernels) as a JobSpec of KERNEL_TYPE_GPU_MODE.

A task directory holds reference.py (`generate_input`, `ref_kernel`, `check_implementation`),
task.yml (its `tests`, `benchmarks`, and the `files` the harness copies beside the sources,
such as task.py and ../utils.py) and usually a submission.py (`custom_kernel`):

    from kerneleval import Client, gpumode

    spec = gpumode.spec_from_directory("problems/pmpp_v2/vectoradd_py", "my_submission.py")
    with Client() as c:
        job = c.evaluate(spec)          # every test, then every benchmark timed
        for case in job.result.benchmark_cases:
            print(case.spec, case.runtime.median_ms, case.speedup)

task.yml is read with PyYAML (`yaml.safe_load`, YAML 1.1 as GPU MODE's own tools read it: `True`
is a boolean). A case's values may be lists and mappings, nested (nvfp4_group_gemm's
`{"m": [96, 128], ...}`): they travel as TaskArg's list_value and map_value, and
generate_input gets a list as a tuple, as GPU MODE's harness gives it. Anything that is not a
task raises TaskError naming the file, and the line where YAML itself failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kerneleval.v1 import kernel_pb2

__all__ = [
    "Task",
    "TaskError",
    "load_task",
    "parse_task_yml",
    "spec_from_directory",
    "spec_from_task",
]

# Files the harness itself puts beside the sources: they travel as kernel and reference, or
# not at all (the service runs its own harness).
HARNESS_FILES = frozenset({"submission.py", "reference.py", "eval.py"})
SUBMISSION_MARK = "@SUBMISSION@"
DEFAULT_SUBMISSION = "submission.py"  # the submission a task directory usually holds


class TaskError(ValueError):
    """The directory or its task.yml is not GPU MODE's format; the message says where."""


@dataclass(frozen=True)
class Task:
    """A GPU MODE task: its reference source and what the job needs besides."""

    directory: Path
    reference: str  # reference.py's source
    task: kernel_pb2.GpuModeTask  # tests, benchmarks, shared modules


def spec_from_directory(
    task_dir: str | Path,
    submission: str | Path | None = None,
    *,
    options: kernel_pb2.EvalOptions | None = None,
    client_tag: str = "",
    labels: Mapping[str, str] | None = None,
) -> kernel_pb2.JobSpec:
    """The JobSpec that evaluates `submission` (default: the directory's submission.py)
    against the task in `task_dir`."""
    task = load_task(task_dir)
    path = Path(submission) if submission is not None else task.directory / DEFAULT_SUBMISSION
    return spec_from_task(
        task,
        _read(path, "the submission"),
        options=options,
        client_tag=client_tag,
        labels=labels,
    )


def spec_from_task(
    task: Task,
    submission_source: str,
    *,
    options: kernel_pb2.EvalOptions | None = None,
    client_tag: str = "",
    labels: Mapping[str, str] | None = None,
) -> kernel_pb2.JobSpec:
    """The JobSpec of one submission's source against a loaded task (one load_task for many
    submissions)."""
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(
            type=kernel_pb2.KERNEL_TYPE_GPU_MODE, source_code=submission_source
        ),
        reference=kernel_pb2.KernelSource(
            type=kernel_pb2.KERNEL_TYPE_GPU_MODE, source_code=task.reference
        ),
        gpu_mode=task.task,
        client_tag=client_tag,
        labels=dict(labels or {}),
    )
    if options is not None:
        spec.options.CopyFrom(options)
    return spec


def load_task(task_dir: str | Path) -> Task:
    directory = Path(task_dir)
    if not directory.is_dir():
        raise TaskError(f"{directory}: not a directory")
    yml = directory / "task.yml"
    parsed = parse_task_yml(_read(yml, "the task file"), str(yml))
    task = kernel_pb2.GpuModeTask()
    for key, into in (("tests", task.tests), ("benchmarks", task.benchmarks)):
        for i, case in enumerate(_list(parsed, key, str(yml))):
            into.append(task_case(case, f"{yml}: {key}[{i}]"))
    if len(task.tests) == 0:
        raise TaskError(f"{yml}: no tests")
    task.files.extend(_shared_files(directory, parsed, str(yml)))
    return Task(directory, _read(directory / "reference.py", "the reference"), task)


def task_case(mapping: Any, where: str) -> kernel_pb2.TaskCase:
    """generate_input's keyword arguments, in the task's order."""
    if not isinstance(mapping, dict):
        raise TaskError(f"{where}: a case is a mapping of generate_input's arguments")
    case = kernel_pb2.TaskCase()
    for name, value in mapping.items():
        _set_value(case.args.add(name=str(name)), value, f"{where}: {name}")
    return case


def _set_value(into: kernel_pb2.TaskArg | kernel_pb2.TaskValue, value: Any, where: str) -> None:
    """A task.yml value into a TaskArg or TaskValue (their oneofs have the same names)."""
    if isinstance(value, bool):  # before int: a bool is an int in Python
        into.bool_value = value
    elif isinstance(value, int):
        into.int_value = value
    elif isinstance(value, float):
        into.float_value = value
    elif isinstance(value, str):
        into.string_value = value
    elif isinstance(value, (list, tuple)):
        into.list_value.SetInParent()  # an empty list is a value too
        for i, item in enumerate(value):
            _set_value(into.list_value.values.add(), item, f"{where}[{i}]")
    elif isinstance(value, dict):
        into.map_value.SetInParent()
        for key, item in value.items():
            _set_value(into.map_value.entries.add(key=str(key)).value, item, f"{where}.{key}")
    elif value is None:
        raise TaskError(f"{where} has no value")
    else:  # a date, bytes (!!binary), ...: nothing generate_input is given by the harness
        raise TaskError(f"{where}: a {type(value).__name__} is not a value of a case")


def parse_task_yml(text: str, where: str = "task.yml") -> dict[str, Any]:
    """task.yml as a mapping of its top-level keys (yaml.safe_load); TaskError naming the
    line when it is not YAML, or not a mapping."""
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(e, "problem", None) or str(e)
        raise TaskError(f"{at}: not YAML: {problem}") from None
    if parsed is None:
        return {}
    if not isinstance(parsed, dict):
        raise TaskError(f"{where}: a task file is a mapping of keys (tests, benchmarks, ...)")
    return {str(k): v for k, v in parsed.items()}


def _shared_files(
    directory: Path, parsed: dict[str, Any], where: str
) -> list[kernel_pb2.SourceFile]:
    """task.yml's `files` less the harness's own; without that list, the task.py and utils.py
    lying in the directory."""
    if "files" not in parsed:
        return [
            kernel_pb2.SourceFile(name=name, content=(directory / name).read_text())
            for name in ("task.py", "utils.py")
            if (directory / name).is_file()
        ]
    out = []
    for i, entry in enumerate(_list(parsed, "files", where)):
        if not isinstance(entry, dict) or not {"name", "source"} <= entry.keys():
            raise TaskError(f"{where}: files[{i}] needs a name and a source")
        name, source = str(entry["name"]), str(entry["source"])
        if name in HARNESS_FILES or source == SUBMISSION_MARK:
            continue
        out.append(
            kernel_pb2.SourceFile(name=name, content=_read(directory / source, f"files[{i}]"))
        )
    return out


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskError(f"{path}: no such file ({what})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"{path}: cannot read {what}: {e}") from None


def _list(parsed: dict[str, Any], key: str, where: str) -> list[Any]:
    value = parsed.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise TaskError(f"{where}: {key} is not a list")
    return value
