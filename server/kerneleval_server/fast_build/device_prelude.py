"""What torch's build of a `.cu` would have shown a candidate's kernels besides torch itself:
so that a split build (cuda_split.py) can tell a candidate's compile error from its own.

The split's device unit compiles the kernels without torch's headers. When that fails, either
the kernels are wrong (torch's build fails too), or they leaned on a header that torch's
include (cuda_fp16.h's __half, <cstdint>, <algorithm>, ...). Compiled again with
`-include device_prelude.h` (every system and CUDA header torch/extension.h pulls in, listed
once at start from `nvcc -M`) the second kind builds. An error that remains on the
candidate's own lines is the candidate's, as torch's build would report it in 45 s, unless it
names a macro of torch's headers (`torch_macros.txt`, from `nvcc -E -dM`): only torch's build
can tell that one, so it runs, as before. Made with the precompiled headers (pch.py), from
torch's headers and the service's flags only, and read-only to build processes.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

PRELUDE = "device_prelude.h"
MACROS = "torch_macros.txt"
_PROBE = "#include <torch/extension.h>\n"
# Where a header's plain name (#include <name>) finds it: the host compiler's search list and
# CUDA's own include folder; torch's and Python's folders are the flags' -I/-isystem.
_SEARCH = re.compile(r"#include <\.\.\.> search starts here:\n(.*?)End of search list", re.S)


def make(folder: Path, nvcc: str, cxx: str, cuda_flags: list[str]) -> str:
    """Writes PRELUDE and MACROS into folder; what happened, in a line."""
    flags = [f for f in cuda_flags if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    with tempfile.TemporaryDirectory(prefix="kerneleval-prelude-") as tmp:
        probe = Path(tmp) / "probe.cu"
        probe.write_text(_PROBE)
        dep_file = Path(tmp) / "probe.d"
        made = _run([nvcc, *flags, "-M", "-x", "cu", str(probe), "-o", str(dep_file)], tmp)
        deps = dep_file.read_text() if made is not None and dep_file.is_file() else None
        macros = _run([nvcc, *flags, "-E", "-Xcompiler", "-dM", "-x", "cu", str(probe)], tmp)
        if deps is None or macros is None:
            return "device prelude: nvcc could not read torch/extension.h"
        roots = _roots(cxx, nvcc)
        names: dict[str, None] = {}
        for token in deps.replace("\\\n", " ").split()[2:]:
            path = Path(token).resolve()
            if path.parent in roots and not path.name.endswith(".hpp"):
                names.setdefault(path.name, None)
        prelude = "".join(f"#include <{name}>\n" for name in names)
        check = Path(tmp) / "check.cu"
        check.write_text("")
        (Path(tmp) / PRELUDE).write_text(prelude)
        cmd = [nvcc, *flags, "-include", str(Path(tmp) / PRELUDE), "-c", str(check)]
        if _run([*cmd, "-o", str(Path(tmp) / "check.o")], tmp) is None:
            return "device prelude: the headers do not compile on their own; not used"
    defined = sorted({m.group(1) for m in re.finditer(r"^#define (\w+)", macros, re.M)})
    (folder / MACROS).write_text("\n".join(defined) + "\n")
    (folder / PRELUDE).write_text(prelude)
    return f"device prelude: {len(names)} headers, {len(defined)} macros"


def torch_macros(folder: Path) -> set[str]:
    path = folder / MACROS
    return set(path.read_text().split()) if path.is_file() else set()


def _roots(cxx: str, nvcc: str) -> set[Path]:
    done = subprocess.run(
        [cxx, "-x", "c++", "-E", "-v", "-"], input="", capture_output=True, text=True, check=False
    )
    m = _SEARCH.search(done.stderr)
    roots = {Path(line.strip()).resolve() for line in m.group(1).splitlines()} if m else set()
    cuda = Path(nvcc).resolve().parents[1]
    roots |= {p.resolve() for p in [cuda / "include", *cuda.glob("targets/*/include")]}
    return roots


def _run(cmd: list[str], cwd: str) -> str | None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None
