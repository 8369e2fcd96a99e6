"""`evaluate`, `compare` and `gpumode`: one file on a Run stream, several on one RunBatch stream,
or submitted and left (--detach)."""

from __future__ import annotations

import argparse

from kerneleval import errors, progress, render
from kerneleval.cli.follow import Follower
from kerneleval.cli.output import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Output,
    as_dict,
    dump,
    exit_code,
    file_entry,
    moved_bars,
    refusal_text,
    show_job,
)
from kerneleval.cli.specs import file_specs, gpumode_specs
from kerneleval.client import Client
from kerneleval.v1 import job_pb2, kernel_pb2


def cmd_evaluate(a: argparse.Namespace, c: Client, out: Output) -> int:
    return run_specs(a, c, out, file_specs(a))


def cmd_compare(a: argparse.Namespace, c: Client, out: Output) -> int:
    return run_specs(a, c, out, file_specs(a))


def cmd_gpumode(a: argparse.Namespace, c: Client, out: Output) -> int:
    return run_specs(a, c, out, gpumode_specs(a))


def run_specs(
    a: argparse.Namespace, c: Client, out: Output, specs: list[tuple[str, kernel_pb2.JobSpec]]
) -> int:
    if a.detach:
        jobs = [(name, c.submit(spec)) for name, spec in specs]
        if out.json or out.jsonl:
            dump([file_entry(n, j) for n, j in jobs], lines=out.jsonl)
        elif len(jobs) == 1:
            print(jobs[0][1].job_id)
        else:
            for name, job in jobs:
                print(f"{job.job_id}  {name}")
        return EXIT_OK
    if len(specs) == 1:
        return _run_one(a, c, out, *specs[0])
    return _run_batch(a, c, out, specs)


def _run_one(
    a: argparse.Namespace, c: Client, out: Output, name: str, spec: kernel_pb2.JobSpec
) -> int:
    """One job on a Run stream: its progress, then its result."""
    view = progress.JobView(out.display, bars=progress.PhaseBars.for_spec(spec))

    def emit(ev: job_pb2.JobEvent) -> None:
        if out.jsonl:
            dump({"file": name, "event": as_dict(ev), **moved_bars(view)}, lines=True)

    follower = Follower(c, out, view, emit)
    try:
        job = follower.run(spec)
    except KeyboardInterrupt:
        return _cancel_on_interrupt(c, out, follower.job_id)
    finally:
        out.display.close()  # before the result goes to the same terminal
    if out.json:
        dump([{"file": name, "job": as_dict(job)}])
        return exit_code([job])
    return show_job(out, job)


def _cancel_on_interrupt(c: Client, out: Output, job_id: str) -> int:
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


def _run_batch(
    a: argparse.Namespace, c: Client, out: Output, specs: list[tuple[str, kernel_pb2.JobSpec]]
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
                    dump({"file": name, "error": as_dict(ev.error)}, lines=True)
                elif ev.event is not None:
                    dump({"file": name, "event": as_dict(ev.event)}, lines=True)
            if not ev.done:
                continue
            if ev.error is not None:
                results[i] = refusal_text(ev.error)
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
        dump([file_entry(n, r) for n, r in ordered])
    elif not out.jsonl:
        print(render.batch_table(ordered, width=out.width, style=out.style))
    return exit_code(r for _, r in ordered)
