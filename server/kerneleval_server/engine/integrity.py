"""Runtime integrity checks: flags for what the engine sees while the candidate runs.

Advisory, like the static checks (`EvalResult.flags`, `FLAG_SOURCE_RUNTIME`): they name what
makes a verdict or a time untrustworthy. In a launch process (built ahead) no candidate code
runs beside the engine, so they cannot be suppressed there; in a job process that runs the
candidate's host code, that code could suppress them (never add them to another job's).

- output_aliases_input: an output shares memory with an input where the reference's does not
  (the kernel handed back what it was given, or wrote in place where the reference makes a
  new tensor; a reference that returns a view allows it). Compare only.
- output_aliases_reference: an output shares memory with the reference's outputs (found and
  returned, not computed).
- replayed_outputs: a timed trial, picked at random, ran on new inputs written in place
  before it, and its outputs did not match the reference's on them (job_timing._ReplayCheck):
  results computed earlier were handed back. The job is also INCORRECT.
- faster_than_memory: the median is below the time the GPU needs just to write the outputs
  (those beyond its L2 cache) at its peak memory bandwidth, a floor no honest kernel beats.
- persisting_l2: the kernel set part of the L2 aside as persisting (its data would survive
  the flush between timed trials); timing found it before a trial and reset it (timing.py).
- time_outside_bound: the kernel's own device times of its timed calls disagree with its judge's
  clock around those calls (less a call of no work) by more than the tolerance: its process
  made its time look shorter. Its time is the judge's bound instead (timed_calls.py).
- lower_precision: the kernel's outputs are much further from a float64 run of the reference
  than the reference's own float32 outputs are: computed in float16, bfloat16 or TF32
  (precision.py). Compare with a Model reference only.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

import torch
from kerneleval.v1 import job_pb2

ALIASES_INPUT = "output_aliases_input"
ALIASES_REFERENCE = "output_aliases_reference"
FASTER_THAN_MEMORY = "faster_than_memory"
REPLAYED_OUTPUTS = "replayed_outputs"
PERSISTING_L2 = "persisting_l2"
LOWER_PRECISION = "lower_precision"
TIME_OUTSIDE_BOUND = "time_outside_bound"
FLOOR_MARGIN = 0.9  # below 90% of the floor: clock and counter noise cannot explain it


def flag(rule: str, message: str) -> job_pb2.IntegrityFlag:
    return job_pb2.IntegrityFlag(rule_id=rule, message=message, source=job_pb2.FLAG_SOURCE_RUNTIME)


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    storage = t.untyped_storage()
    start = storage.data_ptr()
    size = storage.nbytes()
    return (start, start + size) if size > 0 and start else None


def _overlaps(a: tuple[int, int], spans: Iterable[tuple[int, int]]) -> bool:
    return any(a[0] < b[1] and b[0] < a[1] for b in spans)


def _spans(values: list[Any]) -> list[tuple[int, int]]:
    return [s for v in values if isinstance(v, torch.Tensor) and (s := _span(v))]


def aliased_outputs(outputs: list[Any], inputs: list[Any]) -> set[int]:
    """Which outputs share memory with an input (the reference's: a view is its meaning)."""
    ins = _spans(inputs)
    return {
        i
        for i, v in enumerate(outputs)
        if isinstance(v, torch.Tensor) and (span := _span(v)) and _overlaps(span, ins)
    }


def aliasing(
    outputs: list[Any],
    names: list[str],
    inputs: list[Any],
    reference_outputs: list[Any],
    allowed: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[job_pb2.IntegrityFlag]:
    """Outputs sharing memory with the reference's outputs, or with an input where the
    reference's same output does not (`allowed`: those that do)."""
    ins, refs = _spans(inputs), _spans(reference_outputs)
    out: list[job_pb2.IntegrityFlag] = []
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor) or (span := _span(value)) is None:
            continue
        if _overlaps(span, refs):
            name = _output_name(i, names)
            out.append(
                flag(ALIASES_REFERENCE, f"{name} shares memory with the reference's outputs")
            )
        elif i not in allowed and _overlaps(span, ins):
            out.extend(input_aliases([i], names))
    return out


def input_aliases(indices: Iterable[int], names: list[str]) -> list[job_pb2.IntegrityFlag]:
    """The flags of outputs that share memory with an input (their reference's do not)."""
    return [
        flag(ALIASES_INPUT, f"{_output_name(i, names)} shares memory with an input")
        for i in sorted(indices)
    ]


def _output_name(i: int, names: list[str]) -> str:
    return names[i] if i < len(names) else f"output {i}"


@cache
def peak_bandwidth(device_index: int) -> float | None:
    """Bytes a second at the GPU's highest memory clock (NVML), None when unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            handle = next(
                h
                for h in (
                    pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
                )
                if uuid in str(pynvml.nvmlDeviceGetUUID(h))
            )
            mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML in this process: no floor, no flag
        return None
    return float(mhz) * 1e6 * 2 * bits / 8 if mhz and bits else None  # double data rate


def memory_floor(
    median_ms: float, output_bytes: int, bytes_per_s: float | None, l2_bytes: int = 0
) -> job_pb2.IntegrityFlag | None:
    """faster_than_memory when the median beats writing the outputs at peak bandwidth. What
    fits in the L2 cache may still be there when the kernel ends (writes are cached): only
    the bytes beyond it must have reached memory."""
    must_move = output_bytes - l2_bytes
    if not bytes_per_s or median_ms <= 0 or must_move <= 0:
        return None
    floor_ms = must_move / bytes_per_s * 1e3
    if median_ms >= FLOOR_MARGIN * floor_ms:
        return None
    return flag(
        FASTER_THAN_MEMORY,
        f"median {median_ms * 1e3:.2f} us, but writing its {output_bytes / 1e6:.1f} MB of "
        f"outputs ({must_move / 1e6:.1f} MB beyond the L2 cache) takes at least "
        f"{floor_ms * 1e3:.2f} us at the GPU's peak memory bandwidth "
        f"({bytes_per_s / 1e12:.2f} TB/s)",
    )


def persisting_l2(limit_bytes: int, resets: int) -> job_pb2.IntegrityFlag:
    return flag(
        PERSISTING_L2,
        f"the kernel set aside {limit_bytes / 2**20:.1f} MiB of persisting L2 cache "
        f"(cudaLimitPersistingL2CacheSize), which keeps its data in the L2 across the flush "
        f"between timed trials; found at {resets} of the resets before timed trials and reset "
        "each time (the limit back to 0, persisting lines demoted)",
    )
