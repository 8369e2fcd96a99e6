"""A launch process's hygiene between jobs (jobproc.hygiene._clean_for_next_job), on a GPU.

A launch process runs job after job: device memory one job used must hold nothing of it when
the next job allocates (with the same seed, a job's inputs and outputs are the next job's
answers). Fills buffers with a pattern, frees them, cleans up as the runtime does, allocates
the same sizes uninitialised and counts pattern words found, and checks that a tensor still
allocated kept its contents; the same without the cleanup (torch's empty_cache alone) shows
what the zeroing prevents.

    PYTHONPATH=server:clients/python/src python3 bench/gpu_launch_hygiene_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, torch
from kerneleval_server.jobproc import hygiene
clean = sys.argv[1] == "clean"
PATTERN = 0x5EED1234
sizes = [1 << 20, 3 << 20, 16 << 20]  # int32 elements
held = torch.ones(1 << 20, device="cuda")  # the process's own, allocated across the cleanup
bufs = [torch.full((n,), PATTERN, dtype=torch.int32, device="cuda") for n in sizes]
torch.cuda.synchronize()
del bufs
ok = hygiene._clean_for_next_job() if clean else (torch.cuda.empty_cache() or True)
found = 0
for n in sizes:
    y = torch.empty((n,), dtype=torch.int32, device="cuda")
    found += int((y == PATTERN).sum().item())
print(json.dumps({"mode": sys.argv[1], "clean_ok": bool(ok), "pattern_words_found": found,
                  "live_tensor_kept": bool((held == 1).all().item())}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for mode in ("clean", "empty_cache_only"):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120
        )
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        row = json.loads(line) if line.startswith("{") else {"mode": mode, "error": proc.stderr}
        rows.append(row)
        print(row, flush=True)
    passed = (
        rows[0].get("clean_ok") is True
        and rows[0].get("pattern_words_found") == 0
        and rows[0].get("live_tensor_kept") is True
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_launch_hygiene_check.json").write_text(
        json.dumps({"rows": rows, "passed": passed}, indent=1)
    )
    lines = ["| mode | cleanup ok | pattern words found after | a live tensor kept |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.get('mode')} | {r.get('clean_ok')} | {r.get('pattern_words_found')} | "
            f"{r.get('live_tensor_kept')} |"
        )
    (args.out / "gpu_launch_hygiene_check.md").write_text(
        "# Launch process hygiene between jobs\n\n" + "\n".join(lines) + f"\n\npassed: {passed}\n"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
