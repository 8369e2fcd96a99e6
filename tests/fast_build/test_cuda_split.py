"""cuda_split: a load_inline `.cu` split into a device unit (nvcc, no torch headers) and a host
unit (g++), checked by attack and by real compilation (no GPU needed).

Every split here is either compiled for real (host unit with g++, launch functions
instantiated from its `nm -C -u`, device unit with nvcc for sm_80, `ld -r`, and `nm`: no
launch function left undefined), or must raise SplitError. Where the split is conservative only
because a compiler rejects it (the build then falls back to torch's), the test compiles it and
shows the rejection. Every unit must also keep its `#line`s true: each piece of it is the
original text at the line its directive names (so compiler errors point at the candidate's
lines).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kerneleval_server.fast_build import cuda_split
from kerneleval_server.fast_build.cuda_split import LAUNCH_PREFIX, SplitError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO.parent / "shared" / "kernelbench" / "examples"
if not EXAMPLES.exists():
    EXAMPLES = Path("/work/shared/kernelbench/examples")
CUDA_NVCC = Path("/usr/local/cuda/bin/nvcc")
HAS_NVCC = shutil.which("nvcc") is not None or CUDA_NVCC.exists()
NVCC = str(CUDA_NVCC) if CUDA_NVCC.exists() else shutil.which("nvcc") or "nvcc"
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
needs_examples = pytest.mark.skipif(not EXAMPLES.exists(), reason="no KernelBench examples")
PATH = "/build/cuda.cu"  # where torch writes the source: the #line directives name it


def cuda_include() -> str:
    """CUDA's include folder (/usr/local/bin/nvcc may be a wrapper script)."""
    for home in (Path(NVCC).resolve().parents[1], Path("/usr/local/cuda")):
        if (home / "include" / "cuda_runtime.h").exists():
            return str(home / "include")
    out = subprocess.run([NVCC, "--dryrun", "--version"], capture_output=True, text=True)
    top = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    assert top, "cannot find CUDA's include folder"
    return str(Path(top.group(1)) / "include")


def split(source: str) -> cuda_split.Split:
    source = textwrap.dedent(source)
    parts = cuda_split.split(source, PATH)
    assert_line_map(parts.device, source)
    assert_line_map(parts.host, source)
    return parts


def assert_line_map(unit: str, source: str) -> None:
    """Each piece after a `#line N` is the source's text from line N on (the host unit's
    rewritten launches aside, which keep their line count)."""
    src = source.split("\n")
    pieces = re.split(rf'^#line (\d+) "{re.escape(PATH)}"\n', unit, flags=re.M)
    for number, text in zip(pieces[1::2], pieces[2::2], strict=True):
        lines = text.split("\n")
        while lines and (
            not lines[-1].strip() or lines[-1].startswith("template") and LAUNCH_PREFIX in lines[-1]
        ):
            lines.pop()  # the launch functions the split adds after a kernel or at the end
        first, launch = int(number) - 1, False
        for i, line in enumerate(lines):
            original = src[first + i]
            if LAUNCH_PREFIX in line:
                launch = True  # a rewritten launch: its lines, then its arguments' end
                continue
            if launch and (not line.strip() or original.endswith(line.strip())):
                continue
            launch = False
            if len(lines) == 1:
                assert line in original, (number, line)
            elif i == 0:
                assert original.endswith(line), (number, line, original)
            elif i == len(lines) - 1:
                assert original.startswith(line), (number, line, original)
            else:
                assert line == original, (number, line, original)


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


class Compiled:
    """A split compiled as fast_build compiles it, without torch: which step failed (if one
    did) and the compilers' output."""

    def __init__(self, folder: Path, parts: cuda_split.Split) -> None:
        self.folder, self.parts = folder, parts
        self.failed, self.output, self.instantiations = "", "", ""

    def step(self, name: str, cmd: list[str]) -> bool:
        done = run(cmd, self.folder)
        if done.returncode != 0:
            self.failed, self.output = name, done.stdout + done.stderr
        return done.returncode == 0

    def symbols(self, obj: str, *flags: str) -> list[str]:
        done = run(["nm", "-C", *flags, obj], self.folder)
        assert done.returncode == 0, done.stderr
        return [ln for ln in done.stdout.splitlines() if LAUNCH_PREFIX in ln]


def compile_split(source: str, folder: Path) -> Compiled:
    """host g++ -> nm -C -u -> instantiations -> device nvcc -> ld -r (stops at a failure)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = Compiled(folder, split(source))
    (folder / "host.cpp").write_text(c.parts.host)
    flags = ["-std=c++17", "-fPIC", "-isystem", cuda_include()]
    if not c.step("g++", ["g++", *flags, "-c", "host.cpp", "-o", "host.o"]):
        return c
    undefined = run(["nm", "-C", "-u", "host.o"], folder).stdout.splitlines()
    try:
        c.instantiations = cuda_split.instantiations(undefined)
    except SplitError as e:
        c.failed, c.output = "instantiations", str(e)
        return c
    (folder / "device.cu").write_text(c.parts.device + c.instantiations)
    nvcc = [NVCC, "-arch=sm_80", "-std=c++17", "-Xcompiler", "-fPIC", "-c"]
    if not c.step("nvcc", [*nvcc, "device.cu", "-o", "device.o"]):
        return c
    c.step("ld", ["ld", "-r", "host.o", "device.o", "-o", "both.o"])
    return c


def assert_links(c: Compiled) -> None:
    """Every launch function the host unit calls is defined (instantiated) in the device
    unit, and nothing of them is left undefined once both are one object."""
    assert not c.failed, f"{c.failed} failed:\n{c.output[-3000:]}"
    needed = {ln.split(" U ")[-1].strip() for ln in c.symbols("host.o", "-u")}
    assert needed, "the host unit calls no launch function"
    defined = {re.sub(r"^\S+ [WTt] ", "", ln) for ln in c.symbols("both.o", "--defined-only")}
    assert needed <= defined, needed - defined
    assert c.symbols("both.o", "-u") == []
    assert sorted(c.parts.kernels) == sorted(
        {re.match(rf"(?:void )?{LAUNCH_PREFIX}(\w+)", s).group(1) for s in needed}  # type: ignore[union-attr]
    )


# ---- the KernelBench examples, read in place -------------------------------------------------


@functools.cache
def kernelbench_sources() -> dict[str, str]:
    """Each example's cuda.cu as torch writes it (its headers, then the candidate's sources)."""
    sys.path.insert(0, str(REPO / "bench"))
    from build_breakdown import capture_load_inline

    sources = {}
    for path in sorted(EXAMPLES.glob("model_new_ex_*.py")):
        text = path.read_text()
        if "cuda_sources" not in text:
            continue  # the Triton example
        call = capture_load_inline(path)
        sources[path.stem] = (
            "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
            + "\n".join(call["cuda_sources"])
        )
    return sources


@needs_examples
def test_kernelbench_examples_split_torch_to_the_host_only() -> None:
    sources = kernelbench_sources()
    assert set(sources) == {
        "model_new_ex_add",
        "model_new_ex_fuse_gelu",
        "model_new_ex_tiled_matmul",
    }
    kernels = {}
    for name, source in sources.items():
        parts = split(source)
        kernels[name] = parts.kernels
        assert not re.search(r"#\s*include\s*<(torch|ATen|c10)/", parts.device)
        code = "\n".join(ln for ln in parts.device.splitlines() if not ln.startswith("#"))
        assert not re.search(r"\b(torch|at|c10)::|TORCH_|C10_", code)  # #defines aside
        assert "__global__" not in parts.host
        # every launch rewritten; the host keeps all of the wrapper code
        assert "<<<" not in parts.host and "<<<" in parts.device
        assert parts.host.count(f"{LAUNCH_PREFIX}") == 2 * len(parts.kernels)
    assert kernels == {
        "model_new_ex_add": ["elementwise_add_kernel"],
        "model_new_ex_fuse_gelu": ["my_gelu_kernel"],
        "model_new_ex_tiled_matmul": ["tiled_matmul_kernel"],
    }
    add = split(sources["model_new_ex_add"])
    # a non-template kernel's launch passes its arguments as the kernel's parameter types
    assert (
        "kerneleval_launch_elementwise_add_kernel<const float*, const float*, float*, int>("
        "num_blocks, block_size, 0, 0, a.data_ptr<float>(), b.data_ptr<float>(), "
        "out.data_ptr<float>(), size)" in add.host
    )
    assert add.typed and add.typed_instantiations == (
        "template void kerneleval_launch_elementwise_add_kernel<const float*, const float*, "
        "float*, int>(dim3, dim3, size_t, cudaStream_t, const float*, const float*, float*, "
        "int);\n"
    )
    matmul = split(sources["model_new_ex_tiled_matmul"])
    # the tile size is a constant both units need: the kernel's shared arrays, the host's block
    assert "constexpr int TILE_SIZE = 16;" in matmul.device
    assert "constexpr int TILE_SIZE = 16;" in matmul.host
    assert (
        "kerneleval_launch_tiled_matmul_kernel<float*, float*, float*, int, int, int>(blocks, "
        "tpb, 0, 0," in matmul.host
    )
    gelu = split(sources["model_new_ex_fuse_gelu"])
    assert "inline unsigned int cdiv" not in gelu.device  # host-only helper
    assert "kerneleval_launch_my_gelu_kernel<" in gelu.host and gelu.typed
    assert ">(cdiv(n, threads), threads, 0, 0," in gelu.host


@needs_nvcc
@needs_examples
def test_kernelbench_device_units_compile_without_torch(tmp_path: Path) -> None:
    """The examples' device units (kernels, launch functions) compile with nvcc alone; the
    host units need torch's CUDA headers (c10/cuda), which a CPU torch lacks: the add
    example's host unit is compiled against torch in test_fast_build.py."""
    sources = kernelbench_sources()

    def nvcc(name: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / f"{name}.cu").write_text(split(sources[name]).device)
        cmd = [NVCC, "-arch=sm_80", "-std=c++17", "-c", f"{name}.cu", "-o", f"{name}.o"]
        return run(cmd, tmp_path)

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(sources, pool.map(nvcc, sources), strict=True))
    for name, result in done.items():
        assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"


# ---- hand-written sources that split and link ------------------------------------------------

LAUNCHES = r"""
#include <cuda_runtime.h>
#include <cstdint>
#define CDIV(a, b) (((a) + (b) - 1) / (b))
constexpr int kBlock = 128;
const int kGrid = 4;
typedef float real;
using idx_t = int64_t;
struct Params { float scale; int n; };
enum class Mode { Add, Mul };
static_assert(sizeof(Params) == 8, "layout");
inline __host__ __device__ int twice(int v) { return 2 * v; }
__device__ float bias = 0.5f;
extern __shared__ float dyn_smem[];
__device__ __forceinline__ real sq(real v) { return v * v; }
template <typename T, int N>
__global__ void tk(T* x, Params p) { x[threadIdx.x] = T(N) * p.scale; }
template <typename T>
__global__ void __launch_bounds__(256, 2) tk2(T* x, idx_t n) {
    if (threadIdx.x < n) x[threadIdx.x] = sq(x[threadIdx.x]);
}
__global__ void k2(float* x, int n, Mode m) {
    __shared__ float s[kBlock];
    s[threadIdx.x] = x[0];
    if (m == Mode::Add) x[0] += bias + s[0];
}
__global__ void k3(float* x) { dyn_smem[threadIdx.x] = x[threadIdx.x]; }
__global__ void k4(const float* __restrict__ x, float* __restrict__ y) { y[0] = x[0] + twice(1); }
int run(float* x, const float* cx, int n, cudaStream_t stream) {
    // a comment with k2<<<1, 1>>>(x) in it, /* and k3<<<1, 1>>>(x) */
    const char* msg = "tk<float, 1><<<1, 1>>>(x, p)";
    Params p{2.0f, n};
    tk<float, 4><<<dim3(CDIV(n, kBlock), 1), dim3(kBlock, 1)>>>(x, p);
    tk<double, 2><<<1, kBlock>>>(reinterpret_cast<double*>(x), p);
    tk2<float><<<kGrid, 256, 0, stream>>>(x, (idx_t)n);
    k2<<<1, kBlock, 0>>>(x, n, Mode::Add);
    k3 <<< 1, 32, 32 * sizeof(float), stream >>> (x);
    auto launch = [&](int blocks) { k4<<<blocks, 1, 0, stream>>>(cx, x); };
    launch(2);
    for (int i = 0; i < 2; ++i)
        k2<<<
            1,
            1>>>(x, twice(i), Mode::Mul);
    return msg[0] + twice(n);
}
template <typename T>
void run_t(T* x, cudaStream_t s) { tk<T, 8><<<1, 1, 0, s>>>(x, Params{1.0f, 1}); }
template void run_t<float>(float*, cudaStream_t);
"""


def test_launches_rewritten_with_every_configuration() -> None:
    parts = split(LAUNCHES)
    assert parts.kernels == ["tk", "tk2", "k2", "k3", "k4"]
    host = parts.host
    for call in (
        # 2, 3 and 4 configuration values; the missing ones are 0 (no shared memory, the
        # default stream), as in the original
        "kerneleval_launch_tk<float, 4>(dim3(CDIV(n, kBlock), 1), dim3(kBlock, 1), 0, 0, x, p)",
        "kerneleval_launch_tk<double, 2>(1, kBlock, 0, 0, reinterpret_cast<double*>(x), p)",
        "kerneleval_launch_tk2<float>(kGrid, 256, 0, stream, x, (idx_t)n)",
        "kerneleval_launch_k2<float*, int, Mode>(1, kBlock, 0, 0, x, n, Mode::Add)",
        "kerneleval_launch_k3<float*>(1, 32, 32 * sizeof(float), stream, x)",
        # inside a lambda; restrict stays the kernel's (nvcc takes none in a template argument)
        "{ kerneleval_launch_k4<const float*, float*>(blocks, 1, 0, stream, cx, x); }",
        "kerneleval_launch_tk<T, 8>(1, 1, 0, s, x, Params{1.0f, 1})",  # in a host template
    ):
        assert call in host, call
    # a multi-line launch keeps its lines (the #line directives stay true after it)
    assert "kerneleval_launch_k2<float*, int, Mode>(1, 1, 0, 0,\n\n x, twice(i), Mode::Mul)" in host
    assert not parts.typed  # tk and tk2 are templates: their types come from the host object
    # comments and strings are left alone
    assert "// a comment with k2<<<1, 1>>>(x) in it, /* and k3<<<1, 1>>>(x) */" in host
    assert '"tk<float, 1><<<1, 1>>>(x, p)"' in host
    # the device unit: kernels, device code and one launch function each; the host unit: no
    # device code, the types and constants in both
    dev = parts.device
    assert "__device__ float bias" in dev and "__device__ float bias" not in host
    assert "extern __shared__ float dyn_smem[];" in dev and "dyn_smem" not in host
    assert "int run(" not in dev and "void run_t(" not in dev
    for both in ("constexpr int kBlock", "const int kGrid", "struct Params", "enum class Mode"):
        assert both in dev and both in host
    assert "inline __host__ __device__ int twice" in dev and "twice(int v)" in host
    assert (
        "template <typename T, int N, typename... A> void kerneleval_launch_tk(dim3 g, dim3 b, "
        "size_t s, cudaStream_t st, A... a) { tk<T, N><<<g, b, s, st>>>(a...); }"
    ) in dev


@needs_nvcc
def test_launches_compile_link_and_instantiate(tmp_path: Path) -> None:
    c = compile_split(LAUNCHES, tmp_path)
    assert_links(c)
    inst = c.instantiations
    # the host's argument types, as nm demangles them: valid C++ for the device unit
    assert (
        "template void kerneleval_launch_tk<float, 4, float*, Params>(dim3, dim3, unsigned long, "
        "CUstream_st*, float*, Params);\n" in inst
    )
    assert "kerneleval_launch_tk<double, 2, double*, Params>(" in inst
    assert "kerneleval_launch_tk2<float, float*, long>(" in inst  # idx_t: int64_t
    assert "kerneleval_launch_k4<float const*, float*>(" in inst
    assert "kerneleval_launch_tk<float, 8, float*, Params>(" in inst  # from the host template
    assert inst.count("kerneleval_launch_k2<") == 1  # launched twice with the same types


DECLARATIONS = r"""
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
using namespace nvcuda;
#define SCALE 2
#ifndef SCALE
#error unreachable
#endif
#if SCALE > 1 && defined(SCALE)
constexpr int kScale = SCALE;
#endif
constexpr int kMillion = 1'000'000;
struct F2 { float a, b; };
__host__ __device__ inline F2& operator+=(F2& l, const F2& r) { l.a += r.a; l.b += r.b; return l; }
__device__ inline bool operator==(const F2& l, const F2& r) { return l.a == r.a && l.b == r.b; }
namespace util {
__device__ float half_of(float v) { return v / 2; }
inline int blocks(int n) { return (n + 255) / 256; }
}  // namespace util
template <typename T, int N = 4>
__global__ void defaulted(T* x) { x[threadIdx.x] = T(N); }
extern "C" __global__ void c_kernel(F2* x) { x[0] += x[1]; if (x[0] == x[1]) x[0].a = 0; }
static __global__ void local_kernel(float* x) {
    cg::thread_block b = cg::this_thread_block();
    b.sync();
    x[0] = util::half_of(x[0]) * kScale + kMillion;
}
__global__ void wmma_kernel(const half* a, float* c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::fill_fragment(fc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
}
void run(float* x, F2* f, const half* h, float* out, int n) {
    const char* doc = R"doc(a raw "string": local_kernel<<<1, 1>>>(x) {)doc";
    defaulted<float, 8><<<util::blocks(n), 256>>>(x);
    c_kernel<<<1, 1>>>(f);
    local_kernel<<<1, 1>>>(nullptr);
    wmma_kernel<<<1, 32>>>(h, out);
    (void)doc;
}
"""


def test_declarations_go_where_they_are_needed() -> None:
    parts = split(DECLARATIONS)
    assert parts.kernels == ["defaulted", "c_kernel", "local_kernel", "wmma_kernel"]
    dev, host = parts.device, parts.host
    # nvcc-only namespaces (their headers are empty for g++) only in the device unit
    assert "namespace cg = cooperative_groups;" in dev and "cooperative_groups;" not in host
    assert "using namespace nvcuda;" in dev and "nvcuda" not in host
    # operators and default template arguments do not end an item early or late
    assert "inline F2& operator+=" in dev and "inline F2& operator+=" in host
    assert "inline bool operator==" in dev and "operator==" not in host
    assert "__global__ void defaulted" in dev and "__global__" not in host
    # host code in a namespace stays on the host; device code in it goes to the device
    assert "inline int blocks" in host and "inline int blocks" not in dev
    assert "half_of" in dev and "float half_of" not in host
    # a raw string is not code: its launch-like text is left as it is
    assert 'R"doc(a raw "string": local_kernel<<<1, 1>>>(x) {)doc"' in host


@needs_nvcc
def test_declarations_compile_link_and_instantiate(tmp_path: Path) -> None:
    c = compile_split(DECLARATIONS, tmp_path)
    assert_links(c)
    # nullptr passed for a pointer: converted at the call, as a launch converts it
    assert "kerneleval_launch_local_kernel<float*>(" in c.instantiations


# ---- what must not split ---------------------------------------------------------------------

REFUSED = {
    "a kernel in a namespace": """
        namespace ops { __global__ void k(float* x) { x[0] = 1; } }
        void run(float* x) { ops::k<<<1, 1>>>(x); }
        """,
    "a kernel in an unnamed namespace": """
        namespace { __global__ void k(float* x) { x[0] = 1; } }
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "a kernel in a namespace launched there": """
        namespace ops {
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { k<<<1, 1>>>(x); }
        }
        """,
    'a kernel in an extern "C" block': """
        extern "C" {
        __global__ void k(float* x) { x[0] = 1; }
        }
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "a launch in a macro": """
        #define RUN(n, x) k<<<n, 1>>>(x)
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { RUN(1, x); }
        """,
    "a launch in a multi-line macro": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) {
        #define RUN(x) \\
            k<<<1, 1>>>(x)
          RUN(x);
        }
        """,
    "a macro naming the kernel": """
        #define KERNEL k
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { KERNEL<<<1, 1>>>(x); }
        """,
    "a macro taking the kernel": """
        #define GO(kern, x) kern(x)
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { GO(k<<<1, 1>>>, x); }
        """,
    "a launch in __host__ __device__ code": """
        __global__ void k(float* x) { x[0] = 1; }
        __host__ __device__ void go(float* x) { k<<<1, 1>>>(x); }
        """,
    "the kernel's address taken": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) {
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 1 << 16);
          k<<<1, 1, 1 << 16>>>(x);
        }
        """,
    "the kernel passed to the occupancy API": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) {
          int g, b;
          cudaOccupancyMaxPotentialBlockSize(&g, &b, k);
          k<<<g, b>>>(x);
        }
        """,
    "one configuration value": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { k<<<1>>>(x); }
        """,
    "five configuration values": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { k<<<1, 1, 0, 0, 7>>>(x); }
        """,
    "template arguments deduced": """
        template <typename T> __global__ void k(T* x) { x[0] = 1; }
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "template arguments defaulted": """
        template <typename T, int N = 4> __global__ void k(T* x) { x[0] = N; }
        void run(float* x) { k<float><<<1, 1>>>(x); }
        """,
    "a template argument deduced after a defaulted one": """
        template <typename T, typename U = float> __global__ void k(T* x, U u) { x[0] = u; }
        void run(float* x) { k<float><<<1, 1>>>(x, 2.5); }
        """,
    "template arguments on a kernel that has none": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { k<float><<<1, 1>>>(x); }
        """,
    "template arguments nested twice": """
        template <typename T> struct Box { T v; };
        template <typename B> __global__ void k(B* x) { x->v = 1; }
        void run(Box<Box<float>>* x) { k<Box<Box<float>>><<<1, 1>>>(x); }
        """,
    "a kernel template with a pack": """
        template <typename... T> __global__ void k(T... x) { }
        void run(float* x) { k<float*><<<1, 1>>>(x); }
        """,
    "an unnamed template parameter": """
        template <typename, int N> __global__ void k(float* x) { x[0] = N; }
        void run(float* x) { k<float, 2><<<1, 1>>>(x); }
        """,
    "an overloaded kernel": """
        __global__ void k(float* x) { x[0] = 1; }
        __global__ void k(int* x) { x[0] = 1; }
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "a kernel declared apart from its definition": """
        __global__ void k(float* x);
        void run(float* x) { k<<<1, 1>>>(x); }
        __global__ void k(float* x) { x[0] = 1; }
        """,
    "a kernel explicitly instantiated": """
        template <typename T> __global__ void k(T* x) { x[0] = 1; }
        template __global__ void k<float>(float*);
        void run(float* x) { k<float><<<1, 1>>>(x); }
        """,
    "a launch of a kernel defined by a macro": """
        #define KERNEL(name) __global__ void name(float* x) { x[0] = 1; }
        KERNEL(k)
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "a __constant__ written from the host": """
        __constant__ float w[4];
        __global__ void k(float* x) { x[0] = w[0]; }
        void run(float* x, const float* h) { cudaMemcpyToSymbol(w, h, sizeof(float) * 4); }
        """,
    "a __device__ variable read from the host": """
        __device__ int counter;
        __global__ void k() { counter++; }
        int run() { int h; cudaMemcpyFromSymbol(&h, counter, sizeof(int)); return h; }
        """,
    "a __managed__ variable": """
        __managed__ int counter;
        __global__ void k() { counter++; }
        int run() { k<<<1, 1>>>(); cudaDeviceSynchronize(); return counter; }
        """,
    "a __shared__ variable named by the host": """
        extern __shared__ float smem[];
        __global__ void k(float* x) { smem[0] = x[0]; }
        void run(float* x) { k<<<1, 1, sizeof(smem[0])>>>(x); }
        """,
    "__CUDACC__": """
        #ifdef __CUDACC__
        __global__ void k(float* x) { x[0] = 1; }
        #endif
        """,
    "__CUDA_ARCH__": """
        __global__ void k(float* x) {
        #if __CUDA_ARCH__ >= 800
          x[0] = 1;
        #endif
        }
        """,
    "__CUDACC_VER_MAJOR__ in host code": """
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) {
        #if __CUDACC_VER_MAJOR__ >= 12
          k<<<1, 1>>>(x);
        #endif
        }
        """,
    "__NVCC__": """
        #if defined(__NVCC__)
        constexpr int kOn = 1;
        #endif
        """,
    "a torch macro tested in a kernel": """
        #include <torch/extension.h>
        __global__ void k(float* x) {
        #if TORCH_VERSION_MAJOR >= 2
          x[0] = 1;
        #else
          x[0] = 2;
        #endif
        }
        void run(torch::Tensor t) { k<<<1, 1>>>(t.data_ptr<float>()); }
        """,
    "a torch macro tested at the top": """
        #include <torch/extension.h>
        #ifdef C10_WARP_SIZE
        constexpr int kWarp = C10_WARP_SIZE;
        #else
        constexpr int kWarp = 32;
        #endif
        __global__ void k(float* x) { x[0] = kWarp; }
        """,
    "a macro tested before the source defines it": """
        #include <torch/extension.h>
        #ifndef C10_WARP_SIZE
        #define C10_WARP_SIZE 64
        #endif
        __global__ void k(float* x) { x[0] = C10_WARP_SIZE; }
        """,
    "a torch macro tested on a continued line": """
        #include <torch/extension.h>
        #if defined(__cplusplus) && \\
            defined(TORCH_VERSION_MAJOR)
        __global__ void k(float* x) { x[0] = 1; }
        #endif
        """,
    "an unbalanced brace": """
        __global__ void k(float* x) { x[0] = 1; }}
        """,
    "an unterminated comment": """
        __global__ void k(float* x) { x[0] = 1; } /* no end
        """,
    "an unterminated string": """
        void run() { const char* s = "no end; }
        """,
    "code the reader cannot end": """
        __global__ void k(float* x) { x[0] = 1; }
        int trailing = 1
        """,
}


@pytest.mark.parametrize("source", REFUSED.values(), ids=list(REFUSED))
def test_refused(source: str) -> None:
    with pytest.raises(SplitError):
        split(source)


def test_refusals_are_specific() -> None:
    def why(name: str) -> str:
        with pytest.raises(SplitError) as e:
            split(REFUSED[name])
        return str(e.value)

    assert why("a kernel in a namespace") == 'kernel k is in a namespace or extern "C" block'
    assert why("the kernel's address taken") == "kernel k is used other than in a launch"
    assert why("five configuration values") == "a launch of k with 5 configuration values"
    assert why("a macro naming the kernel") == (
        "a launch of KERNEL, which is not a kernel of this source"
    )
    assert why("a __constant__ written from the host") == "device variable w is named in host code"
    assert "TORCH_VERSION_MAJOR" in why("a torch macro tested in a kernel")
    assert why("__CUDA_ARCH__") == "the source tests which compiler reads it"
    assert why("template arguments defaulted") == "a launch of k with 1 of its 2 template arguments"
    assert why("a launch in a multi-line macro") == "a launch in a macro"


ACCEPTED = {
    "a kernel launched by another kernel only": """
        __global__ void child(float* x) { x[0] = 1; }
        __global__ void parent(float* x) { child<<<1, 1>>>(x); }
        """,
    "device code in a namespace": """
        namespace util { __device__ float sq(float v) { return v * v; } }
        __global__ void k(float* x) { x[0] = util::sq(x[0]); }
        void run(float* x) { k<<<1, 1>>>(x); }
        """,
    "a torch macro tested in host code": """
        #include <torch/extension.h>
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) {
        #if TORCH_VERSION_MAJOR >= 2
          k<<<1, 1>>>(x);
        #endif
        }
        """,
    "the source's own macros tested anywhere": """
        #define BLOCK 256
        #undef WIDE
        #if BLOCK > 128 && !defined(WIDE) && __cplusplus >= 201703L
        __global__ void k(float* x) { x[0] = BLOCK; }
        #endif
        void run(float* x) { k<<<1, BLOCK>>>(x); }
        """,
    "math.h's constants tested": """
        #include <torch/extension.h>
        #ifndef M_PI
        #define M_PI 3.14159265358979323846
        #endif
        __global__ void k(float* x) { x[0] = M_PI; }
        void run(torch::Tensor t) { k<<<1, 1>>>(t.data_ptr<float>()); }
        """,
    "a host variable shadowing nothing": """
        __device__ float scale_d;
        __global__ void k(float* x) { x[0] = scale_d; }
        void run(float* x, float scale) { k<<<1, 1>>>(x); (void)scale; }
        """,
    "torch aliases stay on the host": """
        #include <torch/extension.h>
        using torch::Tensor;
        namespace F = torch::nn::functional;
        typedef at::Half half_t;
        __global__ void k(float* x) { x[0] = 1; }
        Tensor run(Tensor t) { k<<<1, 1>>>(t.data_ptr<float>()); return t; }
        """,
}


@pytest.mark.parametrize("source", ACCEPTED.values(), ids=list(ACCEPTED))
def test_accepted(source: str) -> None:
    parts = split(source)
    assert not re.search(r"#\s*include\s*<torch/", parts.device)
    assert not re.search(r"\b(torch|at)::", parts.device)


def test_accepted_details() -> None:
    nested = split(ACCEPTED["a kernel launched by another kernel only"])
    assert nested.kernels == [] and "child<<<1, 1>>>(x)" in nested.device
    assert LAUNCH_PREFIX not in nested.host + nested.device
    aliases = split(ACCEPTED["torch aliases stay on the host"])
    for alias in ("using torch::Tensor;", "namespace F = torch", "typedef at::Half"):
        assert alias in aliases.host and alias not in aliases.device


# Splits that are conservative only because a compiler or the linker refuses them: the
# build then falls back to torch's. Compiled here to show that it does refuse.
REJECTED_BY_A_TOOL = {
    "an argument of a local type": (
        """
        template <typename P> __global__ void k(P p) { }
        void run() { struct L { int a; }; k<L><<<1, 1>>>(L{1}); }
        """,
        "g++",  # a function with a local type in its signature must be defined in its unit
    ),
    "an argument of a lambda's type": (
        """
        template <typename F> __global__ void k(float* x, F f) { x[0] = f(x[0]); }
        void run(float* x) {
          auto f = [](float v) { return v * 2; };
          k<decltype(f)><<<1, 1>>>(x, f);
        }
        """,
        "g++",
    ),
    "an argument of a type in an unnamed namespace": (
        """
        namespace { struct P { int a; }; }
        __global__ void k(P p) { }
        void run() { k<<<1, 1>>>(P{1}); }
        """,
        "instantiations",  # a launch function instantiated for it would not link
    ),
    "a non-inline __host__ __device__ function": (
        """
        __host__ __device__ float sq(float v) { return v * v; }
        __global__ void k(float* x) { x[0] = sq(x[0]); }
        float run(float* x) { k<<<1, 1>>>(x); return sq(2.f); }
        """,
        "ld",  # defined in both units: ld -r refuses the duplicate
    ),
    "a mutable global of a pointer-to-const type": (
        """
        const float* last = nullptr;
        __global__ void k(float* x) { x[0] = 1; }
        void run(float* x) { last = x; k<<<1, 1>>>(x); }
        """,
        "ld",  # "const" but not a constant: defined in both units
    ),
    "torch used in device code": (
        """
        #include <torch/extension.h>
        __global__ void k(at::Half* x) { x[0] = 1; }
        void run(torch::Tensor t) { k<<<1, 1>>>(t.data_ptr<at::Half>()); }
        """,
        "nvcc",  # the device unit has no torch headers
    ),
}


@needs_nvcc
def test_rejected_by_a_tool(tmp_path: Path) -> None:
    def one(name: str) -> str:
        source, _ = REJECTED_BY_A_TOOL[name]
        folder = tmp_path / re.sub(r"\W+", "_", name)
        if "torch/" not in source:
            return compile_split(source, folder).failed
        # the host unit would read torch's headers (slow): its device unit alone shows it
        folder.mkdir()
        (folder / "device.cu").write_text(split(source).device)
        done = run([NVCC, "-arch=sm_80", "-c", "device.cu", "-o", "device.o"], folder)
        return "nvcc" if done.returncode else ""

    with ThreadPoolExecutor(2) as pool:
        failed = dict(zip(REJECTED_BY_A_TOOL, pool.map(one, REJECTED_BY_A_TOOL), strict=True))
    assert failed == {name: tool for name, (_, tool) in REJECTED_BY_A_TOOL.items()}


# ---- instantiations --------------------------------------------------------------------------


def test_instantiations_from_nm() -> None:
    lines = [
        "                 U kerneleval_launch_k<float*, int>(dim3, dim3, unsigned long, "
        "CUstream_st*, float*, int)",
        "                 w void kerneleval_launch_t<float, 4, Params>(dim3, dim3, unsigned long, "
        "CUstream_st*, Params)",
        "                 U cudaLaunchKernel",
        "                 U at::Tensor::data_ptr<float>() const",
    ]
    assert cuda_split.instantiations(lines) == (
        "template void kerneleval_launch_k<float*, int>(dim3, dim3, unsigned long, "
        "CUstream_st*, float*, int);\n"
        "template void kerneleval_launch_t<float, 4, Params>(dim3, dim3, unsigned long, "
        "CUstream_st*, Params);\n"
    )
    assert cuda_split.instantiations(["U cudaMalloc", ""]) == ""
    for unnamed in (
        "U void kerneleval_launch_k<(anonymous namespace)::P>(dim3, dim3, unsigned long, "
        "CUstream_st*, (anonymous namespace)::P)",
        "U void kerneleval_launch_k<run(float*)::{lambda(float)#1}>(dim3, dim3, unsigned long, "
        "CUstream_st*, run(float*)::{lambda(float)#1})",
    ):
        with pytest.raises(SplitError):
            cuda_split.instantiations([unnamed])
