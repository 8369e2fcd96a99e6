"""Whether the service is ready for each kind of job, and what it waits for.

The health check's "" (and each service's name) says whether any job can run: a device has a
warm job process (fleet/devices.py). A job of some kinds needs more to run at its usual
speed, and right after a start that can take minutes:
- "jobs": any job in a job process (PyTorch, Triton, ModelNew): a device's warm job process.
- "load_inline": KERNEL_TYPE_TORCH_CUDA's builds, by build processes: a warm build process and
  the precompiled torch headers (fast_build/pch.py: kept in the state folder from an earlier
  start, else made, 1-2 minutes on a GPU host; builds meanwhile go without them, at several
  times the time). Without build processes the job's own process builds (torch's build).
- "built_ahead": Triton and raw CUDA kernels launched from their IOContract, built by build
  processes: a warm one.
Each is a health-check name (HEALTH_PREFIX + kind: SERVING or NOT_SERVING) and a row of
ListDevices' `readiness` with a sentence. A builder (--role builder) takes no jobs: only its
builds' kinds, which its own health (it serves while its store does) gates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server.fleet.devices import Devices
from kerneleval_server.jobproc import BUILD_DEVICE


class ReadinessHost(Protocol):
    """What readiness asks of the job life cycle (jobs/manager.py JobManager)."""

    @property
    def fleet(self) -> Devices: ...
    @property
    def draining(self) -> bool: ...


HEALTH_PREFIX = "kerneleval.ready."
BUILD_KINDS = ("load_inline", "built_ahead")

OFF, MAKING, READY, FAILED = "off", "making", "ready", "failed"


@dataclass
class Pch:
    """The precompiled headers' state (main.Server._make_pch sets it)."""

    state: str = OFF
    detail: str = ""
    since: float = field(default_factory=time.monotonic)

    def set(self, state: str, detail: str = "") -> None:
        self.state, self.detail, self.since = state, detail, time.monotonic()

    def describe(self) -> str:
        if self.state == MAKING:
            took = time.monotonic() - self.since
            return (
                f"precompiled headers: making them ({took:.0f} s so far; 1-2 minutes on a GPU "
                "host); builds meanwhile go without them, several times slower"
            )
        if self.state == READY:
            return f"precompiled headers {self.detail}"
        if self.state == FAILED:
            return f"precompiled headers could not be made ({self.detail}): builds go without"
        return "no precompiled headers (--build-pch false): builds go without"


class Readiness:
    """The manager's (`m`) readiness per kind of job. `serving` is the service's own health
    (the manager's, or a builder's); `build_processes` how many it runs."""

    def __init__(
        self,
        m: ReadinessHost,
        serving: Callable[[], bool],
        build_processes: int,
        takes_jobs: bool = True,
    ) -> None:
        self.m = m
        self.serving = serving
        self.build_processes = build_processes
        self.takes_jobs = takes_jobs
        self.pch = Pch()

    def kinds(self) -> list[ops_pb2.JobKindReadiness]:
        m = self.m
        out = []
        base = self.serving()
        if self.takes_jobs:
            warm = sorted(d for d in m.fleet.warm_devices if d != BUILD_DEVICE)
            if m.draining:
                said = "stopping: no new jobs"
            elif base:
                said = f"warm job processes on device {', '.join(map(str, warm))}"
            else:
                said = "waiting for a device's first warm job process"
            out.append(ops_pb2.JobKindReadiness(kind="jobs", ready=base, detail=said))
        for kind in BUILD_KINDS:
            ready, said = self._build_kind(kind, base)
            out.append(ops_pb2.JobKindReadiness(kind=kind, ready=ready, detail=said))
        return out

    def _build_kind(self, kind: str, base: bool) -> tuple[bool, str]:
        if self.build_processes <= 0:
            torchs = " (torch's build)" if kind == "load_inline" else ""
            return base, f"no build processes: built in the job's own process{torchs}"
        warm = BUILD_DEVICE in self.m.fleet.warm_devices
        n = self.build_processes
        said = [f"{n} build process{'es' if n != 1 else ''}, " + ("warm" if warm else "starting")]
        ready = base and warm
        if kind == "load_inline":
            said.append(self.pch.describe())
            ready = ready and self.pch.state != MAKING
        if not base:
            said.append("waiting for the service to serve")
        return ready, "; ".join(said)
