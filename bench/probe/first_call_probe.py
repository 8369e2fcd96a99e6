"""First call of a small Triton kernel in a warmed process (CUDA, cuBLAS, a Triton kernel run
before): with an empty Triton cache, with the files a previous process compiled copied as
they are (Triton's group files still name the old folder: a miss), and seeded the way the
service seeds a job's cache (jobproc.job_dirs.seed_compile_cache points them at the new one).
Needs PYTHONPATH=server for the last.

    python3 bench/probe/first_call_probe.py
    FIRST_CALL_PROFILE=1 python3 bench/probe/first_call_probe.py   # + cProfile of first calls
"""

import os
import shutil
import subprocess
import sys
import tempfile

# Runs as a file: @triton.jit needs its source on disk.
CHILD = r'''
import importlib.util
import os
import sys
import time

import torch
import triton
import triton.language as tl

ROOT, LABEL = sys.argv[1], sys.argv[2]
CANDIDATE = """
import triton
import triton.language as tl

@triton.jit
def add(a, b, o, n, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < n
    tl.store(o + p, tl.load(a + p, mask=m) + tl.load(b + p, mask=m), mask=m)
"""


@triton.jit
def warm(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=m) + 1, mask=m)


# The job process's warm-up: context, cuBLAS, one Triton kernel (its own cache folder).
x = torch.zeros(16, device="cuda")
w = torch.randn(64, 64, device="cuda")
(w @ w).sum().item()
os.environ["TRITON_CACHE_DIR"] = ROOT + "/warm"
warm[(1,)](x, 16, BLOCK=16)
torch.cuda.synchronize()

os.environ["TRITON_CACHE_DIR"] = ROOT + "/job"
path = ROOT + "/cand.py"
with open(path, "w") as f:
    f.write(CANDIDATE)
t0 = time.perf_counter()
spec = importlib.util.spec_from_file_location("cand", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
t1 = time.perf_counter()
a = torch.randn(4096, device="cuda")
b = torch.randn(4096, device="cuda")
o = torch.empty_like(a)
profile = None
if os.environ.get("FIRST_CALL_PROFILE"):
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
mod.add[(4,)](a, b, o, 4096, BLOCK=1024)
torch.cuda.synchronize()
t2 = time.perf_counter()
if profile is not None:
    import pstats
    profile.disable()
    print(f"== {LABEL}: where the first call's time goes", flush=True)
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("cumulative").print_stats(28)
    stats.sort_stats("tottime").print_stats(12)
mod.add[(4,)](a, b, o, 4096, BLOCK=1024)
torch.cuda.synchronize()
t3 = time.perf_counter()
found = [os.path.join(d, n) for d, _, names in os.walk(ROOT + "/job") for n in names]
size = sum(os.path.getsize(p) for p in found)
print(
    f"{LABEL}: import {1e3 * (t1 - t0):.1f} ms, first call {1e3 * (t2 - t1):.1f} ms, "
    f"second {1e3 * (t3 - t2):.2f} ms; cache {len(found)} files {size} bytes",
    flush=True,
)
'''


def main() -> None:
    from pathlib import Path

    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.jobproc.job_dirs import seed_compile_cache

    root = tempfile.mkdtemp()
    for label in ("empty cache", "copied cache", "seeded cache", "seeded cache again"):
        d = tempfile.mkdtemp(dir=root)
        if label == "copied cache":
            shutil.copytree(root + "/first/job", d + "/job")
        elif label != "empty cache":
            first = Path(root + "/first/job")
            given = [
                job_channel_pb2.CacheFile(path=str(p.relative_to(first)), data=p.read_bytes())
                for p in sorted(first.rglob("*"))
                if p.is_file()
            ]
            os.makedirs(d + "/job")
            seed_compile_cache(Path(d + "/job"), given)
        with open(d + "/child.py", "w") as f:
            f.write(CHILD)
        subprocess.run([sys.executable, d + "/child.py", d, label], check=False)
        if label == "empty cache":
            os.rename(d, root + "/first")


if __name__ == "__main__":
    main()
