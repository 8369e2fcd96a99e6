"""Every verdict reachable without a GPU, through run_job, with the details a user needs."""

from __future__ import annotations

import pytest
from engine_helpers import (
    ADD_MODEL,
    CUDA,
    TORCH,
    TORCH_CUDA,
    TRITON,
    V,
    job,
    needs_nvcc,
    source,
    tensor,
)
from kerneleval.v1 import job_pb2
from kerneleval_server.engine import DeviceLimits
from kerneleval_server.spec.validation import Limits

BROKEN_FORWARD = ADD_MODEL.replace("return a + b", "return {body}")


def model(body: str) -> str:
    return BROKEN_FORWARD.format(body=body)


def test_evaluate_ok_reports_phases_and_cpu_timing(run) -> None:
    out, rep = run(job(source(TORCH, ADD_MODEL), perf_trial_count=20))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.compiled and r.correctness
    assert not out.context_poisoned
    assert rep.phases() == [V.PHASE_COMPILING, V.PHASE_VALIDATING, V.PHASE_PROFILING]
    assert r.runtime.trial_count == 20 and r.runtime.source == V.TIMING_SOURCE_CPU_WALL_CLOCK
    assert 0 < r.runtime.min_ms <= r.runtime.median_ms <= r.runtime.max_ms
    assert r.runtime.p95_ms <= r.runtime.p99_ms <= r.runtime.max_ms and not r.runtime.l2_flushed
    assert r.device.name == "cpu" and r.device.index == -1 and r.device.torch_version
    assert any("monotonic clock" in n for n in r.notes)
    prof = [e for e in rep.events if e[0] == "progress" and e[1] == V.PHASE_PROFILING]
    assert prof[-1][2:] == (20, 20) and len(prof) <= 10  # every few trials, not every one


def test_compare_ok_fills_validation_and_speedup(run) -> None:
    cand = ADD_MODEL.replace("class Model", "class ModelNew")
    out, rep = run(job(source(TORCH, cand), source(TORCH, ADD_MODEL), correct_trial_count=4))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.correctness
    assert r.validation.trial_count == 4 and r.validation.trials_passed == 4
    assert r.validation.atol == pytest.approx(1e-4) and r.validation.max_abs_error == 0
    assert r.speedup > 0 and r.reference_runtime.trial_count == 3
    val = [e[2:] for e in rep.events if e[0] == "progress" and e[1] == V.PHASE_VALIDATING]
    assert val == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_perf_trial_count_zero_skips_timing(run) -> None:
    out, rep = run(job(source(TORCH, ADD_MODEL), perf_trial_count=0))
    assert out.result.verdict == V.VERDICT_OK and out.result.runtime.trial_count == 0
    assert V.PHASE_PROFILING not in rep.phases()


def test_syntax_error_is_a_compile_error_with_the_line(run) -> None:
    out, _ = run(job(source(TORCH, "import torch\nclass Model(:\n    pass\n")))
    r = out.result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and not r.compiled
    assert "syntax error at line 2" in r.compilation_error


def test_missing_entry_point_says_what_is_missing(run) -> None:
    out, _ = run(job(source(TORCH, "import torch\ndef get_inputs():\n    return []\n")))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR
    assert out.result.compilation_error == "no class ModelNew or Model in the source"
    out, _ = run(job(source(TORCH, ADD_MODEL, entry="Missing")))
    assert out.result.compilation_error == "no class Missing in the source"
    cand = source(TORCH, ADD_MODEL, entry="ModelNew")
    out, _ = run(job(cand, source(TORCH, ADD_MODEL)))
    assert out.result.compilation_error == "no class ModelNew in the source"


def test_import_time_exception_and_missing_get_inputs(run) -> None:
    out, _ = run(job(source(TORCH, "import torch\nraise ValueError('boom')\n")))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR
    assert "ValueError: boom" in out.result.compilation_error
    no_inputs = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x): return x\n"
    out, _ = run(job(source(TORCH, no_inputs)))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR
    assert "no function get_inputs()" in out.result.compilation_error


def test_unknown_triton_entry_point(run) -> None:
    src = "import triton\n@triton.jit\ndef k(x):\n    pass\n"
    out, _ = run(job(source(TRITON, src, [tensor("x", [4])], grid=(1, 1, 1), entry="other")))
    assert out.result.compilation_error == "no @triton.jit function other in the source"
    two = src + "@triton.jit\ndef k2(x):\n    pass\n"
    out, _ = run(job(source(TRITON, two, [tensor("x", [4])], grid=(1, 1, 1))))
    assert "defines 2 @triton.jit functions (k, k2): set entry_point" in (
        out.result.compilation_error
    )


def test_incorrect_fills_the_validation_report(run) -> None:
    cand = source(
        TORCH, model("a + b + (a > 1.5).float()").replace("class Model", "class ModelNew")
    )
    out, _ = run(job(cand, source(TORCH, ADD_MODEL), correct_trial_count=3))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT and r.compiled and not r.correctness
    v = r.validation
    assert v.trial_count == 3 and v.trials_passed == 0
    assert v.max_abs_error == pytest.approx(1.0) and v.max_rel_error > 0
    assert 0 < v.mismatch_count < v.element_count == 256
    assert len(v.first_mismatch_index) == 2 and v.output_name == "output[0]"
    assert "0 of 3 trials passed" in r.validation_error and "expected" in r.validation_error
    assert r.runtime.trial_count == 0  # an incorrect kernel is not timed


def test_shape_and_dtype_mismatches_are_incorrect(run) -> None:
    ref = source(TORCH, ADD_MODEL)
    out, _ = run(job(source(TORCH, model("(a + b)[:2]")), ref))
    assert out.result.verdict == V.VERDICT_INCORRECT
    assert "shape (2, 64) differs from the reference's (4, 64)" in out.result.validation_error
    out, _ = run(job(source(TORCH, model("(a + b).double()")), ref))
    assert "dtype torch.float64 differs" in out.result.validation_error
    out, _ = run(job(source(TORCH, model("(a + b, a)")), ref))
    assert "returned 2 outputs, the reference 1" in out.result.validation_error


def test_nan_never_passes_even_against_nan(run) -> None:
    nan = model("a * float('nan')")
    out, _ = run(job(source(TORCH, nan), source(TORCH, nan)))
    assert out.result.verdict == V.VERDICT_INCORRECT


def test_runtime_error_has_the_kernels_traceback(run) -> None:
    out, _ = run(job(source(TORCH, model("a.no_such_method()"))))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.compiled
    assert r.error.exception_type == "AttributeError" and "no_such_method" in r.error.message
    assert r.error.traceback.startswith("Traceback") and "ke_kernel_" in r.error.traceback
    assert "in forward" in r.error.traceback and not out.context_poisoned


@pytest.mark.parametrize(
    "raise_stmt",
    [
        "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')",
        "MemoryError()",
        "RuntimeError('[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: "
        "can\\'t allocate memory: you tried to allocate 80000000000 bytes.')",
    ],
)
def test_out_of_memory(run, raise_stmt: str) -> None:
    src = ADD_MODEL.replace("return a + b", f"raise {raise_stmt}")
    out, _ = run(job(source(TORCH, src)))
    assert out.result.verdict == V.VERDICT_OUT_OF_MEMORY
    assert "allocator:" in out.result.error.message and not out.context_poisoned


@pytest.mark.parametrize(
    ("message", "name", "code"),
    [
        (
            "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
            "asynchronously reported",
            "cudaErrorIllegalAddress",
            700,
        ),
        ("CUDA error: misaligned address", "cudaErrorMisalignedAddress", 716),
        ("CUDA error: unspecified launch failure", "cudaErrorLaunchFailure", 719),
        (
            "Triton Error [CUDA]: an illegal memory access was encountered",
            "cudaErrorIllegalAddress",
            700,
        ),
        (
            "CUDA error: cuLaunchKernel: CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory "
            "access was encountered",
            "cudaErrorIllegalAddress",
            700,
        ),
        ("CUDA error: device-side assert triggered", "cudaErrorAssert", 710),
    ],
)
def test_cuda_errors_are_device_faults_that_poison_the_context(
    run, message: str, name: str, code: int
) -> None:
    src = ADD_MODEL.replace("return a + b", f"raise RuntimeError({message!r})")
    out, _ = run(job(source(TORCH, src)))
    r = out.result
    assert r.verdict == V.VERDICT_DEVICE_FAULT
    assert (r.error.cuda_error_name, r.error.cuda_error_code) == (name, code)
    assert out.context_poisoned


def test_non_sticky_cuda_error_keeps_the_context(run) -> None:
    src = ADD_MODEL.replace(
        "return a + b", "raise RuntimeError('CUDA error: invalid configuration argument')"
    )
    out, _ = run(job(source(TORCH, src)))
    assert out.result.verdict == V.VERDICT_DEVICE_FAULT
    assert out.result.error.cuda_error_code == 9 and not out.context_poisoned


def test_triton_out_of_resources_is_a_resource_limit(run) -> None:
    src = ADD_MODEL.replace(
        "return a + b",
        "from triton.runtime.errors import OutOfResources\n"
        "        raise OutOfResources(1049600, 232448, 'shared memory')",
    )
    out, _ = run(job(source(TORCH, src)))
    r = out.result
    assert r.verdict == V.VERDICT_RESOURCE_LIMIT
    assert "1049600" in r.error.message and "232448" in r.error.message


CUDA_COPY = """
__global__ void copy(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
__global__ void scale(float* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= s;
}
"""


def cuda_job(code: str = CUDA_COPY, entry: str = "copy", block: int = 256, shared: int = 0):
    from engine_helpers import OUT, scalar

    args = [tensor("x", [1024]), tensor("y", [1024], role=OUT), scalar("n", 1024)]
    return job(
        source(CUDA, code, args, grid=(4, 1, 1), block=(block, 1, 1), entry=entry, shared=shared)
    )


@needs_nvcc
def test_cuda_compiles_then_says_it_cannot_run_without_a_gpu(run) -> None:
    out, rep = run(cuda_job())
    r = out.result
    assert r.compiled and r.verdict == V.VERDICT_CANNOT_RUN_HERE
    assert r.failed_side == V.SIDE_KERNEL
    assert r.error.message.startswith("no CUDA device: copy compiled for sm_")
    assert any("compiled but cannot run" in n for n in r.notes)
    assert any(n.startswith("ptxas (copy, sm_") and "registers" in n for n in r.notes)
    assert any(e[0] == "log" and "ptxas" in e[1] for e in rep.events)  # the compile log


@needs_nvcc
def test_cuda_compile_error_and_entry_points(run) -> None:
    out, _ = run(cuda_job(CUDA_COPY + "\n__global__ void broken( { }\n"))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR and "nvcc failed" in (
        out.result.compilation_error
    )
    assert "error" in out.result.compilation_error
    out, _ = run(cuda_job(entry="nope"))
    assert out.result.compilation_error == "no __global__ function nope in the source (copy, scale)"
    out, _ = run(cuda_job(entry=""))
    assert "defines 2 __global__ functions" in out.result.compilation_error


@needs_nvcc
def test_cuda_preflight_with_device_limits(run) -> None:
    limits = DeviceLimits(max_shared_memory_per_block_optin=232448)
    out, _ = run(cuda_job(block=2048), device_limits=limits)
    r = out.result
    assert r.verdict == V.VERDICT_RESOURCE_LIMIT and r.compiled
    assert "2048 threads" in r.error.message and "1024" in r.error.message
    out, _ = run(cuda_job(shared=300_000), device_limits=limits)
    assert out.result.verdict == V.VERDICT_RESOURCE_LIMIT
    assert "300000" in out.result.error.message and "232448" in out.result.error.message


def test_torch_cuda_without_cuda_is_reported_honestly(run) -> None:
    from engine_helpers import KERNELBENCH, needs_kernelbench  # noqa: F401

    if not KERNELBENCH.exists():
        pytest.skip("no KernelBench copy")
    ex = KERNELBENCH / "examples"
    cand = source(TORCH_CUDA, (ex / "model_new_ex_add.py").read_text())
    out, _ = run(job(cand, source(TORCH, (ex / "model_ex_add.py").read_text())))
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and r.error.message.startswith("no CUDA device")
    assert not r.compiled  # its CUDA sources were not compiled
    assert any("load_inline('elementwise_add') needs a CUDA build of torch" in n for n in r.notes)
    out, _ = run(job(source(TORCH_CUDA, "from torch.utils.cpp_extension import load_inline\n(")))
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR


def test_invalid_spec_is_rejected_before_anything_runs(run) -> None:
    spec = job(source(TORCH, ADD_MODEL, [tensor("x", [10_000, 1_000])]))
    out, rep = run(spec, limits=Limits(max_tensor_elements=1_000_000))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.error.exception_type == "InvalidArgument"
    assert "10000000 elements is over the limit of 1000000" in r.error.message
    assert rep.phases() == []


def test_reporter_failures_propagate(engine_dir) -> None:
    from kerneleval_server.engine import EngineConfig, run_job

    class Cancelled(Exception):
        pass

    class Rep:
        def phase(self, phase: int) -> None:
            if phase == job_pb2.PHASE_PROFILING:
                raise Cancelled()

        def progress(self, phase: int, done: int, total: int) -> None:
            pass

        def log(self, text: str) -> None:
            pass

    with pytest.raises(Cancelled):
        run_job(job(source(TORCH, ADD_MODEL)), Rep(), EngineConfig(work_dir=engine_dir))


def test_sys_exit_in_kernel_code_is_a_runtime_error(run) -> None:
    out, _ = run(job(source(TORCH, model("__import__('sys').exit(3)"))))
    assert out.result.verdict == V.VERDICT_RUNTIME_ERROR
    assert out.result.error.exception_type == "SystemExit"


def test_global_torch_settings_do_not_leak_into_the_next_job(run) -> None:
    import sys

    import torch

    body = "(torch.set_default_dtype(torch.float64), a + b)[1]"
    before = torch.get_default_dtype()
    out, _ = run(job(source(TORCH, model(body))))
    assert out.result.verdict == V.VERDICT_OK
    assert torch.get_default_dtype() == before
    assert not [m for m in sys.modules if m.startswith("ke_kernel_")]  # modules are dropped


def test_kernels_run_without_autograd(run) -> None:
    cand = model("a + b if not torch.is_grad_enabled() else a - b")
    out, _ = run(job(source(TORCH, cand), source(TORCH, ADD_MODEL)))
    assert out.result.verdict == V.VERDICT_OK


def test_get_inputs_over_the_byte_limit_is_refused(run) -> None:
    out, _ = run(job(source(TORCH, ADD_MODEL)), limits=Limits(max_total_tensor_bytes=1000))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.error.exception_type == "InvalidArgument"
    assert "get_inputs() made 2048 bytes of tensors, over the limit of 1000 bytes" in (
        r.error.message
    )
