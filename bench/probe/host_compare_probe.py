"""What a judge's steps on a small output cost on this host, after a job process's warm-up:
the comparison and the lower-precision check's errors on the host (engine/compare.py,
engine/precision.py: numpy) against the same arithmetic in torch's CPU ops (how they ran
before), alternating; and the steps a judge no longer makes on recorded outputs (copying
and poisoning the kernel's arguments, checking its inputs for writes).

    PYTHONPATH=server:clients/python/src python3 bench/probe/host_compare_probe.py \\
        [--elements 4096] [--rounds 300]

Prints each step's median microseconds."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from kerneleval_server.jobproc.startup import load_engine, warm_up


def torch_compare(c: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> list[float]:
    """compare._compare_tensor's host path before numpy: the device arithmetic on the host."""
    cf, rf = c.cpu().reshape(-1).to(torch.float64), r.cpu().reshape(-1).to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    diff = (cf - rf).abs()
    finite = torch.isfinite(diff)
    ok = (cf == rf) | (finite & (diff <= atol + rtol * rf.abs()))
    max_abs = torch.where(finite, diff, zero).max()
    max_rel = torch.where(finite & (rf != 0), diff / rf.abs(), zero).max()
    return torch.stack([max_abs, max_rel, (~ok).sum().to(torch.float64)]).tolist()


def torch_errors(c: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """precision._errors's host path before numpy."""
    gf = g.reshape(-1).cpu()
    scale = float(gf.abs().nan_to_num(0.0, 0.0, 0.0).max())
    errs = [
        float((x.reshape(-1).cpu().to(torch.float64) - gf).abs_().nan_to_num_(0.0, 0.0, 0.0).max())
        for x in (c, r)
    ]
    return errs[0] / scale, errs[1] / scale


def median_us(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    load_engine()
    warm_up()
    from kerneleval_server.engine import compare, precision

    dev = torch.device("cuda")
    c = torch.randn(args.elements, device=dev)
    r = c + 1e-6
    g = r.double()
    a, b = torch.randn(args.elements, device=dev), torch.randn(args.elements, device=dev)
    a2, b2 = a.clone(), b.clone()
    steps: dict[str, Callable[[], object]] = {
        "compare, numpy (now)": lambda: compare.compare_outputs([c], [r], ["o"], None, None),
        "compare, torch on the host (before)": lambda: torch_compare(c, r, 1e-4, 1e-4),
        "precision errors, numpy (now)": lambda: precision._errors(c, r, g),
        "precision errors, torch on the host (before)": lambda: torch_errors(c, r, g),
        "copy 3 arguments (no longer in a judge)": lambda: [t.clone() for t in (a, b, c)],
        "poison an output (no longer in a judge)": lambda: c.clone().fill_(float("nan")),
        "2 inputs checked for writes (no longer in a judge)": lambda: (
            torch.equal(a, a2),
            torch.equal(b, b2),
        ),
    }
    results: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(5):  # alternating rounds: the host's noise falls on every step alike
        for name, fn in steps.items():
            results[name].append(median_us(fn, args.rounds // 5))
    print(f"{args.elements} float32 elements, {torch.cuda.get_device_name()}")
    for name, values in results.items():
        print(f"{name:52} {statistics.median(values):8.1f} us")


if __name__ == "__main__":
    main()
