"""TRITON launched from the IOContract (interpreter on CPU): meta args, INOUT, every dtype,
literal data, and Triton against a torch reference."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import (
    F32,
    INOUT,
    OUT,
    TORCH,
    TORCH_ADD,
    TRITON,
    V,
    job,
    scalar,
    source,
    tensor,
)
from engine_helpers import TRITON_ADD as ADD
from kerneleval.v1 import dtype_pb2


def add_args(n: int = 1000, dtype: int = F32):
    return [
        tensor("x", [n], dtype),
        tensor("y", [n], dtype),
        tensor("out", [n], dtype, OUT),
        scalar("n", n),
        scalar("BLOCK", 256, meta=True),
    ]


def test_triton_against_torch_reference(run) -> None:
    out, _ = run(job(source(TRITON, ADD, add_args(), grid=(4, 1, 1)), source(TORCH, TORCH_ADD)))
    r = out.result
    assert r.verdict == V.VERDICT_OK, r
    assert r.validation.trials_passed == 5 and r.runtime.trial_count == 3


def test_triton_against_itself_and_evaluate(run) -> None:
    k = source(TRITON, ADD, add_args(), grid=(4, 1, 1))
    out, _ = run(job(k, k))
    assert out.result.verdict == V.VERDICT_OK
    out, _ = run(job(k))
    assert out.result.verdict == V.VERDICT_OK and out.result.correctness


def test_wrong_grid_leaves_outputs_unwritten_and_fails(run) -> None:
    out, _ = run(job(source(TRITON, ADD, add_args(), grid=(2, 1, 1)), source(TORCH, TORCH_ADD)))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT and r.validation.output_name == "out"
    assert r.validation.mismatch_count == 488 and list(r.validation.first_mismatch_index) == [512]
    assert "got nan" in r.validation_error


def test_kernel_that_writes_its_input_is_caught(run) -> None:
    cheat = ADD.replace(
        "    tl.store(out_ptr", "    tl.store(x_ptr + offs, 0.0, mask=mask)\n    tl.store(out_ptr"
    )
    k = source(
        TRITON,
        cheat.replace("+ tl.load(y_ptr", "* 0 + tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr"),
        add_args(),
        grid=(4, 1, 1),
    )
    ref = source(TRITON, ADD, add_args(), grid=(4, 1, 1))
    out, _ = run(job(k, ref))
    assert out.result.verdict == V.VERDICT_INCORRECT


def test_input_write_with_correct_output_is_still_incorrect(run) -> None:
    # Writes y after using it: the output is right, but an INPUT was modified.
    sneaky = (
        ADD
        + """
@triton.jit
def sneaky(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, s, mask=mask)
    tl.store(y_ptr + offs, s, mask=mask)
"""
    )
    k = source(TRITON, sneaky, add_args(), grid=(4, 1, 1), entry="sneaky")
    out, _ = run(job(k, source(TORCH, TORCH_ADD)))
    assert out.result.verdict == V.VERDICT_INCORRECT
    assert "wrote its input 'y'" in out.result.validation_error


INOUT_SRC = """
import triton
import triton.language as tl

@triton.jit
def axpy(acc_ptr, x_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(acc_ptr + offs, mask=mask)
    tl.store(acc_ptr + offs, acc + alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)
"""
INOUT_REF = """
import torch
class Model(torch.nn.Module):
    def forward(self, acc, x):
        return acc + 0.5 * x
"""


def test_inout_and_float_scalar_args(run) -> None:
    args = [
        tensor("acc", [300], role=INOUT),
        tensor("x", [300]),
        scalar("alpha", 0.5),
        scalar("n", 300),
        scalar("BLOCK", 128, meta=True),
    ]
    out, _ = run(job(source(TRITON, INOUT_SRC, args, grid=(3, 1, 1)), source(TORCH, INOUT_REF)))
    assert out.result.verdict == V.VERDICT_OK, out.result
    wrong = INOUT_REF.replace("0.5 * x", "0.25 * x")
    out, _ = run(job(source(TRITON, INOUT_SRC, args, grid=(3, 1, 1)), source(TORCH, wrong)))
    assert out.result.verdict == V.VERDICT_INCORRECT and out.result.validation.output_name == "acc"


COPY = """
import triton
import triton.language as tl

@triton.jit
def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
"""
IDENTITY = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.clone()
"""
DTYPES = [d for d in dtype_pb2.DType.values() if d != dtype_pb2.DTYPE_UNSPECIFIED]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: dtype_pb2.DType.Name(d))
def test_every_dtype_through_a_copy_kernel(run, dtype: int) -> None:
    from kerneleval.v1 import kernel_pb2

    init = kernel_pb2.TensorInit(randint=kernel_pb2.RandintInit(low=0, high=2))
    x = (
        tensor("x", [100], dtype)
        if dtype != dtype_pb2.DTYPE_BOOL
        else tensor("x", [100], dtype, init=init)
    )
    args = [x, tensor("y", [100], dtype, OUT), scalar("n", 100), scalar("BLOCK", 128, meta=True)]
    out, _ = run(
        job(
            source(TRITON, COPY, args, grid=(1, 1, 1)),
            source(TORCH, IDENTITY),
            correct_trial_count=2,
            perf_trial_count=1,
        )
    )
    assert out.result.verdict == V.VERDICT_OK, out.result


def test_literal_data_and_half_precision_tolerance(run) -> None:
    data = np.linspace(-1, 1, 64, dtype="<f2")
    args = [
        tensor("x", [64], dtype_pb2.DTYPE_FLOAT16, data=data.tobytes()),
        tensor("y", [64], dtype_pb2.DTYPE_FLOAT16, OUT),
        scalar("n", 64),
        scalar("BLOCK", 64, meta=True),
    ]
    off = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x + 0.004 * x.abs()  # within 1e-2 relative: passes for float16
"""
    out, _ = run(job(source(TRITON, COPY, args, grid=(1, 1, 1)), source(TORCH, off)))
    assert out.result.verdict == V.VERDICT_OK and out.result.validation.rtol == pytest.approx(1e-2)
    assert out.result.validation.max_abs_error > 0


def test_wrong_argument_count_is_a_compile_error(run) -> None:
    args = add_args()[:3]
    out, _ = run(job(source(TRITON, ADD, args, grid=(4, 1, 1))))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR
    assert "takes 5 arguments (x_ptr, y_ptr, out_ptr, n, BLOCK) but the IOContract gives 3" in (
        out.result.compilation_error
    )
