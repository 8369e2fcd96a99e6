"""The service's precompiled torch headers, made once at start for the build processes.

    python -m kerneleval_server.builder.pch DIR

A precompiled header is only used by a compile with the same flags, so one is made per flag
set that candidates commonly use (VARIANTS: torch's defaults, and -O3), by building a probe
extension with each through the builder itself: the headers come out exactly as a candidate's
build asks for them (the smaller ones most files compile against, extension.py), then all of
torch/extension.h with the probe's flags, for the files that need more. Made by the front
end's own user from torch's headers and fixed flags, no candidate input; build processes see
DIR read-only (a candidate's build cannot change what the next one includes) and build
without a PCH when none matches their flags.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import extension

VARIANTS: tuple[list[str], ...] = ([], ["-O3"])

_CPP = "torch::Tensor probe(torch::Tensor x);"
_CU = """#include <torch/extension.h>
__global__ void probe_kernel(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] += 1; }
torch::Tensor probe(torch::Tensor x) {
  probe_kernel<<<1, 32>>>(x.data_ptr<float>(), x.numel());
  return x;
}
"""


def make(folder: Path) -> list[str]:
    """Builds every variant's headers into folder; what happened, a line each. Each variant
    builds in a process of its own: a build patches torch's cpp_extension module for its
    own use, which two threads of one process would do to each other."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    with ProcessPoolExecutor(len(VARIANTS)) as pool:
        lines = list(pool.map(_variant, [folder] * len(VARIANTS), range(len(VARIANTS))))
    for p in folder.rglob("*"):  # readable by the build processes' user
        p.chmod(0o755 if p.is_dir() else 0o644)
    return lines


def _variant(folder: Path, i: int) -> str:
    flags = VARIANTS[i]
    cuda = shutil.which("nvcc") is not None
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
    try:
        built = extension.build_load_inline(call, work, folder, lambda _: None)
        said = f"flags {flags}: {built.seconds:.1f} s "
        said += "ok" if built.fast else built.log[-300:]
        if built.fast:  # the probe used the smaller headers; some candidates need them all
            said += "; " + extension.make_full_pchs(work, folder)
        if built.fast and cuda and not flags:  # torch's default flags: what its build shows
            said += "; " + extension.make_device_prelude(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return said


def main() -> int:
    started = time.monotonic()
    for line in make(Path(sys.argv[1])):
        print(f"kerneleval pch: {line}", flush=True)
    print(f"kerneleval pch: done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
