"""Contract helpers, kernel type detection on real KernelBench files, error decoding."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from kerneleval import contracts, errors
from kerneleval.kernelbench import detect_kernel_type, job_from_files, kernel_type
from kerneleval.v1 import dtype_pb2, kernel_pb2


def test_tensor_output_scalar_and_launch():
    c = contracts.io(
        contracts.tensor("x", (4, 8), "fp16", init=contracts.uniform(-1, 1, seed=3)),
        contracts.output("y", [4, 8], "float16"),
        contracts.inout("acc", 8, "float32", init=contracts.zeros()),
        contracts.scalar("n", 32),
        contracts.scalar("alpha", 0.5),
        contracts.scalar("flag", True),
        contracts.constexpr("BLOCK", 128),
        grid=(2, 3),
        num_warps=4,
    )
    x, y, acc, n, alpha, flag, block = c.args
    assert list(x.tensor.shape) == [4, 8] and x.tensor.dtype == dtype_pb2.DTYPE_FLOAT16
    assert x.tensor.init.uniform.low == -1 and x.tensor.init.seed == 3
    assert y.role == kernel_pb2.ARG_ROLE_OUTPUT and not y.tensor.HasField("init")
    assert acc.role == kernel_pb2.ARG_ROLE_INOUT and acc.tensor.init.HasField("zeros")
    assert n.int_value == 32 and n.WhichOneof("value") == "int_value"
    assert alpha.float_value == 0.5
    assert flag.WhichOneof("value") == "bool_value" and flag.bool_value
    assert block.meta and block.int_value == 128
    assert (c.launch.grid.x, c.launch.grid.y, c.launch.grid.z) == (2, 3, 1)
    assert c.launch.num_warps == 4


def test_dtype_names_and_errors():
    assert contracts.dtype("bf16") == dtype_pb2.DTYPE_BFLOAT16
    assert contracts.dtype("DTYPE_INT8") == dtype_pb2.DTYPE_INT8
    assert contracts.dtype("torch.float64") == dtype_pb2.DTYPE_FLOAT64
    assert contracts.dtype_name(dtype_pb2.DTYPE_UINT8) == "uint8"
    with pytest.raises(ValueError, match="unknown dtype"):
        contracts.dtype("complex64")
    with pytest.raises(ValueError, match="negative"):
        contracts.tensor("x", (2, -1))
    with pytest.raises(ValueError, match="bytes"):
        contracts.tensor("x", (2,), "int32", data=b"\0" * 4)
    with pytest.raises(ValueError, match="high > low"):
        contracts.randint(5, 5)


def test_from_torch_tensors():
    torch = pytest.importorskip("torch")
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.ones(3, dtype=torch.bfloat16)
    c = contracts.from_tensors(a, b, 7, names=["a", "b", "k"], literal=True)
    assert [x.name for x in c.args] == ["a", "b", "k"]
    assert list(c.args[0].tensor.shape) == [2, 3]
    assert c.args[1].tensor.dtype == dtype_pb2.DTYPE_BFLOAT16
    back = torch.frombuffer(bytearray(c.args[0].tensor.data), dtype=torch.float32)
    assert back.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(c.args[1].tensor.data) == 6
    assert c.args[2].int_value == 7
    generated = contracts.from_tensor("g", a, init=contracts.randn(seed=1))
    assert not generated.tensor.data and generated.tensor.init.HasField("randn")


def test_detection_on_kernelbench_files(kernelbench: Path):
    ex = kernelbench / "examples"
    expected = {
        "model_ex_add.py": kernel_pb2.KERNEL_TYPE_TORCH,
        "model_new_ex_add.py": kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
        "model_new_ex_fuse_gelu.py": kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
        "model_new_ex_tiled_matmul.py": kernel_pb2.KERNEL_TYPE_TORCH_CUDA,
        "model_new_ex_add_triton.py": kernel_pb2.KERNEL_TYPE_TRITON,
    }
    for name, want in expected.items():
        assert detect_kernel_type((ex / name).read_text(), name) == want, name
    for problem in sorted((kernelbench / "level1").glob("*.py")):
        assert detect_kernel_type(problem.read_text(), problem.name) == (
            kernel_pb2.KERNEL_TYPE_TORCH
        ), problem.name


def test_raw_cuda_detection_and_overrides():
    cu = "__global__ void k(float* x) { x[threadIdx.x] = 1; }\n"
    assert detect_kernel_type(cu) == kernel_pb2.KERNEL_TYPE_CUDA
    assert detect_kernel_type("", "k.cu") == kernel_pb2.KERNEL_TYPE_CUDA
    assert kernel_type("triton", cu) == kernel_pb2.KERNEL_TYPE_TRITON
    assert kernel_type("KERNEL_TYPE_TORCH", cu) == kernel_pb2.KERNEL_TYPE_TORCH
    with pytest.raises(ValueError):
        kernel_type("fortran", cu)


def test_job_from_files_keeps_sources_as_they_are(kernelbench: Path):
    ref = kernelbench / "examples" / "model_ex_add.py"
    new = kernelbench / "examples" / "model_new_ex_add_triton.py"
    opts = kernel_pb2.EvalOptions(correct_trial_count=2)
    spec = job_from_files(new, ref, options=opts, client_tag="kb")
    assert spec.kernel.source_code == new.read_text()
    assert spec.reference.source_code == ref.read_text()
    assert spec.kernel.type == kernel_pb2.KERNEL_TYPE_TRITON
    assert spec.reference.type == kernel_pb2.KERNEL_TYPE_TORCH
    assert spec.options.correct_trial_count == 2 and spec.client_tag == "kb"
    alone = job_from_files(ref)
    assert not alone.HasField("reference")


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: list) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> list:
        return self._trailing


def test_error_mapping_decodes_bad_request():
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="spec.options.atol", description="must be >= 0")
    packed = any_pb2.Any()
    packed.Pack(bad)
    other = any_pb2.Any()
    other.Pack(error_details_pb2.RetryInfo())
    status = status_pb2.Status(code=3, message="bad", details=[other, packed])
    trailing = [("grpc-status-details-bin", status.SerializeToString())]
    e = errors.from_rpc_error(_FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", trailing))
    assert isinstance(e, errors.InvalidArgument)
    assert e.field_violations == [errors.FieldViolation("spec.options.atol", "must be >= 0")]
    garbage = [("grpc-status-details-bin", b"\xff\xff")]
    e = errors.from_rpc_error(_FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "x", garbage))
    assert e.field_violations == []
    for code, cls in (
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.DATA_LOSS, errors.KernelEvalError),
    ):
        e = errors.from_rpc_error(_FakeRpcError(code, "m", []))
        assert type(e) is cls and e.code == code


def test_package_exports_load_lazily():
    import subprocess
    import sys

    code = (
        "import sys, kerneleval.v1.job_pb2\n"
        "assert 'kerneleval.client' not in sys.modules and 'grpc' not in sys.modules\n"
        "import kerneleval\n"
        "assert kerneleval.Client.__name__ == 'Client'\n"
        "assert kerneleval.job_from_files.__module__ == 'kerneleval.kernelbench'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_text_a_candidate_wrote_cannot_drive_the_terminal() -> None:
    """Escape sequences and bidi overrides in a job's error, notes and log lines are shown as
    escapes: a candidate cannot paint "verdict OK" over its real verdict."""
    import io

    from kerneleval import progress, render
    from kerneleval.v1 import job_pb2

    forged = "\x1b[1A\x1b[2K\rverdict  OK\u202e"
    job = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_DONE)
    job.result.verdict = job_pb2.VERDICT_INCORRECT
    job.result.validation_error = forged
    job.result.error.message = forged
    job.result.notes.append(forged)
    for text in (render.result_table(job), render.job_summary(job),
                 render.batch_table([("k.py", job)])):  # fmt: skip
        assert "\x1b" not in text and "\r" not in text and "\u202e" not in text, text
        assert "\\x1b[1A" in text
    out = io.StringIO()
    view = progress.JobView(progress.LogDisplay(out))
    event = job_pb2.JobEvent()
    event.log.text = forged + "\n"
    view.event(event)
    view.display.close()
    assert "\x1b" not in out.getvalue() and "\\x1b[2K" in out.getvalue()


def test_a_reference_time_given_on_says_how_old_it_is() -> None:
    """The service's --reference-time-reuse-s: the CLI's table and the MCP tool's answer say
    that the reference's time is an earlier job's, and its age."""
    from kerneleval import mcp_server, render
    from kerneleval.v1 import job_pb2

    job = job_pb2.Job(job_id="j3", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict = job_pb2.VERDICT_OK
    r.reference_runtime.median_ms, r.reference_runtime.trial_count = 2.0, 100
    assert "earlier job" not in render.result_table(job)
    assert "reference_time_age_s" not in mcp_server.summary(job)
    r.reference_runtime_age.FromMilliseconds(12500)
    assert "(an earlier job's, 12.5 s old)" in render.result_table(job)
    assert mcp_server.summary(job)["reference_time_age_s"] == 12.5


def test_both_speedups_are_shown_with_a_compile_baseline() -> None:
    """EvalOptions.compile_baseline (issue 43): the table, the one-line summary, the batch
    and jobs tables and the MCP answer give the speedup over eager and over torch.compile;
    without it nothing changes."""
    from kerneleval import mcp_server, render
    from kerneleval.v1 import job_pb2

    job = job_pb2.Job(job_id="j5", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict = job_pb2.VERDICT_OK
    r.runtime.median_ms, r.runtime.trial_count = 1.0, 100
    r.reference_runtime.median_ms, r.reference_runtime.trial_count = 2.0, 100
    r.speedup = 2.0
    plain = render.result_table(job)
    assert "torch.compile" not in plain and "over eager" not in plain
    assert render.job_summary(job).endswith("speedup 2x")
    assert "compiled_speedup" not in mcp_server.summary(job)
    r.compiled_reference_runtime.median_ms, r.compiled_reference_runtime.trial_count = 0.5, 100
    r.compiled_speedup = 0.5
    r.compile_time.FromMilliseconds(12300)
    table = re.sub(" +", " ", render.result_table(job))
    assert "torch.compile median 0.5" in table and "(compiled in 12.3 s, untimed)" in table
    assert "speedup 2x over eager" in table and "vs compile 0.5x over torch.compile" in table
    assert "speedup 2x (0.5x compiled)" in render.job_summary(job)
    assert "2x (0.5x compiled)" in render.batch_table([("k.py", job)], width=200)
    assert "2x (0.5x compiled)" in render.jobs_table([job], width=200)
    s = mcp_server.answer(job)
    assert (s["compiled_speedup"], s["compiled_reference_median_ms"], s["compile_time_s"]) == (
        0.5, 0.5, 12.3,
    )  # fmt: skip
    assert "speedup over torch.compile 0.5x" in s["summary"]
    mcp_server.JobAnswer.model_validate(s)
    spec = mcp_server.build_spec("class ModelNew: ...", "torch", "class Model: ...", "torch",
                                 5, 100, 120, compile_baseline=True)  # fmt: skip
    assert spec.options.compile_baseline


def test_result_table_says_how_the_job_was_timed() -> None:
    from kerneleval import render
    from kerneleval.v1 import job_pb2

    job = job_pb2.Job(job_id="j2", state=job_pb2.JOB_STATE_DONE)
    job.result.verdict = job_pb2.VERDICT_OK
    w = job.result.timing_window
    w.exclusive = w.others_frozen = w.drained = True
    w.waited.FromMilliseconds(12)
    w.drain.FromMilliseconds(0)
    assert render.result_table(job).endswith("window    the GPU to itself, waited 12.0 ms for it")
    w.at_start.CopyFrom(
        job_pb2.GpuConditions(
            known=True, sm_clock_mhz=1980, memory_clock_mhz=2619, temperature_celsius=41,
            power_watts=312.4, throttle_reasons=["gpu_idle"],
        )
    )  # fmt: skip
    w.at_end.CopyFrom(w.at_start)
    w.at_end.throttle_reasons[:] = ["sw_thermal_slowdown"]
    w.drain.FromMilliseconds(7)
    w.others_frozen = w.drained = False
    table = re.sub(" +", " ", render.result_table(job))  # the label column's width varies
    assert (
        "window the GPU to itself (other job processes not frozen), waited 12.0 ms for it, "
        "7.0 ms for others' queued GPU work (still busy: times may include it)"
    ) in table
    assert "gpu start SM 1980 MHz, memory 2619 MHz, 41 C, 312 W\n" in table
    assert table.endswith(
        "gpu end SM 1980 MHz, memory 2619 MHz, 41 C, 312 W, throttled: sw_thermal_slowdown"
    )


def test_calls_go_round_robin_over_every_address_a_name_resolves_to() -> None:
    """Several gateways behind one name (a headless Service, docs/DEPLOY.md): the client's
    service config asks for round_robin, so its calls reach each of them, not the first
    alone as gRPC's default (pick_first) would."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from kerneleval.client import Client

    class Counting(health.HealthServicer):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def Check(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            self.calls += 1
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    servers, servicers, ports = [], [], []
    for _ in range(2):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = Counting()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
        servicers.append(servicer)
    try:
        with Client(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}") as client:
            assert client.wait_ready(10)
            for _ in range(20):
                assert client.health() == "SERVING"
        assert all(s.calls >= 5 for s in servicers), [s.calls for s in servicers]
    finally:
        for server in servers:
            server.stop(0)


def test_devices_from_a_gateway_say_whose_they_are() -> None:
    from kerneleval import render
    from kerneleval.v1 import operations_service_pb2 as ops

    here = [ops.Device(index=0, name="H100")]
    assert "NODE" not in render.devices_table(here, width=200)
    fleet = [
        ops.Device(index=0, name="H100", node="10.0.0.7:50051"),
        ops.Device(index=0, name="H200", node="10.0.0.8:50051"),
    ]
    text = render.devices_table(fleet, width=200)
    assert "NODE" in text and "10.0.0.7:50051" in text and "10.0.0.8:50051" in text
