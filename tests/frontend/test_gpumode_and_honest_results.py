"""GPU MODE's format and the honest results through a real service process with real workers
(on the CPU): a task directory sent as the client builds it, the service's field checks, a
swapped Compare blamed on the reference, and a kernel that cannot run here never cached."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from ke_service import ServiceProcess
from kerneleval import gpumode
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

TASK = Path(__file__).resolve().parents[1] / "gpumode_tasks" / "softmax_py"
LIST_TASK = TASK.parent / "grouped_matmul_py"  # its cases hold lists
FAST = kernel_pb2.EvalOptions(perf_trial_count=3, warmup_count=1)
MODEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(4, 64), torch.randn(4, 64)]
def get_init_inputs():
    return []
"""
MODEL_NEW = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b
"""
# KernelBench's load_inline convention; on a host without CUDA its CUDA is never compiled.
LOAD_INLINE = """
import torch
from torch.utils.cpp_extension import load_inline
ext = load_inline("add_ext_MARK", cpp_sources="torch::Tensor add(torch::Tensor a);",
                  cuda_sources="// a CUDA kernel", functions=["add"])
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return ext.add(a, b)
"""


@pytest.fixture(scope="module")
def stub(
    kerneleval_service: ServiceProcess,
) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with kerneleval_service.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def evaluate(stub, spec: kernel_pb2.JobSpec) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    return stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=180).job


def test_a_gpu_mode_task_runs_as_its_harness_runs_it(stub) -> None:  # type: ignore[no-untyped-def]
    job = evaluate(stub, gpumode.spec_from_directory(TASK, options=FAST))
    r = job.result
    assert job.state == job_pb2.JOB_STATE_DONE and r.verdict == job_pb2.VERDICT_OK, r
    assert r.correctness_status == job_pb2.CORRECTNESS_PASSED
    assert [c.passed for c in r.test_cases] == [True, True, True]
    assert [c.spec for c in r.benchmark_cases] == [
        "rows: 32; cols: 256; seed: 31232",
        "rows: 64; cols: 512; seed: 4052",
    ]
    assert all(c.runtime.trial_count == 3 and c.speedup > 0 for c in r.benchmark_cases)
    assert r.runtime.median_ms > 0 and r.speedup > 0

    wrong = gpumode.spec_from_directory(TASK, TASK / "wrong_submission.py", options=FAST)
    r = evaluate(stub, wrong).result
    assert r.verdict == job_pb2.VERDICT_INCORRECT and r.failed_side == job_pb2.SIDE_KERNEL
    assert r.validation_error.startswith("1 of 5 cases passed; test 1 (rows: 4; cols: 33;")


def test_a_task_whose_cases_hold_lists_runs(stub) -> None:  # type: ignore[no-untyped-def]
    """nvfp4_group_gemm's shape through the service: the fixture's generate_input raises
    unless it gets m, n and k as tuples of g ints; the submission's process records a list of
    tensors per case and its judge checks them."""
    job = evaluate(stub, gpumode.spec_from_directory(LIST_TASK, options=FAST))
    r = job.result
    assert job.state == job_pb2.JOB_STATE_DONE and r.verdict == job_pb2.VERDICT_OK, r
    assert r.test_cases[1].spec == "m: [4, 12, 20]; n: [8, 8, 24]; k: [16, 8, 8]; g: 3; seed: 2222"
    assert [c.passed for c in r.test_cases] == [True, True, True]
    assert r.benchmark_cases[0].runtime.trial_count == 3 and r.speedup > 0
    wrong = gpumode.spec_from_directory(LIST_TASK, LIST_TASK / "wrong_submission.py", options=FAST)
    r = evaluate(stub, wrong).result
    assert r.verdict == job_pb2.VERDICT_INCORRECT, r
    assert [c.passed for c in r.test_cases] == [False, False, True]


def test_a_gpu_mode_kernel_without_its_reference_is_invalid(stub) -> None:  # type: ignore[no-untyped-def]
    spec = gpumode.spec_from_directory(TASK, options=FAST)
    spec.ClearField("reference")
    with pytest.raises(grpc.RpcError) as info:
        evaluate(stub, spec)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["spec.reference"]


def test_compare_with_kernel_and_reference_swapped_blames_the_reference(stub) -> None:  # type: ignore[no-untyped-def]
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=MODEL),
        reference=kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=MODEL_NEW),
        options=FAST,
    )
    job = stub.Compare(pb.CompareRequest(spec=spec), timeout=180).job
    r = job.result
    assert r.verdict == job_pb2.VERDICT_COMPILE_ERROR and r.failed_side == job_pb2.SIDE_REFERENCE
    assert r.compiled and "swapped?" in r.compilation_error


# KernelBench level 2's 66_Matmul_Dropout_Softmax, smaller: its forward draws dropout masks
# (a Model is in training mode), so the reference agrees with itself only where both runs
# draw the same numbers.
DROPOUT = """
import torch
class Model(torch.nn.Module):
    def __init__(self, n, p):
        super(Model, self).__init__()
        self.matmul = torch.nn.Linear(n, n)
        self.dropout = torch.nn.Dropout(p)
    def forward(self, x):
        return torch.softmax(self.dropout(self.matmul(x)), dim=1)
def get_inputs():
    return [torch.rand(64, 64)]
def get_init_inputs():
    return [64, 0.2]
"""


def test_a_reference_that_draws_random_numbers_agrees_with_itself(stub) -> None:  # type: ignore[no-untyped-def]
    """Both processes seed torch's generators the same way right before each run on a
    trial's inputs (TrialArgs.seed), the judge's timed calls too: a Model against itself is
    OK, checks and timed calls alike (it was INCORRECT on an H200, and on the CPU)."""
    same = DROPOUT + "\nclass ModelNew(Model):\n    pass\n"
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=same),
        reference=kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=DROPOUT),
        options=kernel_pb2.EvalOptions(perf_trial_count=8, warmup_count=1),
    )
    r = stub.Compare(pb.CompareRequest(spec=spec), timeout=180).job.result
    assert r.verdict == job_pb2.VERDICT_OK, (r.validation_error, r.error.message)
    assert any(n.startswith("timed from outside its process") for n in r.notes), r.notes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a host without a GPU")
def test_a_kernel_that_cannot_run_here_is_neither_a_crash_nor_cached(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A service of its own with the result cache on (the shared one has it off).
    root = tmp_path_factory.mktemp("cannot-run-here")
    nvml = root / "fake_nvml"
    nvml.write_text("device 0 name=FakeGPU uuid=GPU-fake-9 memory_total=1000000\n")
    service = ServiceProcess(
        root / "state",
        ["--nvml", "fake", "--fake-nvml-path", str(nvml), "--result-cache-hours", "24"],
    )
    service.start()
    try:
        with service.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            spec = kernel_pb2.JobSpec(
                kernel=kernel_pb2.KernelSource(
                    type=kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
                    source_code=LOAD_INLINE.replace("MARK", uuid.uuid4().hex[:8]),
                ),
                reference=kernel_pb2.KernelSource(
                    type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=MODEL
                ),
                options=FAST,
            )
            first, again = evaluate(stub, spec), evaluate(stub, spec)
            for job in (first, again):
                r = job.result
                assert r.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, r
                assert not r.compiled and r.failed_side == job_pb2.SIDE_KERNEL
                assert job.result_origin == job_pb2.RESULT_ORIGIN_RUN
            # The cache is on: an OK job asked twice is answered from it.
            ok = kernel_pb2.JobSpec(options=FAST)
            ok.kernel.CopyFrom(spec.reference)
            ok.kernel.source_code += f"# {uuid.uuid4().hex}\n"
            evaluate(stub, ok)
            assert evaluate(stub, ok).result_origin == job_pb2.RESULT_ORIGIN_CACHE
    finally:
        service.stop()
