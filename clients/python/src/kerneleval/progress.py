"""Live progress of jobs on stderr: bars with counts, rates and an ETA, and status lines.

One interface (`Display`), three kinds: rich's on a terminal where rich is installed
(`pip install 'kerneleval-client[rich]'`), a plain one that redraws one line on other terminals,
and one for logs and pipes that prints a line per step plus a heartbeat while nothing else is
said. `PhaseBars` turns a job's events into one bar per phase (the CLI's bars, its --jsonl
"bars" and the MCP tools' progress alike); `JobView` and `BatchView` show a job's events, or a
batch's results, on a display.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from kerneleval import render
from kerneleval.v1 import job_pb2, kernel_pb2

# The plain displays' refresh (a terminal) and heartbeat (a log) periods, seconds.
REDRAW_S = 0.5
HEARTBEAT_S = 10.0
BAR_WIDTH = 24
NO_RICH_ENV = "KERNELEVAL_NO_RICH"  # set: the plain terminal display even where rich is
DEFAULT_PERF_TRIALS = 100  # EvalOptions.perf_trial_count unset


@dataclass
class Meter:
    """One bar: what it counts and since when."""

    label: str
    done: int = 0
    total: int = 0  # 0: not known (only the time spent is shown)
    started: float = field(default_factory=time.monotonic)

    def rate(self, now: float) -> float | None:
        elapsed = now - self.started
        return self.done / elapsed if self.done and elapsed > 0 else None

    def eta(self, now: float) -> float | None:
        rate = self.rate(now)
        if rate is None or not self.total or self.done >= self.total:
            return None
        return (self.total - self.done) / rate

    def stats(self, now: float) -> str:
        """ "30/100  12.0/s  ETA 6s  2.5s": counts, rate, time left, time spent."""
        parts = [f"{self.done}/{self.total}"] if self.total else []
        rate = self.rate(now)
        if rate is not None and self.total:
            parts.append(f"{rate:.0f}/s" if rate >= 100 else f"{rate:.3g}/s")
        eta = self.eta(now)
        if eta is not None:
            parts.append(f"ETA {render.fmt_duration(eta)}")
        parts.append(render.fmt_duration(now - self.started))
        return "  ".join(parts)

    def bar(self) -> str:
        filled = BAR_WIDTH * min(self.done, self.total) // self.total if self.total else 0
        return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


class Display(Protocol):
    def line(self, text: str) -> None:
        """Prints a line above the live bar."""

    def update(self, meter: Meter) -> None:
        """Shows `meter` as the live bar (a new label starts a new bar)."""

    def settle(self) -> None:
        """Leaves the live bar as it is and starts no new one."""

    def close(self) -> None: ...


class NullDisplay:
    def line(self, text: str) -> None:
        pass

    def update(self, meter: Meter) -> None:
        pass

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Ticking:
    """A thread that calls `tick` every `period` seconds until closed, under `lock`."""

    def __init__(self, period: float) -> None:
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            with self.lock:
                self.tick()

    def tick(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()


class TerminalDisplay(_Ticking):
    """A terminal without rich: one live line, redrawn in place (counts, rate, ETA, time)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.meter: Meter | None = None
        self._drawn = False
        super().__init__(REDRAW_S)

    def _text(self) -> str:
        m = self.meter
        assert m is not None
        now = time.monotonic()
        bar = f"{m.bar()} " if m.total else ""
        return f"  {m.label.ljust(10)} {bar}{m.stats(now)}"

    def _draw(self) -> None:
        if self.meter is not None:
            self.out.write("\r\x1b[2K" + self._text())
            self._drawn = True
            self.out.flush()

    def tick(self) -> None:
        self._draw()

    def line(self, text: str) -> None:
        with self.lock:
            if self._drawn:
                self.out.write("\r\x1b[2K")
            self.out.write(text + "\n")
            self._drawn = False
            self._draw()

    def update(self, meter: Meter) -> None:
        with self.lock:
            if self.meter is not None and self.meter.label != meter.label:
                self._settle()
            self.meter = meter
            self._draw()

    def _settle(self) -> None:
        if self.meter is not None:
            self._draw()
            self.out.write("\n")
            self.out.flush()
        self.meter = None
        self._drawn = False

    def settle(self) -> None:
        with self.lock:
            self._settle()

    def close(self) -> None:
        self.stop()
        self.settle()
        self.meter = None


class LogDisplay(_Ticking):
    """Not a terminal (a log, a pipe): a line when a bar starts and ends, and while nothing
    else is said for HEARTBEAT_S, a line with where it stands, so a long wait is not silent."""

    def __init__(self, out: TextIO, heartbeat: float = HEARTBEAT_S) -> None:
        self.out = out
        self.meter: Meter | None = None
        self.heartbeat = heartbeat
        self._last = time.monotonic()
        super().__init__(min(heartbeat, 1.0))

    def _write(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
        self._last = time.monotonic()

    def tick(self) -> None:
        if self.meter is not None and time.monotonic() - self._last >= self.heartbeat:
            self._write(f"  {self.meter.label} {self.meter.stats(time.monotonic())}")

    def line(self, text: str) -> None:
        with self.lock:
            self._write(text)

    def update(self, meter: Meter) -> None:
        with self.lock:
            if self.meter is None or self.meter.label != meter.label:
                self._write(f"  {meter.label}")
            self.meter = meter
            if meter.total and meter.done >= meter.total:
                self._write(f"  {meter.label} {meter.stats(time.monotonic())}")
                self.meter = None

    def settle(self) -> None:
        with self.lock:
            self.meter = None

    def close(self) -> None:
        self.stop()
        self.settle()


class RichDisplay:
    """rich's live bars: one per step, kept on screen; lines printed above them."""

    def __init__(self, out: TextIO, colour: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn
        from rich.text import Text

        class StatsColumn(ProgressColumn):
            def render(self, task: Any) -> Text:
                return Text(task.fields["meter"].stats(time.monotonic()), style="dim")

        self._text = Text
        console = Console(file=out, force_terminal=True, no_color=not colour, highlight=False)
        self.progress = Progress(
            SpinnerColumn(finished_text=" "),
            TextColumn("{task.description}"),
            BarColumn(bar_width=BAR_WIDTH),
            StatsColumn(),
            console=console,
            refresh_per_second=4,
            # Results go to stdout, which may be a file: rich must not take it over.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.progress.start()
        self.meter: Meter | None = None
        self.task: Any = None

    def line(self, text: str) -> None:
        self.progress.console.print(self._text(text))

    def update(self, meter: Meter) -> None:
        if self.meter is None or self.meter.label != meter.label:
            self.settle()
            self.task = self.progress.add_task(meter.label, total=meter.total or None, meter=meter)
        self.meter = meter
        self.progress.update(
            self.task, completed=meter.done, total=meter.total or None, meter=meter
        )

    def settle(self) -> None:
        if self.task is not None and self.meter is not None:
            # A bar without counts (a wait) is over; one with counts stays where it got to.
            if self.meter.total:
                self.progress.update(self.task, completed=self.meter.done)
            else:
                self.progress.update(self.task, total=1, completed=1)
            self.progress.stop_task(self.task)
        self.meter = None
        self.task = None

    def close(self) -> None:
        self.settle()
        self.progress.stop()  # idempotent


def rich_available() -> bool:
    if os.environ.get(NO_RICH_ENV):
        return False
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


def make_display(out: TextIO, *, enabled: bool, colour: bool) -> Display:
    """The display for `out`: none when disabled, rich's or the plain one on a terminal, the
    log display elsewhere."""
    if not enabled:
        return NullDisplay()
    if not render._isatty(out) or os.environ.get("TERM") == "dumb":
        return LogDisplay(out)
    if rich_available():
        return RichDisplay(out, colour)
    return TerminalDisplay(out)


@dataclass(frozen=True)
class Bar:
    """Where one of a job's bars stands: a phase (the timing split into the kernel's and the
    reference's) with its counts."""

    label: str  # "compiling", "validating", "profiling kernel", "profiling reference", ...
    phase: int  # job_pb2.Phase
    done: int = 0
    total: int = 0  # 0: no counts (a phase without steps, or not known yet)

    def as_dict(self) -> dict[str, Any]:
        """The bar in --jsonl: {"label", "phase" (its enum name), "done", "total"}."""
        phase = job_pb2.Phase.Name(self.phase)
        return {"label": self.label, "phase": phase, "done": self.done, "total": self.total}


def timed_trials(spec: kernel_pb2.JobSpec) -> int:
    """The timed trials of one side of a job as its progress counts them: perf_trial_count
    (100 unset), for each benchmark case of a GPU MODE task."""
    o = spec.options
    n = o.perf_trial_count if o.HasField("perf_trial_count") else DEFAULT_PERF_TRIALS
    if spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE:
        n *= len(spec.gpu_mode.benchmarks)
    return max(n, 0)


class PhaseBars:
    """A job's phase and progress events as one bar per phase, whatever processes sent them.

    A compared job's phases come in two series: the kernel's process compiles, runs the
    correctness trials and times the kernel; then its judge (a process of its own, the
    reference's only) compiles, checks those trials and times the reference. A job run whole in
    one process sends one series, its timing the kernel's trials then the reference's (2n
    steps; a GPU MODE job alternates the two per benchmark case). Here a phase that comes
    again in a later series moves its bar on (never back: counts only grow, as MCP's progress
    must), and a timing series is the kernel's or the reference's: the bars' counts are the
    result's (5 correctness trials, 100 timed trials each side).

    `trials`: a side's timed trials (`timed_trials(spec)`), to tell a whole job's 2n series
    from a kernel's n; None when not known (then such a series is one "profiling" bar)."""

    def __init__(
        self, has_reference: bool | None = None, trials: int | None = None, *,
        interleaved: bool = False,
    ) -> None:  # fmt: skip
        self.has_reference = has_reference
        self.trials = trials
        self.interleaved = interleaved  # GPU MODE: kernel and reference alternate per case
        self.reset()

    @classmethod
    def for_spec(cls, spec: kernel_pb2.JobSpec) -> PhaseBars:
        gpu_mode = spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE
        return cls(spec.HasField("reference"), timed_trials(spec), interleaved=gpu_mode)

    def reset(self) -> None:
        """A new attempt of the job (JobStarted): its phases start again."""
        self.bars: dict[str, Bar] = {}
        self.phase = 0  # the phase of the series now coming in
        self.timing_series = -1  # how many timing series came before this one, less one
        self.provisional: str | None = None  # the bar a timing series started, before counts

    def event(self, event: job_pb2.JobEvent) -> list[Bar]:
        """The bars this event moves, in order (none: it repeats what a bar shows)."""
        kind = event.WhichOneof("kind")
        if kind == "started":
            self.reset()
        elif kind == "phase":
            return self._phase(event.phase.phase)
        elif kind == "progress":
            p = event.progress
            started = self._phase(p.phase) if p.phase != self.phase else []  # no phase event
            counted = self._progress(p.phase, p.done_count, p.total_count)
            return [b for b in started if b.label not in {c.label for c in counted}] + counted
        return []

    def _phase(self, phase: int) -> list[Bar]:
        if phase == job_pb2.PHASE_PROFILING:
            self.timing_series += 1  # a later timing series is always another process's
        self.phase = phase
        if phase == job_pb2.PHASE_PROFILING:
            # Until its first counts, whose timing a series is may be a guess (a GPU MODE
            # job's own process times the kernel alone when judged, both sides when not).
            label = self._timing_label(0, 0)
            moved = self._move(label, phase, 0, 0)
            self.provisional = label if moved else None
            return moved
        return self._move(render.PHASE_NAMES.get(phase, "working"), phase, 0, 0)

    def _timing_label(self, done: int, total: int) -> str:
        if self.timing_series > 0:
            return "profiling reference"  # a judge's: it times the reference only
        if not self.has_reference or self.trials is None:
            return "profiling"
        if self.interleaved and total == 2 * self.trials and total:
            return "profiling"  # both sides, case by case
        return "profiling kernel"

    def _progress(self, phase: int, done: int, total: int) -> list[Bar]:
        if phase != job_pb2.PHASE_PROFILING:
            return self._move(render.PHASE_NAMES.get(phase, "working"), phase, done, total)
        label = self._timing_label(done, total)
        if self.provisional not in (None, label) and self.bars[self.provisional].total == 0:
            del self.bars[self.provisional]  # the guess was wrong: its empty bar goes
        self.provisional = None
        n = self.trials or 0
        if label == "profiling kernel" and n and total == 2 * n:  # one process, both sides
            if done <= n:
                return self._move(label, phase, done, n)
            return self._move(label, phase, n, n) + self._move(
                "profiling reference", phase, done - n, n
            )
        return self._move(label, phase, done, total)

    def _move(self, label: str, phase: int, done: int, total: int) -> list[Bar]:
        old = self.bars.get(label)
        if old is not None:
            done, total = max(done, old.done), max(total, old.total)
        bar = Bar(label, phase, done, total)
        if bar == old:
            return []
        self.bars[label] = bar
        return [bar]


class JobView:
    """One job's events on a display: a bar per phase (PhaseBars: the kernel's timing and the
    reference's each counted on their own), its logs, faults and end."""

    def __init__(
        self, display: Display, has_reference: bool | None = None, trials: int | None = None, *,
        interleaved: bool = False, bars: PhaseBars | None = None,
    ) -> None:  # fmt: skip
        self.display = display
        self.bars = bars or PhaseBars(has_reference, trials, interleaved=interleaved)
        self.meters: dict[str, Meter] = {}
        self.meter: Meter | None = None
        self.started = time.monotonic()
        self.moved: list[Bar] = []  # what the last event moved (for --jsonl)

    def _show(self, label: str, done: int = 0, total: int = 0) -> None:
        meter = self.meters.get(label)
        if meter is None:
            meter = self.meters[label] = Meter(label)
        meter.done, meter.total = done, total
        self.meter = meter
        self.display.update(meter)

    def event(self, event: job_pb2.JobEvent) -> None:
        self.moved = self.bars.event(event)
        for bar in self.moved:
            self._show(bar.label, bar.done, bar.total)
        kind = event.WhichOneof("kind")
        if kind == "queued":
            self.display.line(f"job {event.job_id} queued (position {event.queued.position})")
            self._show("waiting in the queue")
        elif kind == "started":
            s = event.started
            attempt = f", attempt {s.attempt}" if s.attempt > 1 else ""
            where = render.device_label(s.device_index)
            self.display.line(f"started on {where}, worker {s.worker_id}{attempt}")
            self.display.settle()
            self.meter = None
            self.meters.clear()
        elif kind == "log":
            for line in render.printable(event.log.text).rstrip("\n").splitlines():
                self.display.line(f"  | {line}")
        elif kind == "fault":
            self.display.line(f"  fault: {render.fault_text(event.fault)}")
        elif kind == "finished":
            self.display.settle()
            self.meter = None
            job = event.finished
            took = render.fmt_duration(time.monotonic() - self.started)
            self.display.line(
                f"finished: {render.state_name(job.state)} "
                f"{render.verdict_label(job.result.verdict)} ({took})"
            )

    def status(self, label: str) -> None:
        """A bar without counts that shows how long something has taken (a wait)."""
        self._show(label)

    def note(self, text: str) -> None:
        self.display.line(text)


class BatchView:
    """A batch on a display: one bar of jobs done, a line per finished job."""

    def __init__(self, display: Display, total: int, label: str = "jobs") -> None:
        self.display = display
        self.meter = Meter(label, 0, total)
        display.update(self.meter)

    def done(self, name: str, summary: str) -> None:
        self.meter.done += 1
        self.display.line(f"[{self.meter.done}/{self.meter.total}] {name}: {summary}")
        self.display.update(self.meter)
