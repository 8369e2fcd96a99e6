"""The jobs commands: `watch`, `get`, `cancel`, `jobs`."""

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
    moved_bars,
    show_job,
)
from kerneleval.cli.specs import label_dict
from kerneleval.client import Client
from kerneleval.v1 import job_pb2

STATES = {n.removeprefix("JOB_STATE_").lower(): v for n, v in job_pb2.JobState.items()}


def cmd_watch(a: argparse.Namespace, c: Client, out: Output) -> int:
    bars = progress.PhaseBars()
    try:  # to count the candidate's and the reference's timed trials apart
        bars = progress.PhaseBars.for_spec(c.get_job(a.job).spec)
    except errors.NotFound:
        raise
    except errors.KernelEvalError:
        pass  # the server is down: Watch waits for it below

    def emit(ev: job_pb2.JobEvent) -> None:
        if out.jsonl:
            dump({**as_dict(ev), **moved_bars(view)}, lines=True)

    view = progress.JobView(out.display, bars=bars)
    follower = Follower(c, out, view, emit)
    try:
        job = follower.watch(a.job, a.after)
    except KeyboardInterrupt:
        out.display.settle()
        out.note(f"stopped watching job {a.job}; it goes on (`kerneleval cancel {a.job}` stops it)")
        return EXIT_INTERRUPTED
    finally:
        out.display.close()
    return show_job(out, job)


def cmd_get(a: argparse.Namespace, c: Client, out: Output) -> int:
    job = c.get_job(a.job)
    if out.json or out.jsonl:
        dump(as_dict(job), lines=out.jsonl)
        return exit_code([job])
    return show_job(out, job)


def cmd_cancel(a: argparse.Namespace, c: Client, out: Output) -> int:
    job = c.cancel_job(a.job)
    if out.json or out.jsonl:
        dump(as_dict(job), lines=out.jsonl)
    else:
        print(f"{job.job_id}: {out.style.outcome(render.state_name(job.state))}")
    return EXIT_OK


def cmd_jobs(a: argparse.Namespace, c: Client, out: Output) -> int:
    jobs = list(
        c.list_jobs(
            state=STATES[a.state],
            client_tag=a.tag,
            labels=label_dict(a),
            limit=a.limit,
            page_size=min(a.limit, 1000),
        )
    )
    if out.json:
        dump([as_dict(j) for j in jobs])
    elif out.jsonl:
        for j in jobs:
            dump(as_dict(j), lines=True)
    else:
        print(render.jobs_table(jobs, width=out.width, style=out.style))
    return EXIT_OK
