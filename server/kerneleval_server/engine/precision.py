"""lower_precision: a candidate that computes a float32 problem in float16, bfloat16 or TF32 and
returns float32 passes KernelBench's tolerances (1e-2) but is not the same computation.

On the first correctness trial of a Compare whose reference is a Model with float32 or float64
outputs, the reference runs once more in float64 (a deep copy of its module, `.double()`,
its inputs cast to float64; a problem whose outputs are all float64 uses the reference's own
outputs) and both sets of outputs are measured against that run: an output's error is its
largest absolute difference from the float64 output over that output's largest magnitude. The
candidate is flagged when, for some output, its error is above what float32 rounding
explains (the floor) and FACTOR times the reference's own.

The floor grows with the longest sum the computation makes (`terms`: the reduction length
of each matmul, convolution, attention, normalization, scan and reduction the float64 run
calls, seen through a dispatch mode), because an honest float32 kernel that sums in one long
sequential loop has an error that grows with it: floor = max(FLOOR, SEQUENTIAL * eps * sqrt(K)).
Measured on an H100 (errors over the largest magnitude; KernelBench's matmuls take
torch.rand inputs, whose rounding errors average out over K):
- honest float32: cuBLAS 1e-7 to 6e-6; a naive Triton kernel (one sequential sum of fused
  multiply-adds per output) the same up to K = 8192, 8.3e-5 at K = 524288 (level 1's #6) and
  2.0e-4 at K = 1048576 (#4): 0.96 to 1.64 * eps * sqrt(K). SEQUENTIAL = 4 keeps it 2.4x
  below the floor.
- lower precision, K = 4096 to 8192: float16 or TF32 operands summed in float32 (cuBLAS,
  tensor cores) 4.6e-5 to 7.3e-5 on rand inputs and 3.2e-4 on randn ones; bfloat16 operands
  1.7e-4 to 2.8e-4 (rand), 2.2e-3 (randn); Triton's default tl.dot on float32 (TF32, its
  inputs truncated) 6.8e-4; a float16 result 3.6e-4 to 5.2e-4; a bfloat16 one 3.8e-3.
- FLOOR = 3e-5 (about 256 float32 eps): the floor up to K = 4096, a third below the
  smallest of those; honest sums that short stay 6x below it.
- FACTOR = 8: where the reference is itself no better than float32 rounding says (cuDNN runs
  float32 convolutions in TF32 by default: level 1's convolutions are 3e-4 away), a candidate
  is flagged only when clearly worse than the reference, never for matching it.
What it misses: lower precision whose error stays under the floor (float16 operands of a
matmul over K = 1048576 of positive inputs average their rounding out: 1.9e-4, under that
K's floor); precision lowered in the reference too (torch.backends.cuda.matmul.allow_tf32
set by the candidate's module: both run in TF32 and agree); a reduction the dispatch mode
does not see (inside a compiled extension of the reference), for which the floor is too low.
Skipped with a note, never failing the job: a reference that cannot run in float64 (an
exception, a forward that casts back to float32, integer or boolean outputs); float64 copies
of the weights, inputs and outputs over MAX_BYTES (4 GiB, or the job's tensor budget if less)
or the GPU's free memory; on a GPU the run is also capped there (the allocator may take at most
that much beyond what the process holds: past it, an out-of-memory error skips); a float64 run
predicted longer than TIME_BUDGET_S (from the reference's first float32 run, or a second, warm
one when the first, which also loaded its kernels, predicts too long). On an H100, level 1
with each Model against itself and a 16 GiB budget: 65 of 100 problems checked in 8.7 s
together (the others over it, or integer outputs), no flag; the largest took 2.8 s. Under
MAX_BYTES, 41 of those 65 are checked.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from kerneleval.v1 import job_pb2
from torch.utils._python_dispatch import TorchDispatchMode

from . import compare, integrity
from .backends.base import as_outputs

FLOOR = 3e-5  # float32 outputs; float64 ones: scaled by eps(float64) / eps(float32)
SEQUENTIAL = 4.0  # times eps * sqrt(K): above one long sequential float32 sum of K terms
FACTOR = 8.0
CHUNK = 1 << 24  # elements measured at once: a few float64 temporaries of 128 MiB
# The float64 run is skipped when the reference's first float32 run, times the slowdown,
# predicts more than this. On an H100 level 1's checks took 2x to 115x the reference's
# float32 run (cuDNN's float64 convolutions have no tensor cores; the slowest, #68, a 3D
# transposed convolution: 38 ms, then 2.8 s); other GPUs run float64 at 1/64 of float32,
# 32 times slower again. On a 2-core CPU float64 took 2.2x to 4x (matmul 4096^3: 0.9 s, then
# 3.6 s with the comparison; convolutions 2.2x to 3.3x).
TIME_BUDGET_S = 10.0
# The float64 run's memory is part of the job's peak, which GPU memory admission learns a
# problem's footprint from: 16 GiB more per job would let fewer jobs of a large problem share
# a GPU (an RL step's elementwise problems, 6.4 GB a tensor). At most this much (41 of level
# 1's 65 checkable problems fit, on an H100), or the job's tensor budget if that is smaller.
MAX_BYTES = 4 << 30
# A float64 run needing at most this is run without asking the allocator what is free, with
# no cap and no cache given back after: those calls took half of a tiny job's judge (~3 of
# 7 ms on an H100), for memory no GPU job misses (an out-of-memory error still skips).
SMALL_RUN_BYTES = 64 << 20
SLOWDOWN = {"cpu": 8.0, "full_fp64": 128.0, "other": 4096.0}


@dataclass
class Check:
    flag: job_pb2.IntegrityFlag | None = None
    note: str = ""  # why it was skipped
    seconds: float = 0.0  # the float64 run and the comparison
    terms: int = 0  # the longest sum the float64 run made


@dataclass
class Gold:
    """One trial's float64 reference run, which needs no kernel output: a judge started ahead
    makes it while the kernel runs. `outputs` and the longest sum it made (`terms`, 0 for a
    float64 problem judged on its own outputs), or `done`: the check's answer already (why it
    is skipped, or nothing to check)."""

    outputs: list[Any] = field(default_factory=list)
    terms: int = 0
    done: Check | None = None
    seconds: float = 0.0


def check(
    instance: Any,
    inputs: list[Any],
    cand_out: list[Any],
    ref_out: list[Any],
    names: list[str],
    *,
    max_bytes: int,
    device: torch.device,
    ref_seconds: float = 0.0,
    sync: Callable[[], None] = lambda: None,
) -> Check:
    """The lower_precision check of one trial's outputs (see the module's docstring).
    `ref_seconds`: how long the reference's float32 run took (predicts the float64 one)."""
    gold = float64_run(
        instance, inputs, ref_out, max_bytes=max_bytes, device=device,
        ref_seconds=ref_seconds, sync=sync,
    )  # fmt: skip
    return judged(gold, cand_out, ref_out, names)


def judged(gold: Gold, cand_out: list[Any], ref_out: list[Any], names: list[str]) -> Check:
    """The check of one trial's outputs against its float64 run (`float64_run`: made just
    before, or by a judge started ahead while the kernel ran)."""
    t0 = time.perf_counter()
    if gold.done is not None:
        out = gold.done
    elif len(cand_out) != len(ref_out):
        out = Check()
    else:
        out = _judge(cand_out, ref_out, gold.outputs, names, terms=gold.terms)
    out.seconds = gold.seconds + time.perf_counter() - t0
    return out


def float64_run(
    instance: Any,
    inputs: list[Any],
    ref_out: list[Any],
    *,
    max_bytes: int,
    device: torch.device,
    ref_seconds: float = 0.0,
    sync: Callable[[], None] = lambda: None,
) -> Gold:
    """The reference's float64 run on a trial's pristine inputs, within `max_bytes` (and
    what the GPU has free) and TIME_BUDGET_S."""
    t0 = time.perf_counter()
    big = True  # it may have taken much of the GPU's memory
    try:
        gold, big = _float64_run(instance, inputs, ref_out, max_bytes, device, ref_seconds, sync)
    finally:
        if device.type == "cuda" and big:
            torch.cuda.empty_cache()  # the float64 run's memory back to the GPU's other jobs
    gold.seconds = time.perf_counter() - t0
    return gold


def float64_bytes(instance: torch.nn.Module, inputs: list[Any], outputs: list[Any]) -> int:
    """The least a float64 run takes: float64 copies of the weights, the inputs and the
    outputs."""
    state = [*instance.parameters(), *instance.buffers()]
    tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
    return 2 * (_nbytes(state) + _nbytes(_flat(inputs)) + _nbytes(tensors))


def _skip(why: str) -> Check:
    return Check(note=f"lower-precision check skipped: {why}")


def _float64_run(
    instance: Any,
    inputs: list[Any],
    ref_out: list[Any],
    max_bytes: int,
    device: torch.device,
    ref_seconds: float,
    sync: Callable[[], None],
) -> tuple[Gold, bool]:
    """(the run, whether the cache is given back after: not when it was small, with no free
    memory asked and no cap; else always, as before small runs were told apart: a judge that
    kept what its trials had cached ran two of KernelBench's problems out of memory)."""
    tensors = [r for r in ref_out if isinstance(r, torch.Tensor)]
    if not tensors or any(r.dtype in (torch.float16, torch.bfloat16) for r in tensors):
        return Gold(done=Check()), True  # a problem posed in half precision: nothing lower
    odd = [str(r.dtype) for r in tensors if r.dtype not in (torch.float32, torch.float64)]
    if odd:
        return Gold(done=_skip(f"the reference returns {odd[0]}")), True
    if all(r.dtype == torch.float64 for r in tensors):  # its own outputs are the float64 run
        return Gold(outputs=ref_out, terms=0), True
    if not isinstance(instance, torch.nn.Module):
        return Gold(done=_skip("the reference is not a torch.nn.Module")), True
    need = float64_bytes(instance, inputs, tensors)
    small = need <= SMALL_RUN_BYTES
    budget = max_bytes
    free = None if small else _free_bytes(device)
    if free is not None:
        budget = min(budget, free)
    if need > budget:
        mib = 2**20
        return Gold(
            done=_skip(
                f"a float64 run needs over {need / mib:.0f} MiB (budget {budget / mib:.0f} MiB)"
            )
        ), not small
    slowdown = _slowdown(device)
    if ref_seconds * slowdown > TIME_BUDGET_S:
        # The first run also loaded its kernels (cuBLAS, cuDNN's choice of algorithm): timed
        # again, warm, on copies of the inputs.
        try:
            ref_seconds = _timed(instance, inputs, device, sync)
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the reference's code
            why = f"the reference raised {type(e).__name__}: {str(e)[:200]}"
            return Gold(done=_skip(why)), not small
    if ref_seconds * slowdown > TIME_BUDGET_S:
        return Gold(
            done=_skip(
                f"the reference's float32 run took {ref_seconds:.2f} s: in float64 it could "
                f"take {slowdown:g} times as long"
            )
        ), not small
    longest = _LongestSum()
    try:
        with (
            contextlib.nullcontext() if small else _memory_cap(device, budget),
            longest,
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            model = copy.deepcopy(instance).double()
            gold = as_outputs(model(*_double(inputs)))
            sync()
        del model
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except torch.OutOfMemoryError:
        why = f"the float64 run went over its memory budget ({budget / 2**20:.0f} MiB)"
        return Gold(done=_skip(why)), not small
    except BaseException as e:  # noqa: BLE001 - the reference's code: any failure skips
        why = f"the reference raised {type(e).__name__} in float64: {str(e)[:200]}"
        return Gold(done=_skip(why)), not small
    if len(gold) != len(ref_out):
        return Gold(done=_skip("the reference returned other outputs in float64")), not small
    return Gold(outputs=gold, terms=longest.terms), not small


def _judge(
    cand_out: list[Any], ref_out: list[Any], gold: list[Any], names: list[str], terms: int
) -> Check:
    """terms 0: unknown (a float64 problem, judged on its own outputs): the longest sum a
    tensor can hold."""
    worst: tuple[float, float, float, str] | None = None
    for i, (c, r, g) in enumerate(zip(cand_out, ref_out, gold, strict=True)):
        if not isinstance(r, torch.Tensor) or not isinstance(c, torch.Tensor):
            continue
        name = names[i] if i < len(names) else f"output[{i}]"
        if not isinstance(g, torch.Tensor) or g.shape != r.shape:
            return _skip(f"{name} has another shape in float64")
        if g.dtype != torch.float64:
            return _skip(f"the reference computes {name} in {g.dtype} when given float64")
        errors = _errors(c, r, g)
        if errors is None:
            continue
        cand_err, ref_err = errors
        floor = floor_of(r.dtype, terms or 2**31)
        if cand_err > floor and cand_err > FACTOR * ref_err:
            if worst is None or cand_err > worst[0]:
                worst = (cand_err, ref_err, floor, name)
    if worst is None:
        return Check(terms=terms)
    cand_err, ref_err, floor, name = worst
    return Check(
        terms=terms,
        flag=integrity.flag(
            integrity.LOWER_PRECISION,
            f"{name}: {cand_err:.1e} (of its largest magnitude) away from the reference run in "
            f"float64, the reference's own outputs {ref_err:.1e}, float32 rounding at most "
            f"{floor:.1e} (sums of up to {terms or 2**31} terms): computed in lower precision "
            f"than the problem's {_dtype(ref_out)} ({_lower(ref_out)}?)",
        ),
    )


def floor_of(dtype: torch.dtype, terms: int) -> float:
    """What rounding in `dtype` explains, over an output's largest magnitude, for sums of
    up to `terms` terms."""
    eps = torch.finfo(dtype).eps
    return max(FLOOR * eps / torch.finfo(torch.float32).eps, SEQUENTIAL * eps * math.sqrt(terms))


def _errors(c: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> tuple[float, float] | None:
    """The candidate's and the reference's largest error against g, over g's largest finite
    magnitude; None when g has none (all zero or not finite), or when c is r element by
    element (small outputs: then c's error is r's own, nothing to flag). Non-finite
    differences are left out (NaN never passed the comparison; an infinity the candidate
    shares with the reference did)."""
    if g.numel() <= compare.HOST_COMPARE_MAX:  # small: on the host in numpy, as compare does
        c, r = c.detach().cpu(), r.detach().cpu()  # copied once, for both uses
        if compare.identical_small(c, r):
            return None
        return _errors_on_host(*(compare.as_float64(x) for x in (c, r, g)))
    gf = g.detach().reshape(-1)
    flat = [x.detach().reshape(-1).to(gf.device) for x in (c, r)]
    scale, errs = 0.0, [0.0, 0.0]
    for start in range(0, gf.numel(), CHUNK):
        gc = gf[start : start + CHUNK]
        scale = max(scale, float(gc.abs().nan_to_num(0.0, 0.0, 0.0).max()))
        for k, x in enumerate(flat):
            d = (x[start : start + CHUNK].to(torch.float64) - gc).abs_()
            errs[k] = max(errs[k], float(d.nan_to_num_(0.0, 0.0, 0.0).max()))
            del d
    if scale <= 0.0:
        return None
    return errs[0] / scale, errs[1] / scale


def _errors_on_host(c: np.ndarray, r: np.ndarray, g: np.ndarray) -> tuple[float, float] | None:
    """_errors in numpy, for a small output's float64 values."""
    with np.errstate(all="ignore"):
        magnitude = np.abs(g)
        scale = float(np.max(magnitude, where=np.isfinite(magnitude), initial=0.0))
        if scale <= 0.0:
            return None
        errs = []
        for x in (c, r):
            d = np.abs(x - g)
            errs.append(float(np.max(d, where=np.isfinite(d), initial=0.0)))
    return errs[0] / scale, errs[1] / scale


class _LongestSum(TorchDispatchMode):
    """The longest sum any op of the run makes: terms per output element, from the op and
    its arguments' shapes (over rather than under: a higher floor only flags less)."""

    def __init__(self) -> None:
        super().__init__()
        self.terms = 1

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._dynamo.disable, whose first call
        # imports torch._dynamo: 1 to 7 s once a job process, and nothing here compiles.
        return False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        with contextlib.suppress(Exception):  # the count is advice; the run is the reference's
            self.terms = max(self.terms, int(_terms(func, args, out)))
        return out


_MOVES = {"clone", "_to_copy", "copy_", "cat", "stack", "expand", "repeat", "index",
          "index_select", "gather", "scatter", "flip", "roll", "tril", "triu", "where",
          "constant_pad_nd", "masked_fill", "fill_", "zero_", "arange", "lift_fresh",
          "detach", "alias", "_unsafe_view", "slice_scatter", "select_scatter"}  # fmt: skip


def _terms(func: Any, args: tuple[Any, ...], out: Any) -> float:
    name = func.overloadpacket.__name__.strip("_")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or func.is_view or torch.Tag.pointwise in func.tags or name in _MOVES:
        return 1
    if name in ("mm", "bmm", "mv", "dot", "vdot", "matmul"):
        return tensors[0].shape[-1]
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        return tensors[1].shape[-1]
    if "conv" in name and len(tensors) > 1:  # upper bound for transposed and grouped ones
        w = tensors[1]
        return w.numel() / max(1, min(w.shape[0], w.shape[1]))
    if "attention" in name and len(tensors) > 1:  # query (..., L, E), key (..., S, E)
        return max(tensors[0].shape[-1], tensors[1].shape[-2])
    if "batch_norm" in name:
        return tensors[0].numel() / max(1, tensors[0].shape[1])
    if "group_norm" in name or "layer_norm" in name or "rms_norm" in name:
        return tensors[0].numel()  # over every group or row: an upper bound
    if "softmax" in name or name.startswith("cum") or name == "logcumsumexp":
        return tensors[0].shape[int(args[1])]
    first = out[0] if isinstance(out, (tuple, list)) else out
    size = first.numel() if isinstance(first, torch.Tensor) else 1
    return max(t.numel() for t in tensors) / max(1, size)


@contextlib.contextmanager
def _memory_cap(device: torch.device, budget: int) -> Iterator[None]:
    """On a GPU the allocator refuses what the float64 run would take past `budget` (an
    out-of-memory error that skips the check) instead of taking it from the GPU's other
    jobs; the process's own fraction is restored after."""
    if device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    saved = get(device) if get is not None else 1.0
    fraction = min(saved, (torch.cuda.memory_reserved(device) + budget) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(saved, device)


def _slowdown(device: torch.device) -> float:
    """How much longer the float64 run may take than the float32 one: data-center GPUs (V100
    7.0, A100 8.0, H100 9.0, B200 10.0) have float64 units at half the float32 rate."""
    if device.type != "cuda":
        return SLOWDOWN["cpu"]
    major, minor = torch.cuda.get_device_capability(device)
    return SLOWDOWN["full_fp64" if minor == 0 and major >= 7 else "other"]


def _timed(
    instance: Any, inputs: list[Any], device: torch.device, sync: Callable[[], None]
) -> float:
    copies = [v.clone() if isinstance(v, torch.Tensor) else v for v in inputs]
    sync()
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        instance(*copies)
        sync()
    return time.perf_counter() - t0


def _dtype(outputs: list[Any]) -> str:
    dtypes = {str(o.dtype).removeprefix("torch.") for o in outputs if isinstance(o, torch.Tensor)}
    return "/".join(sorted(dtypes))


def _lower(outputs: list[Any]) -> str:
    if any(isinstance(o, torch.Tensor) and o.dtype == torch.float32 for o in outputs):
        return "float16, bfloat16 or TF32"
    return "float32 or lower"


def _flat(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _flat(v)]
    return []


def _double(v: Any) -> Any:
    """A float64 copy of floating tensors, a copy of the others (the reference may write its
    inputs, and these are the trial's pristine ones)."""
    if isinstance(v, torch.Tensor):
        return v.to(torch.float64, copy=True) if v.dtype.is_floating_point else v.clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_double(x) for x in v)
    return v


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _free_bytes(device: torch.device) -> int | None:
    """Device memory this process can still have: the driver's free memory and what torch's
    allocator holds unused. None on the CPU (the job's tensor budget bounds it there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
