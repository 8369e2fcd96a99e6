"""At the start of a timing window: wait until the GPU has finished what others queued.

Before this job process hears of its window, the watchdog freezes the device's other job
processes: they start nothing new, but kernels they queued before still run. Contexts share a
GPU by time slices, so while another context has work, a tiny kernel of ours waits for a
slice: its launch-to-completion time jumps from tens of microseconds to a millisecond or more.
The GPU counts as drained once IDLE_RUNS probes in a row finish within IDLE_LATENCY_S. Still
busy after BUSY_AFTER_S, the job process says so (DrainStatus): only work queued outside a
grant can run now, and the front end has the watchdog find the frozen processes whose work it
is (NVML's per-process utilization) and kill them, which ends their queued work. After LIMIT_S
the window goes on and the result says it was not drained.

The probe runs in the window holder's own process, whose candidate could disturb it; that can
only make its own window look busier (and its times slower), never another job's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

IDLE_LATENCY_S = 200e-6
IDLE_RUNS = 5
BUSY_AFTER_S = 0.25
LIMIT_S = 5.0


def wait_for_idle_gpu(
    limit_s: float = LIMIT_S,
    clock: Any = time.perf_counter,
    on_busy: Callable[[bool], None] = lambda busy: None,
) -> tuple[float, bool]:
    """(seconds waited, drained). Without a CUDA context there is nothing to drain.
    on_busy(True) once the wait passes BUSY_AFTER_S, on_busy(False) when it ends after that."""
    torch: Any = sys.modules.get("torch")
    start = clock()
    if torch is None or not torch.cuda.is_initialized():
        return 0.0, True
    busy = False
    drained = False
    try:
        probe = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        quiet = 0
        while clock() - start <= limit_s:
            if not busy and clock() - start > BUSY_AFTER_S:
                busy = True
                on_busy(True)
            t0 = clock()
            probe.add_(1)
            torch.cuda.synchronize()
            quiet = quiet + 1 if clock() - t0 <= IDLE_LATENCY_S else 0
            if quiet >= IDLE_RUNS:
                drained = True
                break
    except Exception:  # noqa: BLE001 - a broken context is the engine's to report
        pass
    if busy:
        on_busy(False)
    return clock() - start, drained
