"""On a GPU: the paths a CPU cannot take (skipped without one; bench/gpu_engine_check.py covers
the rest, including faults that kill the process's CUDA context)."""

from __future__ import annotations

from engine_helpers import (
    ADD_MODEL,
    CUDA,
    OUT,
    TORCH,
    V,
    gpu,
    job,
    needs_gpu,
    scalar,
    source,
    tensor,
)

pytestmark = [gpu, needs_gpu]

CUDA_ADD = """
extern "C" __global__ void add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
"""
TORCH_ADD = ADD_MODEL


def test_torch_on_the_gpu_is_timed_with_cuda_events(run) -> None:
    out, _ = run(job(source(TORCH, ADD_MODEL), perf_trial_count=20))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.runtime.source == V.TIMING_SOURCE_CUDA_EVENTS
    assert r.runtime.l2_flushed and r.device.name != "cpu"


def test_raw_cuda_against_torch(run) -> None:
    args = [
        tensor("a", [4, 64]),
        tensor("b", [4, 64]),
        tensor("c", [4, 64], role=OUT),
        scalar("n", 256),
    ]
    k = source(CUDA, CUDA_ADD, args, grid=(1, 1, 1), block=(256, 1, 1))
    out, _ = run(job(k, source(TORCH, TORCH_ADD)))
    assert out.result.verdict == V.VERDICT_OK, out.result


def test_raw_cuda_block_too_large_is_a_resource_limit(run) -> None:
    args = [tensor("a", [64]), tensor("b", [64]), tensor("c", [64], role=OUT), scalar("n", 64)]
    k = source(CUDA, CUDA_ADD, args, grid=(1, 1, 1), block=(2048, 1, 1))
    out, _ = run(job(k))
    assert out.result.verdict == V.VERDICT_RESOURCE_LIMIT and not out.context_poisoned


def test_a_job_process_reports_its_peak_memory_as_torch_counts_it() -> None:
    """The runtime's peak (what memory admission learns a problem needs) read from the nested
    statistics, not the flattened ones: the same number."""
    import torch
    from kerneleval_server.jobproc import hygiene

    hygiene._reset_peak_memory()
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert hygiene._peak_memory() == torch.cuda.max_memory_reserved() >= 64 << 20
    del block
