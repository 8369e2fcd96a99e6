"""From the command line to JobSpecs: the job's options, its source files (`-` is standard input),
labels, an IOContract, a GPU MODE task's submissions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import json_format

from kerneleval import gpumode
from kerneleval.kernelbench import job_from_sources, kernelbench_options
from kerneleval.v1 import kernel_pb2

STDIN = "-"


def label_dict(a: argparse.Namespace) -> dict[str, str]:
    """The --label arguments as a dict; a key given twice with two values is a usage error."""
    out: dict[str, str] = {}
    for key, value in a.labels:
        if out.get(key, value) != value:
            raise ValueError(f"--label {key} given twice, as {out[key]!r} and {value!r}")
        out[key] = value
    return out


def eval_options(a: argparse.Namespace) -> kernel_pb2.EvalOptions:
    o = kernelbench_options() if a.preset == "kernelbench" else kernel_pb2.EvalOptions()
    for attr, fld in (
        ("correct_trials", "correct_trial_count"),
        ("perf_trials", "perf_trial_count"),
        ("warmup", "warmup_count"),
        ("atol", "atol"),
        ("rtol", "rtol"),
        ("seed", "seed"),
        ("device", "device_index"),
    ):
        value = getattr(a, attr, None)  # a GPU MODE task has no --correct-trials, --atol, ...
        if value is not None:
            setattr(o, fld, value)
    if getattr(a, "device_model", ""):
        o.device_model = a.device_model
    if a.job_timeout is not None:
        o.timeout.FromNanoseconds(int(a.job_timeout * 1e9))
    if a.no_flush_l2:
        o.flush_l2 = False
    if getattr(a, "no_check_precision", False):  # a GPU MODE task has no Model reference
        o.check_precision = False
    if getattr(a, "compile_baseline", False):
        o.compile_baseline = True
    o.launch_blocking = a.launch_blocking
    o.device_side_assertions = a.dsa
    o.sanitize = a.sanitize
    o.device_metrics = a.device_metrics
    o.reject_flagged = a.reject_flagged
    o.bypass_cache = a.no_cache
    return o


def _io(value: str | None) -> kernel_pb2.IOContract | None:
    if not value:
        return None
    text = value
    if not value.lstrip().startswith("{"):
        text = _read_file(value, "the --io file")
    try:
        return json_format.Parse(text, kernel_pb2.IOContract())
    except json_format.ParseError as e:
        where = "--io" if text is value else f"the --io file {value}"
        raise ValueError(f"{where} is not an IOContract in the proto3 JSON mapping: {e}") from None


def _read_file(name: str, role: str) -> str:
    """A file's text; a missing one is a usage error that says which file it was."""
    try:
        return Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{role} {name} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{role} {name} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {role} {name}: {e}") from None


class _Sources:
    """Reads source files; `-` is standard input, read once however often it is named."""

    def __init__(self) -> None:
        self._stdin: str | None = None

    def read(self, name: str, role: str = "the source file") -> tuple[str, str]:
        """(text, file name for type detection); `role` names the file in an error ("the
        reference file")."""
        if name == STDIN:
            if self._stdin is None:
                if sys.stdin.isatty():
                    print("reading the source from standard input (end with Ctrl-D)",
                          file=sys.stderr)  # fmt: skip
                self._stdin = sys.stdin.read()
            return self._stdin, ""
        return _read_file(name, role), Path(name).name


def file_specs(a: argparse.Namespace) -> list[tuple[str, kernel_pb2.JobSpec]]:
    sources = _Sources()
    reference = None
    ref_name = ""
    if a.reference is not None:
        reference, ref_name = sources.read(a.reference, "the reference file")
    options, io, labels = eval_options(a), _io(a.io), label_dict(a)
    out = []
    for f in a.files:
        text, name = sources.read(f, "the kernel file")
        spec = job_from_sources(
            text,
            reference,
            kernel_filename=name,
            reference_filename=ref_name,
            options=options,
            client_tag=a.tag,
            kernel_type=a.type,
            io=io,
            entry_point=a.entry_point,
        )
        spec.labels.update(labels)
        out.append((f, spec))
    return out


def gpumode_specs(a: argparse.Namespace) -> list[tuple[str, kernel_pb2.JobSpec]]:
    """A job per submission against the task in TASK_DIR (read once); without a submission,
    the task's own submission.py."""
    task = gpumode.load_task(a.task_dir)
    names = list(a.submissions)
    if not names:
        default = task.directory / gpumode.DEFAULT_SUBMISSION
        if not default.is_file():
            raise ValueError(  # the task is fine: a usage error of its own
                f"no {gpumode.DEFAULT_SUBMISSION} in {task.directory}: name the submission "
                f"file(s) after the task folder (kerneleval gpumode {a.task_dir} my_kernel.py)"
            )
        names = [str(default)]
    sources = _Sources()
    options, labels = eval_options(a), label_dict(a)
    specs = []
    for name in names:
        text, _ = sources.read(name, "the submission file")
        spec = gpumode.spec_from_task(task, text, options=options, client_tag=a.tag, labels=labels)
        spec.kernel.entry_point = a.entry_point
        specs.append((name, spec))
    return specs
