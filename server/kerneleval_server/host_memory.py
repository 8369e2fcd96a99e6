"""The host's memory, and the job process memory limit worked out from it (--job-memory-mib 0).

The host's memory is the memory cgroup limit of the service where one is set (cgroup v2
`memory.max`, v1 `memory.limit_in_bytes`, of the service's own cgroup or one above it: a
container's, a systemd slice's), else `MemTotal` of /proc/meminfo. The limit comes first because
it is what the kernel holds the service to, and because MemTotal can be wrong at start: on the
lent GPU machines it starts small and grows as memory is used (a machine with a 256 GiB cgroup
limit read 31 GiB at start).

The job limit: the host's memory less a share kept for the front end, the watchdog and the warm
processes (an eighth, from 4 to 32 GiB), over the job slots that can run at once (job processes
per GPU times GPUs, twice: a compared job's kernel and its judge each have a process; plus the
build processes), and never below a floor that lets the models the service exists for be built
on the host (KernelBench level 3's 2_ShallowWideMLP holds 8 GiB of fp32 weights on the host
before they move to the GPU: 8.2 GiB at its peak), unless the host has less than that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
# A job builds its model on the host first: KernelBench level 3's 2_ShallowWideMLP peaks at 8.2
# GiB there, its process's own memory beside it (torch, a CUDA context's host side) ~1-2 GiB.
FLOOR_MIB = 16 * 1024
# A builder's processes only compile (most builds take 1-2 GiB).
BUILD_FLOOR_MIB = 4 * 1024
MIN_MIB = 1024  # never less, even on a host smaller than its share
KEEP_MIN, KEEP_MAX = 4 * GIB, 32 * GIB  # the front end's share: an eighth, within these
# Larger than any real memory: cgroup v1's "no limit" (a page-rounded 2^63 - 1), v2's "max".
_UNLIMITED = 1 << 60

SYS_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class HostMemory:
    bytes: int
    source: str  # where it was read: "the cgroup limit, <file>" or "MemTotal, /proc/meminfo"

    def describe(self) -> str:
        return f"{self.bytes / GIB:.1f} GiB ({self.source})"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _limit(text: str) -> int | None:
    text = text.strip()
    if not text.isdigit():
        return None  # "max", empty, unreadable
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def cgroup_limit(root: Path = SYS_CGROUP, proc_cgroup: str | None = None) -> tuple[int, str] | None:
    """The smallest memory limit set on this process's cgroup or one above it, and the file
    that says it; None where none is set. `proc_cgroup`: /proc/self/cgroup's text (tests)."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup"))
    found: list[tuple[int, str]] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 (unified): <root>/<path>/memory.max
            base, name = root, "memory.max"
            if not (root / "cgroup.controllers").exists():
                base = root / "unified"  # v1 hosts mount the unified tree beside the others
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        for folder in [rel, *rel.parents]:
            file = base / folder / name
            value = _limit(_read(file))
            if value is not None:
                found.append((value, str(file)))
    return min(found) if found else None


def mem_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read(meminfo), re.M)
    return int(m.group(1)) * 1024 if m else 0


def host_memory(
    root: Path = SYS_CGROUP, meminfo: Path = Path("/proc/meminfo"), proc_cgroup: str | None = None
) -> HostMemory:
    limit = cgroup_limit(root, proc_cgroup)
    if limit is not None:
        return HostMemory(limit[0], f"the cgroup limit, {limit[1]}")
    return HostMemory(mem_total(meminfo), "MemTotal, /proc/meminfo")


def gpu_count(dev: Path = Path("/dev")) -> int:
    """The NVIDIA GPUs whose device nodes this host has (0 without)."""
    try:
        return sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return 0


def job_slots(workers_per_device: int, devices: int, build_processes: int) -> int:
    """Job processes that can hold memory at once: each GPU's (or the CPU's) job-taking ones,
    twice (a compared job's kernel and its judge), and the build processes."""
    return max(1, 2 * workers_per_device * max(1, devices) + build_processes)


def auto_job_memory_mib(host_bytes: int, slots: int, floor_mib: int = FLOOR_MIB) -> int:
    """One job process's memory limit: the host's memory less the front end's share, over the
    slots; at least `floor_mib`; at most what is left after the front end's share."""
    keep = min(KEEP_MAX, max(KEEP_MIN, host_bytes // 8))
    usable_mib = max(MIN_MIB, (host_bytes - keep) // MIB)
    share = usable_mib // max(1, slots)
    return max(MIN_MIB, min(usable_mib, max(floor_mib, share)))
