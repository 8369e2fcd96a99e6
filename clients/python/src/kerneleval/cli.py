"""The `kerneleval` command.

Exit codes: 0 success (verdict OK), 1 the job finished without verdict OK (or was cancelled
or failed), 2 usage error, 3 the service refused or could not be reached, 4 not evaluated:
VERDICT_CANNOT_RUN_HERE (the service's host lacks the GPU the kernel needs; not a failure of
the kernel, and not a pass either), 130 interrupted. Of several jobs, any failure gives 1, else
any not evaluated 4. Global options (--server, --admin-token, --json, ...) go before or after
the command.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

import kerneleval
from kerneleval import errors, gpumode, progress, render
from kerneleval import kernelbench_run as kb
from kerneleval.client import ADDRESS_ENV, ADMIN_TOKEN_ENV, Client, StreamNote, resolve_address
from kerneleval.doctor import run_doctor
from kerneleval.kernelbench import TYPE_NAMES, job_from_sources, kernelbench_options
from kerneleval.v1 import job_pb2, kernel_pb2

EXIT_OK, EXIT_VERDICT, EXIT_USAGE, EXIT_SERVICE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_NOT_RUN = 4  # VERDICT_CANNOT_RUN_HERE: not evaluated, neither a pass nor a failure
STATES = {n.removeprefix("JOB_STATE_").lower(): v for n, v in job_pb2.JobState.items()}
STDIN = "-"
_SECRET_OPTIONS = ("--admin-token",)


def as_dict(message: Message) -> dict[str, Any]:
    """A message in the proto3 JSON mapping with every field, false, zero and empty ones too
    (a job that did not compile has "compiled": false, not no key)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def _dump(value: Any, *, lines: bool = False) -> None:
    print(json.dumps(value) if lines else json.dumps(value, indent=2), flush=True)


# --- options ---------------------------------------------------------------------------


def _label(value: str) -> tuple[str, str]:
    """A `--label KEY=VALUE` argument (the server checks keys and values further)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. --label problem=19_ReLU), got {value!r}"
        )
    return key.strip(), val


def _add_label_option(p: Any, helptext: str) -> None:  # a parser or an argument group
    p.add_argument(
        "--label",
        dest="labels",
        action="append",
        type=_label,
        default=[],
        metavar="KEY=VALUE",
        help=helptext,
    )


def _labels(a: argparse.Namespace) -> dict[str, str]:
    """The --label arguments as a dict; a key given twice with two values is a usage error."""
    out: dict[str, str] = {}
    for key, value in a.labels:
        if out.get(key, value) != value:
            raise ValueError(f"--label {key} given twice, as {out[key]!r} and {value!r}")
        out[key] = value
    return out


def _add_global_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes, before or after its name. On the commands they
    default to SUPPRESS, so that a value given before the command is not overwritten."""

    def d(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("global options (before or after the command)")
    g.add_argument(
        "--server",
        "--address",
        dest="address",
        default=d(None),
        metavar="ADDRESS",
        help=f"server: host:port, a host alone (port 50051) or unix:PATH (env {ADDRESS_ENV}; "
        "default 127.0.0.1:50051)",
    )
    g.add_argument(
        "--admin-token",
        default=d(None),
        metavar="TOKEN",
        help=f"token of the operations commands (env {ADMIN_TOKEN_ENV}); never printed",
    )
    g.add_argument(
        "--admin-token-file",
        default=d(None),
        metavar="FILE",
        help="read the admin token from FILE (e.g. state/admin_token)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d(None),
        metavar="S",
        help="deadline of each call in seconds (default: none)",
    )
    g.add_argument(
        "--reconnect-timeout",
        type=float,
        default=d(60.0),
        metavar="S",
        help="how long to wait for a server that is down before giving up on a job's stream "
        "(default 60)",
    )
    g.add_argument(
        "--tls-ca",
        default=d(os.environ.get("KERNELEVAL_TLS_CA") or None),
        metavar="PEM",
        help="use TLS, trusting this CA certificate (env KERNELEVAL_TLS_CA)",
    )
    g.add_argument("--tls", action="store_true", default=d(False), help="TLS with system roots")
    g.add_argument(
        "--json",
        action="store_true",
        default=d(False),
        help="print JSON (every field, defaults included); see each command's help for its shape",
    )
    g.add_argument(
        "--jsonl",
        action="store_true",
        default=d(False),
        help="evaluate, compare, gpumode, kernelbench, watch, events: one JSON object per event "
        "and line, as they come",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        default=d(False),
        help="no progress bars on stderr (messages about the connection still come)",
    )
    g.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default=d("auto"),
        help="colour: auto (a terminal, without NO_COLOR) by default",
    )


def _add_job_options(p: argparse.ArgumentParser, *, gpu_mode: bool = False) -> None:
    """The job's options; a GPU MODE task leaves out what it does not use (its type is fixed,
    generate_input makes the data, each case runs once, check_implementation judges)."""
    g = p.add_argument_group("job")
    if gpu_mode:
        g.add_argument("--entry-point", default="", help="function to run (custom_kernel)")
    else:
        _add_source_options(g)
    g.add_argument(
        "--perf-trials", type=int, metavar="N", help="timed trials (100; 0 skips timing)"
    )
    g.add_argument("--warmup", type=int, metavar="N", help="warm-up runs before timing (10)")
    if gpu_mode:
        g.add_argument(
            "--seed",
            type=int,
            metavar="N",
            help="mixed into each case's seed, as GPU MODE's secret seed (default: the task's)",
        )
    else:
        _add_check_options(g)
    _add_run_options(g)
    o = p.add_argument_group("output")
    o.add_argument("--detach", action="store_true", help="submit, print the job id(s), exit")
    o.add_argument(
        "--max-in-flight",
        type=int,
        default=16,
        metavar="N",
        help="with several files: jobs in flight at once (default 16)",
    )


def _add_source_options(g: Any) -> None:  # an argument group
    g.add_argument(
        "--type",
        choices=[*TYPE_NAMES, "auto"],
        default="auto",
        help="kernel type (default: detected from the source)",
    )
    g.add_argument("--entry-point", default="", help="class or kernel to run")
    g.add_argument(
        "--io",
        metavar="JSON|FILE",
        help="IOContract as JSON (proto3 JSON mapping), inline or in a file",
    )
    g.add_argument(
        "--preset",
        choices=["service", "kernelbench"],
        default="service",
        help="option defaults: the service's (5 correctness trials, 100 timed, 10 warm-up, "
        "seed 42), or KernelBench's eval_kernel_against_ref (1, 10, 3, seed 42, atol=rtol=1e-4); "
        "the options below override either",
    )


def _add_check_options(g: Any) -> None:  # an argument group
    g.add_argument("--correct-trials", type=int, metavar="N", help="correctness trials (5)")
    g.add_argument(
        "--atol",
        type=float,
        metavar="X",
        help="absolute tolerance of the output check (default by dtype: 1e-4 float32, "
        "1e-2 float16/bfloat16, 0 integers)",
    )
    g.add_argument("--rtol", type=float, metavar="X", help="relative tolerance (default: as atol)")
    g.add_argument("--seed", type=int, metavar="N", help="seed of inputs and weights (default 42)")
    g.add_argument(
        "--no-check-precision",
        action="store_true",
        help="skip the float64 run of the reference that flags lower_precision",
    )
    g.add_argument(
        "--compile-baseline",
        action="store_true",
        help="also time torch.compile of the reference (a Model), as KernelBench's "
        "run_and_check.py: the result gives the speedup over eager and over torch.compile "
        "(compile time untimed)",
    )


def _add_run_options(g: Any) -> None:  # an argument group
    g.add_argument("--device", type=int, help="GPU index (default: the scheduler picks)")
    g.add_argument(
        "--device-model",
        default="",
        help="run only on a GPU whose name contains this, any case (e.g. H100; "
        "`kerneleval devices` lists the names)",
    )
    g.add_argument("--job-timeout", type=float, metavar="S", help="job wall-clock limit")
    g.add_argument("--no-flush-l2", action="store_true", help="keep the L2 cache warm")
    g.add_argument("--launch-blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1")
    g.add_argument("--dsa", action="store_true", help="device-side assertions")
    g.add_argument("--sanitize", action="store_true", help="compute-sanitizer memcheck")
    g.add_argument("--device-metrics", action="store_true", help="Nsight Compute metrics")
    g.add_argument(
        "--reject-flagged",
        action="store_true",
        help="do not run a candidate that static checks flag (VERDICT_REJECTED)",
    )
    g.add_argument(
        "--no-cache",
        action="store_true",
        help="run even if an identical job has a result or is running (bypass_cache)",
    )
    g.add_argument("--tag", default="", help="client tag")
    _add_label_option(g, "a label of the job, for your bookkeeping and `jobs --label` (repeatable)")


def _options(a: argparse.Namespace) -> kernel_pb2.EvalOptions:
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


def _specs(a: argparse.Namespace) -> list[tuple[str, kernel_pb2.JobSpec]]:
    sources = _Sources()
    reference = None
    ref_name = ""
    if a.reference is not None:
        reference, ref_name = sources.read(a.reference, "the reference file")
    options, io, labels = _options(a), _io(a.io), _labels(a)
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


# --- following jobs ----------------------------------------------------------------------


class _Output:
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


class _StreamNotes:
    """Says what a followed job's stream goes through (the client's StreamNotes: it is the
    client that re-attaches), and words the error when the client gives up."""

    def __init__(self, c: Client, out: _Output, view: progress.JobView) -> None:
        self.c, self.out, self.view = c, out, view
        self.waiting = False  # "waiting" said, and the server has not answered since
        self.lost = False  # "lost" said, and no event came since

    def __call__(self, note: StreamNote) -> None:
        if note.kind == "waiting":
            self.waiting = True
            budget = render.fmt_duration(note.seconds)
            self.out.note(f"waiting for the server at {self.c.address} (up to {budget}) ...")
            self.view.status("waiting for the server")
        elif note.kind == "answers":
            self.waiting = False
            self.out.note(f"the server at {self.c.address} answers")
        elif note.kind == "lost":
            self.lost = True
            code = note.code.name if note.code is not None else "UNAVAILABLE"
            self.out.note(
                f"lost the stream of job {note.job_id} after event #{note.sequence} ({code}); "
                "re-attaching ..."
            )
        else:
            self.lost = False
            self.out.note(f"re-attached to job {note.job_id} at event #{note.sequence}")

    def gave_up(self, e: errors.Unavailable, job_id: str, last: int) -> errors.KernelEvalError:
        """The error to show for the client's Unavailable: what to do next, when it gave up."""
        if self.waiting:
            return errors.Unavailable(
                f"the server at {self.c.address} did not answer in time "
                "(is it running? `kerneleval serve`; --reconnect-timeout waits longer)"
            )
        if self.lost:
            return errors.Unavailable(
                f"could not re-attach to job {job_id} within "
                f"{render.fmt_duration(self.c.reconnect_timeout)}; it may still run: "
                f"kerneleval watch {job_id} --after {last}"
            )
        return e


class _Follower:
    """Follows one job to its end on the client's `run` or `watch` (which re-attach within
    --reconnect-timeout): its progress, each event to `emit`, what the stream goes through."""

    def __init__(
        self,
        c: Client,
        out: _Output,
        view: progress.JobView,
        emit: Callable[[job_pb2.JobEvent], None],
    ) -> None:
        self.c, self.view, self.emit = c, view, emit
        self.notes = _StreamNotes(c, out, view)
        self.job_id, self.last = "", 0

    def run(self, spec: kernel_pb2.JobSpec) -> job_pb2.Job:
        return self._follow(self.c.run(spec, on_note=self.notes))

    def watch(self, job_id: str, after: int) -> job_pb2.Job:
        self.job_id, self.last = job_id, after
        return self._follow(self.c.watch(job_id, after, on_note=self.notes))

    def _follow(self, events: Iterator[job_pb2.JobEvent]) -> job_pb2.Job:
        try:
            for ev in events:
                self.job_id, self.last = self.job_id or ev.job_id, ev.sequence
                self.view.event(ev)
                self.emit(ev)
                if ev.HasField("finished"):
                    return ev.finished
        except errors.Unavailable as e:
            raise self.notes.gave_up(e, self.job_id, self.last) from e
        raise errors.Unavailable(f"the stream of job {self.job_id} ended early")


def _ok(job: job_pb2.Job) -> bool:
    return job.state == job_pb2.JOB_STATE_DONE and job.result.verdict == job_pb2.VERDICT_OK


def _not_run(job: job_pb2.Job) -> bool:
    return (
        job.state == job_pb2.JOB_STATE_DONE
        and job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE
    )


def _exit_code(results: Iterable[job_pb2.Job | str]) -> int:
    """0 if every job is OK; 1 if any failed (a refusal, text here, too); else 4 when some
    could not run on the service's host: not evaluated is neither a pass nor a failure."""
    ok = True
    for r in results:
        if isinstance(r, str) or not (_ok(r) or _not_run(r)):
            return EXIT_VERDICT
        ok = ok and _ok(r)
    return EXIT_OK if ok else EXIT_NOT_RUN


def _show_job(out: _Output, job: job_pb2.Job) -> int:
    if out.json:
        _dump(as_dict(job))
    elif not out.jsonl:
        print(render.result_table(job, out.style, width=out.width))
    return _exit_code([job])


def _cancel_on_interrupt(c: Client, out: _Output, job_id: str) -> int:
    out.display.settle()
    if not job_id:
        out.note("interrupted before the service accepted the job")
        return EXIT_INTERRUPTED
    c.timeout = 10.0  # the server may be gone: do not hang on it
    try:
        job = c.cancel_job(job_id)
        out.note(f"interrupted: cancelled job {job_id} ({render.state_name(job.state)})")
    except errors.KernelEvalError as e:
        out.note(f"interrupted; could not cancel job {job_id}: {e}")
    return EXIT_INTERRUPTED


def _run_one(
    a: argparse.Namespace, c: Client, out: _Output, name: str, spec: kernel_pb2.JobSpec
) -> int:
    """One job on a Run stream: its progress, then its result."""
    view = progress.JobView(out.display, bars=progress.PhaseBars.for_spec(spec))

    def emit(ev: job_pb2.JobEvent) -> None:
        if out.jsonl:
            _dump({"file": name, "event": as_dict(ev), **_bars(view)}, lines=True)

    follower = _Follower(c, out, view, emit)
    try:
        job = follower.run(spec)
    except KeyboardInterrupt:
        return _cancel_on_interrupt(c, out, follower.job_id)
    finally:
        out.display.close()  # before the result goes to the same terminal
    if out.json:
        _dump([{"file": name, "job": as_dict(job)}])
        return _exit_code([job])
    return _show_job(out, job)


def _bars(view: progress.JobView) -> dict[str, Any]:
    """--jsonl's "bars": what the event moved of the job's bars, one per phase (none when
    it repeats a phase another of the job's processes reported already)."""
    return {"bars": [b.as_dict() for b in view.moved]} if view.moved else {}


def _refusal_text(error: Any) -> str:
    """A refused submission of a batch: its message, and the violations it does not say."""
    violations = [f"{v.field}: {v.description}" for v in error.field_violations]
    text = f"refused: {error.message}" + "".join(
        f"; {v}" for v in violations if v not in error.message
    )
    hint = _flag_hint([v.field for v in error.field_violations])
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


def _flag_hint(fields: Iterable[str]) -> str:
    """Which of the CLI's options set the fields a refusal names ("" for none)."""
    hints: list[str] = []
    for field in fields:
        for pattern, hint in _FIELD_FLAGS:
            if pattern.match(field) and hint not in hints:
                hints.append(hint)
    return "; ".join(hints)


def _run_batch(
    a: argparse.Namespace, c: Client, out: _Output, specs: list[tuple[str, kernel_pb2.JobSpec]]
) -> int:
    """Several files on one RunBatch stream: a line per finished job, then a table. Each
    file gets its own tag, so the same file twice gives two jobs and two rows."""
    results: dict[int, job_pb2.Job | str] = {}
    view = progress.BatchView(out.display, len(specs))
    tagged = [(str(i), spec) for i, (_, spec) in enumerate(specs)]
    try:
        for ev in c.run_batch(tagged, max_in_flight=a.max_in_flight):
            i = int(ev.request_tag)
            name = specs[i][0]
            if out.jsonl:
                if ev.error is not None:
                    _dump({"file": name, "error": as_dict(ev.error)}, lines=True)
                elif ev.event is not None:
                    _dump({"file": name, "event": as_dict(ev.event)}, lines=True)
            if not ev.done:
                continue
            if ev.error is not None:
                results[i] = _refusal_text(ev.error)
            else:
                assert ev.event is not None
                results[i] = ev.event.finished
            got = results[i]
            view.done(name, got if isinstance(got, str) else render.job_summary(got))
    except KeyboardInterrupt:
        out.display.settle()
        out.note(
            f"interrupted: the service cancels the batch's unfinished jobs "
            f"({len(results)} of {len(specs)} had finished)"
        )
        return EXIT_INTERRUPTED
    finally:
        out.display.close()
    ordered = [(name, results.get(i, "no result")) for i, (name, _) in enumerate(specs)]
    if out.json:
        _dump([_file_entry(n, r) for n, r in ordered])
    elif not out.jsonl:
        print(render.batch_table(ordered, width=out.width, style=out.style))
    return _exit_code(r for _, r in ordered)


def _file_entry(name: str, r: job_pb2.Job | str) -> dict[str, Any]:
    return (
        {"file": name, "job": as_dict(r)}
        if isinstance(r, job_pb2.Job)
        else {
            "file": name,
            "error": r,
        }
    )


def _run_specs(
    a: argparse.Namespace, c: Client, out: _Output, specs: list[tuple[str, kernel_pb2.JobSpec]]
) -> int:
    if a.detach:
        jobs = [(name, c.submit(spec)) for name, spec in specs]
        if out.json or out.jsonl:
            _dump([_file_entry(n, j) for n, j in jobs], lines=out.jsonl)
        elif len(jobs) == 1:
            print(jobs[0][1].job_id)
        else:
            for name, job in jobs:
                print(f"{job.job_id}  {name}")
        return EXIT_OK
    if len(specs) == 1:
        return _run_one(a, c, out, *specs[0])
    return _run_batch(a, c, out, specs)


# --- commands ----------------------------------------------------------------------------


def cmd_evaluate(a: argparse.Namespace, c: Client, out: _Output) -> int:
    return _run_specs(a, c, out, _specs(a))


def cmd_compare(a: argparse.Namespace, c: Client, out: _Output) -> int:
    return _run_specs(a, c, out, _specs(a))


def cmd_gpumode(a: argparse.Namespace, c: Client, out: _Output) -> int:
    return _run_specs(a, c, out, _gpumode_specs(a))


def _gpumode_specs(a: argparse.Namespace) -> list[tuple[str, kernel_pb2.JobSpec]]:
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
    options, labels = _options(a), _labels(a)
    specs = []
    for name in names:
        text, _ = sources.read(name, "the submission file")
        spec = gpumode.spec_from_task(task, text, options=options, client_tag=a.tag, labels=labels)
        spec.kernel.entry_point = a.entry_point
        specs.append((name, spec))
    return specs


def cmd_watch(a: argparse.Namespace, c: Client, out: _Output) -> int:
    bars = progress.PhaseBars()
    try:  # to count the candidate's and the reference's timed trials apart
        bars = progress.PhaseBars.for_spec(c.get_job(a.job).spec)
    except errors.NotFound:
        raise
    except errors.KernelEvalError:
        pass  # the server is down: Watch waits for it below

    def emit(ev: job_pb2.JobEvent) -> None:
        if out.jsonl:
            _dump({**as_dict(ev), **_bars(view)}, lines=True)

    view = progress.JobView(out.display, bars=bars)
    follower = _Follower(c, out, view, emit)
    try:
        job = follower.watch(a.job, a.after)
    except KeyboardInterrupt:
        out.display.settle()
        out.note(f"stopped watching job {a.job}; it goes on (`kerneleval cancel {a.job}` stops it)")
        return EXIT_INTERRUPTED
    finally:
        out.display.close()
    return _show_job(out, job)


def cmd_get(a: argparse.Namespace, c: Client, out: _Output) -> int:
    job = c.get_job(a.job)
    if out.json or out.jsonl:
        _dump(as_dict(job), lines=out.jsonl)
        return _exit_code([job])
    return _show_job(out, job)


def cmd_cancel(a: argparse.Namespace, c: Client, out: _Output) -> int:
    job = c.cancel_job(a.job)
    if out.json or out.jsonl:
        _dump(as_dict(job), lines=out.jsonl)
    else:
        print(f"{job.job_id}: {out.style.outcome(render.state_name(job.state))}")
    return EXIT_OK


def cmd_jobs(a: argparse.Namespace, c: Client, out: _Output) -> int:
    jobs = list(
        c.list_jobs(
            state=STATES[a.state],
            client_tag=a.tag,
            labels=_labels(a),
            limit=a.limit,
            page_size=min(a.limit, 1000),
        )
    )
    if out.json:
        _dump([as_dict(j) for j in jobs])
    elif out.jsonl:
        for j in jobs:
            _dump(as_dict(j), lines=True)
    else:
        print(render.jobs_table(jobs, width=out.width, style=out.style))
    return EXIT_OK


def cmd_devices(a: argparse.Namespace, c: Client, out: _Output) -> int:
    devices = c.list_devices()
    if out.json:
        _dump([as_dict(d) for d in devices])
        return EXIT_OK
    print(render.devices_table(devices, width=out.width, style=out.style))
    for d in devices:
        for x in d.recent_xids:
            who = f" job {x.job_id}" if x.job_id else ""
            print(
                render.printable(
                    f"  gpu {d.index}: XID {x.xid} ({x.category}) -> {x.action}{who} "
                    f"at {render.fmt_time(x.time)}  {x.message}".rstrip()
                )
            )
    return EXIT_OK


def cmd_builders(a: argparse.Namespace, c: Client, out: _Output) -> int:
    resp = c.list_builders()
    if out.json:
        _dump(as_dict(resp))
        return EXIT_OK
    mine = ", ".join(resp.versions) or "not known yet (no job process has reported them)"
    if not resp.builders:
        print("no builders (they register in a shared PostgreSQL store: --role builder)")
    else:
        print(render.builders_table(resp.builders, now=time.time(), width=out.width,
                                    style=out.style))  # fmt: skip
    print(render.printable(f"this server's versions: {mine}"))
    for b in resp.builders:  # a builder no job of this server can use: what it has instead
        if not b.versions_match:
            print(render.printable(f"  {b.builder_id} builds with: {b.versions}"))
    return EXIT_OK


def cmd_events(a: argparse.Namespace, c: Client, out: _Output) -> int:
    for ev in c.watch_events(a.replay):
        if out.json or out.jsonl:
            _dump(as_dict(ev), lines=True)
        else:
            print(render.printable(render.ops_event_line(ev)), flush=True)
    return EXIT_OK


NODE_HELP = "through a gateway: the node that owns the device (as `devices` shows it)"


def cmd_reset_gpu(a: argparse.Namespace, c: Client, out: _Output) -> int:
    if not c.admin_token:
        print(f"error: reset-gpu needs --admin-token or ${ADMIN_TOKEN_ENV}", file=sys.stderr)
        return EXIT_USAGE
    if not a.yes:
        if not sys.stdin.isatty():
            print("error: not a terminal; pass --yes to reset without asking", file=sys.stderr)
            return EXIT_USAGE
        answer = input(
            f"Reset GPU {a.index} at {c.address}? Its jobs get {a.grace:g} s to finish, then its "
            "workers are stopped. Type 'yes': "
        )
        if answer.strip().lower() != "yes":
            print("not reset", file=sys.stderr)
            return EXIT_USAGE
    resp = c.reset_gpu(a.index, grace_period=a.grace, node=a.node)
    if out.json:
        _dump(as_dict(resp))
    else:
        for s in resp.steps:
            state = out.style.outcome("OK") if s.ok else out.style.paint("FAILED", "red")
            print(f"{render.fmt_time(s.time)}  {s.step:<16} {state}  {s.message}".rstrip())
        print("GPU healthy again" if resp.success else "reset FAILED")
    return EXIT_OK if resp.success else EXIT_VERDICT


def cmd_restart_workers(a: argparse.Namespace, c: Client, out: _Output) -> int:
    count = c.restart_workers(a.device, node=a.node)
    if out.json:
        _dump({"restartedCount": count})
        return EXIT_OK
    where = "every device" if a.device is None else render.device_label(a.device)
    print(f"asked {count} worker(s) on {where} to restart")
    return EXIT_OK


def cmd_cleanup(a: argparse.Namespace, c: Client, out: _Output) -> int:
    older = None if a.older_than_hours is None else a.older_than_hours * 3600
    resp = c.cleanup(older)
    if out.json:
        _dump(as_dict(resp))
    else:
        print(f"deleted {resp.deleted_job_count} finished job(s)")
    return EXIT_OK


def cmd_stats(a: argparse.Namespace, c: Client, out: _Output) -> int:
    st = c.get_stats()
    if out.json:
        _dump(as_dict(st))
        return EXIT_OK
    rows = [
        ("uptime", render.fmt_duration(st.uptime.ToTimedelta().total_seconds())),
        ("queue depth", str(st.queue_depth)),
        (
            "jobs",
            ", ".join(
                f"{k.removeprefix('JOB_STATE_')} {v}" for k, v in sorted(st.jobs_by_state.items())
            )
            or "-",
        ),
        (
            "verdicts",
            ", ".join(
                f"{k.removeprefix('VERDICT_')} {v}" for k, v in sorted(st.jobs_by_verdict.items())
            )
            or "-",
        ),
        ("queue latency", _latency(st.queue_latency)),
        ("run latency", _latency(st.run_latency)),
        ("faults", str(st.fault_count)),
        ("worker restarts", str(st.worker_restart_count)),
        ("GPU resets", str(st.gpu_reset_count)),
        ("XIDs", str(st.xid_count)),
    ]
    rows.extend(
        (
            f"timing, {render.device_label(o.device_index)}",
            f"{o.timing_window_count} windows held {o.timing_window.ToNanoseconds() / 1e9:.1f} s "
            f"of {o.timing_wanted.ToNanoseconds() / 1e9:.1f} s wanted",
        )
        for o in st.device_occupancy
    )
    sandbox = render.sandbox_lines(st)
    rows.append(sandbox[0])
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    for key, value in sandbox[1:]:  # what the host refused the sandbox, and other warnings
        print(f"{key}: {value}")
    return EXIT_OK


def _latency(s: Any) -> str:
    if not s.sample_count:
        return "-"
    return f"p50 {s.p50_ms:.1f} ms, p90 {s.p90_ms:.1f} ms, p99 {s.p99_ms:.1f} ms ({s.sample_count})"


def cmd_doctor(a: argparse.Namespace, c: Client, out: _Output) -> int:
    report = run_doctor(c.address, c.admin_token, a.service_timeout, credentials=_credentials(a))
    print(json.dumps(report.as_dict(), indent=2) if out.json else report.text(), end="")
    return EXIT_OK


def cmd_kernelbench(a: argparse.Namespace, c: Client, out: _Output) -> int:
    """Every generated kernel of a KernelBench run against its problem; see kernelbench_run."""
    run_dir = Path(a.run_dir)
    problems = kb.find_problems(Path(a.problems), a.level)
    if a.subset:
        wanted = kb.parse_subset(a.subset)
        problems = {pid: p for pid, p in problems.items() if pid in wanted}
        if not problems:
            raise kb.RunError(f"--subset {a.subset}: none of those problems is in {a.problems}")
    samples, notes = kb.find_samples(run_dir, a.level, problems)
    for n in notes:
        out.note(n)
    inputs = kb.load_inputs(Path(a.inputs) if a.inputs else None)
    # A kernel that could not run on the service's host has no result yet: run it again.
    done = {s: e for s, e in kb.read_results(run_dir, samples).items() if kb.evaluated(e)}
    todo = [s for s in samples if s not in done]
    missing = sorted(set(problems) - {s.problem_id for s in samples})
    out.note(
        f"level {a.level}: {len(samples)} kernel(s) for {len(problems)} problem(s) in "
        f"{run_dir}; {len(done)} already have a result, {len(todo)} to evaluate"
        + (f"; {len(missing)} problem(s) without a kernel" if missing else "")
    )
    options = _options(a)
    interrupted = False
    if todo:
        interrupted = _kernelbench_jobs(a, c, out, run_dir, todo, options, inputs, done)
    all_results = kb.read_results(run_dir, samples)
    kb.write_json(run_dir / "eval_results.json", kb.eval_results(all_results))
    summary = kb.summary(run_dir.name, a.level, problems, all_results)
    kb.write_json(run_dir / "analysis_results.json", summary)
    if out.json:
        _dump(summary)
    else:
        print(kb.summary_text(summary))
        print(f"results: {run_dir / kb.RESULTS_DIR}/, {run_dir / 'eval_results.json'}, "
              f"{run_dir / 'analysis_results.json'}")  # fmt: skip
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK


def _kernelbench_jobs(
    a: argparse.Namespace,
    c: Client,
    out: _Output,
    run_dir: Path,
    todo: list[kb.Sample],
    options: kernel_pb2.EvalOptions,
    inputs: dict[int, kernel_pb2.IOContract],
    done: dict[kb.Sample, dict[str, Any]],
) -> bool:
    """Runs the kernels without a result on one RunBatch stream, writing each result as its
    job ends; True when interrupted (what was written stays: run again to resume)."""
    view = progress.BatchView(out.display, len(todo), label="kernels")
    jobs = (
        (str(i), kb.job_spec(s, options, inputs, client_tag=a.tag or "kernelbench"))
        for i, s in enumerate(todo)
    )
    finished = 0
    try:
        for ev in c.run_batch(jobs, max_in_flight=a.max_in_flight):
            if not ev.done:
                continue
            s = todo[int(ev.request_tag)]
            if ev.error is not None:
                if ev.error.code != grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                    view.done(s.name, _refusal_text(ev.error) + " (not written: run again)")
                    continue
                entry = kb.refused_entry(s.sample_id, _refusal_text(ev.error))
                summary = "REFUSED " + _refusal_text(ev.error)
            else:
                assert ev.event is not None
                job = ev.event.finished
                entry = kb.kernelbench_entry(s.sample_id, job, options.compile_baseline)
                summary = render.job_summary(job)
            kb.write_json(kb.result_path(run_dir, s), entry)
            finished += 1
            if out.jsonl:
                _dump({"kernel": s.kernel.name, "result": entry}, lines=True)
            view.done(s.name, summary)
    except KeyboardInterrupt:
        out.display.settle()
        out.note(
            f"interrupted after {finished} of {len(todo)} kernel(s); their results are "
            f"written, the service cancels the rest: run the same command again to resume"
        )
        return True
    finally:
        out.display.close()
    return False


SERVE = (  # `kerneleval serve`'s interpreter: named `kerneleval` in --help (program_name)
    "import sys; from kerneleval_server.main import main; sys.argv[0] = 'kerneleval'; "
    "sys.exit(main())"
)


def cmd_serve(argv: Sequence[str]) -> int:
    try:
        if importlib.util.find_spec("kerneleval_server.main") is None:
            raise ImportError("No module named 'kerneleval_server.main'")
    except ImportError as e:
        print(
            "kerneleval serve needs the server package (kerneleval-server), which is not "
            f"installed here ({e}).\nInstall it from the repository root: pip install -e . "
            "(or run `make serve`).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # The server's own `serve` subcommand, in a fresh interpreter: this one loaded gRPC
    # already, before the server could set what gRPC reads as it loads (its __init__).
    os.execv(sys.executable, [sys.executable, "-c", SERVE, "serve", *argv])


def _credentials(a: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if a.tls_ca:
        return grpc.ssl_channel_credentials(Path(a.tls_ca).read_bytes())
    if a.tls:
        return grpc.ssl_channel_credentials()
    return None


# --- the parser ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that never prints a secret: its errors show the admin token as ***."""

    secrets: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        message += _did_you_mean(self, message)
        for secret in _Parser.secrets:
            message = message.replace(secret, "***")
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """A suggestion to add to argparse's error: "; did you mean 'evaluate'?" for a mistyped
    command or choice, the closest options for mistyped ones ("--perf-trails: did you mean
    --perf-trials?"); "" when nothing is close."""
    if m := _INVALID_CHOICE.search(message):
        choices = re.findall(r"'([^']*)'", m.group(2)) or m.group(2).split(", ")
        near = difflib.get_close_matches(m.group(1), choices, n=1)
        return f"; did you mean '{near[0]}'?" if near else ""
    if m := _UNRECOGNIZED.search(message):
        known = _option_strings(parser)
        found = []
        for arg in m.group(1).split():
            flag = arg.split("=", 1)[0]
            if flag.startswith("-") and flag not in known:
                near = difflib.get_close_matches(flag, sorted(known), n=1)
                if near:
                    found.append(f"{flag}: did you mean {near[0]}?")
        return "".join(f"; {f}" for f in found)
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option of the parser and its commands."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def _secrets(argv: Sequence[str]) -> tuple[str, ...]:
    """The values given to secret options in argv (`--admin-token X`, `--admin-token=X`)."""
    out = []
    for i, arg in enumerate(argv):
        for opt in _SECRET_OPTIONS:
            if arg == opt and i + 1 < len(argv):
                out.append(argv[i + 1])
            elif arg.startswith(opt + "="):
                out.append(arg.split("=", 1)[1])
    return tuple(s for s in out if s)


MAIN_EXAMPLES = """\
examples:
  kerneleval evaluate model_new.py --reference level1/19_ReLU.py
  kerneleval compare level1/19_ReLU.py a.py b.py c.py --json > results.json
  cat model_new.py | kerneleval compare level1/19_ReLU.py -
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/level1
  kerneleval gpumode reference-kernels/problems/pmpp_v2/vectoradd_py my_submission.py
  kerneleval watch JOB_ID --jsonl
  kerneleval devices --admin-token-file state/admin_token

Exit codes: 0 verdict OK, 1 another verdict, 2 usage error, 3 service error, 4 not evaluated
(CANNOT_RUN_HERE: the service's host lacks the GPU the kernel needs; not a failure of the
kernel), 130 interrupted. Of several jobs: 1 if any failed, else 4 if any was not evaluated.
Colour follows NO_COLOR and whether the output is a terminal; --color overrides.
"""

EPILOGS = {
    "evaluate": """\
examples:
  kerneleval evaluate model_new.py                       # runs it, nothing to compare with
  kerneleval evaluate model_new.py --reference problem.py --perf-trials 200
  kerneleval evaluate k1.py k2.py k3.py --reference problem.py --max-in-flight 8
  kerneleval evaluate add.py --type triton --io io.json --atol 1e-3

--json prints a list with an object {"file", "job"} per file (or {"file", "error"} for one
the service refused), one file or many; --jsonl prints {"file", "event"} per event as it comes.
""",
    "compare": """\
examples:
  kerneleval compare level1/19_ReLU.py model_new.py
  kerneleval compare level1/19_ReLU.py - < model_new.py           # the kernel from stdin
  kerneleval compare level1/19_ReLU.py a.py b.py --preset kernelbench --json | jq '.[].job.result'

--json and --jsonl: as for evaluate.
""",
    "gpumode": """\
examples:
  kerneleval gpumode problems/pmpp_v2/vectoradd_py                # the task's submission.py
  kerneleval gpumode problems/pmpp_v2/vectoradd_py mine.py other.py --perf-trials 50
  kerneleval gpumode vectoradd_py mine.py --json | jq '.[0].job.result.benchmarkCases'

Every test case of task.yml runs once (check_implementation judges the output), then every
benchmark case is checked and timed, the submission and ref_kernel on the same data. The
result shows a row per case (its arguments, pass or FAIL, message, median times, speedup);
the job's runtime and speedup are geometric means over the benchmarks, as GPU MODE ranks.
A submission that needs CUDA on a host without a GPU ends CANNOT_RUN_HERE ("not run here
(needs a GPU)"): not evaluated, exit code 4, not a failure of the submission.

--json and --jsonl: as for evaluate (a list of {"file", "job"}, the file being the
submission's path). A folder that is not a GPU MODE task is a usage error (exit code 2).
""",
    "watch": """\
examples:
  kerneleval watch 3f2a9c... ; kerneleval watch 3f2a9c... --after 12 --jsonl

It waits for a server that is down (up to --reconnect-timeout, saying so) and re-attaches
when the stream drops. --json prints the finished job; --jsonl each event as it comes.
Ctrl-C stops watching; the job goes on.
""",
    "kernelbench": """\
examples:
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/KernelBench
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/KernelBench/level1 \\
      --subset 1-20 --correct-trials 5 --perf-trials 100      # eval_from_generations' settings

Kernels are RUN_DIR/level_{L}_problem_{P}_sample_{S}_kernel.py, problems PROBLEMS/{P}_{Name}.py
(or PROBLEMS/level{L}/...). Each result goes to RUN_DIR/kerneleval/ as its job ends; run the
same command again after an interruption and it goes on where it stopped. At the end
RUN_DIR/eval_results.json and RUN_DIR/analysis_results.json (fast_p, geometric mean speedup)
are written; --json prints the latter.
""",
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kerneleval",
        description="Compile, check and time GPU kernels on a kerneleval server.",
        epilog=MAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--version", action="version", version=f"kerneleval {kerneleval.__version__} (client)"
    )
    _add_global_options(p, suppress=False)
    common = _Parser(add_help=False, allow_abbrev=False)
    _add_global_options(common, suppress=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, helptext: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=helptext,
            description=helptext,
            parents=[common],
            epilog=EPILOGS.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
            **kw,
        )

    s: argparse.ArgumentParser = sub.add_parser(
        "serve", help="start the server (needs kerneleval-server)", add_help=False
    )
    s.add_argument("args", nargs=argparse.REMAINDER)

    s = command("evaluate", "evaluate kernel files (compare with --reference); several at once")
    s.add_argument("files", nargs="+", metavar="FILE", help="kernel source files; - is stdin")
    s.add_argument("--reference", help="reference file (e.g. a KernelBench problem); - is stdin")
    _add_job_options(s)
    s.set_defaults(func=cmd_evaluate)

    s = command("compare", "compare kernel files with a reference file")
    s.add_argument("reference", help="reference file (e.g. a KernelBench problem); - is stdin")
    s.add_argument("files", nargs="+", metavar="FILE", help="kernel source files; - is stdin")
    _add_job_options(s)
    s.set_defaults(func=cmd_compare)

    s = command("kernelbench", "evaluate a KernelBench run's generated kernels, KernelBench-style")
    s.add_argument("run_dir", metavar="RUN_DIR", help="folder of generated kernels")
    s.add_argument("--level", type=int, required=True, help="KernelBench level (1, 2, 3, 4)")
    s.add_argument(
        "--problems",
        required=True,
        metavar="PATH",
        help="the level's problem folder, or the folder that holds level{N}/",
    )
    s.add_argument("--subset", metavar="IDS", help="only these problems, e.g. 1-20 or 19,23,40")
    s.add_argument(
        "--inputs",
        metavar="FILE",
        help='JSON {"19": IOContract, ...} replacing those problems\' get_inputs() (e.g. '
        "smaller shapes on a host without a GPU)",
    )
    _add_job_options(s)
    s.set_defaults(func=cmd_kernelbench, preset="kernelbench")

    s = command("gpumode", "evaluate GPU MODE submissions against a task folder, as its harness")
    s.add_argument(
        "task_dir",
        metavar="TASK_DIR",
        help="the task: reference.py and task.yml (tests, benchmarks, files), e.g. "
        "reference-kernels/problems/pmpp_v2/vectoradd_py",
    )
    s.add_argument(
        "submissions",
        nargs="*",
        metavar="SUBMISSION",
        help="files defining custom_kernel(data); - is stdin (default: TASK_DIR/submission.py)",
    )
    _add_job_options(s, gpu_mode=True)
    s.set_defaults(func=cmd_gpumode, preset="service")

    s = command("watch", "follow a job's events to its result")
    s.add_argument("job")
    s.add_argument("--after", type=int, default=0, help="replay after this sequence")
    s.set_defaults(func=cmd_watch)

    s = command("get", "show a job (--json: the Job object)")
    s.add_argument("job")
    s.set_defaults(func=cmd_get)

    s = command("cancel", "cancel a job")
    s.add_argument("job")
    s.set_defaults(func=cmd_cancel)

    s = command("jobs", "list jobs, newest first (--json: a list of Job objects)")
    s.add_argument("--state", choices=list(STATES), default="unspecified")
    s.add_argument("--tag", default="", help="only jobs with this client tag")
    _add_label_option(s, "only jobs with this label (repeatable: every one of them)")
    s.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    s.set_defaults(func=cmd_jobs)

    s = command("devices", "GPUs, their health and recent XIDs (admin token)")
    s.set_defaults(func=cmd_devices)

    s = command("events", "follow operations events (admin token; --json: one per line)")
    s.add_argument("--replay", type=int, default=0, help="replay this many recent events")
    s.set_defaults(func=cmd_events)

    s = command("reset-gpu", "drain and reset a GPU (admin token)")
    s.add_argument("index", type=int)
    s.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    s.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds running jobs get to finish (default 30)",
    )
    s.add_argument("--node", default="", help=NODE_HELP)
    s.set_defaults(func=cmd_reset_gpu)

    s = command("restart-workers", "replace the workers (admin token)")
    s.add_argument("--device", type=int, default=None, help="GPU index (default: every device)")
    s.add_argument("--node", default="", help=NODE_HELP)
    s.set_defaults(func=cmd_restart_workers)

    s = command("cleanup", "delete old finished jobs now (admin token)")
    s.add_argument(
        "--older-than-hours",
        type=float,
        default=None,
        metavar="H",
        help="cut-off (default: the server's retention period)",
    )
    s.set_defaults(func=cmd_cleanup)

    s = command("stats", "counters and latencies (admin token)")
    s.set_defaults(func=cmd_stats)

    s = command("builders", "the load_inline builders of a shared store (admin token)")
    s.set_defaults(func=cmd_builders)

    s = command("mcp", "serve the tools for LLM agents over MCP (needs kerneleval-client[mcp])")
    s.add_argument("--http-port", type=int, default=0, help="streamable HTTP here; else stdio")
    s.add_argument("--http-host", default="127.0.0.1", help="address for --http-port")

    s = command("doctor", "print a diagnostics report to paste into an issue")
    s.add_argument(
        "--service-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="deadline of the calls to the service (default 5)",
    )
    s.set_defaults(func=cmd_doctor)
    return p


def _admin_token(a: argparse.Namespace) -> str | None:
    if a.admin_token:
        return str(a.admin_token)
    if a.admin_token_file:
        return Path(a.admin_token_file).read_text(encoding="utf-8").strip() or None
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def cmd_mcp(a: argparse.Namespace) -> int:
    try:
        from .mcp_server import serve
    except ImportError as e:
        print(f"error: kerneleval mcp needs the mcp extra ({e}): "
              "pip install 'kerneleval-client[mcp]'", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return serve(
        resolve_address(a.address),
        admin_token=_admin_token(a),
        credentials=_credentials(a),
        http_port=a.http_port,
        http_host=a.http_host,
    )


def _error_text(e: errors.KernelEvalError, address: str, token_given: bool = False) -> str:
    text = f"error: {e}"
    if e.code == grpc.StatusCode.UNAVAILABLE and "serve" not in text:
        text += f"\n(is the server running at {address}? start one with `kerneleval serve`)"
    hint = _flag_hint(v.field for v in e.field_violations)
    if hint:
        text += f"\n({hint}; see `kerneleval evaluate --help`)"
    if e.code == grpc.StatusCode.UNAUTHENTICATED and not token_given:
        text += (
            "\n(no admin token was given: the service's is in the file admin_token of its "
            f"state folder: --admin-token-file STATE_DIR/admin_token, --admin-token TOKEN or "
            f"${ADMIN_TOKEN_ENV})"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    _Parser.secrets = _secrets(args_list)
    parser = build_parser()
    # `serve` hands every argument after it to the server's own parser.
    if "serve" in args_list:
        i = args_list.index("serve")
        head = parser.parse_args([*args_list[:i], "serve"])
        if head.command == "serve":
            return cmd_serve(args_list[i + 1 :])
    a = parser.parse_args(args_list)
    if a.command == "mcp":
        return cmd_mcp(a)
    address = resolve_address(a.address)
    out: _Output | None = None
    try:
        out = _Output(a)
        with Client(
            address,
            timeout=a.timeout,
            admin_token=_admin_token(a),
            credentials=_credentials(a),
            reconnect_timeout=a.reconnect_timeout,
        ) as c:
            return int(a.func(a, c, out))
    except errors.KernelEvalError as e:
        if out is not None:
            out.close()  # the error goes below the bars, not into them
        token_given = bool(_admin_token(a))
        print(render.printable(_error_text(e, address, token_given)), file=sys.stderr)
        return EXIT_SERVICE
    except gpumode.TaskError as e:
        print(f"error: not a GPU MODE task: {e}\n(a task folder holds reference.py and "
              "task.yml, as gpu-mode/reference-kernels; see `kerneleval gpumode --help`)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    except (OSError, ValueError, json_format.ParseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if out is not None:
            out.close()


if __name__ == "__main__":
    sys.exit(main())
