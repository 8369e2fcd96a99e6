"""The evaluation engine: runs one JobSpec inside a worker and returns an Outcome.

    from kerneleval_server.engine import EngineConfig, run_job, configure_process_environment
    configure_process_environment()          # once, at worker start, before triton is imported
    outcome = run_job(spec, reporter, EngineConfig(work_dir=Path(...)))

Built ahead (issue 12): build_job(spec, reporter, config, "sm_90") in a process without a GPU
compiles the kernels (BuildOutcome: artifacts, or a result, or run_whole); then
run_job(spec, reporter, config, prebuilt=outcome.artifacts) launches them without importing
the job's sources.

See runner.py for the defaults and docs/INTERNALS.md for the seam.
"""

from __future__ import annotations

import os


def configure_process_environment() -> None:
    """Call in the zygote, before triton is imported: without a GPU, Triton kernels run under
    its interpreter (TRITON_INTERPRET=1). (Each job process gets its own compile caches.)"""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


from .build import build_job  # noqa: E402
from .device import DeviceLimits  # noqa: E402
from .judge import judge_job  # noqa: E402
from .record import Recorder  # noqa: E402
from .runner import Options, run_job  # noqa: E402
from .types import EngineConfig, NullReporter, Outcome, PathMeasure, Reporter  # noqa: E402

__all__ = [
    "DeviceLimits",
    "EngineConfig",
    "NullReporter",
    "Options",
    "Outcome",
    "PathMeasure",
    "Recorder",
    "Reporter",
    "build_job",
    "configure_process_environment",
    "judge_job",
    "run_job",
]
