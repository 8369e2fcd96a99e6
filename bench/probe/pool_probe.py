"""Which part of a warm job process's start limits how many a host makes a second.

A parent imports torch and triton (no CUDA), then forks N children, C at a time; each child
warms up in steps (CUDA context, cuBLAS matmul, a cached Triton kernel) and reports each step's
duration. Modes pick the steps. Prints processes/s and median step times per mode.

    python3 bench/probe/pool_probe.py [--n 24] [--c 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _warm(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


def child(mode: str, w: int) -> None:
    out = {}
    t = time.perf_counter()
    if "tritonhost" in mode:  # Triton's host side (driver utils, launcher) before any CUDA
        from triton.runtime import driver

        driver.active.get_current_target  # noqa: B018 - touches the active driver
        out["tritonhost"] = time.perf_counter() - t
        t = time.perf_counter()
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    out["ctx"] = time.perf_counter() - t
    if "cublas" in mode:
        t = time.perf_counter()
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        out["cublas"] = time.perf_counter() - t
    if "triton" in mode.replace("tritonhost", ""):
        t = time.perf_counter()
        _warm[(1,)](x, 16, BLOCK=16)
        torch.cuda.synchronize()
        out["triton"] = time.perf_counter() - t
    os.write(w, (json.dumps(out) + "\n").encode())
    os._exit(0)


def run(mode: str, n: int, c: int) -> dict:
    r, w = os.pipe()
    t0 = time.perf_counter()
    live, started = set(), 0
    while started < n or live:
        while started < n and len(live) < c:
            pid = os.fork()
            if pid == 0:
                os.close(r)
                child(mode, w)
            live.add(pid)
            started += 1
        pid, _ = os.wait()
        live.discard(pid)
    wall = time.perf_counter() - t0
    os.close(w)
    rows = [json.loads(line) for line in os.fdopen(r).read().splitlines()]
    keys = sorted({k for row in rows for k in row})
    med = {k: round(statistics.median(row[k] for row in rows if k in row) * 1e3, 1) for k in keys}
    return {"mode": mode, "n": len(rows), "c": c, "per_s": round(n / wall, 2), "median_ms": med}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--c", type=int, default=8)
    args = ap.parse_args()
    # Compile the Triton kernel once in a child so that the children find it in the cache.
    pid = os.fork()
    if pid == 0:
        r, w = os.pipe()
        child("cublas+triton", w)
    os.waitpid(pid, 0)
    for mode in ("ctx", "ctx+cublas", "ctx+cublas+triton", "tritonhost+ctx+cublas+triton"):
        for c in (1, args.c):
            print(json.dumps(run(mode, args.n if c > 1 else 6, c)), flush=True)


if __name__ == "__main__":
    main()
