"""The service's precompiled torch headers, made once at start for the build processes.

    python -m kerneleval_server.fast_build.pch DIR

A precompiled header is only used by a compile with the same flags, so one is made per flag
set that candidates commonly use (VARIANTS: torch's defaults, and -O3), by building a probe
extension with each through the builder itself: the headers come out exactly as a candidate's
build asks for them (the smaller ones most files compile against, extension.py), then all of
torch/extension.h with the probe's flags, for the files that need more. Made by the front
end's own user from torch's headers and fixed flags, no candidate input; build processes see
DIR read-only (a candidate's build cannot change what the next one includes) and build
without a PCH when none matches their flags.

They are kept across restarts in the state folder: MADE_FOR records what they were made for
(torch, its CUDA, the compilers, Python, the architecture list, the flag sets and the recipe),
and a start that finds the same (`kept`) makes nothing; any difference clears the folder and
makes them again. The last line printed says which: "kerneleval pch: ready (kept ...)",
"kerneleval pch: ready (made ...)", or "kerneleval pch: failed ..." (exit code 1).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from . import extension

VARIANTS: tuple[list[str], ...] = ([], ["-O3"])
MADE_FOR = "made_for.json"
PCH_VERSION = "1"  # bump when what make() leaves in the folder changes

_CPP = "torch::Tensor probe(torch::Tensor x);"
_CU = """#include <torch/extension.h>
__global__ void probe_kernel(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] += 1; }
torch::Tensor probe(torch::Tensor x) {
  probe_kernel<<<1, 32>>>(x.data_ptr<float>(), x.numel());
  return x;
}
"""


def made_for() -> dict[str, Any]:
    """What the headers depend on besides the flag sets: torch (its version, CUDA and
    folder: the include paths), the compilers, Python (its headers), the architectures."""
    import torch

    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "",
        "torch_dir": os.path.dirname(torch.__file__),
        "cxx": extension._compiler_id(os.environ.get("CXX", "c++")),
        "nvcc": extension._tool_version("nvcc") if _with_cuda() else "",
        "python": sys.version.split()[0],
        "arch": os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
        "variants": [list(v) for v in VARIANTS],
        "recipe": extension.RECIPE_VERSION,
        "pch": PCH_VERSION,
    }


def kept(folder: Path, wanted: dict[str, Any]) -> bool:
    """The folder holds headers made for exactly `wanted` (a make that finished)."""
    try:
        return bool(json.loads((folder / MADE_FOR).read_text()) == wanted)
    except (OSError, ValueError):
        return False


def clear(folder: Path) -> None:
    """Everything made for something else goes (build processes never read a stale one)."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _with_cuda() -> bool:
    """CUDA sources can be built: nvcc, and a CUDA build of torch (a CPU torch refuses them)."""
    import torch

    return shutil.which("nvcc") is not None and bool(torch.version.cuda)


def make(folder: Path) -> list[tuple[bool, str]]:
    """Builds every variant's headers into folder; whether each did, and what happened, a
    line each. Each variant builds in a process of its own: a build patches torch's
    cpp_extension module for its own use, which two threads of one process would do to each
    other."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    with ProcessPoolExecutor(len(VARIANTS)) as pool:
        lines = list(pool.map(_variant, [folder] * len(VARIANTS), range(len(VARIANTS))))
    for p in folder.rglob("*"):  # readable by the build processes' user
        p.chmod(0o755 if p.is_dir() else 0o644)
    return lines


def _variant(folder: Path, i: int) -> tuple[bool, str]:
    flags = VARIANTS[i]
    cuda = _with_cuda()
    call = {
        "name": f"kerneleval_pch_probe_{i}",
        "cpp_sources": [_CPP],
        "cuda_sources": [_CU] if cuda else [],
        "functions": ["probe"],
        "extra_cflags": flags,
        "extra_cuda_cflags": flags,
    }
    if not cuda:
        call["cpp_sources"] = [_CPP.replace(";", "{ return x; }")]
    work = Path(tempfile.mkdtemp(prefix="kerneleval-pch-"))
    ok = False
    try:
        built = extension.build_load_inline(call, work, folder, lambda _: None)
        said = f"flags {flags}: {built.seconds:.1f} s "
        said += "ok" if built.fast else (built.log or built.error)[-300:]
        if built.fast:  # the probe used the smaller headers; some candidates need them all
            full = extension.make_full_pchs(work, folder)
            ok = full.startswith(extension.FULL_PCH_MADE)
            said += "; " + full
        if built.fast and cuda and not flags:  # torch's default flags: what its build shows
            said += "; " + extension.make_device_prelude(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ok, said


def main() -> int:
    started = time.monotonic()
    folder = Path(sys.argv[1])
    wanted = made_for()
    made_for_text = f"torch {wanted['torch']}, {wanted['cxx']}" + (
        f", {wanted['nvcc']}" if wanted["nvcc"] else ""
    )
    if kept(folder, wanted):
        print(f"kerneleval pch: ready (kept from an earlier start: {made_for_text})", flush=True)
        return 0
    clear(folder)  # none yet, or made for another torch, compiler, flags or recipe
    done = make(folder)
    for _, line in done:
        print(f"kerneleval pch: {line}", flush=True)
    took = time.monotonic() - started
    if not all(ok for ok, _ in done):
        print(f"kerneleval pch: failed after {took:.1f} s (builds go without)", flush=True)
        return 1
    stamp = folder / f"{MADE_FOR}.{os.getpid()}"
    stamp.write_text(json.dumps(wanted, indent=1) + "\n")
    stamp.chmod(0o644)
    stamp.rename(folder / MADE_FOR)
    print(f"kerneleval pch: ready (made in {took:.1f} s: {made_for_text})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
