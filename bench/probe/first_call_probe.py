"""First call of a small Triton kernel in a warmed process (CUDA, cuBLAS, a Triton kernel run
before): with an empty Triton cache, and with the cache a previous process filled."""
import os, shutil, subprocess, sys, tempfile, time

CHILD = r'''
import os, sys, time, torch, triton, triton.language as tl
@triton.jit
def warm(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK); m = o < n
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=m) + 1, mask=m)
x = torch.zeros(16, device="cuda"); a = torch.randn(64, 64, device="cuda"); (a @ a).sum().item()
os.environ["TRITON_CACHE_DIR"] = sys.argv[1] + "/warm"
warm[(1,)](x, 16, BLOCK=16); torch.cuda.synchronize()
os.environ["TRITON_CACHE_DIR"] = sys.argv[1] + "/job"
src = "import triton, triton.language as tl\n@triton.jit\ndef add(a, b, o, n, BLOCK: tl.constexpr):\n    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK); m = p < n\n    tl.store(o + p, tl.load(a + p, mask=m) + tl.load(b + p, mask=m), mask=m)\n"
path = sys.argv[1] + "/cand.py"; open(path, "w").write(src)
t = time.perf_counter()
import importlib.util
spec = importlib.util.spec_from_file_location("cand", path); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
t1 = time.perf_counter()
a = torch.randn(4096, device="cuda"); b = torch.randn(4096, device="cuda"); o = torch.empty_like(a)
mod.add[(4,)](a, b, o, 4096, BLOCK=1024); torch.cuda.synchronize()
t2 = time.perf_counter()
mod.add[(4,)](a, b, o, 4096, BLOCK=1024); torch.cuda.synchronize()
t3 = time.perf_counter()
files = sum(len(f) for _, _, f in os.walk(sys.argv[1] + "/job"))
size = sum(os.path.getsize(os.path.join(d, n)) for d, _, f in os.walk(sys.argv[1] + "/job") for n in f)
print(f"{sys.argv[2]}: import {1e3*(t1-t):.1f} ms, first call {1e3*(t2-t1):.1f} ms, second {1e3*(t3-t2):.2f} ms; cache {files} files {size} bytes", flush=True)
'''

root = tempfile.mkdtemp()
for label in ("empty cache", "seeded cache", "seeded cache again"):
    d = tempfile.mkdtemp(dir=root)
    if label != "empty cache":
        shutil.copytree(root + "/first/job", d + "/job")
    with open(d + "/child.py", "w") as f:
        f.write(CHILD)
    subprocess.run([sys.executable, d + "/child.py", d, label], check=False)
    if label == "empty cache":
        os.rename(d, root + "/first")
