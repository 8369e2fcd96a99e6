"""Where a command's output goes: progress and messages on stderr, tables or JSON on stdout,
and the exit code its jobs give."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from kerneleval import progress, render
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2

EXIT_OK, EXIT_VERDICT, EXIT_USAGE, EXIT_SERVICE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


EXIT_NOT_RUN = 4  # VERDICT_CANNOT_RUN_HERE: not evaluated, neither a pass nor a failure


def as_dict(message: Message) -> dict[str, Any]:
    """A message in the proto3 JSON mapping with every field, false, zero and empty ones too
    (a job that did not compile has "compiled": false, not no key)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def dump(value: object, *, lines: bool = False) -> None:
    print(json.dumps(value) if lines else json.dumps(value, indent=2), flush=True)


class Output:
    """Where a command's progress, messages and results go, as the global options say."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.json = bool(a.json)
        self.jsonl = bool(a.jsonl)
        self.style = render.Style(render.color_enabled(sys.stdout, a.color))
        self.width = render.terminal_width(sys.stdout)
        self._show = not (a.no_progress or self.json or self.jsonl)
        self._err_colour = render.color_enabled(sys.stderr, a.color)
        self._display: progress.Display | None = None

    @property
    def display(self) -> progress.Display:
        """Made on first use: commands without progress start no live display."""
        if self._display is None:
            self._display = progress.make_display(
                sys.stderr, enabled=self._show, colour=self._err_colour
            )
        return self._display

    def note(self, text: str) -> None:
        """A message about the connection or the job's fate: shown even without progress."""
        if isinstance(self.display, progress.NullDisplay):
            print(text, file=sys.stderr, flush=True)
        else:
            self.display.line(text)

    def close(self) -> None:
        if self._display is not None:
            self._display.close()


def _ok(job: job_pb2.Job) -> bool:
    return job.state == job_pb2.JOB_STATE_DONE and job.result.verdict == job_pb2.VERDICT_OK


def _not_run(job: job_pb2.Job) -> bool:
    return (
        job.state == job_pb2.JOB_STATE_DONE
        and job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE
    )


def exit_code(results: Iterable[job_pb2.Job | str]) -> int:
    """0 if every job is OK; 1 if any failed (a refusal, text here, too); else 4 when some
    could not run on the service's host: not evaluated is neither a pass nor a failure."""
    ok = True
    for r in results:
        if isinstance(r, str) or not (_ok(r) or _not_run(r)):
            return EXIT_VERDICT
        ok = ok and _ok(r)
    return EXIT_OK if ok else EXIT_NOT_RUN


def show_job(out: Output, job: job_pb2.Job) -> int:
    if out.json:
        dump(as_dict(job))
    elif not out.jsonl:
        print(render.result_table(job, out.style, width=out.width))
    return exit_code([job])


def moved_bars(view: progress.JobView) -> dict[str, Any]:
    """--jsonl's "bars": what the event moved of the job's bars, one per phase (none when
    it repeats a phase another of the job's processes reported already)."""
    return {"bars": [b.as_dict() for b in view.moved]} if view.moved else {}


def file_entry(name: str, r: job_pb2.Job | str) -> dict[str, Any]:
    return (
        {"file": name, "job": as_dict(r)}
        if isinstance(r, job_pb2.Job)
        else {
            "file": name,
            "error": r,
        }
    )


def refusal_text(error: kernel_eval_service_pb2.SubmissionError) -> str:
    """A refused submission of a batch: its message, and the violations it does not say."""
    violations = [f"{v.field}: {v.description}" for v in error.field_violations]
    text = f"refused: {error.message}" + "".join(
        f"; {v}" for v in violations if v not in error.message
    )
    hint = flag_hint([v.field for v in error.field_violations])
    return f"{text} ({hint})" if hint else text


# The CLI's option for a field a refusal names (its hint says which to use).
_FIELD_FLAGS = (
    (re.compile(r"spec\.kernel\.io\b"), "--io JSON|FILE gives the kernel's IOContract"),
    (re.compile(r"spec\.kernel\.type$"), "--type picks the kernel type"),
    (re.compile(r"spec\.kernel\.entry_point$"), "--entry-point names what to run"),
    (re.compile(r"spec\.options\.correct_trial_count$"), "--correct-trials sets it"),
    (re.compile(r"spec\.options\.perf_trial_count$"), "--perf-trials sets it"),
    (re.compile(r"spec\.options\.warmup_count$"), "--warmup sets it"),
    (re.compile(r"spec\.options\.(atol|rtol)$"), "--atol and --rtol set them"),
    (re.compile(r"spec\.options\.timeout$"), "--job-timeout sets it"),
    (re.compile(r"spec\.options\.device_index$"), "--device sets it"),
    (re.compile(r"spec\.options\.device_model$"), "--device-model sets it"),
    (re.compile(r"spec\.labels\b"), "--label KEY=VALUE sets them"),
    (re.compile(r"spec\.client_tag$"), "--tag sets it"),
)


def flag_hint(fields: Iterable[str]) -> str:
    """Which of the CLI's options set the fields a refusal names ("" for none)."""
    hints: list[str] = []
    for field in fields:
        for pattern, hint in _FIELD_FLAGS:
            if pattern.match(field) and hint not in hints:
                hints.append(hint)
    return "; ".join(hints)
