"""KernelBench workloads, read from the shared copy (never copied into the repo): the example
pairs and a few level-1 problems scaled down through the IOContract."""

from __future__ import annotations

import pytest
from engine_helpers import (
    KERNELBENCH,
    TORCH,
    TORCH_CUDA,
    TRITON,
    V,
    job,
    needs_kernelbench,
    source,
    tensor,
)
from kerneleval.v1 import dtype_pb2, kernel_pb2

pytestmark = needs_kernelbench
EXAMPLES = KERNELBENCH / "examples"
LEVEL1 = KERNELBENCH / "level1"


def read(path) -> str:
    return path.read_text()


def test_example_add_triton_model_new_against_model(run) -> None:
    cand = source(TRITON, read(EXAMPLES / "model_new_ex_add_triton.py"))
    out, _ = run(job(cand, source(TORCH, read(EXAMPLES / "model_ex_add.py"))))
    r = out.result
    assert r.verdict == V.VERDICT_OK, r
    assert r.validation.trials_passed == 5 and r.speedup > 0


@pytest.mark.parametrize("name", ["model_new_ex_fuse_gelu.py", "model_new_ex_tiled_matmul.py"])
def test_example_load_inline_reaches_the_build_and_says_it_cannot_run(run, name: str) -> None:
    ref = name.replace("model_new_", "model_")
    out, _ = run(
        job(source(TORCH_CUDA, read(EXAMPLES / name)), source(TORCH, read(EXAMPLES / ref)))
    )
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and r.error.message.startswith("no CUDA device")
    assert not r.compiled and r.failed_side == V.SIDE_KERNEL
    assert any("needs a CUDA build of torch" in n for n in r.notes)


def scaled(problem: str, args: list[kernel_pb2.ArgSpec]) -> kernel_pb2.KernelSource:
    return source(TORCH, read(LEVEL1 / problem), args)


SOFTMAX_NEW = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, x):
        e = torch.exp(x - x.max(dim=1, keepdim=True).values)
        return e / e.sum(dim=1, keepdim=True)
"""


def test_level1_softmax_scaled_down_against_a_handwritten_candidate(run) -> None:
    args = [tensor("x", [16, 512])]
    out, _ = run(job(source(TORCH, SOFTMAX_NEW, args), scaled("23_Softmax.py", args)))
    assert out.result.verdict == V.VERDICT_OK, out.result
    assert 0 < out.result.validation.max_abs_error < 1e-6


@pytest.mark.parametrize(
    ("problem", "shapes"),
    [
        ("19_ReLU.py", [[32, 256]]),
        ("1_Square_matrix_multiplication_.py", [[64, 64], [64, 64]]),
        ("4_Matrix_vector_multiplication_.py", [[64, 128], [128, 1]]),
        ("67_conv_standard_1D.py", [[2, 64, 128]]),
        ("33_BatchNorm.py", [[2, 64, 8, 8]]),
    ],
)
def test_level1_problem_against_itself(run, problem: str, shapes: list[list[int]]) -> None:
    """Model and ModelNew built from the same source get the same weights (seeded as
    KernelBench does), so the problem must pass against itself."""
    args = [tensor(f"x{i}", s) for i, s in enumerate(shapes)]
    cand = scaled(problem, args)
    cand.source_code += "\n\nclass ModelNew(Model):\n    pass\n"
    out, _ = run(job(cand, scaled(problem, args), correct_trial_count=2, perf_trial_count=2))
    assert out.result.verdict == V.VERDICT_OK, out.result
    assert out.result.validation.max_abs_error == 0


def test_level1_cross_entropy_with_integer_targets(run) -> None:
    init = kernel_pb2.TensorInit(randint=kernel_pb2.RandintInit(low=0, high=100))
    args = [tensor("p", [64, 100]), tensor("t", [64], dtype_pb2.DTYPE_INT64, init=init)]
    out, _ = run(job(scaled("95_CrossEntropyLoss.py", args)))
    assert out.result.verdict == V.VERDICT_OK and out.result.correctness


def test_different_init_seed_changes_weights(run) -> None:
    """A candidate whose weights differ from the reference's fails: the check is real."""
    args = [tensor("x", [2, 64, 128])]
    cand = scaled("67_conv_standard_1D.py", args)
    cand.source_code += (
        "\n\nclass ModelNew(Model):\n    def __init__(self, *a):\n"
        "        torch.manual_seed(1234)\n        super().__init__(*a)\n"
    )
    out, _ = run(job(cand, scaled("67_conv_standard_1D.py", args), perf_trial_count=0))
    assert out.result.verdict == V.VERDICT_INCORRECT
