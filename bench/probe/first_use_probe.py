"""After a job process's warm-up (jobproc/startup.warm_up), what a job's first use of the
engine's GPU paths still costs per output dtype: input generation, the outputs' poison, the
comparison (over compare.HOST_COMPARE_MAX elements: on the GPU). CUDA loads a kernel on its
first launch; a job that pays that in its timing window holds the GPU alone the longer.

    PYTHONPATH=server:clients/python/src python3 bench/probe/first_use_probe.py [--elements N]

Prints the warm-up's milliseconds, then per dtype the first and the second call's of each
step."""

from __future__ import annotations

import argparse
import time

import torch
from kerneleval.v1 import dtype_pb2, kernel_pb2
from kerneleval_server.jobproc.startup import load_engine, warm_up

DTYPES = {
    "float32": dtype_pb2.DTYPE_FLOAT32,
    "float16": dtype_pb2.DTYPE_FLOAT16,
    "bfloat16": dtype_pb2.DTYPE_BFLOAT16,
    "int32": dtype_pb2.DTYPE_INT32,
    "float64": dtype_pb2.DTYPE_FLOAT64,
}


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def probe(name: str, code: int, n: int, dev: torch.device) -> None:
    from kerneleval_server.engine import compare, inputs

    spec = kernel_pb2.TensorSpec(shape=[n], dtype=code)  # type: ignore[arg-type]
    made: list[torch.Tensor] = []
    steps = {
        "inputs": lambda: made.append(inputs.make_tensor(spec, 7, 0, 0, dev)),
        "poison": lambda: compare.poison(made[-1].clone(), 0),
        "compare": lambda: compare.compare_outputs(
            [made[-1]], [made[-1].clone()], ["out"], None, None
        ),
    }
    for step, fn in steps.items():
        first, second = timed(fn), timed(fn)
        print(f"{name:10} {step:8} {first:9.3f} {second:10.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 16)
    n = ap.parse_args().elements
    load_engine()
    began = time.perf_counter()
    warm_up()
    print(f"warm-up {(time.perf_counter() - began) * 1e3:.1f} ms")
    print(f"{'dtype':10} {'step':8} {'first ms':>9} {'second ms':>10}")
    for name, code in DTYPES.items():
        probe(name, code, n, torch.device("cuda"))


if __name__ == "__main__":
    main()
