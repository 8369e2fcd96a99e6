"""Issue 43 on a GPU: the GPU MODE task whose cases hold lists (tests/gpumode_tasks/
grouped_matmul_py) through the service, its correct and its wrong submission; prints one JSON
line each (verdict, the cases' results, the notes) and writes them to --out.

    PYTHONPATH=server:clients/python/src python3 bench/probe/gpumode_list_task_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C  # noqa: E402
from kerneleval import gpumode  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402

TASK = C.REPO / "tests" / "gpumode_tasks" / "grouped_matmul_py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--nvml", default="real")
    args = ap.parse_args()
    task = gpumode.load_task(TASK)
    svc = C.Service([], nvml=args.nvml).start()
    lines = []
    try:
        svc.wait_workers(1)
        with svc.client() as c:
            for name in ("submission.py", "wrong_submission.py"):
                spec = gpumode.spec_from_task(task, (TASK / name).read_text())
                job = c.evaluate(spec)
                r = job.result
                line = {
                    "submission": name, "verdict": job_pb2.Verdict.Name(r.verdict),
                    "device": r.device.name, "median_ms": r.runtime.median_ms,
                    "notes": list(r.notes)[:6], "error": r.error.message[:300],
                }  # fmt: skip
                print(json.dumps(line), flush=True)
                lines.append(line)
    finally:
        svc.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpumode_list_task.json").write_text(json.dumps(lines, indent=1) + "\n")
    ok = lines[0]["verdict"] == "VERDICT_OK" and lines[1]["verdict"] == "VERDICT_INCORRECT"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
