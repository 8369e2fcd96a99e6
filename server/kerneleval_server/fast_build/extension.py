"""Builds a load_inline extension as torch would, in seconds instead of 45.

torch writes the files (main.cpp, cuda.cu) and build.ninja exactly as for the candidate's own
call (`build_load_inline` runs the real load_inline with its ninja step and its import swapped);
then `fast_build` compiles them:

    main.cpp   g++ with a precompiled torch/extension.h            } in parallel
    cuda.cu    split (cuda_split.py): host unit g++ with the PCH,  }
               then the device unit nvcc, torch's headers unread
    link       torch's own link line

Anything fast_build cannot do the same way raises FastBuildError and torch's ninja build runs
instead: its result (the library, or its error) is then the answer. The flags come from torch's
build.ninja, so they are the torch version's own.

Where the time went (2-core CPU machine, the KernelBench elementwise add, nvcc --time): cudafe++
23 s and cicc 25 s, both parsing torch's headers, g++ on the host side 16 s, main.cpp 18 s; the
kernels alone 0.4 s. A PCH takes main.cpp to 6.5 s: what remains is code the torch headers
themselves make (an empty file that includes them compiles to 2.4 MB)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import inspect
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import cuda_split, device_prelude

RECIPE_VERSION = "3"  # part of every cache key: bump when the build's output would differ

# load_inline's arguments that the builder honours; anything else makes the call run in the
# job process as before (they are rare: sycl, standalone executables).
CALL_ARGS = (
    "name",
    "cpp_sources",
    "cuda_sources",
    "functions",
    "extra_cflags",
    "extra_cuda_cflags",
    "extra_ldflags",
    "extra_include_paths",
    "with_cuda",
    "is_python_module",
    "with_pytorch_error_handling",
    "keep_intermediates",
    "use_pch",
    "no_implicit_headers",
    "verbose",
    "build_directory",
)
IGNORED_ARGS = {"verbose", "build_directory", "keep_intermediates"}
# precompiled headers kept, 0.4-0.8 GB each: four a flag set (main.cpp and the host unit, each
# against the smaller headers and all of torch/extension.h)
MAX_PCH = 8
_EXT_HEADER = "#include <torch/extension.h>\n"
_CU_HEADER = (
    "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
    "#include <torch/extension.h>\n"
)
# Most candidates' C++ needs only tensors, their factories, the CUDA runtime and (main.cpp)
# torch's pybind11 casters. A file that names nothing beyond them compiles first against
# these smaller headers (each a subset of the one above it, so what compiles here compiles
# there), with its own `#include <torch/extension.h>` lines blanked: GCC instantiates in every
# file the templates a precompiled header leaves pending, so fewer headers is less work (host
# unit of the KernelBench add: 5.7 s of CPU against 1.6 s). A file that fails is compiled again
# as torch would, against all of torch/extension.h: its errors are torch's own.
_EXT_NARROW = "#include <torch/types.h>\n#include <torch/python.h>\n"
_CU_NARROW = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
_EXT_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<torch/extension\.h>[^\n]*", re.M)
# names that torch/extension.h declares and the smaller headers do not: straight to the full
_BEYOND_TYPES = (
    r"\btorch::(?:nn|optim|jit|autograd|data|serialize|cuda|fft|linalg|special|nested|sparse|"
    r"mps|xpu|python)\b"
)
_BEYOND_EXT_NARROW = re.compile(_BEYOND_TYPES)
_BEYOND_CU_NARROW = re.compile(_BEYOND_TYPES + r"|\bpybind11\b|\bpy::|\bPYBIND11_")
# nvcc flags with no meaning for the host unit (device code generation)
_DEVICE_ONLY = re.compile(
    r"^(--expt-relaxed-constexpr|--expt-extended-lambda|--extended-lambda|-?-use_fast_math|"
    r"-lineinfo|--generate-line-info|-gencode=.*|-arch=.*|--gpu-architecture=.*|-code=.*|"
    r"-maxrregcount=.*|--maxrregcount=.*|-Xptxas=.*|--ptxas-options=.*|-ftz=.*|-prec-div=.*|"
    r"-prec-sqrt=.*|-fmad=.*|-Wno-deprecated-gpu-targets|--threads=.*|-t\d+|-w|-G)$"
)


FULL_PCH_MADE = "torch/extension.h precompiled"  # make_full_pchs's answer when it did


class FastBuildError(Exception):
    """fast_build cannot build this the way torch would; torch's build runs instead."""


class SourceError(Exception):
    """The compiler refused the candidate's own file, compiled as torch compiles it (main.cpp:
    torch's command with its headers precompiled): the build failed, as torch's would."""


@dataclasses.dataclass
class Built:
    library: bytes  # the extension (.so); empty when the build failed
    error: str  # torch's error (the compiler's output) when it failed
    log: str  # what ran, with times
    fast: bool  # fast_build made it (not torch's ninja)
    seconds: float
    main_object: bytes = b""  # main.o, when this build compiled it (for main_key's entry)

    def error_tail(self) -> str:
        return self.log.strip()[-2000:]


def call_key(call: dict[str, Any], target: str) -> str:
    """The content address of a load_inline call: its arguments (minus where it builds and how
    much it prints) and the target (toolchain, torch, architecture, this recipe)."""
    h = hashlib.sha256()
    for k in sorted(call):
        if k not in IGNORED_ARGS:
            h.update(f"{k}={call[k]!r}\n".encode())
    h.update(target.encode())
    h.update(RECIPE_VERSION.encode())
    return h.hexdigest()


# What main.cpp and its compile depend on: torch writes it from these (the CUDA sources and
# flags are cuda.cu's; ldflags the link's).
_MAIN_ARGS = frozenset(CALL_ARGS) - {"cuda_sources", "extra_cuda_cflags", "extra_ldflags"}


def main_key(call: dict[str, Any], target: str) -> str:
    """The content address of a call's main.o: in a search over one problem, candidates change
    their kernels and keep their declarations, so most builds need no main.cpp compile."""
    part = {k: v for k, v in call.items() if k in _MAIN_ARGS}
    part["with_cuda"] = (
        call.get("with_cuda")
        if call.get("with_cuda") is not None
        else bool(call.get("cuda_sources"))
    )
    return call_key(part, target + "\nmain.o")


def normalize_call(
    real: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """load_inline's arguments by name, as plain data; ValueError for what the builder does
    not take (the job process then calls load_inline itself)."""
    bound = inspect.signature(real).bind(*args, **kwargs)
    call: dict[str, Any] = {}
    for k, v in bound.arguments.items():
        if k not in CALL_ARGS:
            raise ValueError(f"load_inline argument {k} is built in the job")
        call[k] = _plain(v)
    return call


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    raise ValueError(f"a load_inline argument of type {type(v).__name__}")


# ---- what the service builds ----------------------------------------------------------------

# Flags a build process passes on. A compiler flag can run a program (gcc's -wrapper, -B,
# -fplugin, -specs) or read a file into its output; torch's fallback ninja build runs its
# commands through a shell. The service builds only calls whose flags are all plainly code
# generation; any other call builds in its own job process, as torch would.
_HOST_FLAG = re.compile(
    r"^(-O[0-3sgz]?|-Ofast|-g[0-3]?|-w|-pthread|-fopenmp|-DNDEBUG|-D[A-Za-z_]\w*(=[\w.+-]*)?|"
    r"-U[A-Za-z_]\w*|-std=[\w+]+|-W(?![lap],)[\w=+-]+|-f(?!plugin)(no-)?[a-z0-9-]+(=[\w.-]+)?|"
    r"-m[a-z0-9-]+(=[\w.-]+)?)$"
)
_NVCC_FLAG = re.compile(
    r"^(-?-use_fast_math|--expt-relaxed-constexpr|--expt-extended-lambda|--extended-lambda|"
    r"-lineinfo|--generate-line-info|-res-usage|--resource-usage|-G|-restrict|--restrict|"
    r"-Wno-deprecated-gpu-targets|-t\d+|--threads=\d+|-maxrregcount=\d+|--maxrregcount=\d+|"
    r"-(Xptxas|-ptxas-options)=[\w,=.-]+|-(ftz|prec-div|prec-sqrt|fmad)=(true|false)|"
    r"-arch=(sm|compute)_\d+a?|--gpu-architecture=(sm|compute)_\d+a?|"
    r"-gencode=arch=compute_\d+a?,code=\[?(sm|compute)_\d+a?(,(sm|compute)_\d+a?)*\]?)$"
)
_NVCC_PAIRED = {"-Xptxas": r"^[\w,=.-]+$", "--ptxas-options": r"^[\w,=.-]+$",
                "-maxrregcount": r"^\d+$"}  # fmt: skip
_LD_FLAG = re.compile(r"^(-l[\w.+-]+|-L/[\w/.+-]+)$")
_PATH = re.compile(r"^/[\w/.+-]*$")


def refusal(call: dict[str, Any]) -> str:
    """Why the service does not build this call ("" when it does): a flag it does not pass
    on, or an argument it does not take. The job process then builds it itself."""
    if not isinstance(call.get("name"), str) or not re.fullmatch(
        r"[A-Za-z_]\w{0,99}", call["name"]
    ):
        return "the extension's name is not an identifier"
    if call.get("is_python_module") is False:
        return "is_python_module=False"

    def flags(key: str) -> list[str]:
        v = call.get(key) or []
        return [v] if isinstance(v, str) else [str(f) for f in v]

    for f in (x for x in flags("extra_cflags") if x):
        if not _HOST_FLAG.match(f):
            return f"extra_cflags {f!r}"
    it = iter(x for x in flags("extra_cuda_cflags") if x)
    for f in it:
        if f in ("-Xcompiler", "--compiler-options"):
            parts = next(it, "").split(",")
            if not all(_HOST_FLAG.match(p) for p in parts if p):
                return f"extra_cuda_cflags {f} {','.join(parts)!r}"
        elif f in _NVCC_PAIRED:
            if not re.match(_NVCC_PAIRED[f], next(it, "")):
                return f"extra_cuda_cflags {f} with an unusual value"
        elif not (_NVCC_FLAG.match(f) or _HOST_FLAG.match(f)):
            return f"extra_cuda_cflags {f!r}"
    for f in (x for x in flags("extra_ldflags") if x):
        if not _LD_FLAG.match(f):
            return f"extra_ldflags {f!r}"
    for f in (x for x in flags("extra_include_paths") if x):
        if not _PATH.match(f):
            return f"extra_include_paths {f!r}"
    return ""


_ERROR_LINE = re.compile(r"(\berror\b|fatal error|undefined reference|ld returned)", re.I)


def clear_errors(text: str, limit: int = 12) -> str:
    """The compiler's errors out of torch's build output (pages of ninja commands and torch's
    headers): each error line with the source line and caret after it, at most `limit`."""
    lines = text.splitlines()
    out: list[str] = []
    count = 0
    i = 0
    while i < len(lines) and count < limit:
        line = lines[i]
        if _ERROR_LINE.search(line) and not line.lstrip().startswith(("[", "FAILED:", "ninja:")):
            if not re.search(r"\b(c\+\+|g\+\+|nvcc|cc1plus)\b.* -c ", line):  # a command line
                out.append(line.strip())
                count += 1
                for follow in lines[i + 1 : i + 3]:  # the source line and the caret, if there
                    if follow.startswith(" ") and not _ERROR_LINE.search(follow):
                        out.append(follow.rstrip())
                        i += 1
                    else:
                        break
        i += 1
    return "\n".join(out)


def build_answer(
    arguments_json: str,
    arch: str,
    work_dir: Path,
    pch_dir: Path | None,
    progress: Callable[[str], None],
    main_object: bytes = b"",
) -> Built:
    """A build process's build of a call sent by the service (ExtensionCall): checked again
    here (refusal), for `arch` ("sm_90"; "" builds for what torch finds)."""
    import json

    try:
        call = json.loads(arguments_json)
    except ValueError as e:
        return Built(b"", f"the call is not JSON: {e}", "", False, 0.0)
    if not isinstance(call, dict) or (why := refusal(call)):
        return Built(b"", f"not built by the service: {why or 'not a call'}", "", False, 0.0)
    m = re.fullmatch(r"sm_(\d+)(\d)(a?)", arch)
    if m:  # torch's spelling of the architecture: "9.0" (with "a" kept)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{m.group(1)}.{m.group(2)}{m.group(3)}"
    built = build_load_inline(call, work_dir / "build", pch_dir, progress, main_object)
    if built.error:
        found = clear_errors(built.error)
        name = call["name"]
        built.log = f"{built.log}\n{built.error}".strip()
        built.error = f"Error building extension '{name}'" + (f":\n{found}" if found else "")
        if not found:
            built.error += f": {built.error_tail()}"
    return built


# ---- the build ------------------------------------------------------------------------------


def build_load_inline(
    call: dict[str, Any],
    work_dir: Path,
    pch_dir: Path | None,
    progress: Callable[[str], None],
    main_object: bytes = b"",
) -> Built:
    """Runs load_inline(**call) with its build in work_dir: fast_build first, torch's ninja if
    that cannot. Never imports the result (a build process has no GPU). `main_object`: main.o
    as an earlier build of the same main.cpp made it (main_key), not compiled again."""
    import torch.utils.cpp_extension as cpp_ext

    started = time.monotonic()
    log: list[str] = []
    state = {"fast": False}
    real_ninja = cpp_ext._run_ninja_build

    def ninja(build_directory: str, verbose: bool, error_prefix: str) -> None:
        try:
            fast_build(Path(build_directory), pch_dir, log, progress, main_object)
            state["fast"] = True
        except SourceError as e:  # torch's own words for a failed build
            raise RuntimeError(f"{error_prefix}: {e}") from None
        except FastBuildError as e:
            log.append(f"fast build not used: {e}")
            progress("compiling with torch's build (ninja)")
            real_ninja(build_directory, verbose, error_prefix)

    kwargs = {k: v for k, v in call.items() if k not in IGNORED_ARGS}
    kwargs["build_directory"] = str(work_dir)
    kwargs["verbose"] = False
    work_dir.mkdir(parents=True, exist_ok=True)
    # torch numbers a name's builds within a process (name_v1.so for a second one): each build
    # here is the name's first, as in the job that asked for it
    cpp_ext.JIT_EXTENSION_VERSIONER.entries.pop(call["name"], None)
    with (
        _patched(cpp_ext, "_run_ninja_build", ninja),
        _patched(cpp_ext, "_import_module_from_library", lambda *a, **k: None),
    ):
        try:
            cpp_ext.load_inline(**kwargs)
        except Exception as e:  # the candidate's compile error, as torch words it
            return Built(b"", str(e), "\n".join(log), False, time.monotonic() - started)
    so = work_dir / f"{call['name']}.so"
    if not so.is_file():
        error = f"load_inline built no {so.name}"
        return Built(b"", error, "\n".join(log), False, time.monotonic() - started)
    built = Built(so.read_bytes(), "", "\n".join(log), state["fast"], time.monotonic() - started)
    main_o = work_dir / "main.o"
    if state["fast"] and not main_object and main_o.is_file():
        built.main_object = main_o.read_bytes()
    return built


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@dataclasses.dataclass
class _Ninja:
    cxx: str
    nvcc: str
    flags: dict[str, list[str]]
    objects: dict[str, tuple[str, str]]  # object -> (rule, source)
    target: str
    link_inputs: list[str]


def _read_ninja(path: Path) -> _Ninja:
    text = path.read_text()
    var = dict(re.findall(r"^(\w+) = ?(.*)$", text, re.M))
    flags = {k: shlex.split(v) for k, v in var.items() if k.endswith("flags")}
    objects: dict[str, tuple[str, str]] = {}
    target, inputs = "", []
    for out, rule, ins in re.findall(r"^build (\S+): (\w+) (.*)$", text, re.M):
        if rule == "link":
            target, inputs = out, ins.split()
        else:
            objects[out] = (rule, ins.strip())
    return _Ninja(var.get("cxx", "c++"), var.get("nvcc", "nvcc"), flags, objects, target, inputs)


def fast_build(
    build_dir: Path,
    pch_dir: Path | None,
    log: list[str],
    progress: Callable[[str], None] = lambda _: None,
    main_object: bytes = b"",
) -> None:
    n = _read_ninja(build_dir / "build.ninja")
    if n.flags.get("cuda_dlink_post_cflags") or n.flags.get("sycl_cflags"):
        raise FastBuildError("device linking or SYCL")
    rules = sorted(rule for rule, _ in n.objects.values())
    if rules not in (["compile"], ["compile", "cuda_compile"]) or not n.target:
        raise FastBuildError(f"an unusual build: {rules}")
    cflags = n.flags.get("cflags", []) + n.flags.get("post_cflags", [])
    jobs: list[Callable[[], None]] = []
    for obj, (rule, src) in n.objects.items():
        out = build_dir / obj
        if rule == "compile" and main_object:
            out.write_bytes(main_object)
            log.append(f"{obj}: from the build cache (the same main.cpp and flags)")
        elif rule == "compile":
            jobs.append(_main_job(n.cxx, cflags, Path(src), out, pch_dir, log))
        else:
            jobs.append(_cuda_job(n, Path(src), out, pch_dir, log, progress))
    progress("compiling (fast build)")
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()
    progress("linking")
    _run([n.cxx, *n.link_inputs, *n.flags.get("ldflags", []), "-o", n.target], build_dir, log)
    undefined = _run(["nm", "-C", "-u", n.target], build_dir, log, quiet=True)
    if cuda_split.LAUNCH_PREFIX in undefined:
        raise FastBuildError("a kernel launch was left uninstantiated")


def _main_job(
    cxx: str, cflags: list[str], src: Path, out: Path, pch_dir: Path | None, log: list[str]
) -> Callable[[], None]:
    def job() -> None:
        # torch's main.cpp starts with torch/extension.h, unless no_implicit_headers
        if not src.read_text().lstrip().startswith(_EXT_HEADER.strip()):
            compile_ = [cxx, *cflags, "-c", str(src), "-o", str(out)]
        elif not _compiled_narrow(cxx, cflags, src, out, pch_dir, log, _EXT_NARROW):
            pch = _pch(cxx, cflags, _EXT_HEADER, pch_dir, log)
            compile_ = [cxx, *pch, *cflags, "-c", str(src), "-o", str(out)]
        else:
            return
        try:
            _run(compile_, out.parent, log)
        except FastBuildError as e:
            raise SourceError(str(e).split(": ", 1)[-1]) from None

    return job


def _cuda_job(
    n: _Ninja,
    src: Path,
    out: Path,
    pch_dir: Path | None,
    log: list[str],
    progress: Callable[[str], None],
) -> Callable[[], None]:
    cuda_flags = n.flags.get("cuda_cflags", []) + n.flags.get("cuda_post_cflags", [])
    host_flags = _host_flags(cuda_flags)
    source = src.read_text()
    try:
        parts = cuda_split.split(source, str(src))
    except cuda_split.SplitError as e:
        raise FastBuildError(f"cuda.cu cannot be split: {e}") from None
    host_src, dev_src = out.with_suffix(".host.cpp"), out.with_suffix(".device.cu")
    host_obj, dev_obj = out.with_suffix(".host.o"), out.with_suffix(".device.o")
    host_src.write_text(parts.host)

    def device(inst: str) -> None:
        # errors in the instantiations are the split's (they name no line of the candidate's)
        dev_src.write_text(f'{parts.device}\n#line 1 "{_INSTANTIATIONS}"\n{inst}')
        nvcc = [n.nvcc, *cuda_flags, "-c", str(dev_src), "-o", str(dev_obj)]
        try:
            _run(nvcc, out.parent, log)
        except FastBuildError as e:
            _kernels_again(nvcc, src, e, pch_dir, out.parent, log, progress)

    def compile_host() -> None:
        # the PCH holds torch/extension.h: used only where the source includes it itself
        if not re.search(r"#\s*include\s*<torch/extension\.h>", source):
            pch = []
        elif _compiled_narrow(n.cxx, host_flags, host_src, host_obj, pch_dir, log, _CU_NARROW):
            return
        else:
            pch = _pch(n.cxx, host_flags, _CU_HEADER, pch_dir, log)
        _run([n.cxx, *pch, *host_flags, "-c", str(host_src), "-o", str(host_obj)], out.parent, log)

    def job() -> None:
        if parts.typed:  # the launches' types are the kernels' own: nvcc beside g++
            progress("compiling the kernels (nvcc) and the host code (g++)")
            with ThreadPoolExecutor(1) as pool:
                kernels = pool.submit(device, parts.typed_instantiations)
                compile_host()
                kernels.result()
        else:  # the launches' types come from the host object
            compile_host()
            undefined = _run(["nm", "-C", "-u", str(host_obj)], out.parent, log, quiet=True)
            try:
                inst = cuda_split.instantiations(undefined.splitlines())
            except cuda_split.SplitError as e:
                raise FastBuildError(str(e)) from None
            progress("compiling the kernels (nvcc)")
            device(inst)
        _run(["ld", "-r", str(host_obj), str(dev_obj), "-o", str(out)], out.parent, log)

    return job


_INSTANTIATIONS = "kerneleval-launch-instantiations"
# nvcc's summary line names the unit it compiled, not the candidate's file
_ERROR_COUNT = re.compile(r"^\d+ errors? detected in the compilation of ")
_UNDEFINED = re.compile(r'identifier "(\w+)" is undefined')


def make_full_pchs(build_dir: Path, pch_dir: Path) -> str:
    """The precompiled torch/extension.h of main.cpp and of the host unit, with the flags of a
    build torch set up in build_dir, for the files the smaller headers cannot compile (a
    build of such a file in a build process finds them ready: it cannot make them)."""
    n = _read_ninja(build_dir / "build.ninja")
    log: list[str] = []
    wanted = [(n.flags.get("cflags", []) + n.flags.get("post_cflags", []), _EXT_HEADER)]
    if "cuda_cflags" in n.flags:
        cuda_flags = n.flags.get("cuda_cflags", []) + n.flags.get("cuda_post_cflags", [])
        wanted.append((_host_flags(cuda_flags), _CU_HEADER))
    started = time.monotonic()
    with ThreadPoolExecutor(len(wanted)) as pool:
        made = list(pool.map(lambda w: _pch(n.cxx, w[0], w[1], pch_dir, log), wanted))
    if not all(made):
        return f"torch/extension.h not precompiled: {' '.join(log)[-300:]}"
    return f"{FULL_PCH_MADE} in {time.monotonic() - started:.1f} s"


def make_device_prelude(build_dir: Path, pch_dir: Path) -> str:
    """The device prelude into pch_dir, with the nvcc, host compiler and flags of a build
    torch set up in build_dir."""
    n = _read_ninja(build_dir / "build.ninja")
    cuda_flags = n.flags.get("cuda_cflags", []) + n.flags.get("cuda_post_cflags", [])
    return device_prelude.make(pch_dir, n.nvcc, n.cxx, cuda_flags)


def _kernels_again(
    nvcc: list[str],
    src: Path,
    failed: FastBuildError,
    pch_dir: Path | None,
    cwd: Path,
    log: list[str],
    progress: Callable[[str], None],
) -> None:
    """The kernels failed to compile without torch's headers: again with the headers torch's
    build would have included (device_prelude.py). Built: they leaned on those. Failed on the
    candidate's own lines only, naming no macro of torch's: the candidate's error, as torch's
    build would have said it (SourceError). Anything else: torch's build (FastBuildError)."""
    if pch_dir is None or not (pch_dir / device_prelude.PRELUDE).is_file():
        raise failed
    prelude = pch_dir / device_prelude.PRELUDE
    progress("compiling the kernels again, with the headers torch's build includes")
    try:
        _run([nvcc[0], "-include", str(prelude), *nvcc[1:]], cwd, log)
        log.append("the kernels needed headers that torch's build includes (device prelude)")
        return
    except FastBuildError as again:
        text = str(again).split(": ", 1)[-1]
        if _candidates_own(text, src, device_prelude.torch_macros(pch_dir)):
            raise SourceError(text) from None
        raise FastBuildError(f"the kernels, with the device prelude: {text}") from None


def _candidates_own(text: str, src: Path, torch_macros: set[str]) -> bool:
    """Every error nvcc printed is on a line of the candidate's file (the split's #line
    directives), none in a launch function or instantiation, none about a name torch's
    headers define as a macro."""
    errors = [ln for ln in text.splitlines() if "error" in ln and not _ERROR_COUNT.match(ln)]
    return (
        bool(errors)
        and cuda_split.LAUNCH_PREFIX not in text
        and _INSTANTIATIONS not in text
        and all(ln.startswith(f"{src}(") for ln in errors)
        and not any(name in torch_macros for name in _UNDEFINED.findall(text))
    )


def _host_flags(cuda_flags: list[str]) -> list[str]:
    """nvcc's flags as its host pass (g++) sees them."""
    out: list[str] = []
    it = iter(cuda_flags)
    for f in it:
        if f in ("--compiler-options", "-Xcompiler"):
            out += [x for x in next(it, "").split(",") if x]
        elif f.startswith(("-Xcompiler=", "--compiler-options=")):
            out += [x for x in f.split("=", 1)[1].split(",") if x]
        elif f in ("-isystem", "-I", "-D", "-include"):
            out += [f, next(it, "")]
        elif re.match(r"^(-D|-I|-isystem|-std=|-O\d?$|-g$|-U)", f):
            out.append(f)
        elif f in ("-Xptxas", "-maxrregcount", "--ptxas-options", "-arch", "-code", "-t"):
            next(it, None)
        elif f in ("-ccbin", "--compiler-bindir"):  # nvcc's host compiler: the host pass is g++
            next(it, None)
        elif f.startswith(("-ccbin=", "--compiler-bindir=")):
            pass
        elif not _DEVICE_ONLY.match(f):
            raise FastBuildError(f"nvcc flag {f} has no known host meaning")
    return out


def _compiled_narrow(
    cxx: str,
    flags: list[str],
    src: Path,
    out: Path,
    pch_dir: Path | None,
    log: list[str],
    narrow: str,
) -> bool:
    """Compiles src into out against the smaller header `narrow` (precompiled), its own
    torch/extension.h includes blanked (lines kept: the line numbers stay); False when it names
    what only the full header declares, when no precompiled `narrow` can be had, or when that
    compile fails (the caller then compiles src as torch would)."""
    source = src.read_text()
    beyond = _BEYOND_EXT_NARROW if narrow == _EXT_NARROW else _BEYOND_CU_NARROW
    if pch_dir is None or beyond.search(source):
        return False
    pch = _pch(cxx, flags, narrow, pch_dir, log)
    if not pch:
        return False
    narrow_src = src.with_name(f"{src.stem}.narrow{src.suffix}")
    narrow_src.write_text(_EXT_INCLUDE.sub("", source))
    try:
        _run([cxx, *pch, *flags, "-c", str(narrow_src), "-o", str(out)], out.parent, log)
    except FastBuildError:
        log.append(f"{src.name}: needs more than {narrow.strip()!r}: compiled with all of torch")
        out.unlink(missing_ok=True)
        return False
    log.append(f"{src.name}: compiled against {narrow.strip()!r} (precompiled)")
    return True


def _pch(
    cxx: str, flags: list[str], header: str, pch_dir: Path | None, log: list[str]
) -> list[str]:
    """`-include <header>` with its precompiled form next to it, built once per flag set
    (the extension's own name left out: torch's headers never read it). [] without a dir."""
    if pch_dir is None:
        return []
    stable = [f for f in flags if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    # torch's version too: one installed over another keeps its include paths (the flags),
    # and GCC does not check that a precompiled header's headers are still the same.
    what = f"{cxx}\n{_compiler_id(cxx)}\n{_torch_id()}\n{stable}\n{header}"
    key = hashlib.sha256(what.encode()).hexdigest()
    folder = pch_dir / key[:24]
    h = folder / "pch.h"
    gch = folder / "pch.h.gch"
    if not pch_dir.exists():
        with contextlib.suppress(OSError):  # a new folder of ours (the service's is made)
            pch_dir.mkdir(parents=True)
    if not os.access(pch_dir, os.W_OK):  # a build process: the service's PCHs, read-only
        if gch.is_file():
            return ["-Winvalid-pch", "-include", str(h)]
        log.append(f"no precompiled header for these flags: {shlex.join(stable)[-300:]}")
        return []
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds it, the others wait for it
        if not gch.is_file():
            h.write_text(header)
            tmp = folder / f"pch.h.gch.{os.getpid()}"
            _run([cxx, "-x", "c++-header", *stable, str(h), "-o", str(tmp)], folder, log)
            tmp.rename(gch)
            _evict_pch(pch_dir)
    os.utime(folder)
    return ["-Winvalid-pch", "-include", str(h)]


def _evict_pch(pch_dir: Path) -> None:
    folders = sorted(
        (p for p in pch_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in folders[MAX_PCH:]:
        for f in old.iterdir():
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            old.rmdir()


_COMPILER_IDS: dict[str, str] = {}


def _torch_id() -> str:
    import torch  # loaded already where headers are built or used (a build of torch's)

    return f"{torch.__version__}|{torch.version.cuda}|{os.path.dirname(torch.__file__)}"


def _compiler_id(cxx: str) -> str:
    if cxx not in _COMPILER_IDS:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
        _COMPILER_IDS[cxx] = done.stdout.splitlines()[0] if done.stdout else cxx
    return _COMPILER_IDS[cxx]


def _run(cmd: list[str], cwd: Path, log: list[str], quiet: bool = False) -> str:
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    took = time.monotonic() - started
    if not quiet:
        log.append(f"[{took:.2f}s] {shlex.join(cmd)[:300]}")
    if "not used because" in done.stderr:  # -Winvalid-pch: correct, only slow
        log.append(done.stderr.strip()[:300])
    if done.returncode != 0:
        raise FastBuildError(f"{Path(cmd[0]).name} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def toolchain_id() -> str:
    """The compilers a build uses (g++ and nvcc, by their versions): with torch, CUDA and the
    architecture, what besides a call's arguments decides what it builds to."""
    return f"{_compiler_id(os.environ.get('CXX', 'c++'))}|{_tool_version('nvcc')}"


def _tool_version(tool: str) -> str:
    try:
        done = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return f"{tool} missing"
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else tool
