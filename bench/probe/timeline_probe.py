"""Probe: where one paced Evaluate's time goes, function by function, across the front end,
the kernel's process and its judge. The service runs with bench/probe/timeline on its
PYTHONPATH (its sitecustomize wraps named functions: timeline/sitecustomize.py); each call's
records fall in its [client send, client receive] window; the table gives each record's
median offset from the send (ms), in order, and the process it came from.

    PYTHONPATH=server:clients/python/src \\
        python3 bench/probe/timeline_probe.py io|modelnew|built [N] [service flags]
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402


def spec_of(kind: str):  # type: ignore[no-untyped-def]
    if kind == "io":
        spec = K.triton_add_io_spec(4096)
    elif kind == "built":
        spec = K.triton_add_io_built_spec(4096)
    else:
        spec = K.triton_add_spec(4096)
    spec.options.CopyFrom(K.options(correct=1, perf=0, warmup=0))
    return spec


def job_records(log: Path) -> list[tuple[int, str, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "KE_TL " not in line:
            continue
        try:
            text = json.loads(line).get("message", "")
        except ValueError:
            text = line
        i = text.find("KE_TL ")
        if i < 0:
            continue
        _, ns, pid, label = text[i:].split(" ", 3)
        out.append((int(ns), pid, label))
    return out


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) > 1 else "io"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    flags = sys.argv[3:]
    fe_file = Path(f"/tmp/ke_timeline_fe_{os.getpid()}.txt")
    fe_file.unlink(missing_ok=True)
    svc = C.Service(flags, nvml=os.environ.get("NVML", "none"))
    real_env = C.child_env
    C.child_env = lambda extra=None: real_env(  # type: ignore[assignment]
        {
            "PYTHONPATH": os.pathsep.join([str(HERE / "timeline"), real_env()["PYTHONPATH"]]),
            "KE_TIMELINE_FE": str(fe_file),
            **(extra or {}),
        }
    )
    svc.start()
    C.child_env = real_env  # type: ignore[assignment]
    spec = spec_of(kind)
    windows = []
    try:
        svc.wait_workers(1)
        with svc.client() as c:
            for i in range(n + 5):
                time.sleep(0.5)
                t0 = time.time_ns()
                job = c.evaluate(spec)
                t1 = time.time_ns()
                if i >= 5:
                    windows.append((t0, t1, job.result.verdict))
        time.sleep(1.0)
    finally:
        svc.stop()
    recs = []
    for line in fe_file.read_text().splitlines():
        _, ns, _, label = line.split(" ", 3)
        recs.append((int(ns), "fe", label))
    recs += job_records(svc.log)
    log_text = svc.log.read_text(errors="replace")
    missing = sorted(
        {
            line.split("KE_TL_MISSING ", 1)[1].split()[0].strip('",\\')
            for line in log_text.splitlines()
            if "KE_TL_MISSING " in line
        }
    )
    if missing:
        print("not found to time:", ", ".join(missing))
    recs.sort()
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    order: dict[str, list[int]] = collections.defaultdict(list)
    walls = []
    for t0, t1, _ in windows:
        walls.append((t1 - t0) / 1e6)
        inside = [r for r in recs if t0 <= r[0] <= t1 + 2_000_000]
        roles: dict[str, str] = {"fe": "fe"}
        for _, pid, label in inside:
            if label.startswith("_run_one:"):
                roles.setdefault(pid, "judge" if label.startswith("_run_one:judge") else "kernel")
        seen: collections.Counter[str] = collections.Counter()
        for idx, (ns, pid, label) in enumerate(inside):
            who = roles.get(pid, pid[-7:])
            key = f"{who:7s} {label}"
            seen[key] += 1
            key = f"{key} #{seen[key]}" if seen[key] > 1 else key
            offsets[key].append((ns - t0) / 1e6)
            order[key].append(idx)
    print(
        f"{kind}: {len(windows)} calls, wall p50 {statistics.median(walls):.2f} ms, "
        f"verdicts {collections.Counter(v for _, _, v in windows)}"
    )
    # The last call, record by record (loop waits included): what the medians smooth over.
    t0, t1, _ = windows[-1]
    print("last call, every record (ms from its send):")
    for ns, pid, label in recs:
        if t0 <= ns <= t1 + 2_000_000:
            print(f"    {(ns - t0) / 1e6:8.3f}  {pid[-7:]:7s} {label}")
    offsets = {
        k: v for k, v in offsets.items() if not k.split(" ", 1)[-1].strip().startswith("loop.wait")
    }
    rows = sorted(offsets, key=lambda k: statistics.median(offsets[k]))
    for key in rows:
        v = offsets[key]
        if len(v) < len(windows) // 2:
            continue
        print(f"{statistics.median(v):8.3f}  n={len(v):3d}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
