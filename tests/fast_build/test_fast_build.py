"""extension.py: a load_inline call built fast on the CPU, from the files and build.ninja that
torch's own load_inline writes.

A CPU torch has no libc10_cuda/libtorch_cuda, so a CUDA extension cannot link here as it is:
the CUDA builds link against empty stand-ins for those two libraries (a shared library may
leave symbols undefined), which is enough to check that fast_build compiles, instantiates and
links everything it should. Tests marked slow read torch's headers (a precompiled header of
torch/extension.h, or the KernelBench add example's host unit): a minute or more each on two
cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.cpp_extension as cpp_ext
from kerneleval_server.fast_build import extension
from kerneleval_server.fast_build.cuda_split import LAUNCH_PREFIX
from kerneleval_server.fast_build.extension import FastBuildError, _host_flags

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO.parent / "shared" / "kernelbench" / "examples"
if not EXAMPLES.exists():
    EXAMPLES = Path("/work/shared/kernelbench/examples")
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
needs_examples = pytest.mark.skipif(not EXAMPLES.exists(), reason="no KernelBench examples")


# ---- nvcc's flags as the host pass sees them -------------------------------------------------


def test_host_flags_keep_what_the_host_compiler_reads() -> None:
    flags = [
        "-DTORCH_EXTENSION_NAME=ext",
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D",
        "FOO=1",
        "-UBAR",
        "-isystem",
        "/torch/include",
        "-I/a",
        "-I",
        "/b",
        "-include",
        "pre.h",
        "-std=c++20",
        "-O3",
        "-g",
        "-Xcompiler",
        "-fPIC,-O3",
        "--compiler-options",
        "-fopenmp",
        "-Xcompiler=-march=native,-Wall",
        "--compiler-options=-fno-strict-aliasing",
    ]
    assert _host_flags(flags) == [
        "-DTORCH_EXTENSION_NAME=ext",
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D",
        "FOO=1",
        "-UBAR",
        "-isystem",
        "/torch/include",
        "-I/a",
        "-I",
        "/b",
        "-include",
        "pre.h",
        "-std=c++20",
        "-O3",
        "-g",
        "-fPIC",
        "-O3",
        "-fopenmp",
        "-march=native",
        "-Wall",
        "-fno-strict-aliasing",
    ]


def test_host_flags_drop_nvcc_and_device_flags_with_their_arguments() -> None:
    device_only = [
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "--extended-lambda",
        "--use_fast_math",
        "-use_fast_math",
        "-lineinfo",
        "--generate-line-info",
        "-gencode=arch=compute_90,code=sm_90",
        "-arch=sm_80",
        "--gpu-architecture=sm_90a",
        "-code=sm_80",
        "-maxrregcount=64",
        "--maxrregcount=64",
        "-Xptxas=-v",
        "--ptxas-options=-v",
        "-ftz=true",
        "-prec-div=false",
        "-prec-sqrt=false",
        "-fmad=true",
        "-Wno-deprecated-gpu-targets",
        "--threads=4",
        "-t4",
        "-w",
        "-G",
        "-ccbin=/usr/bin/gcc-12",
        "--compiler-bindir=/usr/bin",
    ]
    assert _host_flags(device_only) == []
    # flags whose value is the next argument: both go (torch 2.11 passes -ccbin CC)
    paired = [
        ("-ccbin", "/x/gcc"),
        ("--compiler-bindir", "/opt/gcc/bin"),
        ("-Xptxas", "-v"),
        ("--ptxas-options", "-O2"),
        ("-maxrregcount", "32"),
        ("-arch", "sm_80"),
        ("-code", "sm_80"),
        ("-t", "4"),
    ]
    for flag, value in paired:
        assert _host_flags(["-O3", flag, value, "-DX"]) == ["-O3", "-DX"], flag
    assert _host_flags(["-Xcompiler"]) == []  # nothing after it: nothing to pass


@pytest.mark.parametrize(
    "flags",
    [
        ["--default-stream", "per-thread"],  # defines a macro for host code too
        ["-rdc=true"],  # device linking
        ["-dc"],
        ["-gencode", "arch=compute_80,code=sm_80"],  # the two-argument spelling
        ["--gpu-architecture", "sm_80"],
        ["--std=c++17"],
        ["-x", "cu"],
        ["-lcublas"],
        ["-Ofast"],
        ["-Xlinker", "-rpath"],
        ["--keep"],
    ],
    ids=lambda f: " ".join(f),
)
def test_host_flags_refuse_unknown_flags(flags: list[str]) -> None:
    with pytest.raises(FastBuildError, match=re.escape(flags[0])):
        _host_flags(["-O3", *flags])


# ---- torch's files ---------------------------------------------------------------------------


def cuda_home() -> str:
    """The CUDA install nvcc belongs to (/usr/local/bin/nvcc may be a wrapper script)."""
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True)
    top = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    return str(Path(top.group(1)).resolve()) if top else str(Path(nvcc).resolve().parents[1])


@pytest.fixture
def cuda_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_inline takes CUDA sources on a CPU torch (it needs CUDA_HOME) and builds for sm_80
    (it would ask the GPU)."""
    if cpp_ext.CUDA_HOME is None:
        monkeypatch.setattr(cpp_ext, "CUDA_HOME", cuda_home())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")


@pytest.fixture(scope="session")
def stub_libs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Empty libc10_cuda.so and libtorch_cuda.so, for `-L` (a CPU torch has neither)."""
    folder = tmp_path_factory.mktemp("stub_libs")
    (folder / "empty.c").write_text("")
    for lib in ("libc10_cuda.so", "libtorch_cuda.so"):
        cmd = ["cc", "-shared", "-fPIC", "empty.c", "-o", lib]
        subprocess.run(cmd, cwd=folder, check=True, capture_output=True)
    return folder


@pytest.fixture(scope="session")
def pch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The precompiled headers of this session (each made once, by the first build that
    needs it)."""
    return tmp_path_factory.mktemp("pch")


def write_torch_files(call: dict[str, Any], build_dir: Path) -> None:
    """What load_inline writes before it builds: the sources and build.ninja."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_ext, "_run_ninja_build", lambda *a, **k: None)
        mp.setattr(cpp_ext, "_import_module_from_library", lambda *a, **k: None)
        cpp_ext.load_inline(**call, build_directory=str(build_dir))
    assert (build_dir / "build.ninja").is_file()


def nm(path: Path, *flags: str) -> list[str]:
    done = subprocess.run(["nm", "-C", *flags, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def launch_symbols(path: Path, *flags: str) -> list[str]:
    return [ln for ln in nm(path, *flags) if LAUNCH_PREFIX in ln]


def has_device_code(path: Path) -> bool:
    done = subprocess.run(["readelf", "-S", str(path)], capture_output=True, text=True)
    return ".nv_fatbin" in done.stdout


@contextlib.contextmanager
def no_fallback() -> Iterator[None]:
    """torch's ninja build must not run: fast_build is under test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch's ninja build ran")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_ext, "_run_ninja_build", refuse)
        yield


@needs_nvcc
def test_host_flags_of_torchs_own_build(tmp_path: Path, cuda_torch: None) -> None:
    """The flags torch writes for a CUDA extension all map (a torch upgrade that adds one
    shows here first), and the host pass gets torch's includes and defines."""
    call = {
        "name": "kerneleval_test_flags",
        "cpp_sources": ["torch::Tensor f(torch::Tensor x);"],
        "cuda_sources": ["torch::Tensor f(torch::Tensor x) { return x; }"],
        "functions": ["f"],
        "extra_cuda_cflags": ["-O3", "--use_fast_math", "-Xptxas=-v", "-lineinfo"],
    }
    write_torch_files(call, tmp_path)
    n = extension._read_ninja(tmp_path / "build.ninja")
    assert sorted(rule for rule, _ in n.objects.values()) == ["compile", "cuda_compile"]
    cuda_flags = n.flags["cuda_cflags"] + n.flags.get("cuda_post_cflags", [])
    host = _host_flags(cuda_flags)
    assert "-fPIC" in host and "-O3" in host
    assert "-DTORCH_EXTENSION_NAME=kerneleval_test_flags" in host
    assert "-D__CUDA_NO_HALF_OPERATORS__" in host
    for path in cpp_ext.include_paths():
        assert path in host
    assert not any(f.startswith(("-gencode", "--use_fast", "-Xptxas", "--expt")) for f in host)
    # the host pass reads the same standard as main.cpp
    std = [f for f in n.flags["cflags"] if f.startswith("-std=")]
    assert std and std[-1] in host


# ---- builds ----------------------------------------------------------------------------------

# No torch header anywhere: compiles in seconds. no_implicit_headers keeps torch's includes
# out of cuda.cu; main.cpp is the declaration alone (no functions=: no binding).
CHEAP_CU = """#include <cuda_runtime.h>
#include <cstdint>
constexpr int kBlock = 256;
template <typename T, int N>
__global__ void fill(T* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = T(N);
}
__global__ void add_one(float* x, int64_t n) {
    int64_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
int probe_entry(float* x, int n, cudaStream_t s) {
    fill<float, 3><<<(n + kBlock - 1) / kBlock, kBlock>>>(x, n);
    add_one<<<(n + kBlock - 1) / kBlock, kBlock, 0, s>>>(x, n);
    return n;
}
"""


def cheap_call(name: str, stub_libs: Path, source: str = CHEAP_CU) -> dict[str, Any]:
    return {
        "name": name,
        "cpp_sources": ["struct CUstream_st;\nint probe_entry(float*, int, CUstream_st*);"],
        "cuda_sources": [source],
        "no_implicit_headers": True,
        "extra_cuda_cflags": ["-O3", "--use_fast_math"],
        "extra_ldflags": [f"-L{stub_libs}"],
    }


@needs_nvcc
def test_cuda_build_splits_compiles_and_links(
    tmp_path: Path, cuda_torch: None, stub_libs: Path
) -> None:
    steps: list[str] = []
    build = tmp_path / "build"
    with no_fallback():
        built = extension.build_load_inline(
            cheap_call("kerneleval_test_cheap", stub_libs), build, None, steps.append
        )
    assert built.error == "" and built.fast, built.log
    so = build / "kerneleval_test_cheap.so"
    assert built.library == so.read_bytes()
    assert steps[:1] == ["compiling (fast build)"] and "linking" in steps
    assert "compiling the kernels (nvcc)" in steps
    for obj in ("main.o", "cuda.cuda.host.o", "cuda.cuda.device.o", "cuda.cuda.o"):
        assert (build / obj).is_file(), obj
    assert has_device_code(build / "cuda.cuda.device.o") and has_device_code(so)
    assert not has_device_code(build / "cuda.cuda.host.o")
    # the host object calls the launch functions; the device object defines exactly those
    needed = {ln.split(" U ")[-1] for ln in launch_symbols(build / "cuda.cuda.host.o", "-u")}
    assert needed == {
        "void kerneleval_launch_fill<float, 3, float*, int>(dim3, dim3, unsigned long, "
        "CUstream_st*, float*, int)",
        # a non-template kernel: its own parameter types (int64_t), the int converted at the call
        "void kerneleval_launch_add_one<float*, long>(dim3, dim3, unsigned long, CUstream_st*, "
        "float*, long)",
    }
    defined = " ".join(launch_symbols(so, "--defined-only"))
    assert all(sym in defined for sym in needed)
    assert launch_symbols(so, "-u") == []
    assert "probe_entry(float*, int, CUstream_st*)" in " ".join(nm(so, "--defined-only"))
    # what ran (the log keeps each command's first 300 characters): g++ twice (main.cpp,
    # the host unit), nvcc once, ld -r, the link
    commands = [ln.split("] ", 1)[1] for ln in built.log.splitlines() if ln.startswith("[")]
    assert [Path(c.split()[0]).name for c in commands] == ["c++", "c++", "nvcc", "ld", "c++"] or [
        Path(c.split()[0]).name for c in commands
    ] == ["c++", "nvcc", "c++", "ld", "c++"], commands
    assert re.fullmatch(
        r"ld -r \S+/cuda\.cuda\.host\.o \S+/cuda\.cuda\.device\.o -o \S+", commands[3]
    )
    assert "fast build not used" not in built.log


@needs_nvcc
def test_cuda_build_without_the_stand_ins_fails_at_the_link_only(
    tmp_path: Path, cuda_torch: None
) -> None:
    """As on any CPU torch: every object is made, and the link names the missing library."""
    call = cheap_call("kerneleval_test_nolink", Path("/nonexistent"))
    write_torch_files(call, tmp_path)
    log: list[str] = []
    with pytest.raises(FastBuildError, match=r"c\+\+ failed: .*(c10_cuda|torch_cuda)"):
        extension.fast_build(tmp_path, None, log)
    for obj in ("main.o", "cuda.cuda.o"):
        assert (tmp_path / obj).is_file()
    assert launch_symbols(tmp_path / "cuda.cuda.o", "-u") == []
    assert len(launch_symbols(tmp_path / "cuda.cuda.o", "--defined-only")) == 2


@needs_nvcc
@pytest.mark.parametrize(
    ("line", "broken", "tool"),
    [
        (11, "    if (i < n) x[i] += undefined_in_kernel;", "nvcc"),
        (16, "    return n + undefined_on_host;", "c++"),
    ],
    ids=["kernel", "host code"],
)
def test_cuda_compile_error_names_the_candidates_line(
    tmp_path: Path, cuda_torch: None, stub_libs: Path, line: int, broken: str, tool: str
) -> None:
    """A compile error is torch's own (the fast build's failure falls back to ninja), and the
    fast build's log, through the split's #line directives, names the same line."""
    lines = CHEAP_CU.split("\n")
    lines[line - 1] = broken
    call = cheap_call(f"kerneleval_test_error_{tool[0]}", stub_libs, "\n".join(lines))
    built = extension.build_load_inline(call, tmp_path / "build", None, lambda _: None)
    assert built.library == b"" and not built.fast
    assert "undefined_" in built.error
    at_line = rf"cuda\.cu(\({line}\)|:{line}:)"
    assert re.search(at_line, built.error), built.error[-2000:]
    fast = re.search(r"fast build not used: (.*)", built.log, re.S)
    assert fast and fast.group(1).startswith(f"{tool} failed"), built.log[-2000:]
    assert re.search(at_line, fast.group(1)), fast.group(1)[-2000:]


@needs_nvcc
def test_cuda_build_reuses_an_earlier_main_object(
    tmp_path: Path, cuda_torch: None, stub_libs: Path
) -> None:
    """A candidate that changes only its kernels links the main.o of an earlier build."""
    first_call = cheap_call("kerneleval_test_reuse", stub_libs)
    second_call = {**first_call, "cuda_sources": [CHEAP_CU.replace("+= 1", "+= 2")]}
    assert extension.main_key(first_call, "t") == extension.main_key(second_call, "t")
    assert extension.call_key(first_call, "t") != extension.call_key(second_call, "t")
    with no_fallback():
        first = extension.build_load_inline(first_call, tmp_path / "a", None, lambda _: None)
    assert first.fast and first.main_object == (tmp_path / "a" / "main.o").read_bytes()
    # one process builds the same name once in the service (torch would call it _v1 here)
    cpp_ext.JIT_EXTENSION_VERSIONER.entries.pop("kerneleval_test_reuse", None)
    with no_fallback():
        second = extension.build_load_inline(
            second_call, tmp_path / "b", None, lambda _: None, first.main_object
        )
    assert second.fast and second.error == "", second.log
    assert second.main_object == b""  # not compiled: nothing new to keep
    assert "main.o: from the build cache" in second.log
    commands = [ln.split("] ", 1)[1] for ln in second.log.splitlines() if ln.startswith("[")]
    assert [Path(c.split()[0]).name for c in commands] == ["c++", "nvcc", "ld", "c++"]
    assert (tmp_path / "b" / "main.o").read_bytes() == first.main_object


@pytest.fixture(scope="session")
def prelude_dir(tmp_path_factory: pytest.TempPathFactory, stub_libs: Path) -> Path:
    """A folder with the device prelude, as the service makes it beside its precompiled
    headers (from torch's flags for a CUDA extension), and nothing else."""
    folder = tmp_path_factory.mktemp("prelude")
    build = tmp_path_factory.mktemp("prelude_build")
    with pytest.MonkeyPatch.context() as mp:
        if cpp_ext.CUDA_HOME is None:
            mp.setattr(cpp_ext, "CUDA_HOME", cuda_home())
        mp.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
        write_torch_files(cheap_call("kerneleval_test_prelude", stub_libs), build)
    said = extension.make_device_prelude(build, folder)
    assert re.fullmatch(r"device prelude: \d+ headers, \d+ macros", said), said
    return folder


BF16_CU = CHEAP_CU.replace(
    "if (i < n) x[i] += 1;", "if (i < n) x[i] = __bfloat162float(__float2bfloat16(x[i])) + 1;"
)


@needs_nvcc
def test_kernels_leaning_on_a_header_torch_includes_build_fast(
    tmp_path: Path, cuda_torch: None, stub_libs: Path, prelude_dir: Path
) -> None:
    """__nv_bfloat16 without cuda_bf16.h: torch's build compiles it (torch's headers include
    it), the kernels alone do not; with the device prelude they do, with no torch build."""
    prelude = (prelude_dir / "device_prelude.h").read_text()
    assert "#include <cuda_bf16.h>" in prelude and "#include <torch" not in prelude
    call = cheap_call("kerneleval_test_bf16", stub_libs, BF16_CU)
    steps: list[str] = []
    with no_fallback():
        built = extension.build_load_inline(call, tmp_path / "b", prelude_dir, steps.append)
    assert built.fast and built.error == "", built.log[-2000:]
    assert "compiling the kernels again, with the headers torch's build includes" in steps
    assert "device prelude" in built.log


@needs_nvcc
def test_a_kernel_error_that_stays_with_the_prelude_is_the_candidates_at_once(
    tmp_path: Path, cuda_torch: None, stub_libs: Path, prelude_dir: Path
) -> None:
    """No 45 s torch build for a candidate's own kernel error: it is the answer, in torch's
    words, naming the candidate's line."""
    source = CHEAP_CU.replace("if (i < n) x[i] += 1;", "if (i < n) x[i] += undefined_here;")
    call = cheap_call("kerneleval_test_own_error", stub_libs, source)
    with no_fallback():
        built = extension.build_load_inline(call, tmp_path / "b", prelude_dir, lambda _: None)
    assert built.library == b"" and not built.fast
    assert built.error.startswith("Error building extension 'kerneleval_test_own_error'")
    assert re.search(r'cuda\.cu\(11\): error: identifier "undefined_here"', built.error), (
        built.error
    )
    assert "fast build not used" not in built.log


@needs_nvcc
def test_a_kernel_error_naming_a_torch_macro_is_left_to_torchs_build(
    tmp_path: Path, cuda_torch: None, stub_libs: Path, prelude_dir: Path
) -> None:
    """CUDA_KERNEL_ASSERT is torch's (c10's) macro: the kernels alone cannot tell whether
    torch's build would compile them, so torch's build decides."""
    assert "CUDA_KERNEL_ASSERT" in (prelude_dir / "torch_macros.txt").read_text().split()
    source = CHEAP_CU.replace("if (i < n) x[i] += 1;", "CUDA_KERNEL_ASSERT(i >= 0);")
    ran: list[str] = []

    def ninja(build_directory: str, verbose: bool, error_prefix: str) -> None:
        ran.append(build_directory)
        raise RuntimeError(f"{error_prefix}: torch's build")

    call = cheap_call("kerneleval_test_torch_macro", stub_libs, source)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_ext, "_run_ninja_build", ninja)
        built = extension.build_load_inline(call, tmp_path / "b", prelude_dir, lambda _: None)
    assert ran and built.error.endswith("torch's build")
    assert "fast build not used: the kernels, with the device prelude" in built.log


def test_one_name_built_twice_in_one_process(tmp_path: Path) -> None:
    for i in range(2):
        call = {
            "name": "kerneleval_test_twice",
            "cpp_sources": [f"int value() {{ return {i}; }}"],
            "no_implicit_headers": True,
        }
        built = extension.build_load_inline(call, tmp_path / str(i), None, lambda _: None)
        assert built.error == "" and built.library, built.error


def test_cpp_compile_error_comes_back_as_the_error(tmp_path: Path) -> None:
    """main.cpp is compiled with torch's own command: its error is the answer, in torch's
    words, with no second build."""
    call = {
        "name": "kerneleval_test_cpp_error",
        "cpp_sources": ["int broken(int a) {\n  return a + ;\n}"],
        "no_implicit_headers": True,
    }
    built = extension.build_load_inline(call, tmp_path / "build", None, lambda _: None)
    assert built.library == b"" and not built.fast
    assert built.error.startswith("Error building extension 'kerneleval_test_cpp_error'")
    assert re.search(r"main\.cpp:2:\d+: error", built.error), built.error
    assert "fast build not used" not in built.log


@needs_nvcc
def test_fast_build_refuses_before_compiling(tmp_path: Path, cuda_torch: None) -> None:
    """What fast_build cannot build as torch would is refused before anything compiles."""
    cases = {
        "__CUDA_ARCH__": (
            {"cuda_sources": ["#ifdef __CUDA_ARCH__\n#endif\nint probe_entry() { return 0; }"]},
            "cuda.cu cannot be split: the source tests which compiler reads it",
        ),
        "per-thread stream": (
            {"extra_cuda_cflags": ["--default-stream", "per-thread"]},
            "nvcc flag --default-stream has no known host meaning",
        ),
        "rdc": ({"extra_cuda_cflags": ["-rdc=true"]}, "nvcc flag -rdc=true"),
    }
    for i, (overrides, message) in enumerate(cases.values()):
        call = {
            "name": f"kerneleval_test_refused_{i}",
            "cpp_sources": ["int probe_entry();"],
            "cuda_sources": ["int probe_entry() { return 0; }"],
            "no_implicit_headers": True,
            **overrides,
        }
        folder = tmp_path / str(i)
        write_torch_files(call, folder)
        with pytest.raises(FastBuildError, match=re.escape(message)):
            extension.fast_build(folder, None, [])
        assert list(folder.glob("*.o")) == []


@pytest.mark.slow
def test_cpp_build_with_a_precompiled_header_imports_and_computes(
    tmp_path: Path, pch_dir: Path
) -> None:
    """A C++-only call, the usual way (torch/extension.h, functions=): main.cpp compiles
    with the precompiled header, and the module imports and computes."""
    name = "kerneleval_test_cpp"
    call = {
        "name": name,
        "cpp_sources": [
            "torch::Tensor scaled_sum(torch::Tensor x, double k) { return (x * k).sum(); }"
        ],
        "functions": ["scaled_sum"],
    }
    build = tmp_path / "build"
    with no_fallback():
        built = extension.build_load_inline(call, build, pch_dir, lambda _: None)
    assert built.error == "" and built.fast, built.log
    assert built.library == (build / f"{name}.so").read_bytes()
    module = cpp_ext._import_module_from_library(name, str(build), True)
    assert module.scaled_sum(torch.arange(4.0), 2.5).item() == 15.0
    assert "-x c++-header" in built.log  # made the header
    assert re.search(r"\] c\+\+ -Winvalid-pch -include \S+/pch\.h ", built.log)
    assert "main.cpp: compiled against '#include <torch/types.h>" in built.log
    assert "not used because" not in built.log  # and used it
    assert "needs more than" not in built.log  # the smaller header was enough
    # another extension's flags (its name aside) find the same header, made already
    n = extension._read_ninja(build / "build.ninja")
    flags = [f.replace(name, "other_name") for f in n.flags["cflags"]]
    log: list[str] = []
    use = extension._pch(n.cxx, flags, extension._EXT_NARROW, pch_dir, log)
    assert use[:2] == ["-Winvalid-pch", "-include"] and Path(use[2] + ".gch").is_file()
    assert log == []


def _narrow(
    tmp_path: Path, body: str, narrow: str = "#include <vector>\n"
) -> tuple[bool, list[str]]:
    src, out = tmp_path / "unit.cpp", tmp_path / "unit.o"
    src.write_text(f"#include <torch/extension.h>\n{body}\n")
    out.write_bytes(b"stale")
    log: list[str] = []
    done = extension._compiled_narrow("c++", ["-O0"], src, out, tmp_path / "pch", log, narrow)
    return done, log


def test_a_file_compiles_against_the_smaller_header_with_its_extension_include_blanked(
    tmp_path: Path,
) -> None:
    """What the smaller (precompiled) header declares is enough: compiled from a copy whose
    torch/extension.h include is blanked, line numbers kept."""
    done, log = _narrow(tmp_path, "std::vector<int> v{1, 2};")
    assert done and log[-1] == "unit.cpp: compiled against '#include <vector>' (precompiled)"
    assert (tmp_path / "unit.narrow.cpp").read_text() == "\nstd::vector<int> v{1, 2};\n"
    assert "v" in " ".join(nm(tmp_path / "unit.o", "--defined-only"))
    assert "#include <torch/extension.h>" in (tmp_path / "unit.cpp").read_text()  # untouched


def test_a_file_that_needs_more_than_the_smaller_header_is_left_to_the_full_one(
    tmp_path: Path,
) -> None:
    """A compile error against the smaller header is no verdict: False, no object left, and
    the caller compiles the file as torch would (its errors are torch's own)."""
    done, log = _narrow(tmp_path, "std::map<int, int> m;")
    assert not done and not (tmp_path / "unit.o").exists()
    assert "unit.cpp: needs more than '#include <vector>'" in log[-1]


@pytest.mark.parametrize("name", ["torch::nn::Linear", "torch::autograd::Function", "py::object"])
def test_names_only_torch_extension_declares_go_straight_to_the_full_header(
    tmp_path: Path, name: str
) -> None:
    """Not even tried against the smaller header (a compile there would only fail); pybind11 is
    in main.cpp's smaller header, not in the host unit's."""
    done, log = _narrow(tmp_path, f"// uses {name}", extension._CU_NARROW)
    assert not done and log == [] and not (tmp_path / "unit.narrow.cpp").exists()
    if name == "py::object":
        assert not extension._BEYOND_EXT_NARROW.search(name)


def test_full_headers_are_precompiled_with_the_builds_own_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start (pch.py), after the probe built the smaller headers: all of torch/extension.h
    for main.cpp (torch's cflags) and for the host unit (nvcc's flags as g++ sees them)."""
    (tmp_path / "build.ninja").write_text(
        "cxx = c++\nnvcc = nvcc\n"
        "cflags = -DTORCH_EXTENSION_NAME=p -fPIC\npost_cflags = -std=c++17\n"
        "cuda_cflags = -DTORCH_EXTENSION_NAME=p -Xcompiler -fPIC\n"
        "cuda_post_cflags = -O3 -gencode=arch=compute_80,code=sm_80 -std=c++17\n"
        "build main.o: compile main.cpp\nbuild cuda.cuda.o: cuda_compile cuda.cu\n"
        "build p.so: link main.o cuda.cuda.o\n"
    )
    made: list[tuple[list[str], str]] = []
    monkeypatch.setattr(
        extension, "_pch", lambda cxx, flags, header, d, log: made.append((flags, header)) or ["x"]
    )
    said = extension.make_full_pchs(tmp_path, tmp_path / "pch")
    assert said.startswith("torch/extension.h precompiled in "), said
    assert sorted(made, key=lambda m: m[1]) == [
        (["-DTORCH_EXTENSION_NAME=p", "-fPIC", "-std=c++17"], extension._EXT_HEADER),
        (["-DTORCH_EXTENSION_NAME=p", "-fPIC", "-O3", "-std=c++17"], extension._CU_HEADER),
    ]


@pytest.mark.slow
def test_a_precompiled_header_folder_that_does_not_exist_yet_is_made(tmp_path: Path) -> None:
    """A caller's new folder is made and filled (a missing folder once read as a read-only
    one: every build of bench_builds ran without its precompiled header); a folder that
    exists read-only (a build process's view of the service's) is only read."""
    log: list[str] = []
    folder = tmp_path / "new" / "pch"
    use = extension._pch("c++", ["-O2"], "#include <vector>\n", folder, log)
    assert use[:2] == ["-Winvalid-pch", "-include"] and Path(use[2]).is_file(), log
    assert list(folder.glob("*/pch.h.gch")), log
    frozen = tmp_path / "frozen"
    frozen.mkdir(mode=0o555)
    if os.access(frozen, os.W_OK):  # root writes anywhere: nothing to check here
        return
    assert extension._pch("c++", ["-O2"], "#include <vector>\n", frozen, log) == []
    assert "no precompiled header for these flags" in log[-1]


def test_cpp_build_without_torch_headers_gets_none(tmp_path: Path, pch_dir: Path) -> None:
    """no_implicit_headers=True: main.cpp is the candidate's code alone, and torch builds it
    so; with torch's headers put in front, `int at` would clash with namespace at."""
    name = "kerneleval_test_no_torch"
    source = (
        "#include <pybind11/pybind11.h>\n"
        "int at = 41;\n"
        "int next_at() { return at + 1; }\n"
        f'PYBIND11_MODULE({name}, m) {{ m.def("next_at", &next_at); }}\n'
    )
    call = {"name": name, "cpp_sources": [source], "no_implicit_headers": True}
    build = tmp_path / "build"
    built = extension.build_load_inline(call, build, pch_dir, lambda _: None)
    assert built.error == "", built.error[-2000:]
    module = cpp_ext._import_module_from_library(name, str(build), True)
    assert module.next_at() == 42


@pytest.mark.slow
@needs_nvcc
@needs_examples
def test_kernelbench_add_host_unit_compiles_against_torch(
    tmp_path: Path, cuda_torch: None, stub_libs: Path, pch_dir: Path
) -> None:
    """The KernelBench add example as torch writes it: the host unit (torch/extension.h, the
    rewritten launch) with g++ and torch's flags, the kernel with nvcc, the link."""
    sys.path.insert(0, str(REPO / "bench"))
    from build_breakdown import capture_load_inline

    call = capture_load_inline(EXAMPLES / "model_new_ex_add.py")
    name = "kerneleval_test_ex_add"
    call = {k: v for k, v in call.items() if k not in ("verbose", "build_directory")}
    call.update(name=name, extra_ldflags=[f"-L{stub_libs}"])
    write_torch_files(call, tmp_path)
    log: list[str] = []
    extension.fast_build(tmp_path, pch_dir, log)
    # both g++ files against the smaller precompiled headers: all the example needs
    assert not [ln for ln in log if "needs more than" in ln or "not used because" in ln], log
    narrow = [ln for ln in log if ": compiled against '#include <torch/types.h>" in ln]
    assert sorted(ln.split(":")[0] for ln in narrow) == ["cuda.cuda.host.cpp", "main.cpp"], log
    so = tmp_path / f"{name}.so"
    assert so.is_file() and has_device_code(so)
    assert launch_symbols(so, "-u") == []
    # the launch function takes the kernel's own parameter types: size is a.numel()
    # (int64_t), converted to the kernel's int at the call, as a launch converts it; the
    # instantiation is known from the source, so nvcc ran beside g++
    assert [s.split(" ", 2)[-1] for s in launch_symbols(so, "--defined-only")] == [
        "void kerneleval_launch_elementwise_add_kernel<float const*, float const*, float*, "
        "int>(dim3, dim3, unsigned long, CUstream_st*, float const*, float const*, float*, int)"
    ]
    assert f"PyInit_{name}" in " ".join(nm(so, "-D", "--defined-only"))
    host = (tmp_path / "cuda.cuda.host.cpp").read_text()
    assert "#include <torch/extension.h>" in host and "__global__" not in host
    device = (tmp_path / "cuda.cuda.device.cu").read_text()
    assert "torch" not in device.replace(str(tmp_path), "")
