"""Honest results: whose failure a verdict is (EvalResult.failed_side), a kernel that cannot
run on this host (VERDICT_CANNOT_RUN_HERE, `compiled` saying only what happened), and
`correctness_status` telling "not checked" from "checked and correct"; and what the clients'
helpers and the result cache make of them."""

from __future__ import annotations

import pytest
from engine_helpers import ADD_MODEL, HAS_GPU, KERNELBENCH, TORCH, TORCH_CUDA, V, job, source
from kerneleval import rl
from kerneleval.v1 import job_pb2
from kerneleval_server.engine import errors
from kerneleval_server.jobs import result_cache

KERNEL = ADD_MODEL.replace("class Model", "class ModelNew")  # no get_inputs of its own
NEW_ONLY = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b
"""
no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the answer of a host without a GPU")


def test_swapped_kernel_and_reference_blame_the_reference(run) -> None:
    # KernelBench's problem given as the kernel, its generated ModelNew as the reference.
    out, _ = run(job(source(TORCH, ADD_MODEL), source(TORCH, NEW_ONLY)))
    r = out.result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and r.failed_side == V.SIDE_REFERENCE
    assert r.compiled  # the kernel's source compiled; the reference lacks the inputs
    assert r.compilation_error.startswith("reference: no function get_inputs() in the reference")
    assert "are the kernel and the reference swapped?" in r.compilation_error
    # Without a reference the inputs are the kernel's to give: its own failure.
    out, _ = run(job(source(TORCH, NEW_ONLY)))
    r = out.result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and r.failed_side == V.SIDE_KERNEL
    assert not r.compiled and "swapped" not in r.compilation_error


@pytest.mark.parametrize(
    ("reference", "verdict", "message"),
    [
        ("import torch\nclass Model(:\n", V.VERDICT_COMPILE_ERROR, "reference: syntax error"),
        (
            ADD_MODEL.replace("return a + b", "raise KeyError('ref')"),
            V.VERDICT_RUNTIME_ERROR,
            "reference: 'ref'",
        ),
        (
            ADD_MODEL.replace("return [torch.randn", "raise ValueError('x')\n    return [torch"),
            V.VERDICT_RUNTIME_ERROR,
            "get_inputs(): x",
        ),
    ],
)
def test_failures_of_the_reference_say_so_and_leave_compiled_to_the_kernel(
    run, reference: str, verdict: int, message: str
) -> None:
    out, _ = run(job(source(TORCH, KERNEL), source(TORCH, reference)))
    r = out.result
    assert r.verdict == verdict and r.failed_side == V.SIDE_REFERENCE, r
    assert r.compiled
    assert (r.compilation_error or r.error.message).startswith(message)
    assert r.correctness_status == V.CORRECTNESS_UNSPECIFIED  # never reached
    with pytest.raises(rl.NoReward, match="the reference failed"):
        rl.reward(r)
    assert rl.reward(r, unscored_reward=-7.0) == -7.0


def test_failures_of_the_kernel_say_so(run) -> None:
    broken = KERNEL.replace("return a + b", "raise KeyError('kernel')")
    out, _ = run(job(source(TORCH, broken), source(TORCH, ADD_MODEL)))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.failed_side == V.SIDE_KERNEL
    assert rl.reward(r) == pytest.approx(0.1)  # compiled, then failed: as before
    wrong = KERNEL.replace("return a + b", "return a - b")
    out, _ = run(job(source(TORCH, wrong), source(TORCH, ADD_MODEL)))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT and r.failed_side == V.SIDE_KERNEL
    assert r.correctness_status == V.CORRECTNESS_FAILED and not r.correctness


def test_correctness_status_tells_not_checked_from_checked(run) -> None:
    out, _ = run(job(source(TORCH, ADD_MODEL)))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.failed_side == V.SIDE_UNSPECIFIED
    assert r.correctness_status == V.CORRECTNESS_NOT_CHECKED
    assert r.correctness  # kept for clients that read it as "it ran"
    assert r.validation.trial_count == 0 and r.validation.atol == 0  # no trial was judged
    out, _ = run(job(source(TORCH, KERNEL), source(TORCH, ADD_MODEL), correct_trial_count=2))
    r = out.result
    assert r.correctness_status == V.CORRECTNESS_PASSED and r.validation.trials_passed == 2


@no_gpu
def test_load_inline_without_cuda_cannot_run_here_and_did_not_compile(run) -> None:
    if not KERNELBENCH.exists():
        pytest.skip("no KernelBench copy")
    ex = KERNELBENCH / "examples"
    cand = source(TORCH_CUDA, (ex / "model_new_ex_add.py").read_text())
    out, _ = run(job(cand, source(TORCH, (ex / "model_ex_add.py").read_text())))
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and r.failed_side == V.SIDE_KERNEL
    assert not r.compiled and r.error.exception_type == "NoDeviceError"
    assert "the kernel's CUDA sources were not compiled" in " ".join(r.notes)
    with pytest.raises(rl.NoReward, match="could not run on the service's host"):
        rl.reward(r)


@no_gpu
def test_inputs_made_on_cuda_cannot_run_here_blaming_their_source(run) -> None:
    cuda_inputs = ADD_MODEL.replace("torch.randn(4, 64)", "torch.randn(4, 64, device='cuda')")
    out, _ = run(job(source(TORCH, KERNEL), source(TORCH, cuda_inputs)))
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and r.failed_side == V.SIDE_REFERENCE, r
    assert "Torch not compiled with CUDA enabled" in r.error.message
    # At import time it never got to compile: `compiled` is false.
    at_import = "import torch\nX = torch.ones(1, device='cuda')\n" + ADD_MODEL
    out, _ = run(job(source(TORCH, at_import)))
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and not r.compiled
    assert r.failed_side == V.SIDE_KERNEL


def test_classify_maps_missing_cuda_only() -> None:
    f = errors.classify(AssertionError("Torch not compiled with CUDA enabled"))
    assert f.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE
    assert errors.classify(ValueError("shapes differ")).verdict == job_pb2.VERDICT_RUNTIME_ERROR


def test_cannot_run_here_is_never_cached_and_is_named() -> None:
    assert job_pb2.VERDICT_CANNOT_RUN_HERE not in result_cache.CACHEABLE
    assert job_pb2.Verdict.Name(11) == "VERDICT_CANNOT_RUN_HERE"


def test_rl_scores_results_without_the_new_fields_as_before() -> None:
    # What an older service sends: no failed_side, no correctness_status.
    old = job_pb2.EvalResult(verdict=job_pb2.VERDICT_COMPILE_ERROR, compiled=False)
    assert rl.reward(old) == 0.0
    old = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK, compiled=True, correctness=True)
    assert rl.reward(old) == pytest.approx(0.3)
