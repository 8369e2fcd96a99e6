"""A job's options as the engine reads them: EvalOptions with the defaults of the fields left
unset (runner.py's docstring lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kerneleval.v1 import kernel_pb2

DEFAULT_CORRECT_TRIALS = 5
DEFAULT_PERF_TRIALS = 100
DEFAULT_WARMUP = 10
DEFAULT_SEED = 42
DEFAULT_FLUSH_L2 = True


@dataclass(frozen=True)
class Options:
    correct_trials: int
    perf_trials: int
    warmup: int
    atol: float | None
    rtol: float | None
    seed: int
    flush_l2: bool
    check_precision: bool = True
    compile_baseline: bool = False

    @classmethod
    def of(cls, o: kernel_pb2.EvalOptions) -> Options:
        def get(name: str, default: Any) -> Any:
            return getattr(o, name) if o.HasField(name) else default

        return cls(
            correct_trials=get("correct_trial_count", DEFAULT_CORRECT_TRIALS),
            perf_trials=get("perf_trial_count", DEFAULT_PERF_TRIALS),
            warmup=get("warmup_count", DEFAULT_WARMUP),
            atol=get("atol", None),
            rtol=get("rtol", None),
            seed=get("seed", DEFAULT_SEED),
            flush_l2=get("flush_l2", DEFAULT_FLUSH_L2),
            check_precision=get("check_precision", True),
            compile_baseline=o.compile_baseline,
        )
