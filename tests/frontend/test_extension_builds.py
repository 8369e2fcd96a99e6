"""load_inline through the service (jobs/builds/extension_builds.py, fast_build/extension.py) on
the CPU, with the real engine, the real watchdog and a build process: a job's load_inline call
is built by the build process and its library sent to the job, which imports it as torch would; an
identical call later comes from the build cache (across restarts:
tests/jobs/builds/test_build_cache.py); a
compile error comes back as the candidate's error with its first lines; calls with flags the
service does not pass on build in the job's own process. The CPU build of torch builds C++
extensions only, so these jobs' extensions are C++ (cpp_sources); CUDA sources take the same
path on a GPU host. One call includes torch's headers as KernelBench's do; the others are
pybind11 alone, which builds in seconds on 2 cores."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from ke_service import ServiceProcess, real_watchdog_available
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

pytestmark = pytest.mark.skipif(not real_watchdog_available(), reason="needs the watchdog")

REFERENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1
def get_inputs():
    return [torch.randn(256)]
def get_init_inputs():
    return []
"""

CANDIDATE = """
import torch
from torch.utils.cpp_extension import load_inline
cpp = '''
// SALT
torch::Tensor twice_plus_one(torch::Tensor x) { return x * 2 + BODY; }
'''
ext = load_inline(name="NAME", cpp_sources=[cpp], functions=["twice_plus_one"], FLAGS)
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.twice_plus_one(x)
"""


def candidate(*, body: str = "1", flags: str = "extra_cflags=['-O2']", name: str = "") -> str:
    return (
        CANDIDATE.replace("SALT", uuid.uuid4().hex)
        .replace("BODY", body)
        .replace("FLAGS", flags)
        .replace("NAME", name or f"ext_{uuid.uuid4().hex[:8]}")
    )


# Built once by the first test; later tests reuse it (a cache hit) as "the next tenant's job".
SHARED_NAME = f"ext_{uuid.uuid4().hex[:8]}"
SHARED = candidate(name=SHARED_NAME)

# A call without torch's headers (no_implicit_headers, pybind11 alone): a real load_inline
# build in seconds instead of a minute on 2 cores, for the tests that need several builds.
LIGHT = """
import torch
from torch.utils.cpp_extension import load_inline
cpp = '''
#include <pybind11/pybind11.h>
// SALT
float one() { return BODY; }
'''
ext = load_inline(name="NAME", cpp_sources=[cpp], functions=["one"], no_implicit_headers=True,
                  with_pytorch_error_handling=False, FLAGS)
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x * 2 + ext.one()
"""
LIGHT_NAME = f"light_{uuid.uuid4().hex[:8]}"


def light(*, body: str = "1.0f", flags: str = "extra_cflags=['-O2']") -> str:
    return (
        LIGHT.replace("SALT", "")
        .replace("BODY", body)
        .replace("FLAGS", flags)
        .replace("NAME", LIGHT_NAME)
    )


def spec_for(source: str) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag="extensions")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    spec.kernel.source_code = source
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = REFERENCE
    spec.options.timeout.seconds = 400
    spec.options.perf_trial_count = 0
    return spec


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("extensions")
    service = ServiceProcess(
        root / "state",
        ["--workers-per-device", "2", "--build-processes", "1", "--build-pch", "false",
         "--result-cache-hours", "0"],
    )  # fmt: skip
    try:
        service.start()
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def run(stub, source: str) -> tuple[job_pb2.Job, list[str]]:  # type: ignore[no-untyped-def]
    events = [r.event for r in stub.Run(pb.RunRequest(spec=spec_for(source)), timeout=600)]
    logs = [e.log.text for e in events if e.WhichOneof("kind") == "log"]
    job = stub.GetJob(pb.GetJobRequest(job_id=events[0].job_id), timeout=30).job
    return job, logs


def test_built_by_a_build_process_then_from_the_cache(stub) -> None:  # type: ignore[no-untyped-def]
    source = SHARED
    job, logs = run(stub, source)
    assert job.result.verdict == job_pb2.VERDICT_OK, job.result
    assert job.result.correctness
    assert any("load_inline queued for a build process" in t for t in logs), logs
    assert any(t.startswith("kerneleval: building ") for t in logs), logs
    # The build's progress: the compiler's step and the time so far.
    steps = [t for t in logs if t.startswith("kerneleval build: ")]
    assert any("compiling" in t and t.endswith(" s)") for t in steps), logs
    # The same call again: the library comes from the build cache, nothing is built.
    again, logs = run(stub, source)
    assert again.result.verdict == job_pb2.VERDICT_OK, again.result
    assert any("load_inline from the build cache" in t for t in logs), logs
    assert not any(t.startswith("kerneleval: building ") for t in logs), logs


def test_other_sources_never_get_a_cached_library(stub) -> None:  # type: ignore[no-untyped-def]
    """The key is the call's content: a candidate with the same name and flags but another
    body is built for itself, and its own (wrong) answer is judged."""
    first, _ = run(stub, light())
    assert first.result.verdict == job_pb2.VERDICT_OK, first.result
    wrong, logs = run(stub, light(body="2.0f"))
    assert not any("from the build cache" in t for t in logs), logs
    assert wrong.result.verdict == job_pb2.VERDICT_INCORRECT, wrong.result
    # And the next tenant's correct job is still correct, from the cache.
    after, logs = run(stub, light())
    assert after.result.verdict == job_pb2.VERDICT_OK, after.result
    assert any("from the build cache" in t for t in logs), logs


def test_compile_error_names_the_line(stub) -> None:  # type: ignore[no-untyped-def]
    job, _ = run(stub, light(body="undefined_symbol_xyz"))
    assert job.result.verdict == job_pb2.VERDICT_COMPILE_ERROR, job.result
    assert not job.result.compiled
    message = job.result.compilation_error
    assert "Error building extension" in message, message
    # The first lines say what is wrong and where, before any of torch's build output.
    head = message[: message.index("undefined_symbol_xyz") + 40]
    assert "error" in head and "main.cpp" in head, message[:2000]
    assert len(head) < 600, message[:2000]


def test_unusual_flags_build_in_the_job(stub) -> None:  # type: ignore[no-untyped-def]
    """A flag that could run a program (gcc's -wrapper) never reaches a build process: the
    call builds in the job's own sandboxed process, as torch would, and fails there."""
    job, logs = run(stub, light(flags="extra_cflags=['-wrapper', '/bin/true,-x']"))
    assert not any(t.startswith("kerneleval: building ") for t in logs), logs
    assert not any("queued for a build process" in t for t in logs), logs
    assert job.result.verdict != job_pb2.VERDICT_OK
    nxt, _ = run(stub, light())
    assert nxt.result.verdict == job_pb2.VERDICT_OK, nxt.result
