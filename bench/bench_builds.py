"""Builds of KernelBench `load_inline` candidates: the builder (kerneleval_server.fast_build)
against torch's own load_inline, in the same run.

Candidates are the example pairs' ModelNews (../shared/kernelbench/examples/model_new_ex_*.py,
read in place), each made distinct by a salt constant in its CUDA source and a name of its own,
so that nothing can come from a cache. Rows:
  - latency      one build at a time: load_inline for the first --plain candidates of each
                 example, the builder for every candidate; the p50s and their ratio;
  - same module  for each example, the plain and the fast module run on the GPU on the same
                 inputs: outputs must be bitwise equal (the build must mean the same);
  - throughput   --parallel builds at once (processes), distinct candidates: a minute's worth,
                 for the builder and for load_inline;
  - raw CUDA     nvcc -cubin of one kernel alone (the CUDA kernel type's build).
The builder's precompiled headers are built before the clock starts (a node builds them once,
at start); their cost is its own row.

    PYTHONPATH=server:clients/python/src python3 bench/bench_builds.py --out DIR
    ... --cpu-smoke    # no GPU: compile only (the CPU wheel cannot link a CUDA extension)

Results: <out>/bench_builds.json and .md. bench/build_breakdown.py is where the time goes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from build_breakdown import capture_load_inline, cuda_home  # noqa: E402

EXAMPLES = (
    Path(os.environ.get("KERNELBENCH", C.REPO.parent / "shared" / "kernelbench")) / "examples"
)
NAMES = ("model_new_ex_add", "model_new_ex_fuse_gelu", "model_new_ex_tiled_matmul")


def candidate(example: str, index: int) -> dict[str, Any]:
    kw = capture_load_inline(EXAMPLES / f"{example}.py")
    salt = random.randrange(1, 1 << 30)
    call = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in kw.items()}
    call["name"] = f"{kw['name']}_c{index}_{salt}"
    salted = kw["cuda_sources"][-1] + f"\n__device__ int kerneleval_salt = {salt};\n"
    call["cuda_sources"] = [*kw["cuda_sources"][:-1], salted]
    call["verbose"] = False
    return call


def build_plain(call: dict[str, Any], root: str) -> dict[str, Any]:
    import torch.utils.cpp_extension as cpp_ext

    folder = Path(root) / f"plain_{call['name']}"
    folder.mkdir(parents=True)
    kw = {k: (list(v) if isinstance(v, list) else v) for k, v in call.items()}
    t0 = time.monotonic()
    error = ""
    try:
        cpp_ext.load_inline(**kw, build_directory=str(folder))
    except Exception as e:  # noqa: BLE001 - recorded (the CPU wheel cannot link)
        error = str(e)[-600:]
    return {"seconds": time.monotonic() - t0, "error": error, "dir": str(folder)}


def build_fast(call: dict[str, Any], root: str, pch: str) -> dict[str, Any]:
    from kerneleval_server.fast_build import extension

    folder = Path(root) / f"fast_{call['name']}"
    built = extension.build_load_inline(call, folder, Path(pch), lambda _: None)
    return {
        "seconds": built.seconds,
        "error": built.error[-600:],
        "fast": built.fast,
        "log": built.log[-3000:],
        "dir": str(folder),
    }


def same_module(example: str, plain_dir: str, fast_dir: str, name: str) -> dict[str, Any]:
    """Both modules on the same inputs; outputs bitwise equal."""
    import torch
    from torch.utils.cpp_extension import _import_module_from_library

    plain = _import_module_from_library(name, plain_dir, True)
    fast = _import_module_from_library(name, fast_dir, True)
    torch.manual_seed(0)
    fn = [f for f in dir(plain) if not f.startswith("_")][0]
    if example.endswith("tiled_matmul"):
        args = [torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")]
    elif example.endswith("fuse_gelu"):
        args = [torch.randn(4096, device="cuda")]
    else:
        args = [torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")]
    a, b = getattr(plain, fn)(*args), getattr(fast, fn)(*args)
    torch.cuda.synchronize()
    return {"function": fn, "equal": bool(torch.equal(a, b))}


def warm_pch(root: str, pch: str) -> float:
    t0 = time.monotonic()
    built = build_fast(candidate(NAMES[0], 0), root, pch)
    if not built["fast"]:
        print("warm-up build did not take the fast path:", built["log"][-800:], flush=True)
    return time.monotonic() - t0


def cubin_seconds(root: str, n: int) -> list[float]:
    src = Path(root) / "k.cu"
    times = []
    for i in range(n):
        src.write_text(
            f"__global__ void k{i}(const float* a, float* o, int n) {{ int i = blockIdx.x * "
            "blockDim.x + threadIdx.x; if (i < n) o[i] = a[i] * 2.0f; }\n"
        )
        t0 = time.monotonic()
        cubin = str(src.with_suffix(".cubin"))
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(src), "-o", cubin], check=True)
        times.append(time.monotonic() - t0)
    return times


def throughput(
    kind: str, calls: list[dict[str, Any]], root: str, pch: str, parallel: int
) -> dict[str, Any]:
    t0 = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(parallel) as pool:
        if kind == "fast":
            futs = [pool.submit(build_fast, c, root, pch) for c in calls]
        else:
            futs = [pool.submit(build_plain, c, root) for c in calls]
        results = [f.result() for f in futs]
    wall = time.monotonic() - t0
    ok = sum(1 for r in results if not r["error"])
    return {
        "builds": len(calls),
        "ok": ok,
        "wall_s": wall,
        "per_minute": 60 * len(calls) / wall,
        "fast_path": sum(1 for r in results if r.get("fast")),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--per-example", type=int, default=4, help="builder candidates per example")
    ap.add_argument("--plain", type=int, default=1, help="load_inline candidates per example")
    ap.add_argument("--parallel", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--throughput-fast", type=int, default=48)
    ap.add_argument("--throughput-plain", type=int, default=16)
    args = ap.parse_args()
    import torch.utils.cpp_extension as cpp_ext

    if cpp_ext.CUDA_HOME is None:
        cpp_ext.CUDA_HOME = cuda_home()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    if args.cpu_smoke:
        args.per_example, args.plain, args.throughput_fast, args.throughput_plain = 1, 1, 0, 0
    root = tempfile.mkdtemp(prefix="kerneleval-bench-builds-")
    pch = os.path.join(root, "pch")
    info = C.machine_info()
    data: dict[str, Any] = {"pch_warm_s": warm_pch(root, pch)}
    rows, lat = [], {}
    for ex in NAMES:
        fast = [build_fast(candidate(ex, i + 1), root, pch) for i in range(args.per_example)]
        plain_calls = [candidate(ex, 100 + i) for i in range(args.plain)]
        plain = [build_plain(c, root) for c in plain_calls]
        check: dict[str, Any] = {}
        if not args.cpu_smoke and plain and not plain[0]["error"]:
            twin = build_fast(plain_calls[0], root, pch)
            check = {"twin_error": twin["error"]}
            if not twin["error"]:
                check = same_module(ex, plain[0]["dir"], twin["dir"], plain_calls[0]["name"])
        f50 = statistics.median(r["seconds"] for r in fast)
        p50 = statistics.median(r["seconds"] for r in plain)
        lat[ex] = {"fast": fast, "plain": plain, "same_module": check}
        fast_path = sum(r["fast"] for r in fast)
        error = fast[0]["error"][:80] or check.get("twin_error", "")[:80] or "-"
        rows.append(
            [ex, f50, p50, C.ratio(p50, f50), fast_path, len(fast), check.get("equal", "-"), error]
        )
    data["latency"] = lat
    all_fast = [r["seconds"] for v in lat.values() for r in v["fast"]]
    all_plain = [r["seconds"] for v in lat.values() for r in v["plain"]]
    data["p50_fast_s"], data["p50_plain_s"] = (
        statistics.median(all_fast),
        statistics.median(all_plain),
    )
    cub = cubin_seconds(root, 5)
    data["cubin_p50_s"] = statistics.median(cub)
    head = ["example", "builder p50", "load_inline p50", "x faster", "fast path", "of"]
    tables = [("one build at a time (s)", [*head, "same output", "error"], rows)]
    cols = ("builds", "ok", "wall_s", "per_minute")
    trows = []
    if args.throughput_fast:
        calls = [candidate(NAMES[i % 3], 1000 + i) for i in range(args.throughput_fast)]
        data["throughput_fast"] = throughput("fast", calls, root, pch, args.parallel)
        trows.append(["builder", *[data["throughput_fast"][k] for k in cols]])
    if args.throughput_plain:
        calls = [candidate(NAMES[i % 3], 2000 + i) for i in range(args.throughput_plain)]
        data["throughput_plain"] = throughput("plain", calls, root, pch, args.parallel)
        trows.append(["load_inline", *[data["throughput_plain"][k] for k in cols]])
    if trows:
        title = f"{args.parallel} builds at once, distinct candidates"
        tables.append((title, ["build", "builds", "ok", "wall s", "per minute"], trows))
    notes = [
        f"all examples: builder p50 {data['p50_fast_s']:.2f} s, load_inline p50 "
        f"{data['p50_plain_s']:.2f} s ({C.ratio(data['p50_plain_s'], data['p50_fast_s']):.1f}x)",
        f"precompiled headers built once before timing: {data['pch_warm_s']:.1f} s",
        f"raw CUDA kernel, nvcc -cubin p50: {data['cubin_p50_s']:.2f} s",
    ]
    name = "bench_builds_smoke" if args.cpu_smoke else "bench_builds"
    title = "Builds of load_inline candidates: builder vs load_inline"
    C.write_results(args.out, name, title, info, data, tables, notes)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
