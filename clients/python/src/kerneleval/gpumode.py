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

task.yml is read without a YAML library: the part of YAML that GPU MODE's task files use
(top-level keys; lists of one-line `{...}` mappings or of indented `key: value` blocks;
quoted or plain scalars). Anything else raises TaskError naming the line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        arg = case.args.add(name=str(name))
        if isinstance(value, bool):  # before int: a bool is an int in Python
            arg.bool_value = value
        elif isinstance(value, int):
            arg.int_value = value
        elif isinstance(value, float):
            arg.float_value = value
        elif isinstance(value, str):
            arg.string_value = value
        else:
            raise TaskError(f"{where}: {name} has no value")
    return case


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


# --- the YAML that task.yml files use -------------------------------------------------------

_TOP_KEY = re.compile(r"^([A-Za-z_][\w-]*)\s*:\s*(.*)$")
_ITEM = re.compile(r"^(\s+)-\s*(.*)$")
_BLOCK_KEY = re.compile(r"^(\s+)([A-Za-z_][\w-]*)\s*:\s*(.*)$")
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


def parse_task_yml(text: str, where: str = "task.yml") -> dict[str, Any]:
    """Top-level keys to values: a scalar, or a list of mappings (or scalars). Nested
    mappings and block scalars (description: |) are skipped; their keys map to None."""
    out: dict[str, Any] = {}
    key: str | None = None
    item: dict[str, Any] | None = None
    item_indent = 0
    in_text = False  # inside a block scalar (description: |), whose lines are text
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        at = f"{where}:{number}"
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            m = _TOP_KEY.match(line)
            if m is None:
                raise TaskError(f"{at}: expected `key: value`, got {line.strip()!r}")
            key, value, item = m.group(1), _strip_comment(m.group(2)), None
            in_text = value[:1] in ("|", ">")
            out[key] = None if value == "" or in_text else _scalar(value, at)
            continue
        if in_text:
            continue
        if key is None:
            raise TaskError(f"{at}: indented line before any key")
        if (m := _ITEM.match(line)) is not None:
            if out[key] is None:
                out[key] = []
            if not isinstance(out[key], list):
                raise TaskError(f"{at}: a list item under {key}, which has a value")
            body = _strip_comment(m.group(2))
            item = None
            if body.startswith("{"):
                out[key].append(_flow_mapping(body, at))
            elif (kv := _BLOCK_KEY.match(" " + body)) is not None:
                item, item_indent = {}, len(m.group(1)) + 2
                item[kv.group(2)] = _scalar(_strip_comment(kv.group(3)), at)
                out[key].append(item)
            else:
                out[key].append(_scalar(body, at))
            continue
        if item is not None and (m := _BLOCK_KEY.match(line)) and len(m.group(1)) >= item_indent:
            item[m.group(2)] = _scalar(_strip_comment(m.group(3)), at)
        # Anything else is inside a block scalar or a nested mapping: not needed here.
    return out


def _strip_comment(text: str) -> str:
    """The text less a ` # comment` outside quotes."""
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip()
    return text.strip()


def _split_outside_quotes(text: str, sep: str, limit: int = -1) -> list[str]:
    parts, quote, start = [], "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == sep and limit != 0:
            parts.append(text[start:i])
            start = i + 1
            limit -= 1
    if quote:
        raise ValueError("unterminated quote")
    parts.append(text[start:])
    return parts


def _flow_mapping(text: str, at: str) -> dict[str, Any]:
    """`{"size": 127, seed: 4242}` on one line."""
    if not text.endswith("}"):
        raise TaskError(f"{at}: a {{...}} mapping must end on its line")
    out: dict[str, Any] = {}
    try:
        pairs = _split_outside_quotes(text[1:-1], ",")
        for pair in pairs:
            if not pair.strip():
                continue
            parts = _split_outside_quotes(pair, ":", 1)
            if len(parts) != 2:
                raise TaskError(f"{at}: {pair.strip()!r} is not `key: value`")
            name = _scalar(parts[0].strip(), at)
            out[str(name)] = _scalar(parts[1].strip(), at)
    except ValueError as e:
        if isinstance(e, TaskError):
            raise
        raise TaskError(f"{at}: {e}") from None
    return out


def _scalar(text: str, at: str) -> Any:
    """A YAML scalar: quoted string, int, float, bool, null (also empty), or plain string."""
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text[0] == '"':
        try:
            return str(json.loads(text))
        except json.JSONDecodeError:
            raise TaskError(f"{at}: bad double-quoted string {text}") from None
    if text[0] == "'":
        if len(text) < 2 or text[-1] != "'":
            raise TaskError(f"{at}: bad single-quoted string {text}")
        return text[1:-1].replace("''", "'")
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text
