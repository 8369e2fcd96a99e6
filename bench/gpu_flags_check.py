"""Runtime integrity flags on a GPU, through the service: honest candidates (built ahead,
whole Triton from an IOContract against eager PyTorch, ModelNew, raw CUDA) raise none; a
ModelNew that hands back its input raises output_aliases_input; NVML's peak memory bandwidth
is readable where the floor needs it.

    PYTHONPATH=server:clients/python/src python3 bench/gpu_flags_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

COPY_REF = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.clone()
def get_inputs():
    return [torch.randn(4096, 1024, device="cuda")]
def get_init_inputs():
    return []
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    n = 1 << 26  # 256 MiB outputs: beyond the L2 cache, so the memory floor is computed
    cases: list[tuple[str, kernel_pb2.JobSpec, list[str]]] = [
        ("built ahead, Triton vs raw CUDA", K.triton_add_io_built_spec(n, variant=1), []),
        ("raw CUDA vs raw CUDA", K.cuda_add_spec(n, variant=2), []),
        ("Triton IOContract vs eager", K.triton_add_io_spec(n, variant=3), []),
        ("Triton ModelNew vs eager", K.triton_add_spec(n, variant=4), []),
    ]
    hands_back = kernel_pb2.JobSpec(client_tag="flags")
    hands_back.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    hands_back.kernel.source_code = COPY_REF.replace("class Model(", "class ModelNew(").replace(
        "x.clone()", "x"
    )
    hands_back.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    hands_back.reference.source_code = COPY_REF
    cases.append(("ModelNew hands back its input", hands_back, ["output_aliases_input"]))
    rows = []
    svc = C.Service(["--devices", "0"], nvml="real").start()
    try:
        svc.wait_workers(1)
        with svc.client() as c:
            for name, spec, want in cases:
                spec.options.CopyFrom(K.options(correct=2, perf=50, warmup=5))
                job = c.evaluate(spec)
                got = [f.rule_id for f in job.result.flags]
                rows.append({
                    "case": name, "verdict": job_pb2.Verdict.Name(job.result.verdict),
                    "flags": got, "want": want, "median_ms": job.result.runtime.median_ms,
                    "messages": [f.message for f in job.result.flags], "ok": got == want,
                    "notes": list(job.result.notes)[-3:],
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        svc.stop()
    from kerneleval_server.engine import integrity

    bandwidth = integrity.peak_bandwidth(0)
    passed = all(r["ok"] for r in rows) and bool(bandwidth)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_flags_check.json").write_text(
        json.dumps(
            {"rows": rows, "peak_bandwidth_bytes_per_s": bandwidth, "passed": passed}, indent=1
        )  # fmt: skip
    )
    print(f"peak bandwidth {bandwidth}; passed {passed}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
