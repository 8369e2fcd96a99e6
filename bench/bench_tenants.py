"""What the tenant check costs a call (issue 45): the same calls against a service without
tenants and one with a tenants file (`--tenants-file`, the TenantAuth interceptor: a hash of
the call's token looked up, then every job read filtered by its tenant), in the same run,
the two services alternating call by call so that drift falls on both alike:
  - GetJob of a finished job, back to back: one store read, no job process; the check's
    share is largest here;
  - Evaluate of a tiny PyTorch `ModelNew` against its reference (CPU, untimed), paced so
    that a warm job process waits for each call;
  - ListJobs with the service's jobs in the store (tenants on: filtered by the caller's).

    PYTHONPATH=server:clients/python/src python3 bench/bench_tenants.py --out DIR
    ... --calls 300 --evaluates 20 --tenants 100   # lines in the tenants file

Results: <out>/bench_tenants.json and .md. CPU only: the check never touches a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval.client import Client  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402
from kerneleval_server.api.tenants import hash_token  # noqa: E402

REFERENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0
def get_inputs():
    return [torch.randn(4096)]
def get_init_inputs():
    return []
"""
KERNEL = REFERENCE.replace("class Model(", "class ModelNew(")


def spec() -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec(client_tag="bench-tenants")
    s.kernel.type = s.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.kernel.source_code, s.reference.source_code = KERNEL, REFERENCE
    s.options.correct_trial_count = 1
    s.options.perf_trial_count = 0
    return s


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--calls", type=int, default=300, help="GetJob and ListJobs calls each")
    ap.add_argument("--evaluates", type=int, default=20, help="paced Evaluate calls")
    ap.add_argument("--pace-s", type=float, default=0.5, help="pause before an Evaluate")
    ap.add_argument("--tenants", type=int, default=100, help="lines in the tenants file")
    args = ap.parse_args()
    info = C.machine_info()
    root = Path(tempfile.mkdtemp(prefix="kerneleval-tenants-"))
    token = "bench-tenant-token-0"
    tenants = root / "tenants"
    tenants.write_text(
        "".join(f"team-{i}:{hash_token(f'bench-tenant-token-{i}')}\n" for i in range(args.tenants))
    )
    flags = ["--workers-per-device", "2"]
    off = C.Service(flags, root=root / "off").start()
    on = C.Service([*flags, "--tenants-file", str(tenants)], root=root / "on").start()
    try:
        clients = {
            "off": Client(off.address, timeout=120),
            "on": Client(on.address, tenant_token=token, timeout=120),
        }
        finished = {name: c.evaluate(spec()).job_id for name, c in clients.items()}
        walls: dict[str, dict[str, list[float]]] = {
            name: {"get_job": [], "list_jobs": [], "evaluate": []} for name in clients
        }
        for _ in range(args.calls):
            for name, c in clients.items():
                walls[name]["get_job"].append(timed(lambda: c.get_job(finished[name])))  # noqa: B023
        for _ in range(args.calls):
            for name, c in clients.items():
                walls[name]["list_jobs"].append(timed(lambda: list(c.list_jobs())))  # noqa: B023
        ok = {name: 0 for name in clients}
        for _ in range(args.evaluates):
            for name, c in clients.items():
                time.sleep(args.pace_s)
                t = time.perf_counter()
                job = c.evaluate(spec())
                walls[name]["evaluate"].append((time.perf_counter() - t) * 1e3)
                ok[name] += job.result.verdict == job_pb2.VERDICT_OK
        for c in clients.values():
            c.close()
    finally:
        off.stop()
        on.stop()
    rows = []
    for call in ("get_job", "list_jobs", "evaluate"):
        a, b = statistics.median(walls["off"][call]), statistics.median(walls["on"][call])
        rows.append([call, len(walls["off"][call]), round(a, 3), round(b, 3),
                     round((b - a) * 1e3, 1), C.ratio(b, a)])  # fmt: skip
    data = {"walls_ms": walls, "evaluate_ok": ok, "tenants_in_file": args.tenants}
    C.write_results(
        args.out, "bench_tenants", "What the tenant check costs a call (issue 45)", info, data,
        [("Medians, ms (the two services alternating call by call)",
          ["call", "n", "tenants off", "tenants on", "on - off, us", "on / off"], rows)],
        [f"tenants file: {args.tenants} tenants; the caller is one of them; Evaluate OK: "
         f"{ok['off']} off, {ok['on']} on, of {args.evaluates}",
         "ListJobs: tenants off lists every job; on, the caller's (the same jobs here: one "
         "tenant submitted them all)"],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
