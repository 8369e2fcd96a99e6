"""Static pre-checks (issue 13, first step): each hostile class gets its flag, honest code none.

The exploit suite below is small hostile `ModelNew`s (our own code), one or more per rule. The
no-false-alarm test runs the checks over every file of ../shared/kernelbench (the level-1
reference Models and the honest example ModelNews) and wants 0 flags. The end-to-end tests go
through a real service: with reject_flagged a flagged candidate ends VERDICT_REJECTED without
running; without it, it runs and its result carries the flag.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format
from ke_service import ServiceProcess
from kerneleval import render
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval_server.jobs import static_checks

KERNELBENCH = Path(__file__).resolve().parents[3] / "shared" / "kernelbench"
if not KERNELBENCH.exists():
    KERNELBENCH = Path("/work/shared/kernelbench")

TAIL = """
def get_inputs():
    return [torch.randn(64)]

def get_init_inputs():
    return []
"""


def model_new(body: str, head: str = "") -> str:
    """A ModelNew whose forward is `body` (x -> output), after module-level `head`."""
    forward = textwrap.indent(textwrap.dedent(body).strip(), " " * 8)
    return (
        "import torch\nimport torch.nn as nn\n"
        + textwrap.dedent(head).strip()
        + "\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
        + forward
        + "\n"
        + TAIL
    )


def spec_of(source: str, kind: int = kernel_pb2.KERNEL_TYPE_TORCH) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec()
    spec.kernel.type = kind  # type: ignore[assignment]
    spec.kernel.source_code = source
    return spec


def rules(source: str, kind: int = kernel_pb2.KERNEL_TYPE_TORCH) -> list[str]:
    return [f.rule_id for f in static_checks.check(spec_of(source, kind))]


TRITON_HEAD = """
import triton
import triton.language as tl

@triton.jit
def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)
"""

CUDA_DECOY = model_new(
    "return x + 1",
    '''
    from torch.utils.cpp_extension import load_inline
    src = """
    __global__ void add_one(const float* x, float* o, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) o[i] = x[i] + 1.0f;
    }
    torch::Tensor add_one_cuda(torch::Tensor x) { return x + 1; }
    """
    mod = load_inline(name="m", cpp_sources="", cuda_sources=src, functions=["add_one_cuda"])
    ''',
)

# (name, source, kernel type, the rule it must raise)
EXPLOITS = [
    (
        "perf_counter_ns divided",
        model_new(
            "return x + 1",
            "import time\n_real = time.perf_counter_ns\n"
            "time.perf_counter_ns = lambda: _real() // 5",
        ),
        "timer_patch",
    ),
    (
        "perf_counter through an alias",
        model_new("return x + 1", "import time as clock\nclock.perf_counter = lambda: 0.0"),
        "timer_patch",
    ),
    ("time.time", model_new("return x + 1", "import time\ntime.time = lambda: 0.0"), "timer_patch"),
    (
        "setattr on time",
        model_new("return x + 1", "import time\nsetattr(time, 'monotonic', lambda: 0.0)"),
        "timer_patch",
    ),
    (
        "Event.elapsed_time",
        model_new("return x + 1", "torch.cuda.Event.elapsed_time = lambda self, end: 1e-3"),
        "timer_patch",
    ),
    (
        "a fake Event class",
        model_new("return x + 1", "class FakeEvent:\n    pass\ntorch.cuda.Event = FakeEvent"),
        "timer_patch",
    ),
    (
        "synchronize replaced",
        model_new("return x + 1", "from torch import cuda\ncuda.synchronize = lambda *a: None"),
        "timer_patch",
    ),
    (
        "the engine's compare patched",
        model_new(
            "return torch.zeros_like(x)",
            "import kerneleval_server.engine.compare as cmp\n"
            "cmp.compare_outputs = lambda *a, **k: None",
        ),
        "harness_patch",
    ),
    (
        "engine module dict written",
        model_new("return x", "import engine\nengine.__dict__['check'] = print"),
        "harness_patch",
    ),
    (
        "torch.allclose patched",
        model_new("return x", "torch.allclose = lambda *a, **k: True"),
        "harness_patch",
    ),
    (
        "a background thread",
        model_new(
            "out = torch.empty_like(x)\n"
            "threading.Thread(target=lambda: out.copy_(x + 1)).start()\nreturn out",
            "import threading",
        ),
        "thread_or_process",
    ),
    (
        "a thread pool",
        model_new(
            "return ThreadPoolExecutor(1).submit(lambda: x + 1).result()",
            "from concurrent.futures import ThreadPoolExecutor",
        ),
        "thread_or_process",
    ),
    ("os.fork", model_new("os.fork()\nreturn x + 1", "import os"), "thread_or_process"),
    (
        "__import__ subprocess",
        model_new("__import__('subprocess').run(['true'])\nreturn x + 1"),
        "thread_or_process",
    ),
    (
        "a side stream",
        model_new("s = torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    return x + 1"),
        "cuda_stream",
    ),
    (
        "a stream from the pool in inline CUDA",
        model_new(
            "return x + 1",
            'src = "auto s = at::cuda::getStreamFromPool(); cudaStreamCreate(&t);"',
        ),
        "cuda_stream",
    ),
    (
        "sys.modules read",
        model_new("return x + 1", "import sys\nE = sys.modules['kerneleval_server.engine']"),
        "sys_modules",
    ),
    (
        "sys.modules from-imported",
        model_new("return x + 1", "from sys import modules\nE = modules.get('engine')"),
        "sys_modules",
    ),
    (
        "gc walk",
        model_new("return x + 1", "import gc\nobjs = [o for o in gc.get_objects()]"),
        "gc_walk",
    ),
    (
        "gc referrers",
        model_new("return x + 1", "from gc import get_referrers as refs\nr = refs(torch)"),
        "gc_walk",
    ),
    ("ctypes", model_new("return x + 1", "import ctypes\nctypes.CDLL(None)"), "ctypes"),
    (
        "inspect.stack",
        model_new("inspect.stack()[2].frame.f_locals['ref'] = x\nreturn x", "import inspect"),
        "frame_walk",
    ),
    ("sys._getframe", model_new("f = sys._getframe(1)\nreturn x", "import sys"), "frame_walk"),
    (
        "frame walk through a traceback",
        model_new(
            "try:\n    raise ValueError\nexcept ValueError as e:\n"
            "    g = e.__traceback__.tb_frame.f_back.f_globals\nreturn x"
        ),
        "frame_walk",
    ),
    (
        "bare except: pass",
        model_new("try:\n    return my_kernel(x)\nexcept:\n    pass\nreturn x + 1"),
        "swallowed_exception",
    ),
    (
        "except Exception: pass",
        model_new("try:\n    y = my_kernel(x)\nexcept (ValueError, Exception):\n    ...\nreturn x"),
        "swallowed_exception",
    ),
    (
        "a Triton kernel never launched",
        model_new("return torch.add(x, 1)", TRITON_HEAD),
        "decoy_kernel",
    ),
    ("an inline CUDA kernel never launched", CUDA_DECOY, "decoy_kernel"),
]


@pytest.mark.parametrize(("name", "source", "rule"), EXPLOITS, ids=[e[0] for e in EXPLOITS])
def test_each_exploit_gets_its_flag(name: str, source: str, rule: str) -> None:
    flags = static_checks.check(spec_of(source))
    assert rule in [f.rule_id for f in flags], (name, flags)
    for f in flags:
        assert f.source == job_pb2.FLAG_SOURCE_STATIC
        assert f.rule_id in static_checks.RULES
        assert "line" in f.message or f.rule_id == "decoy_kernel"


def test_every_rule_has_an_exploit() -> None:
    covered = {rule for _, _, rule in EXPLOITS}
    assert set(static_checks.RULES) - covered == {"uncheckable"}


def test_honest_neighbours_of_the_exploits_are_not_flagged() -> None:
    honest = [
        model_new("return x + 1", "import time\nt0 = time.perf_counter()"),  # reading a clock
        model_new("return x + 1", "torch.backends.cuda.matmul.allow_tf32 = True"),
        model_new("return x + 1", "from time import perf_counter\nperf_counter = None"),  # local
        model_new("try:\n    import foo\nexcept ImportError:\n    pass\nreturn x + 1"),
        model_new("try:\n    y = f(x)\nexcept Exception:\n    y = x + 1\nreturn y"),
        model_new("torch.cuda.synchronize()\nreturn x + 1"),  # calling it is fine
        model_new("s = torch.cuda.current_stream()\nreturn x + 1"),
        model_new("import gc\ngc.collect()\nreturn x + 1"),
        model_new("add_one[(1,)](x, x, x.numel(), BLOCK=64)\nreturn x", TRITON_HEAD),
        # a Triton kernel handed to a launcher by name
        model_new("return launch(add_one, x)", TRITON_HEAD),
    ]
    for src in honest:
        assert rules(src) == [], src


def test_triton_launched_from_the_io_contract_is_not_a_decoy() -> None:
    spec = spec_of(textwrap.dedent(TRITON_HEAD), kernel_pb2.KERNEL_TYPE_TRITON)
    spec.kernel.io.args.add(name="x_ptr")
    assert static_checks.check(spec) == []
    assert [f.rule_id for f in static_checks.check(spec_of(TRITON_HEAD))] == ["decoy_kernel"]


def test_only_the_candidate_is_checked() -> None:
    spec = spec_of(model_new("return x + 1"))
    spec.reference.source_code = model_new("return x + 1", "import threading")
    assert static_checks.check(spec) == []


def test_a_source_that_does_not_parse_gets_no_flags_and_nothing_raises() -> None:
    for src in ("def f(:\n  import threading", "x = '\0'", "x = " + "+".join(["a"] * 200_000)):
        assert static_checks.check(spec_of(src)) == []


def test_many_hits_make_one_flag_per_rule() -> None:
    src = model_new("return x", "import time\n" + "time.time = None\n" * 5)
    flags = static_checks.check(spec_of(src))
    assert [f.rule_id for f in flags] == ["timer_patch"]
    assert "(and 4 more)" in flags[0].message


@pytest.mark.skipif(
    not KERNELBENCH.exists(), reason=f"no KernelBench copy at {KERNELBENCH} (../shared/kernelbench)"
)
def test_no_false_alarms_on_kernelbench() -> None:
    files = sorted(KERNELBENCH.rglob("*.py"))
    assert len(files) >= 100
    flagged = {}
    for path in files:
        source = path.read_text()
        kind = (
            kernel_pb2.KERNEL_TYPE_TRITON
            if "import triton" in source
            else kernel_pb2.KERNEL_TYPE_TORCH_CUDA
            if "load_inline" in source
            else kernel_pb2.KERNEL_TYPE_TORCH
        )
        flags = static_checks.check(spec_of(source, kind))
        if flags:
            flagged[path.name] = [f"{f.rule_id}: {f.message}" for f in flags]
    assert flagged == {}


# ---- the CLI's rendering ---------------------------------------------------------------------


def test_result_table_lists_the_flags_printably() -> None:
    job = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_DONE)
    job.result.verdict = job_pb2.VERDICT_REJECTED
    job.state_reason = "rejected: static checks flagged timer_patch"
    job.result.flags.add(
        rule_id="timer_patch",
        message="line 3: replaces time.perf_counter\x1b[2J",
        source=job_pb2.FLAG_SOURCE_STATIC,
    )
    job.result.flags.add(rule_id="cuda_stream", message="line 9: calls torch.cuda.Stream")
    table = render.result_table(job)
    assert "verdict   REJECTED" in table
    assert "flags" in table
    assert "timer_patch: line 3: replaces time.perf_counter\\x1b[2J" in table
    assert "\x1b" not in table
    assert "cuda_stream: line 9: calls torch.cuda.Stream" in table
    assert "flags: timer_patch, cuda_stream" in render.job_summary(job)
    # --json prints the job as proto3 JSON: the flags come with it.
    flags = json_format.MessageToDict(job)["result"]["flags"]
    assert flags[0]["ruleId"] == "timer_patch" and flags[0]["source"] == "FLAG_SOURCE_STATIC"


# ---- end to end through the service ----------------------------------------------------------

PATCHED_TIMER = model_new(
    "return x * 2.0 + 1.0",
    "import time\n_real = time.perf_counter_ns\ntime.perf_counter_ns = lambda: _real()",
)
HONEST = model_new("return x * 2.0 + 1.0")
REFERENCE = HONEST.replace("ModelNew", "Model")


@pytest.fixture(scope="module")
def stub(
    kerneleval_service: ServiceProcess,
) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with kerneleval_service.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def compare_spec(source: str, reject: bool) -> kernel_pb2.JobSpec:
    spec = spec_of(source)
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = REFERENCE
    spec.options.perf_trial_count = 3
    spec.options.warmup_count = 1
    spec.options.reject_flagged = reject
    return spec


def test_reject_flagged_ends_rejected_without_running(stub) -> None:  # type: ignore[no-untyped-def]
    job = stub.Compare(pb.CompareRequest(spec=compare_spec(PATCHED_TIMER, True)), timeout=60).job
    assert job.state == job_pb2.JOB_STATE_DONE
    assert job.result.verdict == job_pb2.VERDICT_REJECTED, job
    assert not job.result.correctness and not job.result.compiled
    assert [f.rule_id for f in job.result.flags] == ["timer_patch"]
    assert job.state_reason == "rejected: static checks flagged timer_patch"
    assert not job.worker_id and job.attempt_count == 0  # never given to a job process
    assert not job.HasField("start_time")
    assert job.result.runtime.trial_count == 0
    # GetJob says the same (the store has it).
    again = stub.GetJob(pb.GetJobRequest(job_id=job.job_id)).job
    assert again.result.verdict == job_pb2.VERDICT_REJECTED
    assert list(again.result.flags) == list(job.result.flags)


def test_reject_flagged_runs_an_unflagged_candidate(stub) -> None:  # type: ignore[no-untyped-def]
    job = stub.Compare(pb.CompareRequest(spec=compare_spec(HONEST, True)), timeout=180).job
    assert job.result.verdict == job_pb2.VERDICT_OK, job.result
    assert list(job.result.flags) == []


def test_without_the_option_it_runs_and_its_patch_is_refused_at_its_timing(stub) -> None:  # type: ignore[no-untyped-def]
    job = stub.Compare(pb.CompareRequest(spec=compare_spec(PATCHED_TIMER, False)), timeout=180).job
    assert job.state == job_pb2.JOB_STATE_DONE
    # It ran (the option rejects before that), and its patch was seen at its timed trials
    # (engine/tamper.py): no time is believed.
    assert job.worker_id and job.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, job.result
    assert job.result.error.message.startswith("tampering: "), job.result
    assert not job.result.HasField("runtime")
    assert [f.rule_id for f in job.result.flags] == ["timer_patch", "timer_tampered"]
    assert job.result.flags[0].source == job_pb2.FLAG_SOURCE_STATIC
    assert "time.perf_counter_ns" in job.result.flags[0].message


def test_a_job_process_cannot_claim_rejected() -> None:
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.fleet import job_processes

    msg = job_channel_pb2.JobProcessMessage()
    msg.outcome.result.verdict = job_pb2.VERDICT_REJECTED
    assert "only the front end" in job_processes._unknown_enum(msg)
    msg.outcome.result.verdict = job_pb2.VERDICT_OK
    assert job_processes._unknown_enum(msg) == ""
