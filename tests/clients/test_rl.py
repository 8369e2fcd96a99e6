"""kerneleval.rl: the reward's shapings and edge cases, and code taken out of completions."""

from __future__ import annotations

import functools
import math

import pytest
from fake_server import FakeServer
from kerneleval import contracts, rl
from kerneleval.client import Client
from kerneleval.v1 import job_pb2, kernel_pb2

# --- reward -----------------------------------------------------------------------------------


def result(
    verdict: int = job_pb2.VERDICT_OK,
    *,
    compiled: bool = True,
    speedup: float = 0.0,
    flags: tuple[str, ...] = (),
) -> job_pb2.EvalResult:
    r = job_pb2.EvalResult(verdict=verdict, compiled=compiled, speedup=speedup)  # type: ignore[arg-type]
    r.correctness = verdict == job_pb2.VERDICT_OK
    for rule in flags:
        r.flags.add(rule_id=rule, message="seen", source=job_pb2.FLAG_SOURCE_STATIC)
    return r


def job(
    r: job_pb2.EvalResult, state: int = job_pb2.JOB_STATE_DONE, reason: str = ""
) -> job_pb2.Job:
    return job_pb2.Job(job_id="job-1", state=state, result=r, state_reason=reason)  # type: ignore[arg-type]


def test_default_shaping_ladder():
    assert rl.reward(None) == 0.0
    assert rl.reward(result(job_pb2.VERDICT_COMPILE_ERROR, compiled=False)) == 0.0
    assert rl.reward(result(job_pb2.VERDICT_INCORRECT)) == pytest.approx(0.1)
    assert rl.reward(result(job_pb2.VERDICT_OK)) == pytest.approx(0.3)  # not timed
    assert rl.reward(result(job_pb2.VERDICT_OK, speedup=2.0)) == pytest.approx(2.3)


@pytest.mark.parametrize(
    "verdict",
    [
        job_pb2.VERDICT_INCORRECT,
        job_pb2.VERDICT_RUNTIME_ERROR,
        job_pb2.VERDICT_DEVICE_FAULT,
        job_pb2.VERDICT_CRASHED,
        job_pb2.VERDICT_TIMEOUT,
        job_pb2.VERDICT_OUT_OF_MEMORY,
        job_pb2.VERDICT_RESOURCE_LIMIT,
    ],
)
def test_failures_after_compiling_get_the_compile_reward(verdict: int):
    assert rl.reward(result(verdict), compile_reward=0.25) == 0.25
    # The same failure before the source compiled (e.g. a crash while building) is not.
    assert rl.reward(result(verdict, compiled=False), compile_error_reward=-0.5) == -0.5


def test_a_compile_error_is_never_compiled():
    assert rl.reward(result(job_pb2.VERDICT_COMPILE_ERROR, compiled=True)) == 0.0


def test_linear_speedup_is_clipped():
    assert rl.reward(result(speedup=50.0)) == pytest.approx(10.3)
    assert rl.reward(result(speedup=0.01)) == pytest.approx(0.3 + 0.1)
    assert rl.reward(result(speedup=3.0), speedup_weight=0.5) == pytest.approx(1.8)
    assert rl.reward(result(speedup=50.0), speedup_clip=(0.1, 4.0)) == pytest.approx(4.3)
    assert rl.reward(result(speedup=50.0), speedup_clip=(0.1, math.inf)) == pytest.approx(50.3)


def test_log_speedup():
    log = functools.partial(rl.reward, speedup_shaping="log")
    assert log(result(speedup=1.0)) == pytest.approx(0.3)
    assert log(result(speedup=4.0)) == pytest.approx(2.3)
    assert log(result(speedup=0.5)) == pytest.approx(-0.7), "slower than the reference"
    assert log(result(speedup=0.5), speedup_clip=(1.0, 10.0)) == pytest.approx(0.3)
    assert log(result(speedup=1e6)) == pytest.approx(0.3 + math.log2(10))
    assert log(result(speedup=0.0)) == pytest.approx(0.3), "not timed: no term"


def test_no_speedup_term():
    assert rl.reward(result(speedup=8.0), speedup_shaping="none", correct_reward=1.0) == 1.0


def test_nan_speedup_gives_no_term():
    assert rl.reward(result(speedup=math.nan)) == pytest.approx(0.3)


def test_flagged_and_rejected_results():
    flagged = result(speedup=9.0, flags=("timer_patch",))
    assert rl.reward(flagged) == 0.0
    assert rl.reward(flagged, flagged_reward=-1.0) == -1.0
    assert rl.reward(flagged, ignore_flags={"timer_patch"}) == pytest.approx(9.3)
    both = result(speedup=9.0, flags=("timer_patch", "thread_spawn"))
    assert rl.reward(both, ignore_flags={"timer_patch"}, flagged_reward=-1) == -1.0
    rejected = result(job_pb2.VERDICT_REJECTED, compiled=False, flags=("timer_patch",))
    assert rl.reward(rejected, flagged_reward=-0.5) == -0.5
    assert rl.reward(rejected, flagged_reward=-0.5, ignore_flags={"timer_patch"}) == -0.5
    # A flagged failure gets the flag's reward too (a penalty is a penalty).
    flagged_fail = result(job_pb2.VERDICT_INCORRECT, flags=("stream_use",))
    assert rl.reward(flagged_fail, flagged_reward=-1.0) == -1.0


def test_jobs_and_events_are_accepted():
    assert rl.reward(job(result(speedup=2.0))) == pytest.approx(2.3)
    event = job_pb2.JobEvent(job_id="job-1", sequence=9, finished=job(result(speedup=2.0)))
    assert rl.reward(event) == pytest.approx(2.3)


@pytest.mark.parametrize(
    ("item", "why"),
    [
        (job(result(job_pb2.VERDICT_UNSPECIFIED), job_pb2.JOB_STATE_RUNNING), "RUNNING"),
        (job(result(), job_pb2.JOB_STATE_FAILED, "worker lost"), "FAILED \\(worker lost\\)"),
        (job(result(), job_pb2.JOB_STATE_CANCELLED), "CANCELLED"),
        (job(job_pb2.EvalResult()), "no verdict"),
        (job_pb2.EvalResult(), "no verdict"),
        (job_pb2.JobEvent(job_id="job-1", sequence=3), "not its last"),
        # A result of a failed job read alone: the service's failure, not the kernel's.
        (result(job_pb2.VERDICT_SERVICE_ERROR), "the service could not finish the job"),
    ],
)
def test_results_that_do_not_score_the_kernel(item, why: str):
    with pytest.raises(rl.NoReward, match=why):
        rl.reward(item)
    assert rl.reward(item, unscored_reward=-7.0) == -7.0
    assert issubclass(rl.NoReward, ValueError)


def test_bad_arguments():
    with pytest.raises(ValueError, match="speedup_clip"):
        rl.reward(result(), speedup_clip=(0.0, 10.0))
    with pytest.raises(ValueError, match="speedup_clip"):
        rl.reward(result(), speedup_clip=(5.0, 1.0))
    with pytest.raises(ValueError, match="speedup_shaping"):
        rl.reward(result(), speedup_shaping="square")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Job, an EvalResult"):
        rl.reward("OK")  # type: ignore[arg-type]


# --- code from completions ----------------------------------------------------------------

LOAD_INLINE_MODELNEW = '''import torch
from torch.utils.cpp_extension import load_inline

cuda_src = """
__global__ void relu_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0 ? x[i] : 0;
}
"""
relu = load_inline(name="relu", cpp_sources="", cuda_sources=cuda_src, functions=["relu"])


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return relu.relu(x)
'''

KERNELBENCH_COMPLETION = f"""The problem is a ReLU:

```python
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)
```

I'll fuse it into one CUDA kernel.

```python
{LOAD_INLINE_MODELNEW}```

You can check it with:

```python
model = ModelNew().cuda()
print(model(torch.randn(16, device="cuda")))
```
"""

TRITON_MODELNEW = """import torch
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=offs < n), 0), mask=offs < n)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y
"""

CUDA_KERNEL = """#include <cuda_runtime.h>

__global__ void add(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"""


def test_kernelbench_completion_takes_the_modelnew_block():
    ks = rl.kernel_from_completion(KERNELBENCH_COMPLETION)
    assert ks.source_code == LOAD_INLINE_MODELNEW
    assert ks.type == kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    typed = rl.kernel_from_completion(KERNELBENCH_COMPLETION, kernel_type="torch_cuda")
    assert typed.source_code == LOAD_INLINE_MODELNEW
    assert typed.type == kernel_pb2.KERNEL_TYPE_TORCH_CUDA


def test_triton_modelnew():
    text = f"Here you go.\n```py\n{TRITON_MODELNEW}```\nThis uses a 1024-wide block."
    ks = rl.kernel_from_completion(text, kernel_type="triton")
    assert ks.source_code == TRITON_MODELNEW and ks.type == kernel_pb2.KERNEL_TYPE_TRITON
    assert rl.kernel_from_completion(text).type == kernel_pb2.KERNEL_TYPE_TRITON


def test_triton_kernel_launched_from_its_io_contract_needs_no_modelnew():
    kernel_only = TRITON_MODELNEW.split("class ModelNew")[0].rstrip("\n") + "\n"
    text = (
        f"```python\n{kernel_only}```\n\n```python\nrelu_kernel[(4,)](x, y, 4096, BLOCK=1024)\n```"
    )
    io = contracts.io(
        contracts.tensor("x_ptr", (4096,), "float32"),
        contracts.output("y_ptr", (4096,), "float32"),
        contracts.scalar("n", 4096),
        contracts.constexpr("BLOCK", 1024),
        grid=(4,),
    )
    ks = rl.kernel_from_completion(text, kernel_type="triton", io=io)
    assert ks.source_code == kernel_only
    assert ks.io == io and ks.type == kernel_pb2.KERNEL_TYPE_TRITON
    with pytest.raises(rl.NoCodeFound, match="ModelNew"):
        rl.kernel_from_completion(text, kernel_type="triton")  # no io: a ModelNew is needed


def test_cuda_block_is_preferred_to_a_python_harness():
    text = (
        f"```cuda\n{CUDA_KERNEL}```\n\nTo call it from Python:\n\n"
        f"```python\n{LOAD_INLINE_MODELNEW}```\n"
    )
    ks = rl.kernel_from_completion(text, kernel_type="cuda")
    assert ks.source_code == CUDA_KERNEL and ks.type == kernel_pb2.KERNEL_TYPE_CUDA
    # Auto: the ModelNew block (the KernelBench format) wins.
    assert rl.kernel_from_completion(text).source_code == LOAD_INLINE_MODELNEW
    # Only the CUDA block: auto takes the block with the kernel and detects CUDA from ```cuda.
    only = f"```cuda\n{CUDA_KERNEL}```"
    assert rl.kernel_from_completion(only).type == kernel_pb2.KERNEL_TYPE_CUDA
    named = rl.kernel_from_completion(only, kernel_type="cuda", entry_point="add")
    assert named.entry_point == "add" and named.source_code == CUDA_KERNEL


def test_the_last_of_several_modelnew_blocks_wins():
    first = TRITON_MODELNEW.replace("1024", "256")
    text = f"First try:\n```python\n{first}```\nBetter:\n```python\n{TRITON_MODELNEW}```\n"
    assert rl.extract_code(text) == TRITON_MODELNEW


def test_reasoning_drafts_are_skipped():
    draft = TRITON_MODELNEW.replace("1024", "64")
    text = (
        f"<think>\nMaybe:\n```python\n{draft}```\nNo, wider.\n</think>\n"
        f"```python\n{TRITON_MODELNEW}```"
    )
    assert rl.extract_code(text) == TRITON_MODELNEW
    only_inside = f"<think>\n```python\n{draft}```\n</think>\nDone: the kernel above."
    assert rl.extract_code(only_inside) == draft


def test_unfenced_code_is_taken_whole():
    assert rl.extract_code(TRITON_MODELNEW) == TRITON_MODELNEW
    assert rl.kernel_from_completion(CUDA_KERNEL).type == kernel_pb2.KERNEL_TYPE_CUDA


def test_a_cut_off_completion_runs_to_the_end():
    cut = TRITON_MODELNEW.rsplit("\n", 3)[0]
    text = f"Sure.\n```python\n{cut}"
    assert rl.extract_code(text) == cut + "\n"


def test_tildes_indented_fences_and_longer_fences():
    indented = "\n".join("   " + line if line else "" for line in TRITON_MODELNEW.splitlines())
    text = f"1. The kernel:\n   ~~~python\n{indented}\n   ~~~\n"
    assert rl.extract_code(text) == TRITON_MODELNEW
    nested = TRITON_MODELNEW + '\nDOC = """\n```python\nx = 1\n```\n"""\n'
    text = f"````python title=model_new.py\n{nested}````\n"
    assert rl.extract_code(text) == nested


def test_entry_point_picks_the_block_that_defines_it():
    mine = "import torch\n\nclass MyModel(torch.nn.Module):\n    pass\n"
    text = f"```python\n{TRITON_MODELNEW}```\n```python\n{mine}```"
    ks = rl.kernel_from_completion(text, kernel_type="torch", entry_point="MyModel")
    assert ks.source_code == mine and ks.entry_point == "MyModel"
    assert ks.type == kernel_pb2.KERNEL_TYPE_TORCH


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        ("I cannot write this kernel.", None, "no fenced code block"),
        ("", "triton", "no fenced code block"),
        ("```bash\npip install triton\n```\n```\nprint(1)\n```", None, "2 fenced block.*bash"),
        (f"```cuda\n{CUDA_KERNEL}```", "torch_cuda", "definition of ModelNew.*cuda"),
        ("```python\nimport torch\n```", "cuda", "a kernel"),
        ("```python\n\n```", None, "no fenced code block"),
    ],
)
def test_no_code_found(text: str, kind: str | None, message: str):
    with pytest.raises(rl.NoCodeFound, match=message) as info:
        rl.kernel_from_completion(text, kernel_type=kind)
    assert isinstance(info.value, ValueError)


def test_an_unknown_kernel_type_is_a_value_error():
    with pytest.raises(ValueError, match="unknown kernel type"):
        rl.kernel_from_completion(TRITON_MODELNEW, kernel_type="opencl")


def test_spec_from_completion():
    problem = (
        "import torch\n\nclass Model(torch.nn.Module):\n    pass\n\n"
        "def get_inputs():\n    return []\n"
    )
    opts = kernel_pb2.EvalOptions(perf_trial_count=10)
    spec = rl.spec_from_completion(
        KERNELBENCH_COMPLETION,
        reference=problem,
        options=opts,
        labels={"problem": "19", "step": "420"},
        client_tag="rl",
    )
    assert spec.kernel.source_code == LOAD_INLINE_MODELNEW
    assert spec.reference.source_code == problem
    assert spec.reference.type == kernel_pb2.KERNEL_TYPE_TORCH
    assert spec.options.perf_trial_count == 10 and spec.client_tag == "rl"
    assert dict(spec.labels) == {"problem": "19", "step": "420"}
    ref = kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=problem)
    assert rl.spec_from_completion(KERNELBENCH_COMPLETION, reference=ref).reference == ref
    assert not rl.spec_from_completion(KERNELBENCH_COMPLETION).HasField("reference")
    with pytest.raises(ValueError, match="empty"):
        rl.spec_from_completion(KERNELBENCH_COMPLETION, reference="  \n")


def test_a_rollout_against_the_fake_server(fake: FakeServer):
    problem = "import torch\n\nclass Model(torch.nn.Module):\n    pass\n"
    with Client(fake.address, timeout=20) as c:
        spec = rl.spec_from_completion(
            KERNELBENCH_COMPLETION, reference=problem, labels={"rollout": "1"}
        )
        assert rl.reward(c.compare(spec)) == pytest.approx(2.3)  # the fake's speedup is 2
        bad = KERNELBENCH_COMPLETION.replace("return relu.relu(x)", "return x  # INCORRECT")
        assert rl.reward(c.compare(rl.spec_from_completion(bad, reference=problem))) == 0.1
        events = list(c.run(rl.spec_from_completion(KERNELBENCH_COMPLETION, reference=problem)))
        assert rl.reward(events[-1], speedup_shaping="log") == pytest.approx(1.3)
