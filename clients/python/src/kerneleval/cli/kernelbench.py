"""`kernelbench`: every generated kernel of a KernelBench run against its problem, each result
written as its job ends (see kerneleval.kernelbench_run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import grpc

from kerneleval import kernelbench_run as kb
from kerneleval import progress, render
from kerneleval.cli.output import EXIT_INTERRUPTED, EXIT_OK, Output, dump, refusal_text
from kerneleval.cli.specs import eval_options
from kerneleval.client import Client
from kerneleval.v1 import kernel_pb2


def cmd_kernelbench(a: argparse.Namespace, c: Client, out: Output) -> int:
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
    options = eval_options(a)
    interrupted = False
    if todo:
        interrupted = _kernelbench_jobs(a, c, out, run_dir, todo, options, inputs, done)
    all_results = kb.read_results(run_dir, samples)
    kb.write_json(run_dir / "eval_results.json", kb.eval_results(all_results))
    summary = kb.summary(run_dir.name, a.level, problems, all_results)
    kb.write_json(run_dir / "analysis_results.json", summary)
    if out.json:
        dump(summary)
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
    out: Output,
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
                    view.done(s.name, refusal_text(ev.error) + " (not written: run again)")
                    continue
                entry = kb.refused_entry(s.sample_id, refusal_text(ev.error))
                summary = "REFUSED " + refusal_text(ev.error)
            else:
                assert ev.event is not None
                job = ev.event.finished
                entry = kb.kernelbench_entry(s.sample_id, job, options.compile_baseline)
                summary = render.job_summary(job)
            kb.write_json(kb.result_path(run_dir, s), entry)
            finished += 1
            if out.jsonl:
                dump({"kernel": s.kernel.name, "result": entry}, lines=True)
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
