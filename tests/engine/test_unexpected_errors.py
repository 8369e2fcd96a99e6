"""What reaches run_job outside a source's guarded code still gets a verdict of its own
(issue 40): an OOM is out of memory (torch's allocator asserts instead where NVML is hidden),
an exception raised in a source's own file is that source's failure, only the rest is an
internal engine error."""

from __future__ import annotations

from kerneleval.v1 import job_pb2
from kerneleval_server.engine import runner

NVML_OOM = (
    'NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "/pytorch/c10/'
    'cuda/CUDACachingAllocator.cpp":1135, please report a bug to PyTorch.'
)


def _raised(exc: BaseException, filename: str) -> BaseException:
    code = compile("def f(e):\n    raise e\n", filename, "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["f"](exc)
    except BaseException as e:  # noqa: BLE001 - caught to be classified
        return e
    raise AssertionError("not raised")


def test_an_allocator_assertion_while_out_of_memory_is_out_of_memory() -> None:
    result = job_pb2.EvalResult()
    runner.unexpected_error(result, _raised(RuntimeError(NVML_OOM), "engine.py"), {})
    assert result.verdict == job_pb2.VERDICT_OUT_OF_MEMORY
    assert "internal engine error" not in result.error.message
    # said as what it is, not as torch's request for a bug report
    assert result.error.message.startswith("CUDA out of memory (torch's allocator could not")
    assert "INTERNAL ASSERT" not in result.error.message, result.error.message


def test_an_exception_from_a_sources_file_is_that_sources_failure() -> None:
    files = {"/w/kernel.py": job_pb2.SIDE_KERNEL, "/w/reference.py": job_pb2.SIDE_REFERENCE}
    for path, side in files.items():
        result = job_pb2.EvalResult()
        runner.unexpected_error(result, _raised(ValueError("no"), path), files)
        assert result.verdict == job_pb2.VERDICT_RUNTIME_ERROR
        assert result.failed_side == side
        assert "raised inside the engine: ValueError: no" in result.error.message


def test_the_rest_is_an_internal_engine_error() -> None:
    result = job_pb2.EvalResult()
    runner.unexpected_error(result, _raised(ValueError("bug"), "/srv/engine/x.py"), {})
    assert result.verdict == job_pb2.VERDICT_RUNTIME_ERROR
    assert result.error.message == "internal engine error: bug"


def test_a_stop_without_a_verdict_is_blamed_on_the_source_that_raised_it() -> None:
    files = {"/w/reference.py": job_pb2.SIDE_REFERENCE}
    result = job_pb2.EvalResult()
    runner.stopped_by_a_source(result, _raised(runner._Stop(), "/w/reference.py"), files)
    assert result.verdict == job_pb2.VERDICT_RUNTIME_ERROR
    assert result.failed_side == job_pb2.SIDE_REFERENCE
    result = job_pb2.EvalResult()
    runner.stopped_by_a_source(result, _raised(runner._Stop(), "elsewhere.py"), files)
    assert result.failed_side == job_pb2.SIDE_KERNEL  # no frame says: the candidate's
