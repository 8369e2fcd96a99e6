"""Correctness: outputs against the reference with atol/rtol by dtype (NaN never passes), and
the anti-cheat helpers (poisoned outputs and allocator memory)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Default tolerance (used for both atol and rtol) by output dtype; 0 means exact.
DEFAULT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}


def tolerances(dtype: torch.dtype, atol: float | None, rtol: float | None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCE.get(dtype, 0.0)
    return (default if atol is None else atol, default if rtol is None else rtol)


@dataclass
class TrialCheck:
    """The comparison of one trial's outputs."""

    ok: bool = True
    message: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    mismatches: int = 0
    elements: int = 0
    first_index: list[int] = field(default_factory=list)
    output_name: str = ""
    atol: float = 0.0
    rtol: float = 0.0


def compare_outputs(
    cand: list[Any], ref: list[Any], names: list[str], atol: float | None, rtol: float | None
) -> TrialCheck:
    check = TrialCheck()
    if len(cand) != len(ref):
        check.ok = False
        check.message = f"the kernel returned {len(cand)} outputs, the reference {len(ref)}"
        return check
    for i, (c, r) in enumerate(zip(cand, ref, strict=False)):
        name = names[i] if i < len(names) else f"output[{i}]"
        if not isinstance(r, torch.Tensor):
            r = torch.as_tensor(r)
        if not isinstance(c, torch.Tensor):
            try:
                c = torch.as_tensor(c)
            except Exception:
                return _fail(check, name, f"{name}: the kernel returned a {type(c).__name__}")
        a, rt = tolerances(r.dtype, atol, rtol)
        check.atol, check.rtol = a, rt
        if tuple(c.shape) != tuple(r.shape):
            return _fail(
                check,
                name,
                f"{name}: shape {tuple(c.shape)} differs from the reference's {tuple(r.shape)}",
            )
        if c.dtype != r.dtype:
            return _fail(
                check, name, f"{name}: dtype {c.dtype} differs from the reference's {r.dtype}"
            )
        _compare_tensor(check, name, c.detach(), r.detach(), a, rt)
    return check


def _fail(check: TrialCheck, name: str, message: str) -> TrialCheck:
    check.ok = False
    check.output_name = check.output_name or name
    check.message = check.message or message
    return check


# Elements compared at once: the comparison works in float64 with several temporaries, so a
# KernelBench level-1 output (1.6e9 float32s, 6.4 GB) compared whole needs ~60 GB more; in
# chunks it needs ~2 GB.
COMPARE_CHUNK = 1 << 26
# Outputs of at most this many elements are compared on the host: the comparison is about
# twenty small kernels, and on an H100 their launches took ~1 ms for 4096 float32s, where the
# copy and the same float64 arithmetic on the host take ~0.1 ms (bench/probe/timeline_probe.py).
# On the host it runs in numpy: torch's CPU ops cost ~10 us of dispatch each, numpy's ~1 (an
# H100 host's 4096-element comparison, the copies included: 244 -> 170 us;
# bench/probe/host_compare_probe.py).
HOST_COMPARE_MAX = 1 << 14


def identical_small(c: torch.Tensor, r: torch.Tensor) -> bool:
    """Outputs of at most HOST_COMPARE_MAX elements, equal element by element on the host
    (torch.equal: NaN equals nothing): every rule passes and no error is left to work out, in
    one op instead of the comparison's dozen (~0.45 ms of a tiny job's judge on an H100)."""
    if r.numel() > HOST_COMPARE_MAX or c.shape != r.shape or c.dtype != r.dtype:
        return False
    return bool(torch.equal(c.detach().cpu(), r.detach().cpu()))


def _compare_tensor(
    check: TrialCheck, name: str, c: torch.Tensor, r: torch.Tensor, atol: float, rtol: float
) -> None:
    if r.numel() <= HOST_COMPARE_MAX:
        c, r = c.cpu(), r.cpu()
        if identical_small(c, r):
            return
        bad, first = _compare_on_host(check, as_float64(c), as_float64(r), atol, rtol)
    else:
        bad, first = _compare_on_device(check, c, r, atol, rtol)
    if bad and check.ok:
        cflat, rflat = c.reshape(-1), r.reshape(-1)
        check.ok = False
        check.output_name = name
        check.mismatches = bad
        check.elements = r.numel()
        check.first_index = [int(i) for i in _unravel(first, tuple(r.shape))]
        where = check.first_index
        check.message = (
            f"{name}: {bad} of {r.numel()} elements differ (atol={atol:g}, rtol={rtol:g}); "
            f"first at {where}: got {cflat[first].item()!r}, "
            f"expected {rflat[first].item()!r}"
        )


def as_float64(t: torch.Tensor) -> np.ndarray:
    """A small tensor's values as a flat float64 array on the host (for numpy's arithmetic)."""
    return t.detach().reshape(-1).cpu().to(torch.float64).numpy()


def _compare_on_host(
    check: TrialCheck, cf: np.ndarray, rf: np.ndarray, atol: float, rtol: float
) -> tuple[int, int]:
    """The device comparison's rules, in numpy: (mismatches, the first one's flat index)."""
    with np.errstate(all="ignore"):
        diff = np.abs(cf - rf)
        finite = np.isfinite(diff)
        ok = (cf == rf) | (finite & (diff <= atol + rtol * np.abs(rf)))
        check.max_abs = max(check.max_abs, float(np.max(diff, where=finite, initial=0.0)))
        rel = np.divide(diff, np.abs(rf), out=np.zeros_like(diff), where=finite & (rf != 0))
        check.max_rel = max(check.max_rel, float(np.max(rel, initial=0.0)))
    wrong = np.flatnonzero(~ok)
    return len(wrong), int(wrong[0]) if len(wrong) else -1


def _compare_on_device(
    check: TrialCheck, c: torch.Tensor, r: torch.Tensor, atol: float, rtol: float
) -> tuple[int, int]:
    """(mismatches, the first one's flat index), in chunks on r's device."""
    if c.device != r.device:
        c = c.to(r.device)
    cflat, rflat = c.reshape(-1), r.reshape(-1)
    bad, first = 0, -1
    zero = torch.zeros((), dtype=torch.float64, device=r.device)
    for start in range(0, rflat.numel(), COMPARE_CHUNK):
        end = start + COMPARE_CHUNK
        # Equal bit for bit (NaN never is): nothing to work out, in one read of each side
        # instead of a dozen float64 passes (a judge's checks of timed calls on gigabytes of
        # outputs spent ~130 ms each here on an H200).
        if torch.equal(cflat[start:end], rflat[start:end]):
            continue
        cf, rf = cflat[start:end].to(torch.float64), rflat[start:end].to(torch.float64)
        diff = (cf - rf).abs()
        # Equal infinities pass; NaN on either side never does; nor does anything but the same
        # infinity where the reference is infinite (its tolerance, rtol * inf, is no bound).
        finite = torch.isfinite(diff)
        ok = (cf == rf) | (finite & (diff <= atol + rtol * rf.abs()))
        # The largest finite errors (0 where there is none: errors are never negative), the
        # absolute and the relative one (where the reference is not 0), and the mismatches,
        # read back together: one wait for the device a chunk, not one a number.
        max_abs = torch.where(finite, diff, zero).max()
        max_rel = torch.where(finite & (rf != 0), diff / rf.abs(), zero).max()
        wrong = ~ok
        numbers = torch.stack([max_abs, max_rel, wrong.sum().to(torch.float64)]).tolist()
        check.max_abs = max(check.max_abs, numbers[0])
        check.max_rel = max(check.max_rel, numbers[1])
        chunk_bad = int(numbers[2])
        if chunk_bad and first < 0:
            first = start + int(wrong.nonzero()[0, 0])
        bad += chunk_bad
        del cf, rf, diff, ok, finite, max_abs, max_rel, wrong
    return bad, first


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(flat % d if d else 0)
        flat //= d if d else 1
    return list(reversed(out))


def poison(t: torch.Tensor, trial: int) -> None:
    """Fills an output with a value no correct kernel leaves there: NaN, or for integers one
    of two patterns that alternate by trial (so a constant that happens to match still fails)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(trial % 2 == 0)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min + 0x25 if trial % 2 == 0 else info.max - 0x5A)


def poison_free_memory(nbytes: int, device: torch.device) -> None:
    """Fills memory the allocator will hand out next with NaN bytes (0xFF), so a kernel that
    returns an unwritten torch.empty() does not find the reference's old result there."""
    if nbytes <= 0:
        return
    blob = torch.empty(nbytes, dtype=torch.uint8, device=device)
    blob.fill_(0xFF)
    del blob


def nbytes_of(values: list[Any]) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
