"""Terminal output of the CLI: result tables, device tables, and what they need from the
terminal (its width, whether to colour). Live progress is kerneleval.progress."""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

from google.protobuf import timestamp_pb2

from kerneleval.v1 import job_pb2, kernel_pb2, operations_service_pb2

# Control characters (but newline and tab) and bidirectional overrides: in text a candidate
# wrote (its logs, errors, notes), they could move the cursor or reorder what a terminal shows,
# e.g. paint "verdict OK" over the real verdict.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """The text with every control character shown as an escape (\\x1b), newlines kept."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                            else f"\\u{ord(m.group()):04x}", text)  # fmt: skip


PHASE_NAMES: dict[int, str] = {
    job_pb2.PHASE_COMPILING: "compiling",
    job_pb2.PHASE_VALIDATING: "validating",
    job_pb2.PHASE_PROFILING: "profiling",
}

ColorMode = Literal["auto", "always", "never"]


def color_enabled(stream: TextIO, mode: ColorMode = "auto") -> bool:
    """Whether to colour what goes to `stream`: never with NO_COLOR set (no-color.org) or
    TERM=dumb, always with FORCE_COLOR, else only on a terminal; `mode` overrides all that."""
    if mode != "auto":
        return mode == "always"
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("TERM") == "dumb":
        return False
    return _isatty(stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


def terminal_width(stream: TextIO) -> int | None:
    """Columns that tables must fit: $COLUMNS, else the terminal's; None (no limit) when the
    output is not a terminal, so that a pipe or a file gets every id and path in full."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not _isatty(stream):
        return None
    return shutil.get_terminal_size().columns


def ellipsis() -> str:
    """ "…" where stdout takes UTF-8, else "~" (one column either way)."""
    return "\u2026" if (sys.stdout.encoding or "").lower().replace("-", "") == "utf8" else "~"


_SGR = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}
_GOOD = {"OK", "DONE", "HEALTHY", "SERVING", "yes", "pass", "live"}
_NEUTRAL = {"QUEUED", "RUNNING", "CANCELLED", "UNSPECIFIED", "-", "NOT_CHECKED"}
# Not evaluated, which is not a failure of the kernel: a warning's colour, never a failure's.
_WARNING = {"CANNOT_RUN_HERE"}
# What VERDICT_CANNOT_RUN_HERE means, wherever a result is shown: this host lacks what the
# kernel (or the reference) needs; nothing was checked or timed.
NOT_RUN_HERE = "not run here (needs a GPU)"


@dataclass(frozen=True)
class Style:
    """ANSI colour for words that say how something went; does nothing when disabled."""

    enabled: bool = False

    def paint(self, text: str, colour: str) -> str:
        if not self.enabled or not text:
            return text
        return f"\x1b[{_SGR[colour]}m{text}\x1b[0m"

    def outcome(self, text: str) -> str:
        """Green for OK (and DONE, HEALTHY), yellow for states on the way and for
        CANNOT_RUN_HERE (not evaluated), red for the rest."""
        word = text.split(" ", 1)[0].split(":", 1)[0].strip()
        if word in _GOOD:
            return self.paint(text, "green")
        if word in _WARNING:
            return self.paint(text, "yellow")
        if word in _NEUTRAL or not word:
            return self.paint(text, "yellow") if word not in ("-", "") else text
        return self.paint(text, "red")


PLAIN = Style(False)


def fmt_duration(seconds: float) -> str:
    """ "0.8s", "57s", "4m57s", "1h02m", "3d04h": the two largest units (cut, not rounded)."""
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.1f}s"
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


Shrink = Literal["fixed", "id", "path", "text"]
# How far a column of each kind may be shortened when the table is too wide, and in which
# order they give way: free text first, then paths (their tail is kept), then ids (both ends).
_MIN_WIDTH: dict[str, int] = {"text": 12, "path": 14, "id": 12}
_SHRINK_ORDER: tuple[Shrink, ...] = ("text", "path", "id")


@dataclass(frozen=True)
class Column:
    """A table column: its header, how it may be shortened, whether it says how things went."""

    header: str
    shrink: Shrink = "fixed"
    outcome: bool = False


def shorten(text: str, width: int, how: Shrink) -> str:
    """The text cut to `width` columns: an id keeps both ends, a path its tail, text its
    start; an ellipsis marks the cut."""
    if len(text) <= width or how == "fixed" or width <= 0:
        return text
    mark = ellipsis()
    if width == 1:
        return mark
    if how == "id":
        head = (width - 1) // 2 + (width - 1) % 2
        tail = width - 1 - head
        return text[:head] + mark + (text[-tail:] if tail else "")
    if how == "path":
        return mark + text[-(width - 1) :]
    return text[: width - 1] + mark


def table(
    headers: Sequence[str | Column],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    style: Style = PLAIN,
) -> str:
    """An aligned table, easy to paste, fitted into `width` columns when given (ids, paths and
    free text shortened, see Column); cells shown printable (a client tag or a candidate's
    error is another tenant's text); outcome columns coloured by `style`."""
    cols = [h if isinstance(h, Column) else Column(h) for h in headers]
    cells = [[printable(c).replace("\n", " ") for c in row] for row in rows]
    widths = [len(c.header) for c in cols]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    if width is not None:
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        for kind in _SHRINK_ORDER:
            for i, col in enumerate(cols):
                if excess <= 0:
                    break
                if col.shrink != kind:
                    continue
                floor = max(_MIN_WIDTH[kind], len(col.header))
                cut = min(excess, widths[i] - floor)
                if cut > 0:
                    widths[i] -= cut
                    excess -= cut

    def line(values: Sequence[str], paint: bool) -> str:
        out = []
        for i, (col, value) in enumerate(zip(cols, values, strict=True)):
            text = shorten(value, widths[i], col.shrink)
            pad = "" if i == len(cols) - 1 else " " * (widths[i] - len(text))
            out.append((style.outcome(text) if paint and col.outcome else text) + pad)
        return "  ".join(out).rstrip()

    lines = [line([c.header for c in cols], False), "  ".join("-" * w for w in widths)]
    lines.extend(line(row, True) for row in cells)
    return "\n".join(lines)


def enum_name(value: int, enum: object, prefix: str) -> str:
    """ "OK" for Verdict VERDICT_OK, etc."""
    try:
        return str(enum.Name(value)).removeprefix(prefix)  # type: ignore[attr-defined]
    except ValueError:
        return str(value)


def verdict_name(value: int) -> str:
    return enum_name(value, job_pb2.Verdict, "VERDICT_")


def verdict_label(value: int) -> str:
    """The verdict's name, and what CANNOT_RUN_HERE means: not evaluated on this host, which
    is not a failure of the kernel."""
    if value == job_pb2.VERDICT_CANNOT_RUN_HERE:
        return f"{verdict_name(value)}: {NOT_RUN_HERE}"
    return verdict_name(value)


def state_name(value: int) -> str:
    return enum_name(value, job_pb2.JobState, "JOB_STATE_")


def health_name(value: int) -> str:
    return enum_name(value, operations_service_pb2.DeviceHealth, "DEVICE_HEALTH_")


def fmt_time(ts: timestamp_pb2.Timestamp) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    t = ts.ToDatetime(tzinfo=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def device_label(index: int) -> str:
    return "cpu" if index < 0 else f"gpu {index}"


def fault_text(f: job_pb2.FaultInfo) -> str:
    parts = []
    if f.description:
        parts.append(f.description)
    if f.xid:
        parts.append(f"XID {f.xid}" + (f" ({f.xid_category})" if f.xid_category else ""))
    if f.signal:
        parts.append(f"signal {f.signal}")
    if f.HasField("exit_code"):
        parts.append(f"exit code {f.exit_code}")
    if f.worker_pid:
        parts.append(f"worker pid {f.worker_pid}")
    if f.worker_restarted:
        parts.append("worker replaced")
    if f.gpu_reset:
        parts.append("GPU reset started")
    return "; ".join(parts) or "-"


def origin_text(job: job_pb2.Job) -> str:
    """Where a result came from when another job computed it: "cached from job-..." or
    "shared the run of job-..."; empty when the job ran itself (or it is not known)."""
    other = job.result_job_id or "an earlier job"
    if job.result_origin == job_pb2.RESULT_ORIGIN_CACHE:
        return f"cached from {other}"
    if job.result_origin == job_pb2.RESULT_ORIGIN_SHARED_RUN:
        return f"shared the run of {other}"
    return ""


def labels_text(labels: Mapping[str, str]) -> str:
    """ "problem=19, step=3": a job's labels, sorted by key."""
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _stats(r: job_pb2.RuntimeStats) -> str:
    source = enum_name(r.source, job_pb2.TimingSource, "TIMING_SOURCE_").lower()
    flushed = ", L2 flushed" if r.l2_flushed else ""
    outside = ", timed from outside its process" if r.timed_from_outside else ""
    return (
        f"median {r.median_ms:.4f} ms  mean {r.mean_ms:.4f}  std {r.std_ms:.4f}  "
        f"min {r.min_ms:.4f}  max {r.max_ms:.4f}  p95 {r.p95_ms:.4f}  "
        f"({r.trial_count} trials, {source}{flushed}{outside})"
    )


def _indent(text: str, limit: int = 40) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more lines)"]
    return "\n".join("             " + line for line in lines).lstrip()


def _gpu_conditions(c: job_pb2.GpuConditions) -> str:
    if not c.known:
        return "not read (no NVML)"
    text = (
        f"SM {c.sm_clock_mhz} MHz, memory {c.memory_clock_mhz} MHz, {c.temperature_celsius} C, "
        f"{c.power_watts:.0f} W"
    )
    reasons = [x for x in c.throttle_reasons if x != "gpu_idle"]
    return text + (f", throttled: {', '.join(reasons)}" if reasons else "")


def _window_rows(w: job_pb2.TimingWindow) -> list[tuple[str, str]]:
    """How a result was timed: alone or not, how long it waited, the GPU at both ends."""
    how = "the GPU to itself" if w.exclusive else "shared"
    if w.exclusive and not w.others_frozen:
        how += " (other job processes not frozen)"
    text = f"{how}, waited {w.waited.ToNanoseconds() / 1e6:.1f} ms for it"
    drain_ms = w.drain.ToNanoseconds() / 1e6
    if w.HasField("drain") and (drain_ms >= 0.05 or not w.drained):
        text += f", {drain_ms:.1f} ms for others' queued GPU work"
        text += "" if w.drained else " (still busy: times may include it)"
    rows = [("window", text)]
    if w.HasField("at_start"):
        rows.append(("gpu start", _gpu_conditions(w.at_start)))
    if w.HasField("at_end"):
        rows.append(("gpu end", _gpu_conditions(w.at_end)))
    return rows


def correctness_text(job: job_pb2.Job) -> str:
    """ "yes", "no", "not checked (...)" or "not reached": what the output check found."""
    r = job.result
    status = r.correctness_status
    if r.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE and status == job_pb2.CORRECTNESS_UNSPECIFIED:
        return "not checked (not run here)"
    if status == job_pb2.CORRECTNESS_NOT_CHECKED:
        return "not checked (no reference to compare with)"
    if status == job_pb2.CORRECTNESS_PASSED:
        return "yes"
    if status == job_pb2.CORRECTNESS_FAILED:
        return "no"
    # Not reached, or a service older than correctness_status.
    if not job.spec.HasField("reference") and r.correctness:
        return "not checked (no reference to compare with)"
    if r.correctness:
        return "yes"
    return "no" if r.validation.trial_count else "not reached"


def result_table(job: job_pb2.Job, style: Style = PLAIN, *, width: int | None = None) -> str:
    """The result of a finished job as `key  value` rows; a long one-line value is wrapped
    under itself to fit `width` columns when given."""
    r = job.result
    rows: list[tuple[str, str]] = []
    where = device_label(job.device_index) if job.worker_id else "-"
    if r.device.name:
        where += f" ({r.device.name})"
    attempts = f", {job.attempt_count} attempts" if job.attempt_count > 1 else ""
    rows.append(("job", f"{job.job_id}  {state_name(job.state)} on {where}{attempts}"))
    if job.state_reason:
        rows.append(("reason", job.state_reason))
    if job.spec.labels:
        rows.append(("labels", labels_text(job.spec.labels)))
    verdict = verdict_label(r.verdict)
    if r.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE:
        verdict += "; not a failure of the kernel"
    rows.append(("verdict", style.outcome(verdict)))
    if origin_text(job):
        rows.append(("origin", origin_text(job)))
    if r.failed_side != job_pb2.SIDE_UNSPECIFIED:
        rows.append(("failed side", enum_name(r.failed_side, job_pb2.Side, "SIDE_").lower()))
    rows.append(("compiled", "yes" if r.compiled else "no"))
    v = r.validation
    correct = correctness_text(job)
    if correct in ("yes", "no") and _is_gpu_mode(job):
        correct += f"  ({v.trials_passed}/{v.trial_count} cases passed check_implementation)"
    elif correct in ("yes", "no") and v.trial_count:
        correct += (
            f"  ({v.trials_passed}/{v.trial_count} trials, max abs err {v.max_abs_error:.3g}, "
            f"max rel err {v.max_rel_error:.3g}, atol {v.atol:g}, rtol {v.rtol:g})"
        )
    rows.append(("correct", correct))
    if r.flags:
        flags = "\n".join(f"{f.rule_id}: {f.message}" for f in r.flags)
        rows.append(("flags", _indent(flags)))
    if r.validation_error:
        rows.append(("mismatch", r.validation_error))
    if r.runtime.trial_count or r.runtime.median_ms:
        rows.append(("runtime", _stats(r.runtime)))
    if r.reference_runtime.trial_count or r.reference_runtime.median_ms:
        age = ""
        if r.HasField("reference_runtime_age"):  # the service's --reference-time-reuse-s
            seconds = r.reference_runtime_age.ToMilliseconds() / 1e3
            age = f"  (an earlier job's, {seconds:.1f} s old)"
        rows.append(("reference", _stats(r.reference_runtime) + age))
    if r.HasField("compiled_reference_runtime"):  # EvalOptions.compile_baseline
        took = ""
        if r.HasField("compile_time"):
            took = f"  (compiled in {r.compile_time.ToMilliseconds() / 1e3:.1f} s, untimed)"
        rows.append(("torch.compile", _stats(r.compiled_reference_runtime) + took))
    if r.HasField("timing_window"):
        rows.extend(_window_rows(r.timing_window))
    if r.speedup:
        flag = "  (suspicious: over 10x, check for a timing hack)" if r.speedup_suspicious else ""
        over = "" if not r.compiled_speedup else " over eager"
        rows.append(("speedup", f"{r.speedup:.3g}x{over}{flag}"))
    if r.compiled_speedup:
        rows.append(("vs compile", f"{r.compiled_speedup:.3g}x over torch.compile"))
    if r.compilation_error:
        rows.append(("compile log", _indent(r.compilation_error)))
    if r.error.message or r.error.exception_type:
        e = r.error
        text = f"{e.exception_type}: {e.message}" if e.exception_type else e.message
        if e.cuda_error_name:
            text += f"  [{e.cuda_error_name} ({e.cuda_error_code})]"
        rows.append(("error", text))
        if e.traceback:
            rows.append(("traceback", _indent(e.traceback)))
    if r.HasField("fault") and r.fault.ByteSize():
        rows.append(("fault", fault_text(r.fault)))
    if r.device.torch_version or r.device.triton_version:
        rows.append(
            (
                "software",
                f"torch {r.device.torch_version or '-'}, triton {r.device.triton_version or '-'}"
                + (f", CUDA {r.device.cuda_version}" if r.device.cuda_version else "")
                + (f", driver {r.device.driver_version}" if r.device.driver_version else ""),
            )
        )
    if r.device_metrics.values:
        metrics = ", ".join(f"{k}={v:g}" for k, v in sorted(r.device_metrics.values.items()))
        rows.append(("ncu", f"{r.device_metrics.kernel_name}: {metrics}"))
    if r.sanitizer_report:
        rows.append(("sanitizer", _indent(r.sanitizer_report)))
    for note in r.notes:
        rows.append(("note", note))
    keys = max(len(k) for k, _ in rows)
    room = None if width is None else max(20, width - keys - 2)
    lines = []
    for k, val in rows:
        # The verdict cell carries the style's escapes: everything else is shown printable.
        text = val if k == "verdict" else printable(val)
        if room is not None and "\n" not in text and len(text) > room:
            text = ("\n" + " " * (keys + 2)).join(textwrap.wrap(text, room))
        lines.append(f"{k.ljust(keys)}  {text}")
    if r.test_cases or r.benchmark_cases:
        lines += ["", cases_table(job, style, width=width)]
    return "\n".join(lines)


def _is_gpu_mode(job: job_pb2.Job) -> bool:
    return job.spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE or bool(
        job.result.test_cases or job.result.benchmark_cases
    )


def _ms(stats: job_pb2.RuntimeStats) -> str:
    return f"{stats.median_ms:.4f}" if stats.trial_count or stats.median_ms else "-"


def cases_table(job: job_pb2.Job, style: Style = PLAIN, *, width: int | None = None) -> str:
    """A GPU MODE job's cases: each test and benchmark with its arguments, whether
    check_implementation passed it (or, for the case the job stopped in, the verdict that
    stopped it), its message, and a benchmark's median times and speedup."""
    r = job.result
    cases = [("test", c) for c in r.test_cases] + [("benchmark", c) for c in r.benchmark_cases]
    counts = {"test": 0, "benchmark": 0}
    rows = []
    for i, (kind, c) in enumerate(cases):
        name = f"{kind} {counts[kind]}"  # numbered from 0, as GPU MODE's logs
        counts[kind] += 1
        stopped = i == len(cases) - 1 and r.verdict not in (
            job_pb2.VERDICT_OK,
            job_pb2.VERDICT_INCORRECT,
        )
        outcome = "pass" if c.passed else verdict_name(r.verdict) if stopped else "FAIL"
        rows.append(
            [
                name,
                c.spec,
                outcome,
                _ms(c.runtime),
                _ms(c.reference_runtime),
                f"{c.speedup:.3g}x" if c.speedup else "-",
                c.message.strip().splitlines()[0] if c.message.strip() else "",
            ]
        )
    headers: list[str | Column] = [
        "CASE",
        Column("ARGS", "id"),  # gives way after MESSAGE, keeping both ends (the seed)
        Column("RESULT", outcome=True),
        "MEDIAN MS",
        "REF MS",
        "SPEEDUP",
        Column("MESSAGE", "text"),
    ]
    return table(headers, rows, width=width, style=style)


def speedup_text(r: job_pb2.EvalResult) -> str:
    """The speedup over the eager reference, and over torch.compile's when the job asked for
    that baseline (EvalOptions.compile_baseline): "1.8x (0.9x compiled)"; "-" if not timed."""
    if not r.speedup:
        return "-"
    text = f"{r.speedup:.3g}x"
    if r.compiled_speedup:
        text += f" ({r.compiled_speedup:.3g}x compiled)"
    return text


def job_summary(job: job_pb2.Job) -> str:
    """One line: state, verdict, median and speedup."""
    r = job.result
    text = f"{state_name(job.state)} {verdict_label(r.verdict)}"
    if r.runtime.median_ms:
        text += f"  median {r.runtime.median_ms:.4f} ms"
    if r.speedup:
        text += f"  speedup {speedup_text(r)}"
    reason = r.compilation_error or r.validation_error or r.error.message or r.fault.description
    if reason and r.verdict != job_pb2.VERDICT_OK:
        text += "  " + printable(reason.strip().splitlines()[0][:120])
    if r.flags:
        rules = ", ".join(dict.fromkeys(f.rule_id for f in r.flags))
        text += "  flags: " + printable(rules[:120])
    if origin_text(job):
        text += f"  ({origin_text(job)})"
    return text


def batch_table(
    rows: Sequence[tuple[str, job_pb2.Job | str]],
    *,
    width: int | None = None,
    style: Style = PLAIN,
) -> str:
    """A row per file of a batch: its job and result, or why it was refused."""
    out = []
    for name, r in rows:
        if isinstance(r, str):
            out.append([name, "-", "REFUSED", "-", "-", r[:100]])
            continue
        res = r.result
        why = res.compilation_error or res.validation_error or res.error.message
        why = why or res.fault.description or r.state_reason
        detail = (
            printable(why.strip().splitlines()[0][:100])
            if why and res.verdict != job_pb2.VERDICT_OK
            else origin_text(r)
        )
        if res.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE:
            detail = f"{NOT_RUN_HERE}: {detail}" if detail else NOT_RUN_HERE
        out.append(
            [
                name,
                r.job_id,
                verdict_name(res.verdict) if res.verdict else state_name(r.state),
                f"{res.runtime.median_ms:.4f}" if res.runtime.median_ms else "-",
                speedup_text(res),
                detail,
            ]
        )
    headers: list[str | Column] = [
        Column("FILE", "path"),
        Column("JOB", "id"),
        Column("VERDICT", outcome=True),
        "MEDIAN MS",
        "SPEEDUP",
        Column("DETAIL", "text"),
    ]
    return table(headers, out, width=width, style=style)


def jobs_table(
    jobs: Sequence[job_pb2.Job], *, width: int | None = None, style: Style = PLAIN
) -> str:
    rows = []
    for j in jobs:
        median = f"{j.result.runtime.median_ms:.4f}" if j.result.runtime.median_ms else "-"
        speedup = speedup_text(j.result)
        verdict = verdict_name(j.result.verdict) if j.result.verdict else "-"
        if origin_text(j):
            verdict += f" ({origin_text(j)})"
        rows.append(
            [
                j.job_id,
                state_name(j.state),
                verdict,
                median,
                speedup,
                device_label(j.device_index) if j.worker_id else "-",
                fmt_time(j.create_time),
                j.spec.client_tag or "-",
            ]
        )
    headers: list[str | Column] = [
        Column("JOB", "id"),
        Column("STATE", outcome=True),
        Column("VERDICT", "text", outcome=True),
        "MEDIAN MS",
        "SPEEDUP",
        "DEVICE",
        "CREATED (UTC)",
        Column("TAG", "text"),
    ]
    return table(headers, rows, width=width, style=style)


def devices_table(
    devices: Sequence[operations_service_pb2.Device],
    *,
    width: int | None = None,
    style: Style = PLAIN,
) -> str:
    rows = []
    for d in devices:
        mem = (
            f"{fmt_bytes(d.memory_used_bytes)} / {fmt_bytes(d.memory_total_bytes)}"
            if d.memory_total_bytes
            else "-"
        )
        spare = sum(1 for w in d.workers if w.spare)
        judges = sum(1 for w in d.workers if w.standing_judge)
        workers = str(len(d.workers) - spare - judges)
        workers += f"+{spare} spare" if spare else ""
        workers += f"+{judges} judging" if judges else ""
        xids = ", ".join(f"{x.xid}({x.action or x.category})" for x in d.recent_xids[-5:]) or "-"
        health = health_name(d.health)
        if d.health_reason:
            health += f": {d.health_reason}"
        rows.append(
            [
                "cpu" if d.index < 0 else str(d.index),
                d.name or "-",
                health,
                mem,
                f"{d.temperature_celsius} C" if d.temperature_celsius else "-",
                f"{d.utilization_percent}%" if d.memory_total_bytes else "-",
                workers,
                xids,
            ]
        )
    headers: list[str | Column] = [
        "GPU",
        Column("NAME", "text"),
        Column("HEALTH", "text", outcome=True),
        "MEMORY",
        "TEMP",
        "UTIL",
        "WORKERS",
        Column("RECENT XIDS", "text"),
    ]
    if any(d.node for d in devices):  # a gateway's answer: whose device it is
        headers.insert(0, Column("NODE", "text"))
        for row, d in zip(rows, devices, strict=True):
            row.insert(0, d.node or "-")
    return table(headers, rows, width=width, style=style)


def builders_table(
    builders: Sequence[operations_service_pb2.BuilderInfo],
    *,
    now: float,
    width: int | None = None,
    style: Style = PLAIN,
) -> str:
    """ListBuilders' builders: STATE live or EXPIRED (lost), BUILDING the requests each holds,
    WAITING those of its versions nobody holds, VERSIONS whether they are the server's."""
    rows = []
    for b in builders:
        beat = b.last_heartbeat_time
        ago = now - (beat.seconds + beat.nanos / 1e9)
        rows.append(
            [
                b.builder_id,
                b.address or "-",
                "EXPIRED" if b.expired else "live",
                str(b.build_slots),
                str(b.leased_request_count),
                str(b.waiting_request_count),
                str(b.built_count),
                f"{fmt_duration(ago)} ago" if beat.seconds else "-",
                "yes" if b.versions_match else "differ",
            ]
        )
    headers: list[str | Column] = [
        Column("BUILDER", "id"),
        Column("ADDRESS", "text"),
        Column("STATE", outcome=True),
        "SLOTS",
        "BUILDING",
        "WAITING",
        "BUILT",
        "LAST BEAT",
        Column("VERSIONS", outcome=True),
    ]
    return table(headers, rows, width=width, style=style)


def sandbox_summary(st: operations_service_pb2.GetStatsResponse) -> str:
    """One line: whether job processes run in the full sandbox (GetStats.sandbox_state)."""
    missing = [w.feature for w in st.sandbox_warnings if w.sandbox_feature]
    if st.sandbox_state == operations_service_pb2.SANDBOX_STATE_INCOMPLETE or missing:
        return f"INCOMPLETE: job processes run without {', '.join(missing) or '?'}"
    if st.sandbox_state == operations_service_pb2.SANDBOX_STATE_COMPLETE:
        return "complete"
    return "not known yet (no job process has started since the watchdog started)"


def sandbox_lines(st: operations_service_pb2.GetStatsResponse) -> list[tuple[str, str]]:
    """(key, value) rows: the summary, each missing feature, each other watchdog warning."""
    rows = [("sandbox", sandbox_summary(st))]
    rows += [
        (f"  MISSING {w.feature}", w.message) for w in st.sandbox_warnings if w.sandbox_feature
    ]
    rows += [
        (f"watchdog warning ({w.feature})", w.message)
        for w in st.sandbox_warnings
        if not w.sandbox_feature
    ]
    return rows


def ops_event_line(ev: operations_service_pb2.OpsEvent) -> str:
    head = f"{fmt_time(ev.time)}  #{ev.sequence}  {device_label(ev.device_index)}  "
    kind = ev.WhichOneof("kind")
    if kind == "xid":
        x = ev.xid
        who = f" pid {x.pid}" if x.pid else ""
        who += f" worker {x.worker_id}" if x.worker_id else ""
        who += f" job {x.job_id}" if x.job_id else ""
        return head + f"XID {x.xid} ({x.category}) -> {x.action}{who}  {x.message}".rstrip()
    if kind == "worker_started":
        w = ev.worker_started.worker
        return head + f"worker {w.worker_id} started (pid {w.pid}{', spare' if w.spare else ''})"
    if kind == "worker_exited":
        e = ev.worker_exited
        how = f"signal {e.signal}" if e.signal else f"exit {e.exit_code}"
        again = ", restarting" if e.restarting else ""
        return head + f"worker {e.worker.worker_id} exited ({e.reason}, {how}{again})"
    if kind == "reset_step":
        s = ev.reset_step
        return head + f"reset step {s.step}: {'ok' if s.ok else 'FAILED'} {s.message}".rstrip()
    if kind == "health_changed":
        h = ev.health_changed
        return head + f"health -> {health_name(h.health)} {h.reason}".rstrip()
    if kind == "warning":
        return head + f"warning: {ev.warning}"
    return head + "(unknown event)"
