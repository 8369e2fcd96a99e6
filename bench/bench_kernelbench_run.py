"""A KernelBench run through the CLI (`kerneleval kernelbench RUN_DIR --level 1 --problems
PATH --preset kernelbench`), as a KernelBench user runs it, on every level-1 problem.

There are no generated kernels in ../shared/kernelbench, so RUN_DIR is made here, one sample
per problem: the problem's own Model as the ModelNew (correct, about 1x), and for --wrong
problems a ModelNew that adds 1 to the Model's output (planted wrong kernels: they must come
out incorrect). The run's eval_results.json and analysis_results.json (KernelBench's shapes)
are copied into the results.

    PYTHONPATH=server:clients/python/src python3 bench/bench_kernelbench_run.py --out DIR

Results: <out>/bench_kernelbench_run.json and .md, <out>/kernelbench_run/*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

KERNELBENCH = Path(os.environ.get("KERNELBENCH", C.REPO.parent / "shared" / "kernelbench"))

WRONG = """

class ModelNew(_KernelevalBase):
    def forward(self, *args):
        return super().forward(*args) + 1.0
"""


def model_new(source: str, wrong: bool) -> str:
    """A KernelBench problem's own Model as its ModelNew (correct), or one that adds 1 to the
    Model's output (a planted wrong kernel)."""
    if wrong:
        return re.sub(r"\bModel\b", "_KernelevalBase", source) + WRONG
    return re.sub(r"\bModel\b", "ModelNew", source)


def problem_id(path: Path) -> int | None:
    """42 for level1/42_Max_Pooling_2D.py; None for a file that is not a problem."""
    m = re.match(r"^(\d+)_", path.name)
    return int(m.group(1)) if m else None


def make_run(run_dir: Path, problems: Path, wrong: set[int]) -> int:
    count = 0
    for path in sorted(problems.glob("*.py")):
        pid = problem_id(path)
        if pid is None:
            continue
        kernel = model_new(path.read_text(), pid in wrong)
        (run_dir / f"level_1_problem_{pid}_sample_0_kernel.py").write_text(kernel)
        count += 1
    return count


def judged_in_own_process(svc: C.Service, eval_results: Path) -> list[int]:
    """The problems whose jobs say they were judged in the kernel's own process (issue 13:
    outputs over the record's limit)."""
    if not eval_results.exists():
        return []
    out = []
    with svc.client() as c:
        for pid, entries in json.loads(eval_results.read_text()).items():
            for e in entries:
                job_id = e.get("metadata", {}).get("kerneleval_job_id")
                notes = c.get_job(job_id).result.notes if job_id else []
                if any("judged in the kernel's own process" in n for n in notes):
                    out.append(int(pid))
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.add_argument("--wrong", default="1,19,23,40,95", help="problems given a wrong kernel")
    ap.add_argument("--workers-per-device", type=int, default=8)
    args = ap.parse_args()
    wrong = {int(x) for x in args.wrong.split(",") if x}
    problems = KERNELBENCH / "level1"
    root = Path(tempfile.mkdtemp(prefix="kerneleval-kb-run-"))
    run_dir = root / "run"
    run_dir.mkdir()
    samples = make_run(run_dir, problems, wrong)
    info = C.machine_info()
    svc = C.Service(["--workers-per-device", str(args.workers_per_device)], nvml="real").start()
    try:
        svc.wait_workers(args.workers_per_device)
        cmd = [
            sys.executable, "-m", "kerneleval.cli", "--server", svc.address, "--no-progress",
            "kernelbench", str(run_dir), "--level", "1", "--problems", str(problems),
            "--preset", "kernelbench",
        ]  # fmt: skip
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=C.child_env(), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        judged_here = judged_in_own_process(svc, run_dir / "eval_results.json")
    finally:
        svc.stop()
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    out = Path(args.out) / "kernelbench_run"
    out.mkdir(parents=True, exist_ok=True)
    analysis: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for name in ("eval_results.json", "analysis_results.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, out / name)
    if (run_dir / "analysis_results.json").exists():
        analysis = json.loads((run_dir / "analysis_results.json").read_text())
    if (run_dir / "eval_results.json").exists():
        results = json.loads((run_dir / "eval_results.json").read_text())
    wrong_found = sorted(
        int(pid)
        for pid, entries in results.items()
        if entries and not any(e.get("correctness") for e in entries)
    )
    flagged = {
        pid: e["metadata"]["kerneleval_flags"]
        for pid, entries in results.items()
        for e in entries
        if int(pid) not in wrong and e.get("metadata", {}).get("kerneleval_flags")
    }
    data = {
        "flags_on_honest": flagged,
        "judged_in_own_process": judged_here,
        "samples": samples,
        "wrong_planted": sorted(wrong),
        "incorrect": wrong_found,
        "cli_exit": done.returncode,
        "wall_s": wall,
        "analysis": analysis,
    }
    rows = [[k, json.dumps(v) if isinstance(v, (dict, list)) else v] for k, v in analysis.items()]
    notes = [
        f"{samples} kernels (level 1, one per problem) in {wall:.0f} s through the CLI, exit "
        f"{done.returncode}",
        f"planted wrong: {sorted(wrong)}; incorrect: {wrong_found}",
        f"integrity flags on the {samples - len(wrong)} honest kernels: {len(flagged)} ({flagged})",
        f"judged in the kernel's own process (outputs over the judge's record limit): "
        f"{len(judged_here)} {judged_here}; every other compared job by a judge process",
    ]
    title = "kerneleval kernelbench: level 1 through the CLI (KernelBench's preset)"
    C.write_results(
        args.out, "bench_kernelbench_run", title, info, data, [("summary", ["", ""], rows)], notes
    )
    shutil.rmtree(root, ignore_errors=True)
    return 0 if done.returncode == 0 and wrong_found == sorted(wrong) else 1


if __name__ == "__main__":
    sys.exit(main())
