"""Where a KernelBench `load_inline` build spends its time, and what the variants cost.

One example pair's ModelNew (../shared/kernelbench/examples/model_new_ex_add.py unless
--example) is read in place; its `load_inline(...)` arguments are captured by running the
file with load_inline replaced by a recorder. Each of N candidates is that source with a
distinct constant added (`__device__ int kerneleval_bench_salt = <random>`), so no build
can hit a cache. For each candidate, in one fresh folder, timed one after another:
  - load_inline      torch's own load_inline (ninja, main.cpp and cuda.cu in parallel, link);
                     the baseline of the ratio column, and the source of the flags below;
  - cu_nvcc          nvcc on torch's cuda.cu with the build.ninja flags, with `--time`
                     (the phases: gcc -E twice, cudafe++, cicc, ptxas, host gcc);
  - cu_types_h       the same .cu with <torch/extension.h> replaced by <torch/types.h>;
  - cu_min_headers   (ex_add only) ATen/core/Tensor.h + ATen/ops/zeros_like.h instead;
  - cu_host_O1       nvcc with -Xcompiler -O1 (load_inline gives the host compiler no -O);
  - cu_host_pch      nvcc with -Xcompiler -include,<pch stem> (a g++ PCH beside it);
  - cpp_main         g++ on torch's main.cpp, same flags;
  - cpp_main_pch     g++ with a PCH of <torch/extension.h> (built once; its cost is a row);
  - split_device     (ex_add only) the kernel and an extern "C" launcher alone, nvcc -c;
  - split_build      (ex_add only) split_device || the host wrapper (torch/extension.h,
                     the binding) with the PCH, then the link and an import of the module:
                     a whole build of the split candidate;
  - cubin_kernel     (ex_add only) nvcc -cubin of the kernel alone (the raw CUDA path).
cu_host_O1 and cu_host_pch run for the first candidate only.

    PYTHONPATH=server:clients/python/src python3 bench/bench_builds.py --out DIR
    ... --cpu-smoke       # no GPU: 2 candidates; load_inline's link fails on a CPU torch

Without a CUDA build of torch, `torch.utils.cpp_extension.CUDA_HOME` is None and load_inline
refuses CUDA sources; the script sets it to the CUDA that nvcc belongs to, so that both
translation units compile as they would on a GPU host. The link then fails (the CPU wheel has
no libc10_cuda/libtorch_cuda): its time is the compile time, the link (~0.4 s) left out.

Results: <out>/bench_builds.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import importlib.util
import os
import random
import re
import shlex
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

DEFAULT_EXAMPLE = C.REPO.parent / "shared" / "kernelbench" / "examples" / "model_new_ex_add.py"

# ex_add by hand: the kernel with no torch header, and the host wrapper that launches it.
SPLIT_DEVICE = """#include <cuda_runtime.h>
__device__ int kerneleval_bench_salt = {salt};
__global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {{
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < size) {{
        out[idx] = a[idx] + b[idx];
    }}
}}
extern "C" void elementwise_add_launch(const float* a, const float* b, float* out, int size,
                                       cudaStream_t stream) {{
    const int block_size = 256;
    const int num_blocks = (size + block_size - 1) / block_size;
    elementwise_add_kernel<<<num_blocks, block_size, 0, stream>>>(a, b, out, size);
}}
"""
SPLIT_HOST = """#include <torch/extension.h>
#include <cuda_runtime.h>
extern "C" void elementwise_add_launch(const float*, const float*, float*, int, cudaStream_t);
torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
    auto size = a.numel();
    auto out = torch::zeros_like(a);
    elementwise_add_launch(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(),
                           size, nullptr);
    return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
m.def("elementwise_add_cuda", torch::wrap_pybind_function(elementwise_add_cuda),
      "elementwise_add_cuda");
}
"""
MIN_HEADERS = (
    "#include <ATen/core/Tensor.h>\n#include <ATen/ops/zeros_like.h>\n#include <cuda_runtime.h>\n"
    "namespace torch { using at::Tensor; using at::zeros_like; }\n"
)


class _Captured(Exception):
    pass


def capture_load_inline(path: Path) -> dict[str, Any]:
    """The keyword arguments of the example's load_inline call (its file read in place)."""
    import torch.utils.cpp_extension as cpp_ext

    seen: dict[str, Any] = {}

    def recorder(*args: Any, **kwargs: Any) -> Any:
        names = ["name", "cpp_sources", "cuda_sources", "functions"]
        seen.update(dict(zip(names, args, strict=False)), **kwargs)
        raise _Captured

    real = cpp_ext.load_inline
    cpp_ext.load_inline = recorder  # type: ignore[assignment]
    try:
        exec(compile(path.read_text(), str(path), "exec"), {"__name__": "kerneleval_bench"})
    except _Captured:
        pass
    finally:
        cpp_ext.load_inline = real
    if not seen:
        raise SystemExit(f"{path} calls no load_inline")
    for key in ("cpp_sources", "cuda_sources"):
        if isinstance(seen.get(key), str):
            seen[key] = [seen[key]]
    return seen


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise SystemExit("nvcc was not found")
    return path


def cuda_home() -> str:
    """The CUDA install nvcc belongs to (/usr/local/bin/nvcc may be a wrapper script)."""
    out = subprocess.run([nvcc(), "--dryrun", "--version"], capture_output=True, text=True)
    m = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    return os.path.realpath(m.group(1)) if m else "/usr/local/cuda"


def timed(cmd: list[str], cwd: Path, label: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return time.monotonic() - t0, proc


def first_error(text: str) -> str:
    for line in text.splitlines():
        if "error" in line.lower():
            return line.strip()[:200]
    return text.strip().splitlines()[-1][:200] if text.strip() else ""


def ninja_flags(build_dir: Path) -> dict[str, list[str]]:
    """cflags, cuda_cflags and ldflags from torch's build.ninja."""
    out: dict[str, list[str]] = {}
    for line in (build_dir / "build.ninja").read_text().splitlines():
        m = re.match(r"(cflags|cuda_cflags|ldflags|post_cflags|cuda_post_cflags) = (.*)", line)
        if m:
            out[m.group(1)] = shlex.split(m.group(2))
    return out


def ninja_steps(build_dir: Path) -> dict[str, float]:
    steps: dict[str, float] = {}
    log = build_dir / ".ninja_log"
    if log.exists():
        for line in log.read_text().splitlines()[1:]:
            start, end, _, target, *_ = line.split("\t")
            steps[target] = (int(end) - int(start)) / 1000.0
    return steps


def nvcc_phases(csv_path: Path) -> dict[str, float]:
    phases: dict[str, float] = {}
    if not csv_path.exists():
        return phases
    with csv_path.open() as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:
        if len(row) >= 8:
            name = row[1].strip()
            phases[name] = phases.get(name, 0.0) + float(row[6]) / 1000.0
    return phases


class Candidate:
    """One distinct candidate: its sources, torch's build of it, and the variants."""

    def __init__(self, kw: dict[str, Any], root: Path, index: int, pch: Path | None):
        self.kw = kw
        self.salt = random.randrange(1, 1 << 30)
        self.name = f"{kw['name']}_bench{index}_{self.salt}"
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        salt_line = f"\n__device__ int kerneleval_bench_salt = {self.salt};\n"
        self.cuda_sources = [*kw["cuda_sources"][:-1], kw["cuda_sources"][-1] + salt_line]
        self.pch = pch
        self.flags: dict[str, list[str]] = {}

    def load_inline(self) -> dict[str, Any]:
        import torch.utils.cpp_extension as cpp_ext

        build = self.dir / "torch_build"
        build.mkdir()
        t0 = time.monotonic()
        error = ""
        try:
            # Copies: load_inline adds the include and the binding to the lists it is given.
            cpp_ext.load_inline(
                name=self.name,
                cpp_sources=list(self.kw["cpp_sources"]),
                cuda_sources=list(self.cuda_sources),
                functions=_copy(self.kw.get("functions")),
                extra_cflags=_copy(self.kw.get("extra_cflags")),
                extra_cuda_cflags=_copy(self.kw.get("extra_cuda_cflags")),
                extra_ldflags=_copy(self.kw.get("extra_ldflags")),
                build_directory=str(build),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - the CPU wheel's link fails; recorded
            error = str(e)
        seconds = time.monotonic() - t0
        steps = ninja_steps(build)
        self.flags = ninja_flags(build)
        self.main_cpp = (build / "main.cpp").read_text()
        self.cuda_cu = (build / "cuda.cu").read_text()
        compiled = "main.o" in steps and "cuda.cuda.o" in steps
        note = ""
        if error:
            if compiled and "cannot find -l" in error:
                note = "link failed: no libc10_cuda/libtorch_cuda in this torch; compile only"
            else:
                note = f"failed: {first_error(error)}"
        out = {"seconds": seconds, "ok": compiled, "steps": steps, "note": note}
        if error and not compiled:
            out["error"] = error[-4000:]
        return out

    def _write(self, name: str, text: str) -> Path:
        p = self.dir / name
        p.write_text(text)
        return p

    def nvcc_cu(self, source: str, tag: str, extra: list[str] | None = None) -> dict[str, Any]:
        src = self._write(f"{tag}.cu", source)
        csv_path = self.dir / f"{tag}.time.csv"
        cmd = [nvcc(), *self.flags["cuda_cflags"], *(extra or []), "--time", str(csv_path),
               "-c", str(src), "-o", str(src.with_suffix(".o")),
               *self.flags.get("cuda_post_cflags", [])]  # fmt: skip
        seconds, proc = timed(cmd, self.dir, tag)
        out = {"seconds": seconds, "ok": proc.returncode == 0, "phases": nvcc_phases(csv_path)}
        if proc.returncode:
            errors = len(re.findall(r"\berror\b", proc.stdout + proc.stderr))
            out["note"] = f"failed, {errors} errors: {first_error(proc.stdout + proc.stderr)}"
        return out

    def gxx(self, source: str, tag: str, use_pch: bool) -> dict[str, Any]:
        src = self._write(f"{tag}.cpp", source)
        pch = ["-include", str(self.pch), "-Winvalid-pch"] if use_pch and self.pch else []
        cmd = ["c++", *self.flags["cflags"], *pch, "-c", str(src), "-o",
               str(src.with_suffix(".o")), *self.flags.get("post_cflags", [])]  # fmt: skip
        seconds, proc = timed(cmd, self.dir, tag)
        out: dict[str, Any] = {"seconds": seconds, "ok": proc.returncode == 0}
        if proc.returncode:
            out["note"] = f"failed: {first_error(proc.stderr)}"
        elif pch and ".gch" in proc.stderr:  # -Winvalid-pch: gcc read the header text instead
            out["note"] = f"PCH not used: {first_error(proc.stderr) or proc.stderr[:200]}"
        return out

    def split_device(self) -> dict[str, Any]:
        return self.nvcc_cu(SPLIT_DEVICE.format(salt=self.salt), "split_device")

    def split_build(self) -> dict[str, Any]:
        """The split candidate built whole: device TU || host TU (PCH), link, import."""
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            dev = pool.submit(self.nvcc_cu, SPLIT_DEVICE.format(salt=self.salt), "split_dev2")
            host = pool.submit(self.gxx, SPLIT_HOST, "split_host", True)
            d, h = dev.result(), host.result()
        if not (d["ok"] and h["ok"]):
            return {"seconds": time.monotonic() - t0, "ok": False,
                    "note": d.get("note") or h.get("note")}  # fmt: skip
        so = self.dir / f"{self.name}.so"
        ldflags = [f for f in self.flags["ldflags"] if f not in ("-lc10_cuda", "-ltorch_cuda")]
        cmd = ["c++", str(self.dir / "split_host.o"), str(self.dir / "split_dev2.o"), *ldflags,
               "-o", str(so)]  # fmt: skip
        link_s, proc = timed(cmd, self.dir, "link")
        out: dict[str, Any] = {"seconds": time.monotonic() - t0, "ok": proc.returncode == 0,
                               "device_s": d["seconds"], "host_s": h["seconds"],
                               "link_s": link_s}  # fmt: skip
        if proc.returncode:
            out["note"] = f"link failed: {first_error(proc.stderr)}"
            return out
        # torch's TORCH_EXTENSION_NAME in cflags is the candidate's name: import it by that.
        spec = importlib.util.spec_from_file_location(self.name, so)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            fns = self.kw.get("functions") or []
            missing = [f for f in fns if not hasattr(module, f)]
            out["note"] = f"imports; missing {missing}" if missing else "imports, functions bound"
            out["ok"] = not missing and _check_add(module, fns)
        except ImportError as e:
            out["note"] = f"built; import failed: {str(e)[:150]}"
        return out

    def cubin_kernel(self) -> dict[str, Any]:
        src = self._write("kernel_only.cu", SPLIT_DEVICE.format(salt=self.salt))
        arch = [f for f in self.flags["cuda_cflags"] if f.startswith("-gencode")]
        m = re.search(r"code=(sm_\d+)", " ".join(arch))
        cmd = [nvcc(), "-cubin", f"-arch={m.group(1) if m else 'sm_90'}", "-lineinfo",
               "-o", str(src.with_suffix(".cubin")), str(src)]  # fmt: skip
        seconds, proc = timed(cmd, self.dir, "cubin")
        return {"seconds": seconds, "ok": proc.returncode == 0}


def _check_add(module: Any, fns: list[str]) -> bool:
    """On a GPU: the split ex_add's function adds (a + b) like the original."""
    import torch

    if not torch.cuda.is_available() or fns != ["elementwise_add_cuda"]:
        return True
    a, b = torch.randn(4097, device="cuda"), torch.randn(4097, device="cuda")
    out = module.elementwise_add_cuda(a, b)
    torch.cuda.synchronize()
    return bool(torch.equal(out, a + b))


def build_pch(flags: dict[str, list[str]], folder: Path) -> tuple[Path, float, int]:
    """A g++ PCH of <torch/extension.h> with main.cpp's flags: (stem, seconds, bytes)."""
    stem = folder / "torch_extension_pch.h"
    stem.write_text("#include <torch/extension.h>\n")
    gch = folder / "torch_extension_pch.h.gch"
    # Without the candidate's -DTORCH_EXTENSION_NAME: one PCH serves every candidate (gcc
    # accepts a macro defined at use that the header never mentions).
    cflags = [f for f in flags["cflags"] if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    cmd = ["c++", *cflags, "-x", "c++-header", str(stem), "-o", str(gch)]
    seconds, proc = timed(cmd, folder, "pch")
    if proc.returncode:
        raise SystemExit(f"building the PCH failed:\n{proc.stderr[-2000:]}")
    return stem, seconds, gch.stat().st_size


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--candidates", type=int, default=None, help="distinct candidates (3; 2 smoke)")
    ap.add_argument("--example", default=str(DEFAULT_EXAMPLE), help="a load_inline ModelNew file")
    ap.add_argument("--keep", action="store_true", help="keep the build folders")
    ap.add_argument("--skip", default="", help="variants to leave out, comma-separated")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    n = args.candidates or (2 if smoke else 3)
    example = Path(args.example)
    is_add = example.name == "model_new_ex_add.py"
    skip = {v.strip() for v in args.skip.split(",") if v.strip()} - {"load_inline"}

    import torch
    import torch.utils.cpp_extension as cpp_ext

    notes: list[str] = []
    if cpp_ext.CUDA_HOME is None:
        cpp_ext.CUDA_HOME = cuda_home()
        notes.append(
            f"torch {torch.__version__} has no CUDA: cpp_extension.CUDA_HOME was None and "
            f"load_inline refuses CUDA sources; set to {cpp_ext.CUDA_HOME} so that both "
            "translation units compile; the link then fails (no libc10_cuda/libtorch_cuda in "
            "the CPU wheel) and load_inline's time is its compile time"
        )
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        notes.append("no GPU: TORCH_CUDA_ARCH_LIST=9.0 (sm_90, as on the H100)")

    info = C.machine_info()
    info["nvcc"] = subprocess.run([nvcc(), "--version"], capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    info["cxx"] = subprocess.run(["c++", "--version"], capture_output=True,
                                 text=True).stdout.splitlines()[0]  # fmt: skip
    kw = capture_load_inline(example)
    root = Path(tempfile.mkdtemp(prefix="kerneleval-bench-builds-"))
    load_before = loadavg()
    runs: dict[str, list[dict[str, Any]]] = {}
    pch_info: dict[str, Any] = {}
    try:
        for i in range(n):
            cand = Candidate(kw, root, i, None)
            print(f"candidate {i + 1}/{n}: {cand.name}", flush=True)

            def record(variant: str, run: Any, *a: Any) -> None:
                if variant in skip:
                    return
                t0 = time.monotonic()
                try:
                    result = run(*a)
                except Exception as e:  # noqa: BLE001 - one variant's failure is a row
                    result = {"seconds": time.monotonic() - t0, "ok": False, "note": repr(e)}
                runs.setdefault(variant, []).append(result)
                ok = "ok" if result["ok"] else "FAILED"
                extra = f" ({result['note']})" if result.get("note") else ""
                print(f"  {variant:15s} {result['seconds']:7.2f} s {ok}{extra}", flush=True)

            record("load_inline", cand.load_inline)
            if not pch_info:
                stem, secs, size = build_pch(cand.flags, root)
                pch_info = {"stem": str(stem), "seconds": secs, "bytes": size}
                print(f"  PCH of torch/extension.h: {secs:.2f} s, {size / 2**20:.0f} MiB")
            cand.pch = Path(pch_info["stem"])
            include = "#include <torch/extension.h>"
            cu = cand.cuda_cu
            record("cu_nvcc", cand.nvcc_cu, cu, "cu_nvcc")
            types_h = cu.replace(include, "#include <torch/types.h>")
            record("cu_types_h", cand.nvcc_cu, types_h, "cu_types_h")
            if is_add:
                body = cu.split(include, 1)[1]
                record("cu_min_headers", cand.nvcc_cu, MIN_HEADERS + body, "cu_min_headers")
            if i == 0:
                record("cu_host_O1", cand.nvcc_cu, cu, "cu_host_O1", ["-Xcompiler", "-O1"])
                pch = ["-Xcompiler", f"-include,{cand.pch}", "-Xcompiler", "-Winvalid-pch"]
                record("cu_host_pch", cand.nvcc_cu, cu, "cu_host_pch", pch)
            record("cpp_main", cand.gxx, cand.main_cpp, "cpp_main", False)
            record("cpp_main_pch", cand.gxx, cand.main_cpp, "cpp_main_pch", True)
            if is_add:
                record("split_device", cand.split_device)
                record("split_build", cand.split_build)
                record("cubin_kernel", cand.cubin_kernel)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(r["seconds"] for r in runs["load_inline"])
    rows: list[list[Any]] = []
    for variant, results in runs.items():
        times = [float(r["seconds"]) for r in results]
        med = statistics.median(times)
        ok = sum(r["ok"] for r in results)
        note = next((r["note"] for r in results if r.get("note")), "")
        rows.append([variant, len(times), med, min(times), max(times), C.ratio(med, base),
                     f"{ok}/{len(times)}", note])  # fmt: skip
    rows.append(["pch_build (once)", 1, pch_info["seconds"], pch_info["seconds"],
                 pch_info["seconds"], C.ratio(pch_info["seconds"], base), "1/1",
                 f"{pch_info['bytes'] / 2**20:.0f} MiB .gch"])  # fmt: skip
    phase_rows: list[list[Any]] = []
    for variant in ("cu_nvcc", "cu_types_h", "cu_min_headers", "cu_host_O1"):
        if variant not in runs:
            continue
        names: list[str] = []
        for r in runs[variant]:
            names += [p for p in r.get("phases", {}) if p not in names]
        for p in names:
            vals = [r["phases"][p] for r in runs[variant] if p in r.get("phases", {})]
            if vals and statistics.median(vals) >= 0.05:
                phase_rows.append([variant, p, statistics.median(vals)])
    steps = [r["steps"] for r in runs["load_inline"]]
    step_rows = [[t, statistics.median(s[t] for s in steps if t in s)]
                 for t in ("main.o", "cuda.cuda.o") if any(t in s for s in steps)]  # fmt: skip
    notes += [
        f"{n} distinct candidates from {example.name} (read in place), one after another; "
        f"ratio = median / load_inline's median in this run ({base:.1f} s)",
        f"load average before {load_before}, after {loadavg()} ({os.cpu_count()} CPUs); "
        "other work on the machine shows in every row alike",
        "load_inline gives neither g++ nor nvcc's host compiler an -O flag: the host code "
        "already builds at -O0",
        "cu_host_pch: nvcc preprocesses the .cu with gcc -E for each pass and feeds the "
        "expanded text to cudafe++ and cicc, so a g++ PCH cannot stand in for the torch "
        "headers there; -include also puts them before nvcc's cuda_runtime.h",
        'split_*: ex_add split by hand (kernel + extern "C" launcher in the .cu, torch only '
        "in the host wrapper): the bound of what a device/host split gives",
    ]
    C.write_results(
        args.out, "build_breakdown_smoke" if smoke else "build_breakdown",
        "KernelBench load_inline builds: where the time goes", info,
        {"candidates": n, "example": str(example), "runs": runs, "pch": pch_info},
        [("Variants (seconds per candidate)",
          ["variant", "n", "median s", "min s", "max s", "x load_inline", "ok", "note"], rows),
         ("load_inline's ninja steps (seconds, in parallel)", ["step", "median s"], step_rows),
         ("nvcc --time phases (seconds, in sequence)", ["variant", "phase", "median s"],
          phase_rows)],
        notes,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
