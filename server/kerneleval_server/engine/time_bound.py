"""What a kernel's timed calls say of its time (issue 40): the path's own cost, calibrated by
calls of no work through it (`calibrate`), and the kernel's claims against its judge's bound
(`decide`): its own times where they agree within the tolerance, else the bound, flagged.
The calls themselves are timed_calls.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kerneleval.v1 import job_pb2

from . import integrity
from .timed_calls import Driver

CALIBRATION_CALLS = 10  # calls of no work: what the path of a timed call costs by itself
# ... but only this many once CALIBRATION_ENOUGH_MS have passed in them: a path that copies
# gigabytes costs ~17 ms a call of no work on an H200 (KernelBench's elementwise level-1
# problems: 170 ms of an RL step's ~500 ms window per job), and varies by far less than its
# tolerance (a quarter of it); the median of 4 is as good there as of 10. (The cap on it,
# the judge's own measure, does not depend on how many there are.)
CALIBRATION_LEAST = 4
CALIBRATION_ENOUGH_MS = 20.0
# An honest kernel's claim sits under the bound by up to ~8% of it on an H200 (level-1
# problems whose calls write gigabytes of inputs: bench/README.md "outside-timing"), and a
# tiny one's by ~15-20 us: below these, two of ten honest problems were flagged.
TOLERANCE_FLOOR_US = 25.0
TOLERANCE_SHARE = 0.08
# A call's path costs more than a call of no work by what the candidate's own GPU work does to
# it (the switch back to the judge's context after real kernels, not after a copy): honest
# GPU MODE kernels of 30-500 us (reference-kernels' pmpp tasks on an H200) read up to 66 us
# more under their bound than the rest of the tolerance allowed, with paths of 430-470 us.
PATH_SHARE = 0.25
CPU_TOLERANCE_FLOOR_US = 1000.0  # a sleeping process's wake-up on a loaded host: up to ~1 ms
# What the path of a call of no work may cost beyond the driver's own measure of it: on an
# H200 (levels 1-3 of KernelBench, bench/README.md "outside-timing") honest calls of no work
# took from 13 us less to 134 us more than that measure, the most where the outputs are
# gigabytes (the server copies them from memory of its own, the driver from the shared).
# On the CPU, the wake-ups of two processes on shared cores.
PATH_SLACK_NS = 40_000
PATH_SLACK_SHARE = 0.02
CPU_PATH_SLACK_NS = 2_000_000


@dataclass
class Decision:
    """The kernel's time from its calls: the server's claims where they agree with the
    driver's bound, else the bound (`flagged`)."""

    times_ms: list[float]
    flagged: bool
    tolerance_us: float
    gap_us: float  # median of (outside - calibration) - inside, per call
    calibration_us: float  # median outside span of a call of no work (at most the cap)
    outside_ms: list[float] = field(default_factory=list)
    calibration_capped: bool = False  # the calls of no work took longer than the cap
    calibration_measured_us: float = 0.0  # their median, before the cap

    def flag(self, where: str = "") -> job_pb2.IntegrityFlag:
        """The flag of a time taken at the bound (`flagged`); `where`: which of the job's
        timings (a GPU MODE case's label), said first."""
        return integrity.flag(
            integrity.TIME_OUTSIDE_BOUND,
            f"{where}{': ' if where else ''}its own times were {self.gap_us:.1f} us a call "
            f"under the judge's bound (tolerance {self.tolerance_us:.1f} us): timed by that "
            "bound",
        )


def calibrate(
    driver: Driver, inputs: Any, calls: int = CALIBRATION_CALLS, least: int = CALIBRATION_LEAST,
    enough_ms: float = CALIBRATION_ENOUGH_MS,
) -> list[int]:  # fmt: skip
    """Spans of calls of no work through the same path: what the path itself costs. `calls`
    of them, but no more than `least` once `enough_ms` have passed in them."""
    enough_ns = enough_ms * 1e6
    spans: list[int] = []
    while len(spans) < calls and (len(spans) < least or sum(spans) < enough_ns):
        spans.append(driver.call(inputs, noop=True).outside_ns)
    return spans


def decide(
    inside_ns: Sequence[int], outside_ns: Sequence[int], calibration_ns: Sequence[int],
    cpu: bool = False, own_path_ns: int | None = None,
) -> Decision:  # fmt: skip
    """The kernel's times: its claims where their median agrees with the bound (each call's
    outside span less the path's median cost) within the tolerance, else the bound, flagged.
    The path's cost is measured through the server, which may slow its calls of no work to
    lower the bound: it is taken at most `own_path_ns` (timed_calls.own_path_ns) plus
    PATH_SLACK_NS and PATH_SLACK_SHARE of it (CPU_PATH_SLACK_NS on the CPU).
    The tolerance: the path's own spread (p90 - p10 of the calibration, at most that slack)
    plus TOLERANCE_SHARE of the bound's median plus PATH_SHARE of the path's cost, at least
    TOLERANCE_FLOOR_US; on
    the CPU (`cpu`: host wall-clock, two processes' wake-ups on shared cores) 10% and at least
    CPU_TOLERANCE_FLOOR_US. A claim over the bound is taken as it is: a candidate may only
    make itself slower."""
    calib = measured = float(np.median(calibration_ns)) if len(calibration_ns) else 0.0
    spread = (
        float(np.percentile(calibration_ns, 90) - np.percentile(calibration_ns, 10))
        if len(calibration_ns) > 2
        else 0.0
    )
    capped = False
    if own_path_ns is not None:
        slack = CPU_PATH_SLACK_NS if cpu else PATH_SLACK_NS + PATH_SLACK_SHARE * own_path_ns
        cap = own_path_ns + slack
        capped = calib > cap
        calib = min(calib, cap)
        # The spread too is the server's to make: calls of no work slowed by turns would
        # widen the tolerance past any claim. Honest ones stay within the slack of the cap.
        spread = min(spread, slack)
    bound = [max(0.0, o - calib) for o in outside_ns]
    gap = float(np.median([b - i for b, i in zip(bound, inside_ns, strict=True)]))
    floor, share = (CPU_TOLERANCE_FLOOR_US, 0.10) if cpu else (TOLERANCE_FLOOR_US, TOLERANCE_SHARE)
    tolerance = max(floor * 1e3, spread + share * float(np.median(bound)) + PATH_SHARE * calib)
    flagged = gap > tolerance
    chosen = bound if flagged else [float(i) for i in inside_ns]
    return Decision(
        times_ms=[t / 1e6 for t in chosen],
        flagged=flagged,
        tolerance_us=tolerance / 1e3,
        gap_us=gap / 1e3,
        calibration_us=calib / 1e3,
        outside_ms=[b / 1e6 for b in bound],
        calibration_capped=capped,
        calibration_measured_us=measured / 1e3,
    )
